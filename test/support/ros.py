"""The ROS test harness: an in-process rclpy node on its own context, and child processes that are always stopped.
Every process runs with ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and this run's ROS_DOMAIN_ID (test/conftest.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from support.paths import REPO_ROOT

PYTHON = sys.executable  # the venv's python running pytest (it has rclpy and the message packages)


class RosHarness:
    """An rclpy node on its own Context and executor inside the test process; ``close()`` undoes everything."""

    def __init__(self, name: str) -> None:
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor

        self.context = Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)

    def spin_until(self, predicate: Callable[[], bool], timeout: float, what: str = "condition") -> None:
        """Spin until ``predicate()`` is true; fail the test naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
            self.executor.spin_once(timeout_sec=0.05)

    def spin_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.executor.spin_once(timeout_sec=0.05)

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()

    def __enter__(self) -> "RosHarness":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChildProcess:
    """A child process with its output in a file (no pipe to fill up); stopped with SIGINT, then killed."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, cwd: Path = REPO_ROOT) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"child process did not exit within {timeout:.0f} s; output:\n{self.output[-3000:]}")

    def stop(self, grace: float = 10.0) -> int:
        """SIGINT (a clean rclpy shutdown), then SIGKILL to the whole process group after ``grace`` seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=grace)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=grace)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ChildProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
