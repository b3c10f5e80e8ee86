"""The node's throttled log line about refused input (gp_mapping/ros/diagnostics.py, NodeStatus._log_refusals):
a reason not reported before is logged at once, repeats are throttled, and counts wait for a line that is
emitted."""
from __future__ import annotations

import pytest

pytest.importorskip("diagnostic_msgs")

from gp_mapping.ros.diagnostics import LOG_THROTTLE_S, NodeStatus  # noqa: E402


class _Logger:
    def __init__(self):
        self.calls = []
        self.emit = True

    def warning(self, line, throttle_duration_sec=None):
        self.calls.append((line, throttle_duration_sec))
        return self.emit


class _Node(NodeStatus):
    def __init__(self):
        self._logged_counts = {}
        self.logger = _Logger()

    def get_logger(self):
        return self.logger


def test_a_new_reason_is_logged_at_once_and_repeats_are_throttled():
    node = _Node()
    node._log_refusals({"rejected/reading_before_init": 3})
    assert node.logger.calls[-1] == ("input refused or dropped since the last report: reading_before_init +3", None)
    # the same reason again: throttled (a refusal in a node's last seconds would otherwise never be logged if it
    # came after a reason already reported; a new one must not wait)
    node._log_refusals({"rejected/reading_before_init": 5})
    assert node.logger.calls[-1][1] == LOG_THROTTLE_S and "+2" in node.logger.calls[-1][0]
    node._log_refusals({"rejected/reading_before_init": 5, "rejected/reading_nonfinite": 2})
    assert node.logger.calls[-1] == ("input refused or dropped since the last report: reading_nonfinite +2", None)
    # nothing grew: no line
    before = len(node.logger.calls)
    node._log_refusals({"rejected/reading_before_init": 5, "rejected/reading_nonfinite": 2})
    assert len(node.logger.calls) == before


def test_counts_wait_for_an_emitted_line():
    node = _Node()
    node._log_refusals({"rejected/odometry_jump": 1})
    node.logger.emit = False  # the throttle held the next line back
    node._log_refusals({"rejected/odometry_jump": 3})
    node.logger.emit = True
    node._log_refusals({"rejected/odometry_jump": 4})
    assert "odometry_jump +3" in node.logger.calls[-1][0]
