"""Match magnetometer samples with the robot's pose: interpolation, sensor extrinsic, units, rejection counts.

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

Bad input (docs/reliability.md). Non-finite values and stamps, a zero reading, a reading above
``sync.max_field``, a reading in another frame than the magnetometer's (``sync.field_frame``; when that is empty
the first frame seen is held, and another frame that sends FRAME_RELATCH_AFTER readings in a row while the
held one is silent takes over, so one stray message cannot lock the sensor out), a frame_id longer than
FRAME_ID_MAX_LENGTH, a pose beyond ``sync.max_position`` or with an
orientation whose norm is not 1 within ``sync.quaternion_tolerance``, stamps that go backwards or repeat, stamps
more than ``sync.max_stamp_jump`` ahead of the newest accepted one and (when the caller gives the receive time)
stamps more than ``sync.max_stamp_skew`` from it are refused and counted. A pose farther from the previous one
than ``sync.max_speed`` allows is a teleport: it is kept (it starts a new trajectory segment) but no sample is
interpolated across it. A stream whose stamps keep disagreeing with the accepted ones (a clock that really
jumped, or a bad stamp accepted earlier) re-anchors after :data:`REANCHOR_AFTER` consistent messages: the
buffers are cleared (waiting samples counted as ``stamp_reanchor``) and the new time base is accepted. A stamp
jump that comes with an equal jump of the receive time (within PAUSE_SLACK_S, or PAUSE_SLACK_FRACTION of the
jump) is a pause in the data, not a bad stamp: it is accepted at once and counted in ``pauses``.

Stamps ahead of their stream (within ``sync.max_stamp_jump``, when that check is on). A message whose stamp is
ahead of its own stream's newest by more than HOLD_INTERVALS of the stream's usual interval (the median of its
last HOLD_INTERVALS_KEPT; at least HOLD_MIN_S) is held back, not accepted, until the stream confirms it: the
next message of the stream at or near its stamp (within that margin), or a message of the other stream at or
after it, releases it (a real gap in the stream costs one message of latency, nothing else); a next message of
the stream that carries on below it means it was a lone stamp ahead, and it is refused (``*_stamp_ahead``). So
one bad stamp seconds ahead no longer turns the clean data after it into "backwards" refusals. The end of the
stream (:meth:`finish`) releases what is held.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from gp_mapping.config import FRAME_ID_MAX_LENGTH, SyncConfig
from gp_mapping.mapping.frames import (MIN_QUATERNION_NORM, normalize_quaternion, quaternion_multiply, rotate_vectors,
                                       slerp)
from gp_mapping.mapping.magnetometer import IronCorrection

# Multiply a value in tesla by this to get the named unit (the one table of field units).
UNIT_PER_TESLA: dict[str, float] = {
    "tesla": 1.0,
    "millitesla": 1e3,
    "microtesla": 1e6,
    "nanotesla": 1e9,
    "gauss": 1e4,
}
UNIT_SYMBOL: dict[str, str] = {"tesla": "T", "millitesla": "mT", "microtesla": "uT", "nanotesla": "nT",
                               "gauss": "G"}

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
# Consecutive messages of one stream, refused for their stamps (backwards or jump) and consistent among
# themselves, after which the sync takes them as the new time base.
REANCHOR_AFTER = 20
# Consecutive readings in one other frame, while the held frame is silent, after which a learned magnetometer
# frame is re-latched to that one (a stray first frame cannot hold the lock).
FRAME_RELATCH_AFTER = REANCHOR_AFTER
# A stamp jump beyond sync.max_stamp_jump is a pause, not a bad stamp, when the receive time jumped by as much:
# within PAUSE_SLACK_S, or PAUSE_SLACK_FRACTION of the jump for long ones (latency, clock rates).
PAUSE_SLACK_S = 2.0
PAUSE_SLACK_FRACTION = 0.05
# A stamp ahead of its stream's newest by more than HOLD_INTERVALS of its usual interval (median of the last
# HOLD_INTERVALS_KEPT, known after HOLD_MIN_INTERVALS), and at least HOLD_MIN_S, waits for the stream to confirm it.
HOLD_INTERVALS = 4.0
HOLD_INTERVALS_KEPT = 15
HOLD_MIN_INTERVALS = 3
HOLD_MIN_S = 0.02
_HOLD = "hold"  # _stamp_refusal's answer for a stamp that waits for confirmation
# A teleport must exceed sync.max_speed * dt by this much [m]: localisation noise between close poses is no jump.
TELEPORT_SLACK_M = 0.05
LOG = logging.getLogger("gp_mapping.sync")
# Samples queued before they are decided in one vectorised batch (see "Cost" above).
DECIDE_CHUNK = 256


class SyncError(ValueError):
    """A pose or field sample has the wrong shape (a programming error, not a data error)."""


def field_scale(unit: str) -> float:
    """Factor from tesla to ``unit``; raises SyncError naming the known units."""
    try:
        return UNIT_PER_TESLA[unit]
    except KeyError:
        raise SyncError(f"unknown field unit {unit!r}; known: {', '.join(UNIT_PER_TESLA)}") from None


def output_dims(target: str) -> int:
    """Number of model outputs P for a ``sync.target``: 1 for 'magnitude', 3 for 'vector'."""
    if target == "magnitude":
        return 1
    if target == "vector":
        return 3
    raise SyncError(f"unknown sync.target {target!r}; known: 'magnitude', 'vector'")


@dataclass
class Measurements:
    """Matched samples: model inputs ``x (N, D)``, targets ``y (N, P)`` in the field unit, stamps ``t (N,)``.

    ``position`` holds the full 3-D sensor positions (map frame), used for coverage and plots.
    """

    x: np.ndarray
    y: np.ndarray
    t: np.ndarray
    position: np.ndarray

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @classmethod
    def empty(cls, input_dims: int, output_dims: int) -> "Measurements":
        return cls(np.zeros((0, input_dims)), np.zeros((0, output_dims)), np.zeros(0), np.zeros((0, 3)))

    @classmethod
    def concatenate(cls, parts: list["Measurements"]) -> "Measurements":
        if not parts:
            raise ValueError("Measurements.concatenate needs at least one part")
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("x", "y", "t", "position")))

    def slice(self, start: int, stop: int | None = None) -> "Measurements":
        sl = slice(start, stop)
        return Measurements(self.x[sl], self.y[sl], self.t[sl], self.position[sl])


def interpolate_poses(stamps: np.ndarray, positions: np.ndarray, orientations: np.ndarray, t: np.ndarray,
                      max_gap: float) -> tuple[np.ndarray, ...]:
    """The pose at each stamp ``t`` from time-ordered poses (``stamps`` (K,), ``positions`` (K, 3),
    ``orientations`` (K, 4) [x, y, z, w]): linear interpolation of the positions and slerp of the orientations
    between the last pose at or before ``t`` and the first at or after it, the matching rule of this module
    (and of the replay's tf lookups). Returns (positions (N, 3), orientations (N, 4), has a pose before (N,),
    both neighbours within ``max_gap`` (N,), and the indices (N,) of the two neighbours, clipped to the poses).
    A stamp after the last pose takes the last one as both neighbours: callers decide only stamps up to it.
    """
    st = stamps
    i1 = np.searchsorted(st, t, side="left")  # first pose at or after t
    exact = (i1 < st.shape[0]) & (st[np.minimum(i1, st.shape[0] - 1)] == t)
    i0 = np.where(exact, i1, i1 - 1)          # last pose at or before t
    has_before = i0 >= 0
    i0c = np.clip(i0, 0, st.shape[0] - 1)
    i1c = np.clip(i1, 0, st.shape[0] - 1)
    t0, t1 = st[i0c], st[i1c]
    within = has_before & (t - t0 <= max_gap) & (t1 - t <= max_gap)
    span = t1 - t0
    alpha = np.where(span > 0, (t - t0) / np.where(span > 0, span, 1.0), 0.0)
    p0, p1 = positions[i0c], positions[i1c]
    q0, q1 = orientations[i0c], orientations[i1c]
    pos = p0 + alpha[:, None] * (p1 - p0)
    quat = slerp(q0, q1, alpha) if t.shape[0] else np.zeros((0, 4))
    return pos, quat, has_before, within, i0c, i1c


class _PoseBuffer:
    """Time-ordered poses in growable numpy arrays, trimmed to a time window (cheap searchsorted lookups)."""

    def __init__(self, capacity: int = 256) -> None:
        self._t = np.empty(capacity)
        self._p = np.empty((capacity, 3))
        self._q = np.empty((capacity, 4))
        self._jump = np.zeros(capacity, dtype=bool)  # True: this pose teleported from the previous one
        self._lo = 0
        self._hi = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def stamps(self) -> np.ndarray:
        return self._t[self._lo:self._hi]

    @property
    def newest(self) -> float:
        return float(self._t[self._hi - 1])

    @property
    def newest_position(self) -> np.ndarray:
        return self._p[self._hi - 1]

    def append(self, t: float, p: np.ndarray, q: np.ndarray, jump: bool = False) -> None:
        if self._hi == self._t.shape[0]:
            n = len(self)
            cap = self._t.shape[0] * (2 if n > self._t.shape[0] // 2 else 1)
            for name in ("_t", "_p", "_q", "_jump"):
                old = getattr(self, name)
                new = np.empty((cap,) + old.shape[1:], dtype=old.dtype)
                new[:n] = old[self._lo:self._hi]
                setattr(self, name, new)
            self._lo, self._hi = 0, n
        self._t[self._hi], self._p[self._hi], self._q[self._hi] = t, p, q
        self._jump[self._hi] = jump
        self._hi += 1

    def trim_before(self, cutoff: float) -> None:
        """Drop poses older than ``cutoff``, keeping the last one at or before it (a sample at the cutoff still
        has its left neighbour)."""
        k = int(np.searchsorted(self.stamps, cutoff, side="right")) - 1
        if k > 0:
            self._lo += k

    def interpolate(self, t: np.ndarray, max_gap: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Positions, orientations, and the masks (has a pose before, both within max_gap, across a teleport)
        at stamps ``t``. A sample exactly at a teleported pose counts as across it (its neighbourhood is unknown).

        Every ``t`` must be at or before the newest pose.
        """
        lo, hi = self._lo, self._hi
        pos, quat, has_before, within, _, i1 = interpolate_poses(self._t[lo:hi], self._p[lo:hi], self._q[lo:hi], t,
                                                                 max_gap)
        across = self._jump[lo + i1]
        return pos, quat, has_before, within, across


class MeasurementSync:
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
        self._poses = _PoseBuffer()
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

    def _clear_held(self) -> None:
        # Per stream: the message held back for being ahead of its stream, (stamp, accept it), and the stream's
        # recent intervals between accepted stamps.
        self._held: dict[str, tuple[float, Any] | None] = {"field": None, "pose": None}
        self._intervals: dict[str, deque[float]] = {"field": deque(maxlen=HOLD_INTERVALS_KEPT),
                                                    "pose": deque(maxlen=HOLD_INTERVALS_KEPT)}

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

    def _stamp_refusal(self, stream: str, stamp: float, receive_time: float | None) -> str | None:
        """Why ``stamp`` of ``stream`` ('field' or 'pose') is refused, or None. Re-anchors a stream whose
        refused stamps keep agreeing with each other (see the module docstring)."""
        if not math.isfinite(stamp):
            return f"{stream}_stamp_nonfinite"
        cfg = self.config
        if cfg.max_stamp_skew > 0 and receive_time is not None and math.isfinite(receive_time) \
                and abs(stamp - receive_time) > cfg.max_stamp_skew:
            return f"{stream}_stamp_skew"
        last = self._last_field_stamp if stream == "field" else self._last_pose_stamp
        if stamp == last:
            return f"{stream}_stamp_duplicate"  # a repeated stamp is never a new time base
        if self._held[stream] is not None:
            self._resolve_held(stream, stamp)  # this message confirms the held one, or shows it was alone
            last = self._last_field_stamp if stream == "field" else self._last_pose_stamp
            if stamp == last:
                return f"{stream}_stamp_duplicate"
        newest = max(self._last_field_stamp, self._last_pose_stamp)
        reason = None
        if cfg.max_stamp_jump > 0 and math.isfinite(newest) and stamp > newest + cfg.max_stamp_jump:
            if self._is_pause(stamp, receive_time):
                self.pauses += 1
                LOG.info("a pause of %.1f s in the data (stamps and receive times jumped together)", stamp - newest)
                self._stale[stream] = (0, -math.inf)
                return None
            reason = f"{stream}_stamp_jump"
        elif stamp < last:
            reason = f"{stream}_stamp_backwards"
        if reason is None:
            self._stale[stream] = (0, -math.inf)
            margin = self._hold_margin(stream)
            if margin is not None and stamp > last + margin:
                return _HOLD
            return None
        count, previous = self._stale[stream]
        consistent = previous < stamp and (cfg.max_stamp_jump <= 0 or stamp - previous <= cfg.max_stamp_jump)
        count = count + 1 if consistent else 1
        if count < REANCHOR_AFTER:
            self._stale[stream] = (count, stamp)
            return reason
        self._reanchor()
        return None

    def _hold_margin(self, stream: str) -> float | None:
        """How far ahead of its stream's newest stamp a message may be before it is held back (None: no hold;
        the check is off, or the stream's interval is not known yet)."""
        intervals = self._intervals[stream]
        if self.config.max_stamp_jump <= 0 or len(intervals) < HOLD_MIN_INTERVALS:
            return None
        ordered = sorted(intervals)
        return max(HOLD_MIN_S, HOLD_INTERVALS * ordered[len(ordered) // 2])

    def _resolve_held(self, stream: str, stamp: float) -> None:
        """A usable message of ``stream`` at ``stamp`` came while one is held: at or near the held stamp (or after
        it) it confirms it (accepted now, before this one); between the stream's newest and the held stamp it shows
        the held one was a lone stamp ahead (refused); older than the stream's newest it says nothing."""
        held_stamp, accept = self._held[stream]
        last = self._last_field_stamp if stream == "field" else self._last_pose_stamp
        margin = self._hold_margin(stream) or HOLD_MIN_S
        if stamp >= held_stamp - margin:
            self._held[stream] = None
            accept()
        elif stamp > last:
            self._held[stream] = None
            self._reject(f"{stream}_stamp_ahead")

    def _release_other(self, stream: str, stamp: float) -> None:
        """A message of ``stream`` accepted at ``stamp``: the other stream's held message at or before it is
        confirmed by it (the data have reached its time)."""
        other = "pose" if stream == "field" else "field"
        held = self._held[other]
        if held is not None and stamp >= held[0]:
            self._held[other] = None
            held[1]()

    def _note_interval(self, stream: str, stamp: float) -> None:
        last = self._last_field_stamp if stream == "field" else self._last_pose_stamp
        if math.isfinite(last) and stamp > last:
            self._intervals[stream].append(stamp - last)

    def _is_pause(self, stamp: float, receive_time: float | None) -> bool:
        """Whether a stamp jump came with an equal jump of the receive time since the last accepted message."""
        if self._anchor is None or receive_time is None or not math.isfinite(receive_time):
            return False
        anchor_stamp, anchor_receive = self._anchor
        waited = receive_time - anchor_receive
        return abs((stamp - anchor_stamp) - waited) <= max(PAUSE_SLACK_S, PAUSE_SLACK_FRACTION * waited)

    def _accepted_at(self, stamp: float, receive_time: float | None) -> None:
        if receive_time is not None and math.isfinite(receive_time):
            self._anchor = (stamp, receive_time)

    def _frame_refusal(self, frame_id: str) -> str | None:
        """Why a reading's ``frame_id`` is refused, or None; holds or re-latches the learned frame."""
        if len(frame_id) > FRAME_ID_MAX_LENGTH:
            return "field_frame_invalid"
        if not frame_id or frame_id == self._field_frame:
            if frame_id:
                self._frame_candidate = ("", 0)  # the held frame spoke: a candidate starts over
            return None
        if not self._field_frame:
            return None  # the first frame seen is latched once the reading is accepted
        if self.config.field_frame:
            return "field_frame_mismatch"
        name, count = self._frame_candidate
        count = count + 1 if name == frame_id else 1
        if count < FRAME_RELATCH_AFTER:
            self._frame_candidate = (frame_id, count)
            return "field_frame_mismatch"
        LOG.warning("magnetometer frame re-latched from '%s' to '%s': %d readings in a row in it while '%s' was "
                    "silent", self._field_frame, frame_id, count, self._field_frame)
        self._field_frame = frame_id
        self._frame_candidate = ("", 0)
        self.frame_relatches += 1
        return None

    def _reanchor(self) -> None:
        """Take a new time base: forget poses, waiting samples (counted) and the stamp references."""
        self._decide_waiting()  # samples the old poses bracket are decided under them
        self._reject("stamp_reanchor", len(self._waiting))
        self._waiting.clear()
        self._poses = _PoseBuffer()
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
        if reason == _HOLD:  # ahead of the pose stream: waits for the stream to confirm it
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
        if reason == _HOLD:  # ahead of the field stream: waits for the stream to confirm it
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
        st = self._poses
        waiting_t = np.array([t for t, _ in self._waiting], dtype=np.float64)
        waiting_b = np.array([b for _, b in self._waiting], dtype=np.float64).reshape(-1, 3)
        arrays = {"pose_t": st.stamps.copy(), "pose_p": st._p[st._lo:st._hi].copy(),
                  "pose_q": st._q[st._lo:st._hi].copy(), "pose_jump": st._jump[st._lo:st._hi].copy(),
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
        self._poses = _PoseBuffer(max(256, t.shape[0]))
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
