"""Diagnostics an operator can trust (issue 38, item 5): levels with reasons, as diagnostic_updater's frequency and
timestamp checks. The rules alone (gp_mapping.mapping.health), then a node over DDS: the sensor stops, the level
goes WARN then STALE within the configured times, and back to OK when the data return."""
from __future__ import annotations

import re
import threading
import time
import types

import numpy as np
import pytest

from gp_mapping.mapping.health import ERROR, OK, STALE, WARN, HealthMonitor, Tick

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def settings(**kw):
    base = dict(stale_after=2.0, stale_level_after=6.0, expected_mag_rate=0.0, expected_pose_rate=0.0,
                max_refused_share=0.5, diagnostics_window=4.0)
    base.update(kw)
    return types.SimpleNamespace(**base)


class Stream:
    """Counters of a node fed at ``rate`` Hz, advanced one diagnostics tick (1 s) at a time."""

    def __init__(self, rate=50.0):
        self.now, self.rate = 100.0, rate
        self.mag = self.pose = self.accepted = self.updates = self.failed = self.pending = 0
        self.refused: dict[str, int] = {}
        self.seen = {"magnetometer": None, "pose": None}

    def tick(self, mag=True, pose=True, refused=0, pending_step=0, failed=0, error="", node_error=""):
        self.now += 1.0
        n = int(self.rate)
        if mag:
            self.mag += n
            self.seen["magnetometer"] = self.now
            self.accepted += n - refused
            self.refused["pose_gap"] = self.refused.get("pose_gap", 0) + refused
        if pose:
            self.pose += n
            self.seen["pose"] = self.now
        self.pending += pending_step
        self.updates += 1
        self.failed += failed
        return Tick(self.now, {"magnetometer": self.mag, "pose": self.pose}, dict(self.seen), self.accepted,
                    dict(self.refused), self.pending, self.updates, self.failed, error, node_error, batch_size=50)


def test_a_silent_stream_is_warn_then_stale_then_ok_again():
    s = Stream()
    monitor = HealthMonitor(settings(), start=s.now)
    levels = [monitor.observe(s.tick()).level for _ in range(5)]
    assert levels == [OK] * 5
    silent = [monitor.observe(s.tick(mag=False)) for _ in range(7)]
    assert [h.level for h in silent] == [OK, WARN, WARN, WARN, WARN, STALE, STALE]
    assert "no magnetometer message for 2.0 s" in silent[1].message
    assert monitor.observe(s.tick()).level == OK


def test_nothing_since_the_start_is_reported_too():
    s = Stream()
    monitor = HealthMonitor(settings(), start=s.now)
    health = [monitor.observe(s.tick(mag=False, pose=False)) for _ in range(3)][-1]
    assert health.level == WARN and "(none since the start)" in health.message and "pose" in health.message


def test_a_rate_below_the_expected_one_warns_after_a_full_window():
    s = Stream(rate=10.0)
    monitor = HealthMonitor(settings(expected_mag_rate=40.0), start=s.now)
    levels = [monitor.observe(s.tick()) for _ in range(6)]
    assert levels[0].level == OK and levels[-1].level == WARN
    assert "magnetometer at 10.0 Hz" in levels[-1].message and "node.expected_mag_rate 40" in levels[-1].message
    monitor.settings = settings(expected_mag_rate=5.0)  # a live change applies at the next tick
    assert monitor.observe(s.tick()).level == OK


def test_a_high_refused_share_warns_with_its_main_reason():
    s = Stream()
    monitor = HealthMonitor(settings(), start=s.now)
    monitor.observe(s.tick())
    assert monitor.observe(s.tick(refused=20)).level == OK  # 40 %
    health = monitor.observe(s.tick(refused=45))
    assert health.level == WARN and "pose_gap" in health.message and "readings refused" in health.message
    for _ in range(5):
        health = monitor.observe(s.tick())
    assert health.level == OK  # the window moved past them


def test_falling_behind_warns_and_failed_updates_are_errors():
    s = Stream()
    monitor = HealthMonitor(settings(), start=s.now)
    health = [monitor.observe(s.tick(pending_step=40)) for _ in range(6)][-1]
    assert health.level == WARN and "falling behind" in health.message
    steady = [monitor.observe(s.tick(pending_step=0)) for _ in range(6)][-1]
    assert steady.level == OK
    health = monitor.observe(s.tick(failed=1, error="GPNumericalError: not positive definite"))
    assert health.level == ERROR and "1 model updates failed" in health.message and "positive definite" in health.message
    health = monitor.observe(s.tick(mag=False, node_error="map publication failed: boom"))
    assert health.level == ERROR and health.message.startswith("1 model updates failed")
    assert "map publication failed" in health.message
    for _ in range(5):
        health = monitor.observe(s.tick())
    assert health.level == OK


# ------------------------------------------------------------------------------------------------ over DDS


def test_the_node_over_dds_goes_warn_then_stale_when_the_sensor_stops_and_ok_when_it_returns():
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from geometry_msgs.msg import PoseStamped
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import MagneticField

    from gp_mapping.ros.conversions import seconds_to_stamp
    from gp_mapping.ros.mapper_node import MapperNode

    params = {"model.num_inducing": 16, "model.learn_hyperparameters": False, "model.device": "cpu",
              "batching.size": 25, "grid.resolution": 0.5, "node.publish_period": 5.0, "node.model_period": 0.0,
              "node.stale_after": 1.0, "node.stale_level_after": 3.0, "node.diagnostics_window": 2.0,
              # the rate check is wired but set well below what the publishing loop below reaches: that loop shares
              # the GIL with the executor's threads (and, in the full suite, with threads earlier tests leave) and
              # delivered 3-7 Hz instead of its nominal 50 in CI, which kept the node at WARN for 12 s
              "node.expected_mag_rate": 2.0}
    context = Context()
    rclpy.init(context=context)
    node = MapperNode(context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    probe = rclpy.create_node("diagnostics_probe", context=context)
    statuses: list = []
    probe.create_subscription(DiagnosticArray, "/diagnostics",
                              lambda msg: statuses.extend((time.monotonic(), s) for s in msg.status
                                                          if s.name.startswith(f"{node.get_name()}:")), 10)
    mag_pub = probe.create_publisher(MagneticField, "/mag", qos_profile_sensor_data)
    pose_pub = probe.create_publisher(PoseStamped, "/pose", qos_profile_sensor_data)
    executor = MultiThreadedExecutor(num_threads=2, context=context)
    executor.add_node(node)
    executor.add_node(probe)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    t = [1000.0]

    def publish(seconds, mag=True, until=None):
        """Publish pose (and magnetometer) at <= 50 Hz for ``seconds``, or until ``until()`` holds."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and until()):
            t[0] += 0.02
            pose = PoseStamped()
            pose.header.stamp, pose.header.frame_id = seconds_to_stamp(t[0]), "map"
            pose.pose.position.x, pose.pose.orientation.w = 0.2 * np.sin(t[0]), 1.0
            pose_pub.publish(pose)
            if mag:
                msg = MagneticField()
                msg.header.stamp, msg.header.frame_id = seconds_to_stamp(t[0] - 0.01), "mag"
                msg.magnetic_field.x, msg.magnetic_field.z = 2e-5, -4e-5
                mag_pub.publish(msg)
            time.sleep(0.02)

    def level_since(start):
        return [(round(at - start, 1), s.level[0], s.message) for at, s in statuses if at >= start]

    def seen(start, level):
        return lambda: any(lv == level for _, lv, _ in level_since(start))

    # The levels' timing is checked on synthetic ticks above; over DDS the test checks the wiring, and waits for
    # each level with a deadline that a loaded 2-core CI machine still meets (the node's 1 s diagnostics timer
    # and its callbacks can run seconds late there; a fixed publishing time made this test flaky).
    deadline = 12.0
    try:
        publish(4.0)
        start = time.monotonic()
        publish(deadline, until=seen(start, OK))
        healthy = level_since(start)
        assert healthy and healthy[-1][1] == OK, healthy
        stopped = time.monotonic()
        publish(deadline, mag=False, until=seen(stopped, STALE))  # the magnetometer stops; the pose goes on
        after = level_since(stopped)
        levels = [level for _, level, _ in after]
        assert WARN in levels and STALE in levels and levels.index(WARN) < levels.index(STALE), after
        assert OK not in levels[levels.index(WARN):], after  # no OK while the magnetometer is silent
        # the node's own clock says when each level came, whatever the load: WARN after node.stale_after (1 s,
        # the default is 5) and before node.stale_level_after (3 s, the default 30), STALE after it
        silent = {level: [float(m) for _, lv, msg in after if lv == level
                          for m in re.findall(r"no magnetometer message for ([0-9.]+) s", msg)]
                  for level in (WARN, STALE)}
        # (the message rounds to 0.1 s: a silence of 2.97 s is still WARN and reads "3.0 s")
        assert silent[WARN] and 1.0 <= min(silent[WARN]) and max(silent[WARN]) <= 3.0, after
        assert silent[STALE] and min(silent[STALE]) >= 3.0, after
        back = time.monotonic()
        publish(deadline, until=seen(back, OK))  # the rate check needs the window filled with data again
        again = level_since(back)
        assert again and again[-1][1] == OK, again
    finally:
        executor.shutdown()
        spinner.join(timeout=10)
        probe.destroy_node()
        node.close()
        context.try_shutdown()
