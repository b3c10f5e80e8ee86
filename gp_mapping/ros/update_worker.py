"""The update thread of a node: an inbox of messages, a queue of jobs, and one thread that runs them.

The executor's callbacks never wait for a model update: they put messages in the inbox (:meth:`UpdateWorker._push`,
bounded, the oldest dropped; a full inbox holds the callback back a moment, see there) and jobs in the queue
(:meth:`UpdateWorker._submit`: publishing, checkpoints, services, parameter changes), and the update thread runs the
jobs between two update steps. So the subscriptions keep up with a flood while a long update runs, and the state
the steps change (the Mapper) has one user. ``_lock`` is held while a step runs; it only makes it safe for tests (and jobs) to look inside.

A node that mixes :class:`UpdateWorker` in says what one step is (``_update_step``: feed the inbox to the model,
run one update; returns whether more work is ready) and what follows it (``_after_update_step``).
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

#: How long a message callback waits for room when the inbox is full [s]. The update thread is behind then, and the
#: executor thread taking messages only to drop them would take the GIL from it: under a 2 kHz flood on a loaded
#: two-core machine an update (0.15 s alone) took 12 s and the map stalled. Waiting (GIL released) hands the update
#: thread that time; meanwhile the transport drops what does not fit its queue, counted by the sequence numbers.
#: Bounded, so that timers and services still run between two messages.
INBOX_FULL_WAIT = 0.05


class UpdateWorker:
    """Mixin: the inbox, the job queue and the update thread of a node (see the module docstring)."""

    _updating = False  # the update thread is in a step (feeding the model or updating it)

    def _setup_worker(self) -> None:
        self._lock = threading.Lock()
        self._inbox_cond = threading.Condition()  # guards _inbox, _jobs, _queued and _stopping
        self._inbox: deque[Any] = deque()
        self._jobs: deque[tuple[str, Callable[[], Any], Future]] = deque()
        self._queued: set[str] = set()  # names of the periodic jobs waiting in _jobs (one of each at most)
        self._updates_waiting = False  # the last step ran an update: more full batches may be ready
        self._stopping = False
        self._updating = False
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- the inbox

    def _push(self, item: Any, limit: int) -> bool:
        """Put ``item`` in the inbox. With ``limit`` items there already and the update thread running, wait up to
        :data:`INBOX_FULL_WAIT` for it to take them; if they are still there, the oldest is dropped. Returns whether
        one was dropped (the caller counts it)."""
        with self._inbox_cond:
            if len(self._inbox) >= limit and self._worker is not None and self._worker.is_alive():
                self._inbox_cond.wait_for(lambda: len(self._inbox) < limit or self._stopping, INBOX_FULL_WAIT)
            dropped = len(self._inbox) >= limit
            if dropped:
                self._inbox.popleft()
            self._inbox.append(item)
            self._inbox_cond.notify_all()
        return dropped

    def _take_inbox(self) -> deque:
        """Everything in the inbox, in arrival order; the inbox is left empty."""
        with self._inbox_cond:
            items, self._inbox = self._inbox, deque()
            self._inbox_cond.notify_all()  # a callback waiting for room (_push)
        return items

    def _drop_inbox(self) -> int:
        """Forget the inbox (a reset, a loaded map); returns how many messages were dropped."""
        with self._inbox_cond:
            dropped = len(self._inbox)
            self._inbox.clear()
            self._inbox_cond.notify_all()
        return dropped

    @property
    def backlog(self) -> int:
        """Messages received and not yet handed to the model (the update thread is busy)."""
        with self._inbox_cond:
            return len(self._inbox)

    # -------------------------------------------------------------------------------------------- the jobs

    def _submit(self, name: str, job: Callable[[], Any], periodic: bool = True) -> Future | None:
        """Queue ``job`` for the update thread; it runs before the next update. A periodic job (publish,
        checkpoint) is queued once: a tick that finds it still waiting adds nothing. Returns the job's future,
        or None where it was not queued (already waiting, or the node is stopping)."""
        future: Future = Future()
        with self._inbox_cond:
            if self._stopping or (periodic and name in self._queued):
                return None
            if periodic:
                self._queued.add(name)
            self._jobs.append((name, job, future))
            self._inbox_cond.notify_all()
        return future

    def _fail_queued_jobs(self) -> None:
        """Jobs that will never run (the thread has stopped): their callers get an answer now."""
        with self._inbox_cond:
            for name, _, future in self._jobs:
                future.set_exception(RuntimeError(f"{name}: the node stopped before it ran"))
            self._jobs.clear()
            self._queued.clear()

    # ---------------------------------------------------------------------------------------- the thread

    def _start_worker(self) -> None:
        with self._inbox_cond:
            self._stopping = False
        self._worker = threading.Thread(target=self._worker_loop, name="gp_mapping_updates", daemon=True)
        self._worker.start()

    def _request_stop(self) -> None:
        """The thread finishes its step and stops (join ``_worker`` to wait for it); no job is queued from now."""
        with self._inbox_cond:
            self._stopping = True
            self._inbox_cond.notify_all()

    def _worker_loop(self) -> None:
        """Run the queued jobs, then one step; again while there is work."""
        while True:
            with self._inbox_cond:
                while not (self._inbox or self._jobs or self._updates_waiting or self._stopping):
                    self._inbox_cond.wait()
                if self._stopping:
                    return
                jobs, self._jobs = self._jobs, deque()
                self._queued.clear()
            for name, job, future in jobs:
                try:
                    future.set_result(job())
                except Exception as err:  # the caller (a service) gets the error; the thread goes on
                    future.set_exception(err)
            with self._lock:
                self._updating = True
                try:
                    self._updates_waiting = self._update_step()
                finally:
                    self._updating = False
            self._after_update_step()

    def _update_step(self) -> bool:
        """One step on the update thread (``_lock`` held); returns whether more work is ready at once."""
        raise NotImplementedError

    def _after_update_step(self) -> None:
        """Runs after each step, outside the lock."""
