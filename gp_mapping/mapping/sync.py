"""Match magnetometer samples with the robot's pose: the matching rule, the sensor extrinsic, rejection counts, the
bound on what is held.

Matching rule. A field sample at time ``t`` is matched with the latest pose at or before ``t`` (stamp ``t0``)
and the earliest pose at or after ``t`` (``t1``); it is accepted when both exist and ``t - t0`` and ``t1 - t``
are each at most ``sync.max_pose_gap``. The body pose at ``t`` is the linear interpolation of the two
positions and the slerp of the two orientations. A sample newer than every pose waits (bounded) for the pose
that follows it, because the two topics arrive independently.

Frames. ``sync.sensor_translation`` and ``sync.sensor_rotation`` place the sensor in the body frame, so the
sensor sits at ``p + R(q) t_s`` in the map frame and a reading ``b`` (sensor frame) is ``R(q) R_s b`` in the
map frame. The model input ``x`` is the sensor position's first ``sync.input_dims`` coordinates.

Magnetometer calibration. ``sync.hard_iron`` (h) and ``sync.soft_iron`` (S) correct each reading to
``S (b - h)`` before it is rotated or its magnitude taken (:class:`~gp_mapping.mapping.magnetometer.IronCorrection`,
which the localizer uses too); at the defaults nothing is computed. The bad-input guards below look at the reading
as the sensor sent it (a zero or saturated message is the sensor's).

Every sample or pose that is not used is counted under a named reason (:data:`REJECTION_REASONS`).

Cost. A sample's bracket is fixed once a pose at or after it has arrived (poses only move forward), so samples
are decided in batches, not one by one: when :data:`DECIDE_CHUNK` have queued, and before anything reads the
result (``pop_ready``, the counters, a checkpoint) or could change it (a trim of the pose buffer past a queued
sample, a re-anchor, a timeout, the bound, the end of the stream). The outcome is the one of deciding each
sample on arrival; the cost per sample falls from a vectorised call each (~0.3 ms) to a share of one.

Bad input (docs/reliability.md). Non-finite values, a zero reading, a reading above ``sync.max_field``, a pose
beyond ``sync.max_position`` or with an orientation whose norm is not 1 within ``sync.quaternion_tolerance`` are
refused and counted here; a message's stamp and a reading's frame are judged against their stream by
:mod:`~gp_mapping.mapping.stream_checks` (bad stamps, re-anchoring to a new time base, pauses, stamps held back
while they are ahead of their stream, the magnetometer frame's latch). A pose farther from the previous one than
``sync.max_speed`` allows is a teleport: it is kept (it starts a new trajectory segment) but no sample is
interpolated across it.

What the sync hands over (:class:`Measurements`) and the field units are in :mod:`~gp_mapping.mapping.measurements`;
the pose buffer and the interpolation in :mod:`~gp_mapping.mapping.poses`.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import numpy as np

from gp_mapping.config import FRAME_ID_MAX_LENGTH, SyncConfig
from gp_mapping.mapping.frames import MIN_QUATERNION_NORM, normalize_quaternion, quaternion_multiply, rotate_vectors
from gp_mapping.mapping.magnetometer import IronCorrection
from gp_mapping.mapping.measurements import (UNIT_PER_TESLA, UNIT_SYMBOL, Measurements, SyncError, field_scale,
                                             output_dims)
from gp_mapping.mapping.poses import PoseBuffer
from gp_mapping.mapping.stream_checks import HOLD_BACK, StreamChecks

# The public names of the sync, with those of the field units and the matched samples (measurements.py), which
# were defined here before they had a module of their own.
__all__ = ["DECIDE_CHUNK", "POSE_REJECTION_REASONS", "REJECTION_REASONS", "SAMPLE_REJECTION_REASONS",
           "TELEPORT_SLACK_M", "UNIT_PER_TESLA", "UNIT_SYMBOL", "MeasurementSync", "Measurements", "SyncError",
           "field_scale", "output_dims"]

# Why a pose or a field sample was not used; each is a key of MeasurementSync.rejected.
REJECTION_REASONS: dict[str, str] = {
    "field_nonfinite": "a field component is NaN or infinite",
    "field_stamp_nonfinite": "the field sample's stamp is NaN or infinite, or malformed (nanosec >= 1e9)",
    "field_stamp_backwards": "the field sample is older than the previous field sample",
    "field_stamp_duplicate": "the field sample has the same stamp as the previous field sample",
    "field_stamp_jump": "the field sample's stamp is more than sync.max_stamp_jump ahead of the newest accepted stamp",
    "field_stamp_skew": "the field sample's stamp is more than sync.max_stamp_skew from its receive time",
    "field_stamp_ahead": "a lone field stamp ahead of its stream (within sync.max_stamp_jump), held back and not "
                         "confirmed: the next reading carried on below it",
    "field_zero": "the reading is exactly (0, 0, 0): an unset message or a dead sensor",
    "field_out_of_range": "|B| is above sync.max_field (saturated or absurd)",
    "field_frame_mismatch": "the reading's frame_id differs from the magnetometer frame (sync.field_frame, or the "
                            "one held)",
    "field_frame_invalid": "the reading's frame_id is longer than FRAME_ID_MAX_LENGTH (256) characters",
    "pose_nonfinite": "a pose position or orientation entry is NaN or infinite",
    "pose_bad_quaternion": "the pose orientation has zero norm, or a norm off 1 by more than "
                           "sync.quaternion_tolerance",
    "pose_out_of_range": "the pose position is farther than sync.max_position from the origin",
    "pose_stamp_nonfinite": "the pose stamp is NaN or infinite, or malformed (nanosec >= 1e9)",
    "pose_stamp_backwards": "the pose is older than the previous pose",
    "pose_stamp_duplicate": "the pose has the same stamp as the previous pose",
    "pose_stamp_jump": "the pose stamp is more than sync.max_stamp_jump ahead of the newest accepted stamp",
    "pose_stamp_skew": "the pose stamp is more than sync.max_stamp_skew from its receive time",
    "pose_stamp_ahead": "a lone pose stamp ahead of its stream (within sync.max_stamp_jump), held back and not "
                        "confirmed: the next pose carried on below it",
    "no_pose_before": "no buffered pose at or before the sample (before the first pose, or beyond the pose "
                      "buffer)",
    "pose_gap": "the nearest pose before or after the sample is more than sync.max_pose_gap away",
    "pose_jump": "the poses around the sample are a teleport (faster than sync.max_speed) apart",
    "pose_timeout": "no pose followed the sample within sync.pose_buffer_seconds of field time",
    "no_pose_after": "the stream ended before a pose followed the sample",
    "sync_overflow": "more samples waited than the bound allows; the oldest were dropped",
    "stamp_reanchor": "the sample was waiting for a pose when a stream re-anchored to a new time base",
}
# Reasons that count rejected poses; every other reason counts rejected field samples, so that
# accepted + sum(rejected[r] for r in SAMPLE_REJECTION_REASONS) + waiting = field samples given.
POSE_REJECTION_REASONS = ("pose_nonfinite", "pose_bad_quaternion", "pose_out_of_range", "pose_stamp_nonfinite",
                          "pose_stamp_backwards", "pose_stamp_duplicate", "pose_stamp_jump", "pose_stamp_skew",
                          "pose_stamp_ahead")
SAMPLE_REJECTION_REASONS = tuple(r for r in REJECTION_REASONS if r not in POSE_REJECTION_REASONS)
# A teleport must exceed sync.max_speed * dt by this much [m]: localisation noise between close poses is no jump.
TELEPORT_SLACK_M = 0.05
LOG = logging.getLogger("gp_mapping.sync")
# Samples queued before they are decided in one vectorised batch (see "Cost" above).
DECIDE_CHUNK = 256


class MeasurementSync(StreamChecks):
    """Pose buffer plus waiting field samples; turns (pose, field) streams into :class:`Measurements`.

    ``add_pose`` and ``add_field`` take SI units (metres, tesla) and stamps in seconds; ``pop_ready`` returns
    every sample decided so far as accepted, in stamp order. ``rejected`` counts unused inputs by reason.
    ``max_pending`` bounds the samples held (waiting for a pose, plus accepted and not yet popped).
    """

    def __init__(self, config: SyncConfig | None = None, max_pending: int = 10_000) -> None:
        self.config = config or SyncConfig()
        if max_pending < 1:
            raise SyncError(f"max_pending must be at least 1, got {max_pending}")
        self.max_pending = int(max_pending)
        self.output_dims = output_dims(self.config.target)
        self.input_dims = int(self.config.input_dims)
        self._scale = field_scale(self.config.field_unit)
        self._t_sensor = np.asarray(self.config.sensor_translation, dtype=np.float64).reshape(3)
        try:
            self._q_sensor = normalize_quaternion(self.config.sensor_rotation)
        except ValueError as err:
            raise SyncError(f"sync.sensor_rotation: {err}") from err
        try:
            self._iron = IronCorrection.from_sync(self.config, self._scale)
        except ValueError as err:
            raise SyncError(f"sync.hard_iron / sync.soft_iron: {err}") from err
        self._rejected: dict[str, int] = {reason: 0 for reason in REJECTION_REASONS}
        self._accepted = 0
        self.poses_accepted = 0
        self.teleports = 0   # accepted poses that jumped (events, not rejections)
        self.reanchors = 0   # times a stream's stamps were taken as a new time base
        self.pauses = 0      # stamp jumps accepted because the receive time jumped with them
        self.frame_relatches = 0  # times the learned magnetometer frame passed to another one
        self.reset()

    def reset(self) -> None:
        """Forget poses and samples (the counters are kept; see ``reset_counters``)."""
        if hasattr(self, "_waiting"):
            self._decide_waiting()  # the counters include what was decidable before the reset
        self._poses = PoseBuffer()
        self._waiting: deque[tuple[float, np.ndarray]] = deque()  # (stamp, field in tesla), stamp order
        self._ready: list[Measurements] = []
        self._ready_count = 0
        self._last_field_stamp = -math.inf
        self._last_pose_stamp = -math.inf
        self._field_frame = self.config.field_frame  # empty: learned from the readings
        self._frame_candidate: tuple[str, int] = ("", 0)  # another frame and its readings in a row
        self._anchor: tuple[float, float] | None = None  # (stamp, receive time) of the last accepted message
        # Per stream: (consecutive stamp refusals consistent among themselves, the last refused stamp).
        self._stale: dict[str, tuple[int, float]] = {"field": (0, -math.inf), "pose": (0, -math.inf)}
        self._clear_held()

    def reset_counters(self) -> None:
        self._decide_waiting()
        self._rejected = {reason: 0 for reason in REJECTION_REASONS}
        self._accepted = 0
        self.poses_accepted = 0
        self.teleports = 0
        self.reanchors = 0
        self.pauses = 0
        self.frame_relatches = 0

    @property
    def field_frame(self) -> str:
        """The magnetometer frame readings must be in ('' until one is seen when it is learned)."""
        return self._field_frame

    @property
    def rejected(self) -> dict[str, int]:
        """Unused inputs by reason (:data:`REJECTION_REASONS`)."""
        self._decide_waiting()
        return self._rejected

    @rejected.setter
    def rejected(self, counts: dict[str, int]) -> None:
        self._rejected = counts

    @property
    def accepted(self) -> int:
        """Field samples matched with a pose (returned by ``pop_ready`` or still ready)."""
        self._decide_waiting()
        return self._accepted

    @accepted.setter
    def accepted(self, count: int) -> None:
        self._accepted = count

    @property
    def num_waiting(self) -> int:
        """Samples waiting for a pose that follows them."""
        self._decide_waiting()
        return len(self._waiting) + (self._held["field"] is not None)

    @property
    def num_held(self) -> int:
        """Samples given and neither returned by ``pop_ready`` nor refused yet, decided or not: what a
        ``pop_ready`` could return at most. Deciding nothing, it costs nothing."""
        return len(self._waiting) + self._ready_count + (self._held["field"] is not None)

    @property
    def num_ready(self) -> int:
        """Accepted samples not yet returned by ``pop_ready``."""
        self._decide_waiting()
        return self._ready_count

    @property
    def last_stamp(self) -> float:
        """Newest stamp seen on either stream (-inf before any)."""
        return max(self._last_field_stamp, self._last_pose_stamp)

    def _reject(self, reason: str, count: int = 1) -> None:
        self._rejected[reason] += count

    def _reanchor(self) -> None:
        """Take a new time base: forget poses, waiting samples (counted) and the stamp references."""
        self._decide_waiting()  # samples the old poses bracket are decided under them
        self._reject("stamp_reanchor", len(self._waiting))
        self._waiting.clear()
        self._poses = PoseBuffer()
        self._last_field_stamp = self._last_pose_stamp = -math.inf
        self._stale = {"field": (0, -math.inf), "pose": (0, -math.inf)}
        for stream, held in self._held.items():
            if held is not None:
                self._reject(f"{stream}_stamp_ahead")
        self._clear_held()
        self._anchor = None
        self.reanchors += 1

    def add_pose(self, stamp: float, position, orientation_xyzw, receive_time: float | None = None) -> bool:
        """Buffer one body pose (map frame). Returns False, counting the reason, when it is rejected.

        ``receive_time`` (seconds on the stamps' clock, optional) enables the ``sync.max_stamp_skew`` check.
        """
        p = np.asarray(position, dtype=np.float64)
        q = np.asarray(orientation_xyzw, dtype=np.float64)
        if p.shape != (3,) or q.shape != (4,):
            raise SyncError(f"a pose needs position (3,) and orientation [x, y, z, w] (4,), got {p.shape} and "
                            f"{q.shape}")
        stamp = float(stamp)
        reason = None
        # Scalar checks in plain floats: numpy's per-call overhead on 3- and 4-vectors dominates at sensor rates.
        values = p.tolist() + q.tolist()
        if not all(map(math.isfinite, values)):
            reason = "pose_nonfinite" if math.isfinite(stamp) else "pose_stamp_nonfinite"
        elif not (MIN_QUATERNION_NORM < (q_norm := math.hypot(*values[3:]))
                  and abs(q_norm - 1.0) <= self.config.quaternion_tolerance):
            reason = "pose_bad_quaternion" if math.isfinite(stamp) else "pose_stamp_nonfinite"
        elif math.hypot(*values[:3]) > self.config.max_position:
            reason = "pose_out_of_range" if math.isfinite(stamp) else "pose_stamp_nonfinite"
        else:
            # Only a pose with usable values may take part in re-anchoring the stream's time base.
            reason = self._stamp_refusal("pose", stamp, receive_time)
        if reason == HOLD_BACK:  # ahead of the pose stream: waits for the stream to confirm it
            self._held["pose"] = (stamp, lambda: self._accept_pose(stamp, p, q, values, receive_time))
            return True
        if reason is not None:
            self._reject(reason)
            return False
        self._accept_pose(stamp, p, q, values, receive_time)
        return True

    def _accept_pose(self, stamp: float, p: np.ndarray, q: np.ndarray, values: list[float],
                     receive_time: float | None) -> None:
        jump = False
        if self.config.max_speed > 0 and len(self._poses):
            dt = stamp - self._poses.newest
            distance = math.dist(values[:3], self._poses.newest_position.tolist())
            jump = distance > self.config.max_speed * dt + TELEPORT_SLACK_M
            self.teleports += int(jump)
        self._accepted_at(stamp, receive_time)
        self._note_interval("pose", stamp)
        self._last_pose_stamp = stamp
        self._poses.append(stamp, p, normalize_quaternion(q), jump)
        self.poses_accepted += 1
        cutoff = stamp - self.config.pose_buffer_seconds
        if self._waiting and self._waiting[0][0] < cutoff:
            self._decide_waiting()  # before the trim drops a queued sample's left neighbour
        self._poses.trim_before(cutoff)
        self._release_other("pose", stamp)

    def add_field(self, stamp: float, field_tesla, frame_id: str = "", receive_time: float | None = None) -> None:
        """Queue one magnetometer reading (sensor frame, tesla); decided now or when its next pose arrives.

        ``frame_id`` (optional): readings in another frame than ``sync.field_frame`` are refused; with that
        empty, the first non-empty frame is held, and re-latched as FRAME_RELATCH_AFTER says.
        ``receive_time`` (optional) enables the ``sync.max_stamp_skew`` check.
        """
        b = np.asarray(field_tesla, dtype=np.float64)
        if b.shape != (3,):
            raise SyncError(f"a magnetic field sample must have shape (3,), got {b.shape}")
        stamp = float(stamp)
        components = b.tolist()
        magnitude = math.hypot(*components) if all(map(math.isfinite, components)) else math.nan
        reason = None
        if not math.isfinite(stamp):
            reason = "field_stamp_nonfinite"
        elif not math.isfinite(magnitude):
            reason = "field_nonfinite"
        elif magnitude == 0.0:
            reason = "field_zero"
        elif self.config.max_field > 0 and magnitude > self.config.max_field:
            reason = "field_out_of_range"
        else:
            reason = self._frame_refusal(frame_id)
            if reason is None:
                reason = self._stamp_refusal("field", stamp, receive_time)
        if reason == HOLD_BACK:  # ahead of the field stream: waits for the stream to confirm it
            self._held["field"] = (stamp, lambda: self._accept_field(stamp, b, frame_id, receive_time))
            return
        if reason is not None:
            self._reject(reason)
            return
        self._accept_field(stamp, b, frame_id, receive_time)

    def _accept_field(self, stamp: float, b: np.ndarray, frame_id: str, receive_time: float | None) -> None:
        if frame_id and not self._field_frame:
            self._field_frame = frame_id
            LOG.info("magnetometer frame '%s' held: readings in another frame are refused", frame_id)
        self._accepted_at(stamp, receive_time)
        self._note_interval("field", stamp)
        self._last_field_stamp = stamp
        self._waiting.append((stamp, b))
        # A pose stream that stopped long ago (in field time) will not bracket the oldest samples any more.
        limit = stamp - self.config.pose_buffer_seconds
        if self._waiting[0][0] < limit:
            self._decide_waiting()  # what is left at the front has no pose after it
            while self._waiting and self._waiting[0][0] < limit and (
                    len(self._poses) == 0 or self._waiting[0][0] > self._poses.newest):
                self._waiting.popleft()
                self._reject("pose_timeout")
        if len(self._waiting) >= DECIDE_CHUNK:
            self._decide_waiting()
        self._enforce_bound()
        self._release_other("field", stamp)

    def _decide_waiting(self) -> None:
        """Decide every waiting sample that is at or before the newest pose (its bracket is now known)."""
        if not self._waiting or len(self._poses) == 0:
            return
        newest = self._poses.newest
        n = 0
        for stamp, _ in self._waiting:
            if stamp > newest:
                break
            n += 1
        if n == 0:
            return
        items = [self._waiting.popleft() for _ in range(n)]
        t = np.array([s for s, _ in items])
        b = np.stack([f for _, f in items])
        pos, quat, has_before, within, across = self._poses.interpolate(t, self.config.max_pose_gap)
        self._reject("no_pose_before", int(np.count_nonzero(~has_before)))
        self._reject("pose_gap", int(np.count_nonzero(has_before & ~within)))
        self._reject("pose_jump", int(np.count_nonzero(within & across)))
        ok = within & ~across
        if not np.any(ok):
            return
        t, b, pos, quat = t[ok], b[ok], pos[ok], quat[ok]
        b = self._iron.apply(b)  # the hard- and soft-iron correction (the input itself at the defaults)
        sensor_pos = pos + rotate_vectors(quat, self._t_sensor)
        if self.output_dims == 1:
            y = np.linalg.norm(b, axis=1, keepdims=True) * self._scale  # |B| does not depend on the frame
        else:
            y = rotate_vectors(quaternion_multiply(quat, self._q_sensor), b) * self._scale
        self._ready.append(Measurements(sensor_pos[:, :self.input_dims].copy(), y, t, sensor_pos))
        self._ready_count += t.shape[0]
        self._accepted += t.shape[0]

    def _enforce_bound(self) -> None:
        if len(self._waiting) + self._ready_count <= self.max_pending:
            return
        self._decide_waiting()  # refused samples do not count against the bound
        excess = len(self._waiting) + self._ready_count - self.max_pending
        if excess <= 0:
            return
        # Oldest first: accepted-but-unpopped samples are older than every waiting one.
        while excess > 0 and self._ready:
            head = self._ready[0]
            k = min(excess, len(head))
            self._ready[0] = head.slice(k)
            if len(self._ready[0]) == 0:
                self._ready.pop(0)
            self._ready_count -= k
            self._accepted -= k
            self._reject("sync_overflow", k)
            excess -= k
        while excess > 0 and self._waiting:
            self._waiting.popleft()
            self._reject("sync_overflow")
            excess -= 1

    def export_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The buffers (poses, samples waiting for a pose) as arrays, and the stamp references as plain values,
        for a checkpoint. Samples accepted and not yet popped are the caller's to save (pop them first)."""
        self._decide_waiting()
        pose_t, pose_p, pose_q, pose_jump = self._poses.arrays()
        waiting_t = np.array([t for t, _ in self._waiting], dtype=np.float64)
        waiting_b = np.array([b for _, b in self._waiting], dtype=np.float64).reshape(-1, 3)
        arrays = {"pose_t": pose_t, "pose_p": pose_p, "pose_q": pose_q, "pose_jump": pose_jump,
                  "waiting_t": waiting_t, "waiting_b": waiting_b}
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731 - JSON has no infinity
        info = {"last_field_stamp": finite(self._last_field_stamp), "last_pose_stamp": finite(self._last_pose_stamp),
                "field_frame": self._field_frame, "anchor": list(self._anchor) if self._anchor else None}
        return arrays, info

    def import_state(self, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
        """Inverse of :meth:`export_state` (raises KeyError / ValueError on malformed data)."""
        t = np.asarray(arrays["pose_t"], dtype=np.float64).reshape(-1)
        p = np.asarray(arrays["pose_p"], dtype=np.float64).reshape(t.shape[0], 3)
        q = np.asarray(arrays["pose_q"], dtype=np.float64).reshape(t.shape[0], 4)
        jump = np.asarray(arrays["pose_jump"], dtype=bool).reshape(t.shape[0])
        wt = np.asarray(arrays["waiting_t"], dtype=np.float64).reshape(-1)
        wb = np.asarray(arrays["waiting_b"], dtype=np.float64).reshape(wt.shape[0], 3)
        if not (np.all(np.isfinite(t)) and np.all(np.isfinite(p)) and np.all(np.isfinite(wt))):
            raise ValueError("non-finite pose or waiting-sample data")
        self._poses = PoseBuffer(max(256, t.shape[0]))
        for k in range(t.shape[0]):
            self._poses.append(float(t[k]), p[k], normalize_quaternion(q[k]), bool(jump[k]))
        self._waiting = deque((float(wt[k]), wb[k].copy()) for k in range(wt.shape[0]))
        self._last_field_stamp = -math.inf if info["last_field_stamp"] is None else float(info["last_field_stamp"])
        self._last_pose_stamp = -math.inf if info["last_pose_stamp"] is None else float(info["last_pose_stamp"])
        if not self.config.field_frame:  # a configured frame wins over the saved one
            self._field_frame = str(info["field_frame"])[:FRAME_ID_MAX_LENGTH]
        anchor = info.get("anchor")
        self._anchor = (float(anchor[0]), float(anchor[1])) if anchor else None

    def pop_ready(self) -> Measurements:
        """Every accepted sample not returned before, oldest first (possibly empty)."""
        self._decide_waiting()
        if not self._ready:
            return Measurements.empty(self.input_dims, self.output_dims)
        out = Measurements.concatenate(self._ready)
        self._ready, self._ready_count = [], 0
        return out

    def finish(self) -> None:
        """End of stream: held messages are released (nothing came to contradict them); samples still waiting
        for a following pose can never be matched; count them."""
        for stream in ("pose", "field"):
            held = self._held[stream]
            if held is not None:
                self._held[stream] = None
                held[1]()
        self._decide_waiting()
        self._reject("no_pose_after", len(self._waiting))
        self._waiting.clear()

    def counters(self) -> dict[str, int | dict[str, int]]:
        """Plain numbers: accepted samples, poses, samples waiting/ready, rejections by reason and totals."""
        self._decide_waiting()
        return {
            "accepted": self._accepted,
            "samples_rejected": sum(self._rejected[r] for r in SAMPLE_REJECTION_REASONS),
            "poses_accepted": self.poses_accepted,
            "poses_rejected": sum(self._rejected[r] for r in POSE_REJECTION_REASONS),
            "waiting": len(self._waiting),
            "ready": self._ready_count,
            "teleports": self.teleports,
            "reanchors": self.reanchors,
            "pauses": self.pauses,
            "frame_relatches": self.frame_relatches,
            "rejected": dict(self._rejected),
        }
