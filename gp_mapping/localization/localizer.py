"""The localizer as a driver sees it: odometry and magnetometer streams in, pose estimates out, bad input counted.

:class:`Localizer` wraps a :class:`~gp_mapping.localization.filter.ParticleFilter` the way nav2's AMCL wraps its
filter, for the ROS node and ``gp-mapping localize`` alike:

* ``add_odometry(stamp, position, orientation)``: the robot's pose in the odom frame (``nav_msgs/Odometry`` or
  tf ``odom -> base_link``). Odometry is kept for a short while to interpolate it at reading stamps.
* ``add_magnetic_field(stamp, field_tesla)``: a reading in the magnetometer frame, tesla as
  ``sensor_msgs/MagneticField`` carries it. It waits until odometry after its stamp has arrived, then gets the
  odometry pose at its stamp (linear in position, shortest arc in heading; both neighbours within
  ``max_odometry_gap``).
* A reading becomes a filter update when the odometry moved ``update_min_d`` or turned ``update_min_a`` since the
  last update, and at most ``max_update_rate`` times a second; the others are skipped (counted): readings closer
  together than that carry the same map error, and a 200 Hz magnetometer is subsampled so the filter keeps up.
  The update applies the odometry increment since the last update (the motion model) and weighs the particles
  by the reading (the measurement model). The first reading after an initialisation is always an update.

Frames. The sensor sits at ``sensor_translation`` in the body frame (x, y used) and ``sensor_rotation`` turns its
readings into the body frame. Each reading is first corrected for the robot's own magnetism with the map's
``sync.hard_iron`` / ``sync.soft_iron`` (the robot that made the map; ``iron`` overrides them), by the mapper's own
:class:`~gp_mapping.mapping.magnetometer.IronCorrection`. A magnitude map needs |B| only. A vector map needs the reading in a levelled body
frame: with ``orientation: level`` the body is taken as level; with ``orientation: orientation`` the roll and
pitch of the odometry's orientation level it (the filter adds the heading per particle).

Bad input is refused and counted under a named reason (:data:`REJECTION_REASONS`), never raised: non-finite or
zero readings, stamps that go backwards, readings without odometry around them, non-finite odometry, and odometry
jumps (a move faster than ``max_speed`` or a turn faster than ``max_yaw_rate`` between two messages), which are
bridged: the odometry after the jump is re-anchored so that the jump itself moves no particle.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import numpy as np

from gp_mapping.localization.config import LocalizationError, LocalizerConfig
from gp_mapping.localization.field_map import MagneticMap
from gp_mapping.localization.filter import ParticleFilter, PoseEstimate
from gp_mapping.localization.motion import compose, inverse, wrap_angle
from gp_mapping.mapping.frames import (FrameError, normalize_quaternion, quaternion_from_rpy, quaternion_multiply,
                                       rotate_vectors, slerp, yaw_of)
from gp_mapping.mapping.magnetometer import IronCorrection
from gp_mapping.mapping.measurements import UNIT_PER_TESLA

REJECTION_REASONS: dict[str, str] = {
    "reading_nonfinite": "a field component is NaN or infinite",
    "reading_zero": "the reading is exactly (0, 0, 0): an unset message or a dead sensor",
    "reading_stamp": "the reading's stamp is not finite or not after the previous reading's",
    "reading_no_odometry": "no odometry within max_odometry_gap before and after the reading",
    "reading_before_init": "the filter had no initial pose yet",
    "odometry_nonfinite": "an odometry position or orientation entry is NaN or infinite, or the quaternion is zero",
    "odometry_stamp": "the odometry stamp is not finite or not after the previous odometry stamp",
    "odometry_jump": "the odometry moved faster than max_speed or turned faster than max_yaw_rate (bridged "
                     "without motion)",
}
#: Slack on the jump test [m] and [rad]: the noise of a localisation between close messages is no jump.
JUMP_SLACK = 0.05
#: Readings kept waiting for odometry after them; beyond, the oldest is refused (reading_no_odometry).
MAX_WAITING = 2000
UPDATE_TIMES_KEPT = 1000
NIS_KEPT = 50


class Localizer:
    """Odometry and magnetometer streams through a particle filter (see the module docstring)."""

    def __init__(self, field_map: MagneticMap, config: LocalizerConfig | None = None,
                 sensor_translation=(0.0, 0.0, 0.0), sensor_rotation=(0.0, 0.0, 0.0, 1.0),
                 iron: IronCorrection | None = None) -> None:
        self.config = config if config is not None else LocalizerConfig()
        self.map = field_map
        t = np.asarray(sensor_translation, dtype=np.float64).reshape(-1)
        if t.shape not in ((2,), (3,)) or not np.all(np.isfinite(t)):
            raise LocalizationError(f"sensor_translation must be 2 or 3 finite numbers [m], got {sensor_translation!r}")
        try:
            self._sensor_q = normalize_quaternion(sensor_rotation)
        except FrameError as err:
            raise LocalizationError(f"sensor_rotation: {err}") from None
        self._identity_rotation = bool(abs(abs(self._sensor_q[3]) - 1.0) < 1e-12)
        if field_map.field_unit not in UNIT_PER_TESLA:
            raise LocalizationError(f"the map's field unit {field_map.field_unit!r} is not one of "
                                    f"{', '.join(UNIT_PER_TESLA)}")
        self._scale = UNIT_PER_TESLA[field_map.field_unit]
        if iron is None:
            try:
                iron = IronCorrection(field_map.hard_iron, field_map.soft_iron, self._scale)
            except ValueError as err:
                raise LocalizationError(f"the map's magnetometer calibration: {err}") from None
        self._iron = iron
        self.filter = ParticleFilter(field_map, self.config, sensor_offset=t[:2])
        self.rejected = {reason: 0 for reason in REJECTION_REASONS}
        self.readings = 0          # readings given
        self.skipped = 0           # readings that were no update (update_min_d / update_min_a / max_update_rate)
        self.jumps = 0
        self.reinitialisations = 0
        self._odom: deque[tuple[float, np.ndarray, np.ndarray]] = deque()  # (stamp, corrected (x, y, yaw), q)
        self._raw_last: tuple[float, np.ndarray] | None = None
        self._fix = np.zeros(3)    # odom correction after bridged jumps: corrected = fix * raw
        self._waiting: deque[tuple[float, np.ndarray]] = deque()
        self._last_reading_stamp = -math.inf
        self._last_update: tuple[float, np.ndarray] | None = None  # (stamp, odom pose) of the last update
        self._update_seconds: deque[float] = deque(maxlen=UPDATE_TIMES_KEPT)
        self._nis: deque[float] = deque(maxlen=NIS_KEPT)
        self.last_estimate: PoseEstimate | None = None

    # ------------------------------------------------------------------------------------------ initialisation

    def initialise(self, pose, std=None) -> None:
        """Start (or restart: RViz's 2D Pose Estimate) from a Gaussian around ``pose`` (x, y, yaw in the map
        frame), at the next reading."""
        self.filter.initialise_gaussian(pose, std)
        self._restarted()

    def initialise_global(self) -> None:
        """Start (or restart) with particles uniform over the map's known cells (global localization)."""
        self.filter.initialise_global()
        self._restarted()

    def _restarted(self) -> None:
        if self._last_update is not None or self.last_estimate is not None:
            self.reinitialisations += 1
        self._last_update = None
        self.last_estimate = None

    # ------------------------------------------------------------------------------------------ odometry

    def add_odometry(self, stamp: float, position, orientation_xyzw) -> list[PoseEstimate]:
        """The body pose in the odom frame at ``stamp`` [s] (position (>= 2,) [m], quaternion [x, y, z, w]).
        Returns the estimates of the readings this odometry let through (usually none or one)."""
        stamp = float(stamp)
        p = np.asarray(position, dtype=np.float64).reshape(-1)
        q = np.asarray(orientation_xyzw, dtype=np.float64).reshape(-1)
        if p.shape[0] < 2 or q.shape != (4,) or not (np.all(np.isfinite(p)) and np.all(np.isfinite(q))) \
                or float(np.linalg.norm(q)) < 1e-9:
            self.rejected["odometry_nonfinite"] += 1
            return []
        if not math.isfinite(stamp) or (self._raw_last is not None and stamp <= self._raw_last[0]):
            self.rejected["odometry_stamp"] += 1
            return []
        q = q / np.linalg.norm(q)
        raw = np.array([p[0], p[1], float(yaw_of(q))])
        if self._raw_last is not None:
            t0, raw0 = self._raw_last
            dt = stamp - t0
            step = compose(inverse(raw0), raw)
            if math.hypot(step[0], step[1]) > self.config.max_speed * dt + JUMP_SLACK or \
                    abs(float(step[2])) > self.config.max_yaw_rate * dt + JUMP_SLACK:
                # Bridge the jump: the corrected odometry stays where it was.
                self.rejected["odometry_jump"] += 1
                self.jumps += 1
                self._fix = compose(compose(self._fix, raw0), inverse(raw))
        self._raw_last = (stamp, raw)
        corrected = compose(self._fix, raw)
        if self._fix[2] != 0.0:  # the orientation follows the corrected heading (roll and pitch unchanged)
            q = quaternion_multiply(quaternion_from_rpy(0.0, 0.0, float(self._fix[2])), q)
        self._odom.append((stamp, corrected, q))
        keep = max(4.0 * self.config.max_odometry_gap, 2.0)
        while len(self._odom) > 2 and self._odom[0][0] < stamp - keep:
            self._odom.popleft()
        return self._drain()

    def add_odometry_2d(self, stamp: float, x: float, y: float, yaw: float) -> list[PoseEstimate]:
        """:meth:`add_odometry` for a planar pose."""
        return self.add_odometry(stamp, (x, y, 0.0), quaternion_from_rpy(0.0, 0.0, yaw))

    def odometry_at(self, stamp: float) -> tuple[np.ndarray, np.ndarray] | None:
        """The (bridged) odometry pose ``(x, y, yaw)`` and orientation at ``stamp``, interpolated between the kept
        messages around it; None without messages within ``max_odometry_gap`` on both sides."""
        odom = self._odom
        if not odom or stamp > odom[-1][0] or stamp < odom[0][0]:
            return None
        k = len(odom) - 1
        while k > 0 and odom[k - 1][0] >= stamp:
            k -= 1
        t1, p1, q1 = odom[k]
        if t1 == stamp:
            return p1, q1
        t0, p0, q0 = odom[k - 1]
        gap = self.config.max_odometry_gap
        if stamp - t0 > gap or t1 - stamp > gap:
            return None
        f = (stamp - t0) / (t1 - t0)
        pose = np.array([p0[0] + f * (p1[0] - p0[0]), p0[1] + f * (p1[1] - p0[1]),
                         float(wrap_angle(p0[2] + f * float(wrap_angle(p1[2] - p0[2]))))])
        q = slerp(q0, q1, f) if self.config.orientation == "orientation" else q1
        return pose, q

    # ------------------------------------------------------------------------------------------ readings

    def add_magnetic_field(self, stamp: float, field_tesla) -> list[PoseEstimate]:
        """A reading in the magnetometer frame [T] at ``stamp`` [s]. Returns the estimates it produced: one when
        it was an update, none when it waits for odometry, was skipped or refused."""
        self.readings += 1
        stamp = float(stamp)
        b = np.asarray(field_tesla, dtype=np.float64).reshape(-1)
        if b.shape != (3,) or not np.all(np.isfinite(b)):
            self.rejected["reading_nonfinite"] += 1
            return []
        if not np.any(b):
            self.rejected["reading_zero"] += 1
            return []
        if not math.isfinite(stamp) or stamp <= self._last_reading_stamp:
            self.rejected["reading_stamp"] += 1
            return []
        self._last_reading_stamp = stamp
        self._waiting.append((stamp, b))
        if len(self._waiting) > MAX_WAITING:
            self._waiting.popleft()
            self.rejected["reading_no_odometry"] += 1
        return self._drain()

    def finish(self) -> None:
        """The streams ended: readings still waiting for odometry after them can never get it (counted)."""
        self.rejected["reading_no_odometry"] += len(self._waiting)
        self._waiting.clear()

    def _drain(self) -> list[PoseEstimate]:
        out: list[PoseEstimate] = []
        if not self._odom:
            return out
        newest = self._odom[-1][0]
        while self._waiting and self._waiting[0][0] <= newest:
            stamp, b = self._waiting.popleft()
            estimate = self._reading(stamp, b)
            if estimate is not None:
                out.append(estimate)
        return out

    def _reading(self, stamp: float, b: np.ndarray) -> PoseEstimate | None:
        if not self.filter.initialised:
            self.rejected["reading_before_init"] += 1
            return None
        at = self.odometry_at(stamp)
        if at is None:
            self.rejected["reading_no_odometry"] += 1
            return None
        odom, q = at
        cfg = self.config
        last = self._last_update
        if last is not None:
            t0, odom0 = last
            if cfg.max_update_rate > 0 and stamp - t0 < 1.0 / cfg.max_update_rate:
                self.skipped += 1
                return None
            moved = math.hypot(odom[0] - odom0[0], odom[1] - odom0[1])
            turned = abs(float(wrap_angle(odom[2] - odom0[2])))
            if moved < cfg.update_min_d and turned < cfg.update_min_a:
                self.skipped += 1
                return None
        start = time.perf_counter()
        reading = self._reading_in_map_units(b, q)
        if last is not None:
            self.filter.predict(last[1], odom, stamp - last[0])
        self.filter.correct(reading)
        self._update_seconds.append(time.perf_counter() - start)
        self._nis.append(self.filter.last_nis)
        self._last_update = (stamp, odom)
        self.last_estimate = self.filter.estimate(stamp, odom)
        return self.last_estimate

    def _reading_in_map_units(self, b: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The reading as the filter takes it: |B|, or the levelled body-frame vector, in the map's unit."""
        b = self._iron.apply(b) * self._scale
        if self.map.target == "magnitude":
            return np.array([float(np.linalg.norm(b))])
        if not self._identity_rotation:
            b = rotate_vectors(self._sensor_q, b)
        if self.config.orientation == "orientation":
            # R_level = Rz(-yaw) R(q): remove the odometry's heading, keep its roll and pitch.
            b = rotate_vectors(quaternion_from_rpy(0.0, 0.0, -float(yaw_of(q))), rotate_vectors(q, b))
        return b

    # ------------------------------------------------------------------------------------------ outputs

    @property
    def updates(self) -> int:
        return self.filter.updates

    def map_to_odom(self) -> np.ndarray | None:
        """The ``map -> odom`` transform ``(x, y, yaw)`` of the last estimate (None before one), into the frame the
        odometry messages are in: after a bridged jump the filter's odometry is re-anchored (``corrected = fix *
        raw``), and the transform carries that correction so that it composed with the odometry as received gives
        the estimate."""
        if self.last_estimate is None:
            return None
        return compose(self.last_estimate.map_to_odom(), self._fix)

    def diagnostics(self) -> dict[str, Any]:
        """Counters, health and timing as plain numbers (``rejected`` by reason)."""
        est = self.last_estimate
        times = np.asarray(self._update_seconds, dtype=np.float64)
        nis = np.asarray(self._nis, dtype=np.float64)
        return {
            "readings": self.readings,
            "updates": self.filter.updates,
            "skipped": self.skipped,
            "waiting": len(self._waiting),
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
            "odometry_jumps": self.jumps,
            "reinitialisations": self.reinitialisations,
            "resamples": self.filter.resamples,
            "particles": self.filter.num_particles,
            "ess": float(self.filter.last_ess),
            "nis_mean": float(nis.mean()) if nis.size else math.nan,
            "off_map_weight": float(self.filter.last_off_map),
            "converged": bool(est.converged) if est is not None else False,
            "bias": [float(v) for v in est.bias] if est is not None else [],
            "bias_std": [float(v) for v in est.bias_std] if est is not None else [],
            "median_update_ms": float(np.median(times) * 1e3) if times.size else math.nan,
            "field_unit": self.map.field_unit,
        }


__all__ = ["JUMP_SLACK", "Localizer", "REJECTION_REASONS"]
