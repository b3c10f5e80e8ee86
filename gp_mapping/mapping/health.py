"""The mapping node's health, as levels with reasons (ROS-free; the node publishes it on /diagnostics).

Modelled on diagnostic_updater's frequency and timestamp checks, evaluated once per diagnostics tick over the
last ``node.diagnostics_window`` seconds (node clock, so sim time too):

- a stream (the magnetometer; the pose topic, or /tf with ``node.pose_source: tf``) silent for
  ``node.stale_after`` seconds is WARN, for ``node.stale_level_after`` STALE (also before its first message);
- a stream's message rate over the window below ``node.expected_mag_rate`` / ``node.expected_pose_rate`` is WARN;
- more than ``node.max_refused_share`` of the readings of the window refused is WARN (at least MIN_READINGS);
- the model falling behind (samples pending for an update grew at every tick of the window, by more than a
  batch) is WARN;
- a model update that failed within the window, or an error the node reported (a map that cannot be predicted,
  encoded or published; a checkpoint that cannot be written) is ERROR.

The level is the worst of them (OK 0, WARN 1, ERROR 2, STALE 3, as diagnostic_msgs/DiagnosticStatus); the
message names every reason, worst first, or says "mapping" when there is none.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

OK, WARN, ERROR, STALE = 0, 1, 2, 3
LEVEL_NAMES = {OK: "OK", WARN: "WARN", ERROR: "ERROR", STALE: "STALE"}
MIN_READINGS = 10  # readings in the window below which the refused share is not judged


@dataclass
class Tick:
    """What the node counted up to one diagnostics tick (cumulative counts)."""

    now: float                 # node clock [s]
    messages: dict[str, int]   # stream ("magnetometer", "pose") -> messages received
    last_seen: dict[str, float | None]  # stream -> node-clock time of its last message (None: none yet)
    accepted: int              # readings accepted
    refused: dict[str, int]    # readings refused, by reason
    pending: int               # samples waiting for an update (and messages not yet handed to the mapper)
    updates: int
    failed_updates: int
    update_error: str = ""     # the last failed update's error
    node_error: str = ""       # an error the node reported (cleared by the next good map)
    batch_size: int = 50


@dataclass
class Health:
    level: int
    message: str
    reasons: list[tuple[int, str]] = field(default_factory=list)

    @property
    def level_name(self) -> str:
        return LEVEL_NAMES[self.level]


class HealthMonitor:
    """Keeps the ticks of the last window and judges each new one (see the module docstring). ``settings`` is the
    node section of the config (read at every tick, so live changes apply at once; a node without rate checks
    leaves out ``expected_mag_rate`` / ``expected_pose_rate``); ``prefix`` is how the messages name its keys
    (``node.`` for the mapping node's, ``localizer.`` for the localizer's)."""

    def __init__(self, settings: Any, start: float, prefix: str = "node.") -> None:
        self.settings = settings
        self.start = float(start)
        self.prefix = prefix
        self._ticks: deque[Tick] = deque()

    def observe(self, tick: Tick) -> Health:
        s = self.settings
        window = float(s.diagnostics_window)
        self._ticks.append(tick)
        while len(self._ticks) > 2 and self._ticks[1].now <= tick.now - window:
            self._ticks.popleft()
        first = self._ticks[0]
        span = tick.now - first.now
        full = span >= window * 0.999 - 1e-9 and len(self._ticks) >= 2
        reasons: list[tuple[int, str]] = []

        # Silent streams (timestamp check): since the last message, or since the start.
        warn_after = float(s.stale_after)
        stale_after = max(float(s.stale_level_after), warn_after)
        for stream in tick.messages:
            seen = tick.last_seen.get(stream)
            silent = tick.now - (seen if seen is not None else self.start)
            since = "" if seen is not None else " (none since the start)"
            if warn_after > 0 and silent >= stale_after:
                reasons.append((STALE, f"no {stream} message for {silent:.1f} s{since}"))
            elif warn_after > 0 and silent >= warn_after:
                reasons.append((WARN, f"no {stream} message for {silent:.1f} s{since}"))

        # Rates (frequency check) over a full window.
        expected = {"magnetometer": float(getattr(s, "expected_mag_rate", 0.0)),
                    "pose": float(getattr(s, "expected_pose_rate", 0.0))}
        if full and span > 0:
            for stream, count in tick.messages.items():
                want = expected.get(stream, 0.0)
                rate = (count - first.messages.get(stream, 0)) / span
                if want > 0 and rate < want and not any(stream in r and lvl >= WARN for lvl, r in reasons):
                    reasons.append((WARN, f"{stream} at {rate:.1f} Hz over the last {span:.0f} s, below "
                                          f"{self.prefix}expected_{'mag' if stream == 'magnetometer' else 'pose'}_rate "
                                          f"{want:g} Hz"))

        # Refused share of the readings of the window.
        refused = {k: v - first.refused.get(k, 0) for k, v in tick.refused.items()}
        refused = {k: v for k, v in refused.items() if v > 0}
        n_refused = sum(refused.values())
        n_total = n_refused + tick.accepted - first.accepted
        share_limit = float(s.max_refused_share)
        if len(self._ticks) >= 2 and n_total >= MIN_READINGS and share_limit < 1.0 \
                and n_refused > share_limit * n_total:
            top = ", ".join(f"{k} {v}" for k, v in sorted(refused.items(), key=lambda kv: -kv[1])[:3])
            reasons.append((WARN, f"{100.0 * n_refused / n_total:.0f} % of the last {n_total} readings refused "
                                  f"(over {self.prefix}max_refused_share {share_limit:g}; {top})"))

        # Falling behind: pending grew at every tick of a full window, by more than a batch.
        pend = [t.pending for t in self._ticks]
        if full and len(pend) >= 3 and all(b > a for a, b in zip(pend, pend[1:])) \
                and pend[-1] - pend[0] > tick.batch_size:
            done = tick.updates - first.updates
            reasons.append((WARN, f"falling behind: {tick.pending} samples pending, {pend[-1] - pend[0]:+d} over "
                                  f"the last {span:.0f} s ({done} updates ran)"))

        # Errors.
        failed = tick.failed_updates - first.failed_updates if len(self._ticks) >= 2 else 0
        if failed > 0:
            reasons.append((ERROR, f"{failed} model updates failed in the last {span:.0f} s"
                                   + (f": {tick.update_error}" if tick.update_error else "")))
        if tick.node_error:
            reasons.append((ERROR, tick.node_error))

        if not reasons:
            return Health(OK, "mapping", [])
        reasons.sort(key=lambda r: -r[0])
        level = reasons[0][0]
        return Health(level, "; ".join(text for _, text in reasons), reasons)
