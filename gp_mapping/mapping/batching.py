"""Batches: the part of the :class:`~gp_mapping.mapping.mapper.Mapper` that holds the matched samples waiting for
their batch (:class:`Batching`) and cuts them (``batching.mode``: a count, or a period of data time).

Catching up. A caller that limits its updates (``process(max_updates=...)``: the node's update thread runs one per
step) can fall behind the stream; the replay, which runs every full batch at once, never does. Once
``batching.catch_up_after`` full batches are waiting, such a caller's update takes several full batches at once
(``k`` of them, k a power of two, at most ``batching.catch_up_max`` samples and what is waiting), so the backlog
stays bounded and nothing is dropped while the sensor rate is within what the engine can absorb. How many is
learned from the engine's own cost: the seconds per sample of each size taken so far (a running mean); the
largest size within 10 % of the cheapest is taken, and the next size up is tried while the largest tried is that
one, so an engine whose update costs about the same for a larger batch (a memory-bounded engine) takes larger
batches and one whose cost per sample grows with the batch stays where it is cheapest. Below the threshold the
batches are the replay's, so the node's map equals the replay's bit for bit.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from gp_mapping.mapping.measurements import Measurements

CATCH_UP_TOLERANCE = 1.1  # a larger catch-up batch is preferred while its cost per sample is within 10 % of the best
CATCH_UP_SMOOTHING = 0.3  # weight of the newest update in the running mean of a batch size's cost per sample


class Batching:
    """Mixin of :class:`~gp_mapping.mapping.mapper.Mapper`: the pending queue, and the batches cut from it."""

    def _clear_pending(self) -> None:
        self._pending: deque[Measurements] = deque()
        self._pending_count = 0
        self._batch_cost: dict[int, float] = {}  # full batches per update -> running mean of seconds per sample

    @property
    def num_pending(self) -> int:
        """Matched samples waiting for their batch (including those not yet moved out of the sync)."""
        return self._pending_count + self._sync.num_ready

    def _enforce_bound(self) -> None:
        excess = self._pending_count - self.config.batching.max_pending
        while excess > 0:
            head = self._pending[0]
            k = min(excess, len(head))
            if k == len(head):
                self._pending.popleft()
            else:
                self._pending[0] = head.slice(k)
            self._pending_count -= k
            self.dropped += k
            self.dropped_overflow += k
            excess -= k

    def _take(self, n: int) -> Measurements:
        parts, need = [], n
        while need > 0:
            head = self._pending[0]
            if len(head) <= need:
                parts.append(self._pending.popleft())
                need -= len(head)
            else:
                parts.append(head.slice(0, need))
                self._pending[0] = head.slice(need)
                need = 0
        self._pending_count -= n
        return Measurements.concatenate(parts)

    def _full_batch_size(self) -> int:
        """Samples in the next full batch, or 0 while it is still filling."""
        b = self.config.batching
        if b.mode == "count":
            return b.size if self._pending_count >= b.size else 0
        if self._pending_count == 0:
            return 0
        # Time mode: a batch spans [t_first, t_first + period) of data time and is full once a later sample
        # has arrived; it is also cut at batching.max_pending samples, so that a bound smaller than a period's
        # worth of samples still lets batches close.
        t = np.concatenate([m.t for m in self._pending])
        n = int(np.searchsorted(t, t[0] + b.period, side="left"))
        if n < t.shape[0]:
            return min(n, b.max_pending)
        return b.max_pending if t.shape[0] >= b.max_pending else 0

    def _full_batch_ends(self, need: int, cap: int) -> list[int]:
        """Samples in the first 1, 2, ... full batches waiting (cumulative), at least ``need`` of them where so many
        are waiting, and on until one ends at ``cap`` samples or beyond: count mode, multiples of
        ``batching.size``; time mode, the ends of the full periods (each also cut at ``batching.max_pending``
        samples, as :meth:`_full_batch_size` cuts one)."""
        b = self.config.batching
        if b.mode == "count":
            return [b.size * (k + 1) for k in range(min(self._pending_count // b.size, max(need, -(-cap // b.size))))]
        if self._pending_count == 0:
            return []
        t = np.concatenate([m.t for m in self._pending])
        ends: list[int] = []
        start = 0
        while start < t.shape[0] and (len(ends) < need or ends[-1] < cap):
            n = int(np.searchsorted(t, t[start] + b.period, side="left"))
            if n < t.shape[0]:
                end = min(n, start + b.max_pending)
            elif t.shape[0] - start >= b.max_pending:
                end = start + b.max_pending
            else:
                break
            ends.append(end)
            start = end
        return ends

    def _catch_up_batches(self) -> tuple[int, int]:
        """(full batches, samples) the next update of a caller that limits its updates takes: one full batch, or
        several once ``batching.catch_up_after`` are waiting (see the module docstring); (0, 0) while none is
        full."""
        b = self.config.batching
        n = self._full_batch_size()
        if n == 0 or b.catch_up_after == 0:
            return (1, n) if n else (0, 0)
        if b.mode == "count" and self._pending_count < b.catch_up_after * b.size:
            return 1, n  # the common case, decided without looking at the stamps
        ends = self._full_batch_ends(b.catch_up_after, b.catch_up_max)
        if len(ends) < b.catch_up_after:
            return 1, n
        sizes, k = [], 1  # powers of two that fit what is waiting and batching.catch_up_max
        while k <= len(ends) and (k == 1 or ends[k - 1] <= b.catch_up_max):
            sizes.append(k)
            k *= 2
        tried = [k for k in sizes if k in self._batch_cost]
        if not tried:
            return 1, n
        cheapest = min(self._batch_cost[k] for k in tried)
        best = max(k for k in tried if self._batch_cost[k] <= CATCH_UP_TOLERANCE * cheapest)
        if best == max(tried) and best < sizes[-1]:  # no larger size has been worse yet: try the next one up
            best = sizes[sizes.index(best) + 1]
        return best, ends[best - 1]

    def _learn_cost(self, batches: int, stats: dict[str, Any]) -> None:
        """Fold an update's seconds per sample into the running mean of its size (``batches`` full batches)."""
        per_sample = float(stats["update_seconds"]) / max(1, int(stats["batch_size"]))
        old = self._batch_cost.get(batches)
        self._batch_cost[batches] = per_sample if old is None else \
            (1.0 - CATCH_UP_SMOOTHING) * old + CATCH_UP_SMOOTHING * per_sample
