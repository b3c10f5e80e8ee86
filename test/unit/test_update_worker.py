"""The update thread's inbox (gp_mapping.ros.update_worker): bounded, the oldest dropped and counted, and a full
inbox holds a message callback back a moment so that the update thread gets the CPU (a flood must not starve it)."""
from __future__ import annotations

import threading
import time

from gp_mapping.ros import update_worker
from gp_mapping.ros.update_worker import UpdateWorker

LIMIT = 4


class SlowWorker(UpdateWorker):
    """An update thread whose step takes the inbox and then waits for ``release`` (a long model update)."""

    def __init__(self) -> None:
        self._setup_worker()
        self.release = threading.Event()
        self.in_step = threading.Event()
        self.taken: list = []

    def _update_step(self) -> bool:
        self.taken.extend(self._take_inbox())
        self.in_step.set()
        self.release.wait(10.0)
        self.release.clear()
        return False


def timed_push(worker: UpdateWorker, item) -> tuple[bool, float]:
    start = time.perf_counter()
    dropped = worker._push(item, LIMIT)
    return dropped, time.perf_counter() - start


def test_a_full_inbox_without_an_update_thread_drops_the_oldest_at_once():
    worker = SlowWorker()  # not started: tests that drive a node's callbacks directly must not wait
    results = [timed_push(worker, i) for i in range(LIMIT + 2)]
    assert [d for d, _ in results] == [False] * LIMIT + [True, True]
    assert max(t for _, t in results) < update_worker.INBOX_FULL_WAIT / 2
    assert list(worker._take_inbox()) == [2, 3, 4, 5]  # the newest kept, in arrival order


def test_a_full_inbox_waits_a_bounded_time_for_the_update_thread_then_drops_the_oldest():
    worker = SlowWorker()
    worker._start_worker()
    try:
        worker._push("first", LIMIT)
        assert worker.in_step.wait(5.0)  # the thread took "first" and is in a long step
        for i in range(LIMIT):
            assert timed_push(worker, i)[0] is False
        dropped, waited = timed_push(worker, "late")  # full, and the thread is busy: wait, then drop
        assert dropped
        assert update_worker.INBOX_FULL_WAIT * 0.8 <= waited < update_worker.INBOX_FULL_WAIT + 1.0
        assert list(worker._inbox) == [1, 2, 3, "late"]
    finally:
        worker._request_stop()
        worker.release.set()
        worker._worker.join(5.0)


def test_a_message_that_waits_for_room_is_kept_when_the_update_thread_takes_the_inbox():
    worker = SlowWorker()
    worker._start_worker()
    try:
        worker._push("first", LIMIT)
        assert worker.in_step.wait(5.0)
        worker.in_step.clear()
        for i in range(LIMIT):
            worker._push(i, LIMIT)
        # The step ends while the callback waits: the thread's next step takes the inbox, which makes room.
        threading.Timer(update_worker.INBOX_FULL_WAIT / 5, worker.release.set).start()
        dropped, _ = timed_push(worker, "kept")
        assert not dropped
        assert worker.in_step.wait(5.0)
        deadline = time.monotonic() + 5.0
        while "kept" not in worker.taken + list(worker._inbox) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.taken[:LIMIT + 1] == ["first", 0, 1, 2, 3]  # nothing lost
        assert "kept" in worker.taken + list(worker._inbox)
    finally:
        worker._request_stop()
        worker.release.set()
        worker._worker.join(5.0)
