"""The live node and the offline replay make the same map from the same messages.

Both drive the same Mapper, which cuts batches in data time, so the node's batching (messages buffered by the
subscriptions, fed to the Mapper by the update thread, one batch per lock hold) must give the replay's batches.
Two ways to feed the node the bag's messages, with different trade-offs:

- Deterministic (``test_node_callbacks_reproduce_the_replay_of_the_demo_bag``): the node runs in a child process
  without DDS traffic; the bag's raw CDR bytes are deserialised into rclpy messages (what DDS would deliver)
  and handed to the node's subscription callbacks in bag order. Nothing can be lost or reordered, so the whole
  demo bag is used and the maps must agree to the last bit. It does not exercise the transport or the QoS.
- Over DDS (``test_node_over_dds_reproduces_the_replay``): the test publishes the bag's serialised messages in
  bag order (what ``ros2 bag play`` does) to the node in its own process. This covers discovery, QoS and the
  two subscriptions interleaving, but best-effort inputs may drop a message on a loaded machine, and every
  message must arrive for the maps to be equal; so it uses a short bag, paced, and checks the node's counters
  first. Equality across the interleaving holds because the sync decides samples in stamp order whatever
  order the two topics arrive in.

Both sides run in child processes with one torch thread, so their floating-point work is the same.
"""
from __future__ import annotations

import os
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.paths import REPO_ROOT
from support.ros import PYTHON, ChildProcess, RosHarness

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEMO_BAG = REPO_ROOT / "bags" / "demo"
PARAMS = {
    "model": {"num_inducing": 32, "hyper_steps": 5, "device": "cpu"},
    "batching": {"size": 500},
    "grid": {"resolution": 0.25},
    "node": {"publish_period": 0.2, "queue_depth": 1000},
}

# Drives the node's subscription callbacks with the bag's messages, then its save_map service; writes the map.
DRIVE_NODE = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path
    import numpy as np
    import rclpy
    from rclpy.serialization import deserialize_message
    from rosbags.highlevel import AnyReader
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import MagneticField
    from std_srvs.srv import Trigger
    from gp_mapping.ros.mapper_node import MapperNode

    bag, params, out = sys.argv[1:4]
    rclpy.init(args=["drive", "--ros-args", "--params-file", params])
    node = MapperNode()
    types = {"/mag": MagneticField, "/pose": PoseStamped}
    callbacks = {"/mag": node.on_mag, "/pose": node.on_pose}
    with AnyReader([Path(bag)]) as reader:
        connections = [c for c in reader.connections if c.topic in types]
        for connection, _, raw in reader.messages(connections=connections):
            callbacks[connection.topic](deserialize_message(bytes(raw), types[connection.topic]))
            while node.backlog > 1000:  # as fast as the node maps, never faster (no overflow drop)
                time.sleep(0.01)
    response = node.on_save_map(Trigger.Request(), Trigger.Response())
    assert response.success, response.message
    with node._lock:
        grid = node.mapper.grid()
        diagnostics = node.mapper.diagnostics()
    np.savez(out, mean=grid.layers["magnitude"][0], variance=grid.layers["magnitude"][1], known=grid.known,
             origin=[grid.spec.origin_x, grid.spec.origin_y], shape=grid.spec.shape, stamp=grid.stamp,
             updates=diagnostics["updates"], accepted=diagnostics["accepted"],
             overflow=node._node_rejected["inbox_overflow"], received=node._counts["mag_messages"])
    node.close()
    rclpy.shutdown()
""")


def write_params(path: Path, **overrides) -> Path:
    params = {k: dict(v) for k, v in PARAMS.items()}
    for section, values in overrides.items():
        params[section].update(values)
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    return path


def child_env(tmp: Path) -> dict[str, str]:
    # One torch thread on both sides: identical floating-point reductions, and fair to the 2-core machine.
    return dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_HOME=str(tmp), OMP_NUM_THREADS="1")


def replay(tmp: Path, bag: Path, params: Path) -> dict[str, np.ndarray]:
    out = tmp / "replay"
    with ChildProcess([PYTHON, "-m", "gp_mapping.cli", "replay", str(bag), "--config", str(params), "--out", str(out),
                       "--pose-topic", "/pose", "--mag-topic", "/mag", "--no-progress"], child_env(tmp),
                      tmp / "replay.log") as child:
        assert child.wait(timeout=180.0) == 0, child.output[-3000:]
    with np.load(out / "map.npz", allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def test_node_callbacks_reproduce_the_replay_of_the_demo_bag(tmp_path):
    if not (DEMO_BAG / "metadata.yaml").is_file():
        pytest.skip("bags/demo is absent (make it with `gp-mapping demo-bag bags/demo`)")
    params = write_params(tmp_path / "params.yaml")
    expected = replay(tmp_path, DEMO_BAG, params)
    with ChildProcess([PYTHON, "-c", DRIVE_NODE, str(DEMO_BAG), str(params), str(tmp_path / "node.npz")],
                      child_env(tmp_path), tmp_path / "node.log") as child:
        assert child.wait(timeout=180.0) == 0, child.output[-3000:]
    node = dict(np.load(tmp_path / "node.npz"))
    assert int(node["overflow"]) == 0 and int(node["received"]) == 8944
    assert int(node["accepted"]) == 8944 and int(node["updates"]) == 18  # the whole bag, in batches of 500
    assert tuple(node["shape"]) == expected["known"].shape
    np.testing.assert_array_equal(node["origin"], expected["origin"])
    assert float(node["stamp"]) == float(expected["stamp"])
    np.testing.assert_array_equal(node["known"], expected["known"])
    # Same batches, same arithmetic: the same numbers, bit for bit.
    np.testing.assert_array_equal(node["mean"], expected["magnitude_mean"])
    np.testing.assert_array_equal(node["variance"], expected["magnitude_variance"])
    assert np.ptp(expected["magnitude_mean"][expected["known"]]) > 1.0  # a real map, not a constant


def _short_bag(tmp: Path) -> Path:
    """A 30 s demo bag (same writer and world model as bags/demo): 600 readings and poses."""
    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import write_demo_bag

    area = (-3.0, -3.0, 3.0, 3.0)
    rec = sim.simulate(sim.WorldConfig(area=area, n_dipoles=6),
                       sim.TrajectoryConfig(patterns=("lawnmower",), area=area, speed=1.0, rate=20.0, duration=30.0),
                       sim.SensorConfig(), seed=7)
    bag = tmp / "short_bag"
    write_demo_bag(bag, rec, ground_truth=False)
    return bag


def test_node_over_dds_reproduces_the_replay(tmp_path):
    from geometry_msgs.msg import PoseStamped
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from rosbags.highlevel import AnyReader
    from sensor_msgs.msg import MagneticField
    from std_srvs.srv import Trigger

    from gp_mapping.ros.conversions import cloud_to_array, scale_from_msg
    from support.mapper_process import diagnostic_values, subscribe_map

    bag = _short_bag(tmp_path)
    params = write_params(tmp_path / "params.yaml", batching={"size": 100})
    expected = replay(tmp_path, bag, params)

    name = f"mapper_{uuid.uuid4().hex[:8]}"
    mag_topic, pose_topic = f"/{name}_in/mag", f"/{name}_in/pose"

    class Proc(ChildProcess):
        def topic(self, rel: str) -> str:
            return f"/{name}/{rel}"

        def check_alive(self) -> None:
            if self.poll() is not None:
                pytest.fail(f"the node exited with {self.poll()}:\n{self.output[-3000:]}")

    with RosHarness("vs_replay") as harness, Proc(
            [PYTHON, "-m", "gp_mapping.ros.mapper_node", "--ros-args", "--params-file", str(params),
             "-r", f"__node:={name}", "-r", f"mag:={mag_topic}", "-r", f"pose:={pose_topic}"],
            child_env(tmp_path), tmp_path / "node.log") as proc:
        proc.name = name
        view = subscribe_map(harness, proc)
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        pubs = {"/mag": harness.node.create_publisher(MagneticField, mag_topic, qos),
                "/pose": harness.node.create_publisher(PoseStamped, pose_topic, qos)}
        harness.spin_until(lambda: (proc.check_alive() or True) and all(p.get_subscription_count() for p in
                                                                         pubs.values()), 60.0,
                           "the node's subscriptions to be discovered")
        # The publisher can see the node's readers before the readers have matched the publisher, and a best
        # effort reader drops what comes from a writer it has not matched yet: give discovery a moment.
        harness.spin_for(1.0)
        sent = {"/mag": 0, "/pose": 0}
        with AnyReader([bag]) as reader:  # the bag's own bytes, in bag order, as `ros2 bag play` sends them
            connections = [c for c in reader.connections if c.topic in pubs]
            for connection, _, raw in reader.messages(connections=connections):
                pubs[connection.topic].publish(bytes(raw))
                sent[connection.topic] += 1
                harness.executor.spin_once(timeout_sec=0.0)
                time.sleep(0.002)
        harness.spin_until(lambda: diagnostic_values(view).get("node/mag_messages") == str(sent["/mag"])
                           and diagnostic_values(view).get("node/pose_messages") == str(sent["/pose"]), 30.0,
                           f"the node to count all {sent} messages (best effort: a loss makes equality impossible)")
        client = harness.node.create_client(Trigger, proc.topic("save_map"))
        harness.spin_until(client.service_is_ready, 15.0, "the save_map service")
        future = client.call_async(Trigger.Request())
        harness.spin_until(future.done, 60.0, "the save_map response")
        assert future.result().success, future.result().message
        stamp = float(expected["stamp"])
        harness.spin_until(lambda: view.cloud and view.mean and abs(view.cloud[-1].header.stamp.sec
                                                                    + 1e-9 * view.cloud[-1].header.stamp.nanosec
                                                                    - stamp) < 1e-6
                           and abs(view.mean[-1].header.stamp.sec + 1e-9 * view.mean[-1].header.stamp.nanosec
                                   - stamp) < 1e-6, 30.0, "the map of the whole bag")
        # /diagnostics comes once a second from the node's last snapshot: the second one after the save_map
        # response was published after save_map's flush decided the last readings (0.3 s was not enough).
        after_save = len(view.diagnostics)
        harness.spin_until(lambda: len(view.diagnostics) >= after_save + 2, 10.0,
                           "two /diagnostics messages after the save_map response")
        values = diagnostic_values(view)
    assert values["accepted"] == str(sent["/mag"]), {k: v for k, v in values.items() if v not in ("0", "")}
    # The published map is the replay's map: geometry, known cells, quantised values and the float cloud.
    mean_msg = view.mean[-1]
    known = expected["known"]
    assert (mean_msg.info.height, mean_msg.info.width) == known.shape
    assert (mean_msg.info.origin.position.x, mean_msg.info.origin.position.y) == tuple(expected["origin"])
    data = np.asarray(mean_msg.data, dtype=np.int8).reshape(known.shape)
    np.testing.assert_array_equal(data >= 0, known)
    scales, _ = scale_from_msg(view.scale[-1])
    offset, scale = scales["magnitude"]["mean"]
    assert offset == expected["magnitude_mean"][known].min()
    np.testing.assert_array_equal(data[known], np.rint((expected["magnitude_mean"][known] - offset) / scale))
    points = cloud_to_array(view.cloud[-1])
    np.testing.assert_allclose(points["mean"], expected["magnitude_mean"][known], rtol=1e-6)
    np.testing.assert_allclose(points["variance"], expected["magnitude_variance"][known], rtol=1e-5, atol=1e-9)
