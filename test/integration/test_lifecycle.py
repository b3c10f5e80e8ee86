"""The managed node (``lifecycle_mapper``) driven over DDS the way a lifecycle manager drives it:
configure -> activate -> deactivate -> activate -> deactivate -> cleanup. Publishing stops and resumes, the map
survives deactivate, cleanup drops it; a bad parameter fails configure with the reason."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.mapper_process import (PARAMS, T0, diagnostic_values, node_env, publish_recording, simulate, stamp_seconds,
                                    subscribe_map, wait_until_settled)
from support.ros import PYTHON, ChildProcess, RosHarness

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class LifecycleProcess(ChildProcess):
    """``lifecycle_mapper`` in its own process, under a unique name, inputs remapped to unique topics."""

    def __init__(self, tmp: Path, env: dict[str, str], params: Path) -> None:
        self.name = f"lc_mapper_{uuid.uuid4().hex[:8]}"
        self.batch = PARAMS["batching"]["size"]
        self.mag_topic, self.pose_topic = f"/{self.name}_in/mag", f"/{self.name}_in/pose"
        code = ("import sys; from gp_mapping.ros.mapper_node import lifecycle_main; "
                "sys.exit(lifecycle_main(['lifecycle_mapper'] + sys.argv[1:]))")
        super().__init__([PYTHON, "-c", code, "--ros-args", "--params-file", str(params), "-r",
                          f"__node:={self.name}", "-r", f"mag:={self.mag_topic}", "-r", f"pose:={self.pose_topic}"],
                         env, tmp / "lifecycle.log")

    def topic(self, name: str) -> str:
        return f"/{self.name}/{name}"

    def check_alive(self) -> None:
        if self.poll() is not None:
            pytest.fail(f"the node exited with {self.poll()}:\n{self.output[-3000:]}")


class Manager:
    """What nav2's lifecycle manager does, on one node: change_state and get_state over DDS."""

    def __init__(self, harness: RosHarness, proc: LifecycleProcess) -> None:
        from lifecycle_msgs.srv import ChangeState, GetState

        self.harness, self.proc = harness, proc
        self.change = harness.node.create_client(ChangeState, proc.topic("change_state"))
        self.get = harness.node.create_client(GetState, proc.topic("get_state"))
        harness.spin_until(lambda: self.change.service_is_ready() and self.get.service_is_ready(), 60.0,
                           "the lifecycle services")

    def _call(self, client, request):
        future = client.call_async(request)
        self.harness.spin_until(future.done, 120.0, "a lifecycle service response")
        return future.result()

    def state(self) -> str:
        from lifecycle_msgs.srv import GetState

        return self._call(self.get, GetState.Request()).current_state.label

    def transition(self, name: str) -> bool:
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState

        ids = {"configure": Transition.TRANSITION_CONFIGURE, "activate": Transition.TRANSITION_ACTIVATE,
               "deactivate": Transition.TRANSITION_DEACTIVATE, "cleanup": Transition.TRANSITION_CLEANUP}
        request = ChangeState.Request()
        request.transition.id = ids[name]
        return self._call(self.change, request).success


def _params(tmp_path: Path, **node) -> Path:
    params = {k: dict(v) for k, v in PARAMS.items()}
    params["node"].update(node)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    return path


def test_configure_activate_deactivate_activate_cleanup(tmp_path, ros_env):
    rec = simulate()
    half = len(rec.t) // 2
    with RosHarness("lifecycle") as harness:
        proc = LifecycleProcess(tmp_path, node_env(ros_env, tmp_path), _params(tmp_path))
        with proc:
            manager = Manager(harness, proc)
            view = subscribe_map(harness, proc)
            assert manager.state() == "unconfigured"
            assert manager.transition("configure") and manager.state() == "inactive"
            harness.spin_for(1.5)
            assert not view.diagnostics and not view.mean  # configured, not active: nothing published

            assert manager.transition("activate") and manager.state() == "active"
            harness.spin_until(lambda: bool(view.diagnostics), 30.0, "diagnostics once active")
            sent = publish_recording(harness, proc, rec, "pose_stamped", count=half)
            # Settled, not merely mapped once: a message still in flight would start an update after the
            # deactivation below and change the map that activation must publish again unchanged.
            before = wait_until_settled(harness, view, proc, sent)
            assert int(before["updates"]) >= 1
            map_before, maps = view.mean[-1], len(view.mean)

            assert manager.transition("deactivate") and manager.state() == "inactive"
            harness.spin_for(0.5)
            diagnostics, maps = len(view.diagnostics), len(view.mean)
            # Messages sent while inactive are not taken: the subscriptions are gone.
            from sensor_msgs.msg import MagneticField
            from rclpy.qos import QoSProfile, ReliabilityPolicy
            mag_pub = harness.node.create_publisher(MagneticField, proc.mag_topic,
                                                    QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
            for _ in range(20):
                mag_pub.publish(MagneticField())
                harness.spin_for(0.1)
            assert len(view.diagnostics) == diagnostics and len(view.mean) == maps  # publishing stopped
            proc.check_alive()

            assert manager.transition("activate") and manager.state() == "active"
            # The kept map is published again at once: the same stamp, the same cells.
            harness.spin_until(lambda: len(view.mean) > maps and len(view.diagnostics) > diagnostics, 30.0,
                               "publishing to resume")
            assert stamp_seconds(view.mean[-1]) == stamp_seconds(map_before)
            assert np.array_equal(np.asarray(view.mean[-1].data), np.asarray(map_before.data))
            after = diagnostic_values(view)
            assert after["accepted"] == before["accepted"] and after["num_seen"] == before["num_seen"]
            assert after["node/mag_messages"] == before["node/mag_messages"]  # nothing taken while inactive

            assert manager.transition("deactivate") and manager.transition("cleanup")
            assert manager.state() == "unconfigured"
            # Configured and activated again: a fresh, empty map (cleanup dropped it).
            assert manager.transition("configure") and manager.transition("activate")
            count = len(view.diagnostics)
            harness.spin_until(lambda: len(view.diagnostics) > count, 30.0, "diagnostics after the restart")
            assert diagnostic_values(view)["num_seen"] == "0"
            assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
    assert "deactivated: not mapping; the map is kept" in proc.log_path.read_text()


def test_bad_initial_map_fails_configure_with_the_reason(tmp_path, ros_env):
    missing = tmp_path / "missing.safetensors"
    with RosHarness("lifecycle_bad") as harness:
        proc = LifecycleProcess(tmp_path, node_env(ros_env, tmp_path), _params(tmp_path, initial_map=str(missing)))
        with proc:
            manager = Manager(harness, proc)
            assert not manager.transition("configure")
            assert manager.state() == "unconfigured"
            proc.check_alive()
            harness.spin_for(0.3)
    log = proc.log_path.read_text()
    assert "configure failed" in log and "node.initial_map" in log
