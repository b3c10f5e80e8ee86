"""Bad input, kind by kind: each is refused under its documented reason (README "Bad input and reliability"),
clean data around it is still mapped, and the map never holds a NaN. Through the sync, the Mapper, the node's
callbacks in this process, and a real node over DDS."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from gp_mapping.config import SyncConfig, config_from_dict
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.stream_checks import REANCHOR_AFTER
from gp_mapping.mapping.sync import POSE_REJECTION_REASONS, REJECTION_REASONS, MeasurementSync
from support.nodes import _wait_idle, node_factory  # noqa: F401  (fixture)

torch.set_num_threads(1)

Q = [0.0, 0.0, 0.0, 1.0]
B = [20e-6, -5e-6, -42e-6]
SPEED = 1.0  # m/s along x


def clean(sync, t0: float, t1: float, rate: float = 10.0):
    """Poses at ``rate`` on a line at SPEED m/s and one reading between every two poses; returns readings fed."""
    n = 0
    for t in np.round(np.arange(t0, t1, 1.0 / rate), 6):
        t = float(t)
        sync.add_pose(t, [SPEED * t, 0.0, 0.0], Q)
        if t > t0:
            sync.add_field(round(t - 0.5 / rate, 6), B, "mag")
            n += 1
    return n


# kind -> (what to feed at t = 10.0 (inside a clean stream), the reason it is counted under)
BAD = {
    "field_nan": (lambda s: s.add_field(10.0, [math.nan, 0, 0], "mag"), "field_nonfinite"),
    "field_inf": (lambda s: s.add_field(10.0, [0, math.inf, 0], "mag"), "field_nonfinite"),
    "field_stamp_nan": (lambda s: s.add_field(math.nan, B, "mag"), "field_stamp_nonfinite"),
    "field_stamp_inf": (lambda s: s.add_field(math.inf, B, "mag"), "field_stamp_nonfinite"),
    "field_zero": (lambda s: s.add_field(10.0, [0.0, 0.0, 0.0], "mag"), "field_zero"),
    "field_saturated": (lambda s: s.add_field(10.0, [0.5, 0.0, 0.0], "mag"), "field_out_of_range"),
    "field_wrong_frame": (lambda s: s.add_field(10.0, B, "other_imu"), "field_frame_mismatch"),
    "field_backwards": (lambda s: s.add_field(3.0, B, "mag"), "field_stamp_backwards"),
    "field_repeat": (lambda s: s.add_field(9.85, B, "mag"), "field_stamp_duplicate"),
    "field_far_future": (lambda s: s.add_field(1e9, B, "mag"), "field_stamp_jump"),
    "pose_nan": (lambda s: s.add_pose(10.0, [math.nan, 0, 0], Q), "pose_nonfinite"),
    "pose_inf": (lambda s: s.add_pose(10.0, [0, -math.inf, 0], Q), "pose_nonfinite"),
    "pose_stamp_nan": (lambda s: s.add_pose(math.nan, [10, 0, 0], Q), "pose_stamp_nonfinite"),
    "quaternion_zero": (lambda s: s.add_pose(10.0, [10, 0, 0], [0, 0, 0, 0]), "pose_bad_quaternion"),
    "quaternion_nan": (lambda s: s.add_pose(10.0, [10, 0, 0], [0, 0, math.nan, 1]), "pose_nonfinite"),
    "quaternion_not_unit": (lambda s: s.add_pose(10.0, [10, 0, 0], [0, 0, 0, 2.0]), "pose_bad_quaternion"),
    "pose_absurd": (lambda s: s.add_pose(10.0, [1e12, 0, 0], Q), "pose_out_of_range"),
    "pose_backwards": (lambda s: s.add_pose(2.0, [2, 0, 0], Q), "pose_stamp_backwards"),
    "pose_repeat": (lambda s: s.add_pose(9.9, [9.9, 0, 0], Q), "pose_stamp_duplicate"),
    "pose_far_future": (lambda s: s.add_pose(1e9, [10, 0, 0], Q), "pose_stamp_jump"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_each_bad_kind_is_refused_and_counted_and_mapping_goes_on(kind):
    feed, reason = BAD[kind]
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1))
    n = clean(sync, 0.0, 9.95)
    before = sync.accepted
    feed(sync)
    n += clean(sync, 10.0, 20.0)
    sync.finish()
    expected = {r: 0 for r in REJECTION_REASONS}
    expected[reason] = 1
    assert sync.rejected == expected
    assert before > 0 and sync.accepted == n  # every clean reading is used
    c = sync.counters()
    assert c["poses_rejected"] == (1 if reason in POSE_REJECTION_REASONS else 0)
    m = sync.pop_ready()
    assert np.all(np.isfinite(m.x)) and np.all(np.isfinite(m.y))
    np.testing.assert_allclose(m.x[:, 0], SPEED * m.t, atol=1e-9)  # no bad pose moved a sample


def test_slightly_non_unit_quaternion_is_normalised_not_refused():
    sync = MeasurementSync(SyncConfig(target="vector", max_pose_gap=0.5))
    q = np.array([0.0, 0.0, math.sin(0.25), math.cos(0.25)]) * 1.005  # norm 1.005, within the 0.01 tolerance
    sync.add_pose(0.0, [0, 0, 0], q)
    sync.add_pose(0.2, [0, 0, 0], q)
    sync.add_field(0.1, [1e-6, 0, 0])
    m = sync.pop_ready()
    assert len(m) == 1 and sync.rejected["pose_bad_quaternion"] == 0
    np.testing.assert_allclose(m.y[0], [math.cos(0.5), math.sin(0.5), 0.0], atol=1e-12)  # a pure 0.5 rad yaw


def test_stamps_far_from_the_receive_time_are_refused_when_the_skew_check_is_on():
    sync = MeasurementSync(SyncConfig(max_stamp_skew=2.0, max_pose_gap=0.2))
    now = 1000.0
    sync.add_pose(now, [0, 0, 0], Q, receive_time=now)
    assert not sync.add_pose(now + 0.1 - 3600.0, [0, 0, 0], Q, receive_time=now + 0.1)  # an hour in the past
    sync.add_field(now + 0.1, B, receive_time=now + 0.1 + 5.0)                           # 5 s late
    sync.add_field(now + 0.05, B, receive_time=now + 0.06)
    sync.add_pose(now + 0.1, [0.1, 0, 0], Q, receive_time=now + 0.1)
    assert sync.rejected["pose_stamp_skew"] == 1 and sync.rejected["field_stamp_skew"] == 1
    assert sync.accepted == 1
    # without a receive time (an offline caller that has none) the check does not apply
    sync.add_field(now + 0.15, B)
    assert sync.rejected["field_stamp_skew"] == 1


def test_pose_gap_and_teleport():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, max_speed=5.0))
    n = clean(sync, 0.0, 5.0)
    # The localisation jumps 30 m in 0.1 s (300 m/s): the readings between the last pose before the jump and
    # the first after it are refused as pose_jump; mapping continues on the new segment.
    sync.add_field(4.95, B)
    for t in np.arange(5.0, 8.0, 0.1):
        sync.add_pose(t, [SPEED * t + 30.0, 0.0, 0.0], Q)
        sync.add_field(t + 0.05, B)
    sync.add_pose(8.0, [38.0, 0.0, 0.0], Q)
    assert sync.teleports == 1
    assert sync.rejected["pose_jump"] == 1  # the one reading between 4.9 and 5.0
    m = sync.pop_ready()
    assert len(m) == n + 30
    # no sample was placed between the two segments
    assert not np.any((m.x[:, 0] > 5.0) & (m.x[:, 0] < 35.0))
    # a pose stall longer than max_pose_gap: readings inside it are refused as pose_gap
    sync.add_field(8.3, B)
    sync.add_pose(8.6, [38.6, 0, 0], Q)  # 0.6 s after a 10 Hz stream: held back until the stream confirms it
    sync.add_pose(8.7, [38.7, 0, 0], Q)
    assert sync.rejected["pose_gap"] == 1


def test_one_far_future_stamp_does_not_block_later_data_and_a_real_clock_jump_re_anchors():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1))
    clean(sync, 0.0, 5.0)
    sync.add_pose(4e9, [5, 0, 0], Q)     # one absurd stamp (year 2096): refused, the stream goes on
    sync.add_field(4e9, B)
    n = clean(sync, 5.0, 10.0)
    assert sync.rejected["pose_stamp_jump"] == 1 and sync.rejected["field_stamp_jump"] == 1
    assert sync.reanchors == 0
    accepted = sync.accepted
    # Now the robot's clock really jumps by a day (both streams): after REANCHOR_AFTER consistent messages of a
    # stream the sync takes the new time base and maps again.
    day = 86400.0
    m = clean(sync, day + 10.0, day + 20.0)
    assert sync.reanchors >= 1
    refused = sync.rejected["pose_stamp_jump"] + sync.rejected["field_stamp_jump"] - 2
    assert refused <= 2 * REANCHOR_AFTER
    assert sync.accepted - accepted >= m - 2 * REANCHOR_AFTER - 2
    t = sync.pop_ready().t
    assert np.all(np.diff(t) > 0) and t[-1] > day
    # A stamp accepted by mistake (the check off) is undone the same way: the stream re-anchors back.
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, max_stamp_jump=0.0))
    clean(sync, 0.0, 5.0)
    assert sync.add_pose(1e6, [5, 0, 0], Q)
    before = sync.accepted
    n = clean(sync, 5.0, 15.0)
    assert sync.reanchors == 1 and sync.accepted - before >= n - REANCHOR_AFTER - 2


# ------------------------------------------------------------------------------------------- the Mapper


def mapper_config(**sync):
    return config_from_dict({
        "model": {"num_inducing": 16, "memory_size": 50, "hyper_steps": 3, "device": "cpu"},
        "batching": {"size": 40}, "sync": {"max_pose_gap": 0.1, **sync},
        "grid": {"resolution": 0.5, "tile_size": 1000}})


def lawn_events(n_poses: int = 400):
    """A short figure of eight: (stamp, kind, values) poses at 10 Hz and readings between them."""
    events = []
    for k in range(n_poses):
        t = 0.1 * k
        p = [2.0 * math.sin(0.2 * t), math.sin(0.4 * t), 0.0]
        events.append((t, "pose", p))
        if k:
            x = 2.0 * math.sin(0.2 * (t - 0.05))
            events.append((t - 0.05 + 1e-4, "field", [(50.0 + 2.0 * math.sin(x)) * 1e-6, 0.0, 0.0]))
    return sorted(events, key=lambda e: (e[0], e[1] == "pose"))


def run_mapper(mapper, events, bad_every: int = 0):
    """Feed ``events``; with ``bad_every``, a bad message of every side-effect-free kind every so often."""
    bad = [
        lambda t: mapper.add_magnetic_field(t, [math.nan, 0, 0], "mag"),
        lambda t: mapper.add_magnetic_field(t, [0, 0, 0], "mag"),
        lambda t: mapper.add_magnetic_field(t, [1.0, 0, 0], "mag"),
        lambda t: mapper.add_magnetic_field(t, [50e-6, 0, 0], "second_magnetometer"),
        lambda t: mapper.add_magnetic_field(t - 30.0, [50e-6, 0, 0], "mag"),
        lambda t: mapper.add_magnetic_field(t + 1e8, [50e-6, 0, 0], "mag"),
        lambda t: mapper.add_pose(t, [0, 0, 0], [0, 0, 0, 0]),
        lambda t: mapper.add_pose(t, [1e15, 0, 0], Q),
        lambda t: mapper.add_pose(t - 30.0, [0, 0, 0], Q),
        lambda t: mapper.add_pose(t + 1e8, [0, 0, 0], Q),
        lambda t: mapper.add_pose(math.nan, [0, 0, 0], Q),
        lambda t: mapper.add_pose(t, [0, 0, 0], [0, 0, 0, 3.0]),
    ]
    n_bad = 0
    for k, (t, kind, values) in enumerate(events):
        if kind == "pose":
            mapper.add_pose(t, values, Q)
        else:
            mapper.add_magnetic_field(t, values, "mag")
        if bad_every and k % bad_every == 0:
            bad[n_bad % len(bad)](t)
            n_bad += 1
        mapper.process()
    mapper.flush()
    return n_bad


def test_bad_messages_leave_the_mapper_exactly_as_clean_data_does():
    events = lawn_events()
    clean_mapper, dirty_mapper = Mapper(mapper_config()), Mapper(mapper_config())
    run_mapper(clean_mapper, events)
    n_bad = run_mapper(dirty_mapper, events, bad_every=7)
    a, b = clean_mapper.diagnostics(), dirty_mapper.diagnostics()
    assert n_bad > 100 and b["rejected_total"] == n_bad
    for reason in ("field_nonfinite", "field_zero", "field_out_of_range", "field_frame_mismatch",
                   "field_stamp_backwards", "field_stamp_jump", "pose_bad_quaternion", "pose_out_of_range",
                   "pose_stamp_backwards", "pose_stamp_jump", "pose_stamp_nonfinite"):
        assert b["rejected"][reason] > 0, reason
    assert b["accepted"] == a["accepted"] and b["updates"] == a["updates"] and b["failed_updates"] == 0
    # refused messages have no side effect: the same batches, so the same model, bit for bit
    ga, gb = clean_mapper.grid(), dirty_mapper.grid()
    assert ga.spec == gb.spec
    np.testing.assert_array_equal(ga.layers["magnitude"][0], gb.layers["magnitude"][0])
    np.testing.assert_array_equal(ga.layers["magnitude"][1], gb.layers["magnitude"][1])
    assert np.all(np.isfinite(gb.layers["magnitude"][0]))


# ------------------------------------------------------------------------------------------- the node


def test_publish_ticks_give_at_most_one_map_each_and_a_tick_during_an_update_is_served_after_it(node_factory):
    """Maps follow the publish timer (node clock, so sim time too): updates alone publish nothing, a tick on an idle
    node with nothing new publishes nothing later, and a tick that comes while the update thread is busy is
    served as soon as that update has made the map dirty, not one update later."""
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import MagneticField

    from gp_mapping.ros.conversions import seconds_to_stamp

    node = node_factory(**{"batching.size": 20, "model.num_inducing": 16, "model.hyper_steps": 2,
                           "model.device": "cpu", "grid.resolution": 0.5})
    sent = 0

    def feed(n: int) -> None:  # n clean samples along a line, then wait for their update
        nonlocal sent
        for _ in range(n):
            t = 100.0 + 0.1 * sent
            pose = PoseStamped()
            pose.header.stamp, pose.header.frame_id = seconds_to_stamp(t), "map"
            pose.pose.position.x, pose.pose.orientation.w = 0.1 * sent, 1.0
            mag = MagneticField()
            mag.header.stamp, mag.header.frame_id = seconds_to_stamp(t), "magnetometer"
            mag.magnetic_field.x = 50e-6 + 1e-7 * sent
            node.on_pose(pose)
            node.on_mag(mag)
            sent += 1
        _wait_idle(node)

    def maps_reach(count: int) -> bool:
        deadline = time.monotonic() + 10.0
        while node._counts["maps_published"] < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return node._counts["maps_published"] == count

    feed(41)  # two updates, the last sample waits for the next pose; the timers never run (no executor)
    time.sleep(0.3)
    assert node._counts["updates"] == 2 and node._counts["maps_published"] == 0
    node._on_publish_timer()  # a tick with a dirty map: published at once
    assert maps_reach(1)
    node._on_publish_timer()  # a tick on an idle node with nothing new: no map, now or after the next update
    feed(20)
    time.sleep(0.3)
    assert node._counts["updates"] == 3 and node._counts["maps_published"] == 1
    node._on_publish_timer()  # the third update's map
    assert maps_reach(2)
    node._updating = True  # as the update thread sets it while it feeds and updates
    node._on_publish_timer()  # the map is clean at this tick: it arms the publish for the update's end
    node._updating = False
    time.sleep(0.3)
    assert node._counts["maps_published"] == 2
    feed(20)
    assert maps_reach(3) and node._counts["updates"] == 4


def test_node_callbacks_refuse_empty_and_bad_messages_and_keep_publishing(node_factory):
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import MagneticField

    from gp_mapping.ros.conversions import seconds_to_stamp

    # catch-up off: one update per batch, so the updates counted below are the batches mapped
    node = node_factory(**{"batching.size": 20, "model.num_inducing": 16, "model.hyper_steps": 2,
                           "model.device": "cpu", "grid.resolution": 0.5, "batching.catch_up_after": 0})

    def pose(t, x, frame="map", q=(0.0, 0.0, 0.0, 1.0)):
        msg = PoseStamped()
        msg.header.stamp, msg.header.frame_id = seconds_to_stamp(t), frame
        msg.pose.position.x = x
        msg.pose.orientation.x, msg.pose.orientation.y, msg.pose.orientation.z, msg.pose.orientation.w = q
        return msg

    def mag(t, b=(50e-6, 0.0, 0.0), frame="mag"):
        msg = MagneticField()
        msg.header.stamp, msg.header.frame_id = seconds_to_stamp(t), frame
        msg.magnetic_field.x, msg.magnetic_field.y, msg.magnetic_field.z = b
        return msg

    t0 = 100.0
    for k in range(120):
        t = t0 + 0.1 * k
        node.on_pose(pose(t, 0.1 * k))
        node.on_mag(mag(t + 0.05, (50e-6 + 1e-7 * k, 0.0, 0.0)))
        if k == 60:
            node.on_pose(PoseStamped())      # empty: zero stamp (receive time), frame '' -> frame mismatch
            node.on_mag(MagneticField())     # empty: zero stamp, zero field -> field_zero
            node.on_pose(pose(t + 0.01, 0.0, frame="odom"))
            node.on_mag(mag(t + 0.06, (math.nan, 0.0, 0.0)))
            node.on_pose(pose(t + 0.02, 6.0, q=(0.0, 0.0, 0.0, 0.0)))
            node.on_mag(mag(t + 0.07, (0.2, 0.2, 0.2)))  # ~0.35 T: saturated
            node.on_mag(mag(t + 0.08, frame="imu2"))
    _wait_idle(node)
    with node._lock:
        d = node.mapper.diagnostics()
    assert node._node_rejected["pose_frame_mismatch"] == 2
    assert node._counts["stamps_from_clock"] == 2
    r = d["rejected"]
    # The empty reading got the receive time (the wall clock, far ahead of t0): refused as zero first.
    assert r["field_zero"] == 1 and r["field_nonfinite"] == 1 and r["field_out_of_range"] == 1
    assert r["field_frame_mismatch"] == 1 and r["pose_bad_quaternion"] == 1
    assert d["updates"] >= 5 and d["failed_updates"] == 0
    published = node._counts["maps_published"]  # the update thread publishes a due map after an update
    node.publish_map()
    assert node._counts["maps_published"] == published + 1 and node._last_grid is not None
    assert np.all(np.isfinite(node._last_grid.layers["magnitude"][0][node._last_grid.known]))


def test_node_counts_messages_the_transport_dropped_from_gaps_in_the_publishers_sequence_numbers(node_factory):
    """A burst larger than the subscription queue, sent while the node does not spin: DDS keeps the last
    ``node.queue_depth`` messages and drops the rest before the node sees them. The node counts exactly those from
    the gap in the publisher's sequence numbers (the first message it hears from a publisher counts no gap)."""
    import time

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import MagneticField

    depth, burst = 5, 200
    node = node_factory(**{"node.queue_depth": depth, "model.num_inducing": 16, "model.device": "cpu"})
    sender = rclpy.create_node("burst_sender", context=node.context)
    try:
        qos = QoSProfile(depth=burst, reliability=ReliabilityPolicy.BEST_EFFORT)
        pub = sender.create_publisher(MagneticField, node.resolve_topic_name("mag"), qos)
        executor = SingleThreadedExecutor(context=node.context)
        executor.add_node(node)

        def spin_until(done, what):
            deadline = time.monotonic() + 20.0
            while not done():
                assert time.monotonic() < deadline, what
                executor.spin_once(timeout_sec=0.05)

        spin_until(lambda: pub.get_subscription_count() > 0, "the node's subscription to match")
        pub.publish(MagneticField())  # the first message: the node learns this publisher's sequence number
        spin_until(lambda: node._counts["mag_messages"] == 1, "the first message")
        for _ in range(burst):  # the node does not spin: its queue keeps the last `depth`
            pub.publish(MagneticField())
        time.sleep(0.5)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        executor.remove_node(node)
    finally:
        sender.destroy_node()
    assert node._counts["mag_messages"] == 1 + depth
    assert node._node_rejected["transport_lost_mag"] == burst - depth
    assert node._node_rejected["transport_lost_pose"] == 0


def test_node_refuses_bad_parameters_at_start_and_live_keeping_the_old_value(node_factory):
    from rclpy.parameter import Parameter

    from gp_mapping.ros.mapper_node import NodeStartError

    for name, value, fragment in (("sync.max_speed", -1.0, "too small"),
                                  ("node.checkpoint_interval_s", -5.0, "too small"),
                                  ("sync.quaternion_tolerance", 2.0, "too large"),
                                  ("node.resume", "yes", "not a boolean")):
        with pytest.raises(NodeStartError) as err:
            node_factory(**{name: value})
        assert name in str(err.value) and fragment in str(err.value)
    node = node_factory(**{"node.publish_period": 0.5})
    for value, fragment in ((0.0, "node.publish_period"), (-2.0, "node.publish_period"), (1e9, "node.publish_period")):
        result = node.set_parameters([Parameter("node.publish_period", value=value)])[0]
        assert not result.successful and fragment in result.reason
        assert node.get_parameter("node.publish_period").value == 0.5
        assert node.config.node.publish_period == 0.5
    result = node.set_parameters([Parameter("sync.max_speed", value=3.0)])[0]
    assert not result.successful and "read-only" in result.reason
    assert node.set_parameters([Parameter("node.publish_period", value=0.25)])[0].successful
    assert node._publish_timer.timer_period_ns == 250_000_000  # the timer changes at once
    # The config the Mapper shares is changed by the update thread, before its next update.
    deadline = time.monotonic() + 10.0
    while node.config.node.publish_period != 0.25 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.config.node.publish_period == 0.25


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_real_node_over_dds_refuses_bad_messages_and_keeps_publishing_an_accurate_map(tmp_path, ros_env):
    """Bad messages of several kinds among a clean recording, over DDS to the node in its own process: each is
    counted under its reason in /diagnostics and the map stays accurate and finite."""
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import MagneticField

    from gp_mapping.ros.conversions import cloud_to_array, seconds_to_stamp
    from support.mapper_process import (T0, MapperProcess, check_accuracy, node_env, publish_recording, simulate,
                                        subscribe_map, wait_for_node, wait_until_settled, write_params)
    from support.ros import RosHarness

    params = write_params(tmp_path / "params.yaml")
    rec = simulate()

    def extra(k, pose_pub, mag_pub) -> int:
        if k % 100 != 50:
            return 0
        stamp = seconds_to_stamp(T0 + rec.t[k] + 0.05)
        bad_pose = PoseStamped()                      # zero quaternion, in the right frame
        bad_pose.header.stamp, bad_pose.header.frame_id = stamp, "map"
        bad_pose.pose.orientation.w = 0.0
        pose_pub.publish(bad_pose)
        future = MagneticField()                      # far-future stamp (year 2033; T0 is 1000 s)
        future.header.stamp, future.header.frame_id = seconds_to_stamp(2e9), "magnetometer"
        future.magnetic_field.x = 50e-6
        mag_pub.publish(future)
        mag_pub.publish(MagneticField())              # empty: zero stamp -> receive time, zero field
        saturated = MagneticField()
        saturated.header.stamp, saturated.header.frame_id = stamp, "magnetometer"
        saturated.magnetic_field.x = math.inf
        mag_pub.publish(saturated)
        return 3

    with RosHarness("bad_input_dds") as harness:
        proc = MapperProcess(tmp_path, node_env(ros_env, tmp_path), params)
        with proc:
            view = subscribe_map(harness, proc)
            wait_for_node(harness, view, proc)
            sent = publish_recording(harness, proc, rec, "pose_stamped", extra)
            values = wait_until_settled(harness, view, proc, sent)
            assert "input refused or dropped since the last report" in proc.output  # the throttled summary
    n = len(rec.t)
    counts = {r: int(values[f"rejected/{r}"]) for r in ("pose_bad_quaternion", "field_stamp_jump", "field_zero",
                                                          "field_nonfinite")}
    if int(values["node/mag_messages"]) == n + 12 and int(values["node/pose_messages"]) == n + 4:
        assert counts == {"pose_bad_quaternion": 4, "field_stamp_jump": 4, "field_zero": 4, "field_nonfinite": 4}
        assert int(values["accepted"]) == n
    else:  # best effort lost a message on the way: the bad ones that arrived are still all refused
        assert all(1 <= c <= 4 for c in counts.values()), counts
    check_accuracy(rec, view)
    assert np.all(np.isfinite(np.column_stack(list(cloud_to_array(view.cloud[-1]).values()))))
