"""The checks of a message's stamp and of a reading's frame (:class:`StreamChecks`, a part of
:class:`~gp_mapping.mapping.sync.MeasurementSync`): what each stream's own stamps say about a new one.

Stamps (docs/reliability.md). Non-finite stamps, stamps that go backwards or repeat, stamps more than
``sync.max_stamp_jump`` ahead of the newest accepted one and (when the caller gives the receive time) stamps more
than ``sync.max_stamp_skew`` from it are refused and counted. A stream whose stamps keep disagreeing with the
accepted ones (a clock that really jumped, or a bad stamp accepted earlier) re-anchors after :data:`REANCHOR_AFTER`
consistent messages: the buffers are cleared (waiting samples counted as ``stamp_reanchor``) and the new time base
is accepted. A stamp jump that comes with an equal jump of the receive time (within PAUSE_SLACK_S, or
PAUSE_SLACK_FRACTION of the jump) is a pause in the data, not a bad stamp: it is accepted at once and counted in
``pauses``.

Frames. A reading in another frame than the magnetometer's (``sync.field_frame``; when that is empty the first
frame seen is held, and another frame that sends FRAME_RELATCH_AFTER readings in a row while the held one is
silent takes over, so one stray message cannot lock the sensor out), or with a frame_id longer than
FRAME_ID_MAX_LENGTH, is refused and counted.

Stamps ahead of their stream (within ``sync.max_stamp_jump``, when that check is on). A message whose stamp is
ahead of its own stream's newest by more than HOLD_INTERVALS of the stream's usual interval (the median of its
last HOLD_INTERVALS_KEPT; at least HOLD_MIN_S) is held back, not accepted, until the stream confirms it: the
next message of the stream at or near its stamp (within that margin), or a message of the other stream at or
after it, releases it (a real gap in the stream costs one message of latency, nothing else); a next message of
the stream that carries on below it means it was a lone stamp ahead, and it is refused (``*_stamp_ahead``). So
one bad stamp seconds ahead no longer turns the clean data after it into "backwards" refusals. The end of the
stream (:meth:`~gp_mapping.mapping.sync.MeasurementSync.finish`) releases what is held.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from gp_mapping.config import FRAME_ID_MAX_LENGTH

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
HOLD_BACK = "hold"  # _stamp_refusal's answer for a stamp that waits for confirmation
LOG = logging.getLogger("gp_mapping.sync")


class StreamChecks:
    """Mixin of :class:`~gp_mapping.mapping.sync.MeasurementSync`: a stamp or a frame judged against its stream,
    the message held back while it is ahead of its stream, re-anchoring and pauses."""

    def _clear_held(self) -> None:
        # Per stream: the message held back for being ahead of its stream, (stamp, accept it), and the stream's
        # recent intervals between accepted stamps.
        self._held: dict[str, tuple[float, Any] | None] = {"field": None, "pose": None}
        self._intervals: dict[str, deque[float]] = {"field": deque(maxlen=HOLD_INTERVALS_KEPT),
                                                    "pose": deque(maxlen=HOLD_INTERVALS_KEPT)}

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
                return HOLD_BACK
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
