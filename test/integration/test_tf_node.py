"""Pose from tf in the live node (node.pose_source: tf): a robot that publishes only map -> odom -> base_link on
/tf (30 Hz) and its magnetometer mount base_link -> imu_link on /tf_static (rotated, offset) maps the same field
as the pose-topic path with the mount in the config. Through the node's callbacks, then over DDS."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from gp_mapping.mapping.transforms import (TfPoseMatcher, TransformSample, compose, invert)
from support.nodes import mag_msg, node_factory, tf_msg  # noqa: F401  (node_factory: fixture)

pytest.importorskip("tf2_msgs", reason="tf2_msgs is not installed (`make venv` builds it)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

AREA = (-2.0, -2.0, 2.0, 2.0)
MOUNT_T = (0.25, -0.1, 0.15)
MOUNT_Q = tuple(float(v) for v in Rotation.from_euler("zyx", [60.0, 8.0, -4.0], degrees=True).as_quat())
MAP_ODOM = (np.array([1.5, -0.7, 0.0]), Rotation.from_euler("z", 35.0, degrees=True).as_quat())
T0 = 500.0
NOISE = 0.05e-6
PARAMS = {"model.num_inducing": 64, "model.learn_hyperparameters": False, "model.lengthscale": 1.0,
          "model.device": "cpu", "batching.size": 100, "sync.target": "vector", "grid.mode": "fixed",
          "grid.origin": [AREA[0], AREA[1]], "grid.size": [AREA[2] - AREA[0], AREA[3] - AREA[1]],
          "grid.resolution": 0.25, "grid.unknown_distance": 0.5, "node.publish_period": 0.5,
          # every node maps in the same batches: catching up merges batches by measured update cost, i.e. by the
          # machine's load, and a loaded CI run made the maps compared here differ by 0.46 uT
          "batching.catch_up_after": 0}


def simulate(duration: float = 30.0):
    """30 Hz lawnmower with the magnetometer on a rotated, offset mount; readings in the sensor frame."""
    from gp_mapping import sim

    world = sim.WorldConfig(area=AREA, n_dipoles=4, depth_range=(0.8, 1.5), anomaly_range=(2e-6, 8e-6))
    path = sim.TrajectoryConfig(patterns=("lawnmower",), area=AREA, inset=0.25, speed=1.0, rate=30.0,
                                duration=duration, line_spacing=0.5)
    return sim.simulate(world, path, sim.SensorConfig(noise_std=NOISE, translation=MOUNT_T, rotation=MOUNT_Q),
                        seed=7)


def tf_chain(rec, k: int) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """map -> odom (constant, published with every instant, as a localiser does) and odom -> base_link."""
    odom_base = compose(invert(MAP_ODOM), (rec.position[k], rec.orientation_xyzw[k]))
    return [("map", "odom", *MAP_ODOM), ("odom", "base_link", *odom_base)]


def pose_msg(stamp: float, position, orientation):
    from geometry_msgs.msg import PoseStamped

    from gp_mapping.ros.conversions import seconds_to_stamp

    msg = PoseStamped()
    msg.header.stamp, msg.header.frame_id = seconds_to_stamp(stamp), "map"
    p, q = msg.pose.position, msg.pose.orientation
    p.x, p.y, p.z = (float(v) for v in position)
    q.x, q.y, q.z, q.w = (float(v) for v in orientation)
    return msg


def _settle(node, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with node._lock:
            idle = node.backlog == 0 and node.mapper.num_pending < node.config.batching.size
        if idle:
            break
        time.sleep(0.05)
    with node._lock:
        node._feed_inbox()
        node._run_updates(flush=True)
        return node.mapper.grid()


def _max_component_difference(a, b) -> float:
    assert a.spec == b.spec
    known = a.known & b.known
    assert known.sum() > 0.5 * a.known.sum()
    return max(float(np.max(np.abs(a.layers[n][0][known] - b.layers[n][0][known]))) for n in "xyz")


# ----------------------------------------------------------------------------------- through the callbacks


def test_tf_only_robot_maps_the_same_field_as_the_pose_topic(node_factory):  # noqa: F811
    rec = simulate(20.0)
    mount = {"sync.sensor_translation": list(MOUNT_T), "sync.sensor_rotation": list(MOUNT_Q)}
    topic = node_factory(**PARAMS, **mount)
    from_static = node_factory(**PARAMS, **{"node.pose_source": "tf"})  # mount from /tf_static
    from_config = node_factory(**PARAMS, **mount, **{"node.pose_source": "tf"})  # no imu_link in tf
    from_static.on_tf(tf_msg(0.0, [("base_link", "imu_link", np.array(MOUNT_T), np.array(MOUNT_Q))]), static=True)
    for k in range(len(rec.t)):
        stamp = T0 + rec.t[k]
        topic.on_pose(pose_msg(stamp, rec.position[k], rec.orientation_xyzw[k]))
        topic.on_mag(mag_msg(stamp, rec.field_sensor_tesla[k], "imu_link"))
        for node, frame in ((from_static, "imu_link"), (from_config, "magnetometer")):
            node.on_tf(tf_msg(stamp, tf_chain(rec, k)))
            node.on_mag(mag_msg(stamp, rec.field_sensor_tesla[k], frame))
    grids = [_settle(node) for node in (topic, from_static, from_config)]
    accepted = [node.mapper.diagnostics()["accepted"] for node in (topic, from_static, from_config)]
    # The pose topic's sync needs a pose after the reading: the last reading waits there; tf gives it at once.
    assert accepted[1] == accepted[2] >= accepted[0] > 0.95 * len(rec.t)
    assert from_static._tf.from_sensor_frame == accepted[1] and from_static._tf.from_base_frame == 0
    assert from_config._tf.from_base_frame == accepted[2] and from_config._tf.from_sensor_frame == 0
    assert from_static._tf.rejected == {"tf_missing": 0, "tf_stale": 0}
    for other in grids[1:]:
        assert _max_component_difference(grids[0], other) < 3 * NOISE * 1e6  # uT: within the sensor noise
    # Ignoring the mount's rotation gives another map, so the comparison can fail.
    ignored = node_factory(**PARAMS, **{"node.pose_source": "tf"})
    for k in range(len(rec.t)):
        ignored.on_tf(tf_msg(T0 + rec.t[k], tf_chain(rec, k)))
        ignored.on_mag(mag_msg(T0 + rec.t[k], rec.field_sensor_tesla[k], "imu_link"))
    assert _max_component_difference(grids[0], _settle(ignored)) > 5.0


def test_missing_and_stale_transforms_are_refused_and_counted():
    """The matcher alone: readings wait for their transforms; a chain that never connects, a tf that stops, a
    gap wider than sync.max_pose_gap and a reading older than the buffer are each refused under their reason."""
    identity = (np.zeros(3), np.array([0.0, 0.0, 0.0, 1.0]))
    m = TfPoseMatcher("map", "base_link", identity, max_gap=0.1, timeout=1.0)

    def tf(stamp, x):
        m.add_transform(TransformSample(stamp, "map", "base_link", np.array([x, 0.0, 0.0]),
                                        np.array([0.0, 0.0, 0.0, 1.0])), static=False)

    def decided():
        return [(round(s, 3), round(float(p[0]), 3)) for s, p, _, _ in m.ready()]

    m.add_field(10.0, [1e-5, 0, 0], "mag")
    assert decided() == [] and m.waiting == 1  # no tf yet: waits
    tf(9.95, 9.95)
    assert decided() == [] and m.waiting == 1  # tf older than the reading: still waits for the next one
    tf(10.05, 10.05)
    assert decided() == [(10.0, 10.0)]  # interpolated
    m.add_field(10.2, [1e-5, 0, 0], "mag")  # tf stops after 10.05
    m.add_field(10.9, [1e-5, 0, 0], "mag")
    assert decided() == [] and m.waiting == 2
    m.add_field(11.3, [1e-5, 0, 0], "mag")  # 1.1 s newer than 10.2: that one is given up
    assert decided() == [] and m.rejected["tf_missing"] == 1 and m.waiting == 2
    tf(11.0, 11.0)  # the gap 10.05 .. 11.0 is wider than max_gap: 10.9 is stale
    assert decided() == [] and m.rejected["tf_stale"] == 1
    tf(11.25, 11.25)
    tf(11.35, 11.35)
    assert decided() == [(11.3, 11.3)]
    m.add_field(9.0, [1e-5, 0, 0], "mag")  # older than every transform kept
    assert decided() == [] and m.rejected["tf_stale"] == 2
    m.add_field(12.0, [1e-5, 0, 0], "other_sensor")
    lonely = TfPoseMatcher("map", "base_footprint", identity, max_gap=0.1, timeout=1.0)
    lonely.add_field(12.0, [1e-5, 0, 0], "mag")
    lonely.add_transform(TransformSample(12.1, "odom", "base_link", np.zeros(3), np.array([0, 0, 0, 1.0])), False)
    assert list(lonely.ready()) == [] and lonely.waiting == 1  # not connected yet: may still connect
    lonely.add_field(13.5, [1e-5, 0, 0], "mag")
    assert list(lonely.ready()) == [] and lonely.rejected["tf_missing"] == 1 and lonely.waiting == 1
    assert "not connected" in lonely.last_error


def test_tf_node_counts_refusals_in_its_diagnostics(node_factory):  # noqa: F811
    node = node_factory(**PARAMS, **{"node.pose_source": "tf", "node.tf_timeout": 0.5})
    for k in range(20):  # readings, and a tf tree that never reaches the map frame
        node.on_tf(tf_msg(T0 + 0.05 * k, [("odom", "base_link", np.zeros(3), np.array([0, 0, 0, 1.0]))]))
        node.on_mag(mag_msg(T0 + 0.05 * k, [2e-5, 0, -4e-5], "imu_link"))
    _settle(node)
    published = []
    node._diag_pub.publish = published.append
    node._publish_diagnostics()
    values = {kv.key: kv.value for kv in published[-1].status[0].values}
    # Given up: the readings 0.5 s (node.tf_timeout) older than the newest; the last 0.5 s still wait.
    assert int(values["node/rejected/tf_missing"]) == 10 and values["node/rejected/tf_stale"] == "0"
    assert values["node/tf_waiting"] == "10"
    assert node.mapper.diagnostics()["accepted"] == 0
    assert "pose from tf" in node.describe() and "/tf_static" in node.describe()


# ------------------------------------------------------------------------------------------------ over DDS


def test_tf_only_robot_over_dds_maps_the_field_of_the_pose_topic_path(tmp_path, ros_env):
    """The node in its own process, fed /tf, /tf_static and the magnetometer over DDS; its published vector
    map agrees with the pose-topic path (the same Mapper fed the poses and the config's mount) within the
    sensor noise plus one grey level."""
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import MagneticField
    from tf2_msgs.msg import TFMessage

    from gp_mapping.config import config_from_dict
    from gp_mapping.mapping.mapper import Mapper
    from support.mapper_process import (MapperProcess, decode, node_env, subscribe_map, wait_for_node,
                                        wait_until_settled, write_params)
    from support.ros import RosHarness

    rec = simulate(30.0)
    nested: dict = {}
    for key, value in {**PARAMS, "node.pose_source": "tf", "node.publish_period": 0.5}.items():
        section, name = key.split(".")
        nested.setdefault(section, {})[name] = value
    params = tmp_path / "params.yaml"
    import yaml
    params.write_text(yaml.safe_dump({"/**": {"ros__parameters": nested}}))
    with RosHarness("tf_robot") as harness:
        proc = MapperProcess(tmp_path, node_env(ros_env, tmp_path), params, batch=100)
        with proc:
            view = subscribe_map(harness, proc, vector=True)
            wait_for_node(harness, view, proc)
            node = harness.node
            reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
            static_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                    durability=DurabilityPolicy.TRANSIENT_LOCAL)
            tf_pub = node.create_publisher(TFMessage, "/tf", reliable)
            static_pub = node.create_publisher(TFMessage, "/tf_static", static_qos)
            mag_pub = node.create_publisher(MagneticField, proc.mag_topic, reliable)
            harness.spin_until(lambda: min(p.get_subscription_count() for p in (tf_pub, static_pub, mag_pub)) > 0,
                               30.0, "the node's tf and magnetometer subscriptions")
            harness.spin_for(1.0)  # discovery settles (a best-effort reader can miss a writer's first messages)
            static_pub.publish(tf_msg(T0, [("base_link", "imu_link", np.array(MOUNT_T), np.array(MOUNT_Q))]))
            for k in range(len(rec.t)):
                stamp = T0 + rec.t[k]
                tf_pub.publish(tf_msg(stamp, tf_chain(rec, k)))
                mag_pub.publish(mag_msg(stamp, rec.field_sensor_tesla[k], "imu_link"))
                harness.executor.spin_once(timeout_sec=0.0)
                time.sleep(0.004)
            values = wait_until_settled(harness, view, proc, len(rec.t))
    assert int(values["node/tf_messages"]) >= 0.9 * len(rec.t)
    assert values["node/rejected/tf_stale"] == "0" and int(values["node/tf_from_sensor_frame"]) > 0
    # The pose-topic path: the same readings with the body poses and the mount in the config.
    config = config_from_dict({"model": {"num_inducing": 64, "learn_hyperparameters": False, "lengthscale": 1.0,
                                         "device": "cpu"},
                               "batching": {"size": 100}, "sync": {"target": "vector",
                                                                   "sensor_translation": list(MOUNT_T),
                                                                   "sensor_rotation": list(MOUNT_Q)},
                               "grid": nested["grid"]})
    mapper = Mapper(config)
    for k in range(len(rec.t)):
        mapper.add_pose(T0 + rec.t[k], rec.position[k], rec.orientation_xyzw[k])
        mapper.add_magnetic_field(T0 + rec.t[k], rec.field_sensor_tesla[k], frame_id="imu_link")
        mapper.process()
    mapper.flush()
    reference = mapper.grid()
    for name in "xyz":
        mean, _, scale, _ = decode(view, name)
        known = np.isfinite(mean) & reference.known
        assert known.sum() > 0.5 * reference.known.sum()
        difference = np.abs(mean[known] - reference.layers[name][0][known])
        assert np.max(difference) < 3 * NOISE * 1e6 + scale["mean"][1], (name, float(np.max(difference)))
