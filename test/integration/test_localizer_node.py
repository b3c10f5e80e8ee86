"""The localizer node in its own process over real DDS on localhost: a map of a simulated survey (a Mapper, saved),
a second drive in the same world with drifting wheel odometry played into it, and what it publishes checked
against the simulator's truth: poses near the true path, particles, the map -> odom transform (which composed
with the odometry as sent gives the pose, also after an odometry jump), the map and /diagnostics. It waits for
/initialpose, and a late /initialpose restarts it; NaN readings, an odometry jump and an /initialpose in another
frame are refused and counted; a missing map, a map of another frame or a bad parameter end the process with
exit status 2 and the reason."""
from __future__ import annotations

import argparse
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.localization import AREA, SEED, survey_map
from support.mapper_process import map_qos, node_env, stamp_seconds
from support.ros import PYTHON, ChildProcess, RosHarness

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

T0 = 2000.0           # stamp of the drive's first sample [s]
STEP = 2              # the drive's 50 Hz samples, every second one: 25 Hz readings and odometry
JUMP = (3.0, -1.0)    # the odometry's frame jumps by this much [m] halfway (a wheel-odometry reset)
NAN_READINGS = 3


# ------------------------------------------------------------------------------------------------ the world


@dataclass
class World:
    state: Path                 # the saved map
    t: np.ndarray               # the drive's stamps [s], 25 Hz
    truth: np.ndarray           # (N, 3) true x, y, yaw in the map frame
    odom_position: np.ndarray   # (N, 3) drifting odometry in the odom frame
    odom_orientation: np.ndarray
    field_tesla: np.ndarray     # (N, 3) readings in the sensor frame


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """The map of a lawnmower survey of the world of seed 3 (test_localization_cli's) and a random drive of 35 s
    through it with 4 % scale error and 1 deg/s heading drift in its odometry."""
    from gp_mapping.mapping.frames import yaw_of
    from gp_mapping.sim.demo_bag import add_arguments, configs_from_args, drifting_odometry
    from gp_mapping.sim.simulation import World as SimWorld, simulate

    root = tmp_path_factory.mktemp("localizer_node")
    state = survey_map(root)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # The drive: another path through the same world (the world of seed 3 is drawn from its first stream).
    drive_args = parser.parse_args([str(root / "drive"), "--seed", SEED, "--duration", "35", "--spike-rate", "0",
                                    "--dropout-rate", "0", "--patterns", "random_walk", *AREA])
    world_cfg, trajectory, sensor = configs_from_args(drive_args)
    sim_world = SimWorld.from_config(world_cfg, np.random.default_rng(np.random.SeedSequence(int(SEED)).spawn(3)[0]))
    drive = simulate(sim_world, trajectory, sensor, seed=8)
    odom_p, odom_q = drifting_odometry(drive.t, drive.position, drive.orientation_xyzw, 0.04, 1.0, seed=8)
    k = np.arange(0, len(drive.t), STEP)
    truth = np.column_stack([drive.position[k, :2], yaw_of(drive.orientation_xyzw[k])])
    return World(state, T0 + drive.t[k], truth, odom_p[k], odom_q[k], drive.field_sensor_tesla[k])


# ------------------------------------------------------------------------------------------------ the node


class LocalizerProcess(ChildProcess):
    """The node (``ros2 run gp_mapping localizer`` runs this module's main) under a unique name, its inputs on
    unique topics."""

    def __init__(self, tmp: Path, env: dict[str, str], params: dict, *, lifecycle: bool = False,
                 log: str = "localizer.log") -> None:
        self.name = f"localizer_{uuid.uuid4().hex[:8]}"
        self.mag_topic, self.odom_topic = f"/{self.name}_in/mag", f"/{self.name}_in/odom"
        path = tmp / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"localizer": params}}}))
        ros = ["--ros-args", "--params-file", str(path), "-r", f"__node:={self.name}", "-r", f"mag:={self.mag_topic}",
               "-r", f"odom:={self.odom_topic}"]
        if lifecycle:
            code = ("import sys; from gp_mapping.ros.localizer_node import lifecycle_main; "
                    "sys.exit(lifecycle_main(sys.argv))")
            args = [PYTHON, "-c", code, "--autostart", *ros]
        else:
            args = [PYTHON, "-m", "gp_mapping.ros.localizer_node", *ros]
        super().__init__(args, env, tmp / log)

    def topic(self, name: str) -> str:
        return f"/{self.name}/{name}"

    def check_alive(self) -> None:
        if self.poll() is not None:
            pytest.fail(f"the localizer exited with {self.poll()}:\n{self.output[-3000:]}")


@dataclass
class Outputs:
    poses: list = field(default_factory=list)
    particles: list = field(default_factory=list)
    transforms: list = field(default_factory=list)   # (stamp, x, y, yaw) of map -> odom
    maps: list = field(default_factory=list)
    diagnostics: list = field(default_factory=list)

    def values(self, index: int = -1) -> dict[str, str]:
        return {kv.key: kv.value for kv in self.diagnostics[index].values}


def _yaw(q) -> float:
    return 2.0 * math.atan2(q.z, q.w)


def subscribe(harness: RosHarness, proc: LocalizerProcess) -> Outputs:
    from diagnostic_msgs.msg import DiagnosticArray
    from geometry_msgs.msg import PoseArray, PoseWithCovarianceStamped
    from nav_msgs.msg import OccupancyGrid
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from tf2_msgs.msg import TFMessage

    out = Outputs()
    node = harness.node
    deep = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
    node.create_subscription(PoseWithCovarianceStamped, proc.topic("pose"), out.poses.append, deep)
    node.create_subscription(PoseArray, proc.topic("particles"), out.particles.append, deep)
    node.create_subscription(OccupancyGrid, proc.topic("mean"), out.maps.append, map_qos())

    def on_tf(msg) -> None:
        for ts in msg.transforms:
            if ts.header.frame_id == "map" and ts.child_frame_id == "odom":
                tr = ts.transform
                out.transforms.append((stamp_seconds(ts), tr.translation.x, tr.translation.y, _yaw(tr.rotation)))
    node.create_subscription(TFMessage, "/tf", on_tf, deep)
    name = f"{proc.name}: gp_mapping"
    node.create_subscription(DiagnosticArray, "/diagnostics",
                             lambda m: out.diagnostics.extend(s for s in m.status if s.name == name), 100)
    return out


class Player:
    """Publishes the drive into the node: odometry (nav_msgs/Odometry in frame odom, or ``tf``: odom -> base_link on
    /tf; with the jump from ``jump_at`` on), readings, /initialpose."""

    def __init__(self, harness: RosHarness, proc: LocalizerProcess, world: World, tf: bool = False) -> None:
        from geometry_msgs.msg import PoseWithCovarianceStamped
        from nav_msgs.msg import Odometry
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import MagneticField
        from tf2_msgs.msg import TFMessage

        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self.harness, self.world, self.tf = harness, world, tf
        self.mag = harness.node.create_publisher(MagneticField, proc.mag_topic, qos)
        self.odom = (harness.node.create_publisher(TFMessage, "/tf", qos) if tf
                     else harness.node.create_publisher(Odometry, proc.odom_topic, qos))
        self.initial = harness.node.create_publisher(PoseWithCovarianceStamped, "/initialpose", qos)
        self.jump_at = len(world.t)

    def wait_matched(self) -> None:
        # /tf: the node's subscription beside this test's own
        self.harness.spin_until(lambda: self.mag.get_subscription_count() > 0 and self.initial.get_subscription_count()
                                > 0 and self.odom.get_subscription_count() > int(self.tf), 30.0,
                                "the localizer's subscriptions")
        self.harness.spin_for(1.0)  # a best-effort reader drops what an unmatched writer sends: let them match

    def _send_odometry(self, odom) -> None:
        if not self.tf:
            self.odom.publish(odom)
            return
        from geometry_msgs.msg import TransformStamped
        from tf2_msgs.msg import TFMessage

        ts = TransformStamped()
        ts.header, ts.child_frame_id = odom.header, odom.child_frame_id
        p = odom.pose.pose.position
        ts.transform.translation.x, ts.transform.translation.y, ts.transform.translation.z = p.x, p.y, p.z
        ts.transform.rotation = odom.pose.pose.orientation
        self.odom.publish(TFMessage(transforms=[ts]))

    def raw_odometry(self, k: int) -> np.ndarray:
        """The odometry as sent at sample k: (x, y, yaw) in the odom frame, shifted after the jump."""
        from gp_mapping.mapping.frames import yaw_of

        p = self.world.odom_position[k]
        shift = np.array(JUMP) if k >= self.jump_at else np.zeros(2)
        return np.array([p[0] + shift[0], p[1] + shift[1], float(yaw_of(self.world.odom_orientation[k]))])

    def play(self, start: int, stop: int, nan_at: tuple[int, ...] = ()) -> None:
        from nav_msgs.msg import Odometry
        from sensor_msgs.msg import MagneticField

        from gp_mapping.ros.conversions import seconds_to_stamp

        w = self.world
        for k in range(start, stop):
            odom = Odometry()
            odom.header.stamp, odom.header.frame_id, odom.child_frame_id = seconds_to_stamp(w.t[k]), "odom", "base_link"
            x, y, _ = self.raw_odometry(k)
            p, q = odom.pose.pose.position, odom.pose.pose.orientation
            p.x, p.y, p.z = x, y, float(w.odom_position[k, 2])
            q.x, q.y, q.z, q.w = (float(v) for v in w.odom_orientation[k])
            self._send_odometry(odom)
            mag = MagneticField()
            mag.header.stamp, mag.header.frame_id = seconds_to_stamp(w.t[k]), "magnetometer"
            b = mag.magnetic_field
            b.x, b.y, b.z = (float(v) for v in w.field_tesla[k])
            if k in nan_at:
                b.x = float("nan")
            self.mag.publish(mag)
            self.harness.executor.spin_once(timeout_sec=0.0)
            time.sleep(0.003)

    def initial_pose(self, pose, std, frame: str = "map") -> None:
        from geometry_msgs.msg import PoseWithCovarianceStamped

        from gp_mapping.ros.conversions import pose_with_covariance_msg, seconds_to_stamp

        msg = pose_with_covariance_msg(seconds_to_stamp(self.world.t[0]), frame, pose, np.diag(np.square(std)))
        assert isinstance(msg, PoseWithCovarianceStamped)
        self.initial.publish(msg)
        self.harness.spin_for(0.5)  # taken before the next readings (the node is idle meanwhile)


def _pose_rows(out: Outputs) -> np.ndarray:
    """(stamp, x, y, yaw, sd_x, sd_y) of every ~/pose received."""
    return np.array([(stamp_seconds(m), m.pose.pose.position.x, m.pose.pose.position.y,
                      _yaw(m.pose.pose.orientation), math.sqrt(m.pose.covariance[0]), math.sqrt(m.pose.covariance[7]))
                     for m in out.poses]).reshape(-1, 6)


def _errors(rows: np.ndarray, world: World) -> np.ndarray:
    return np.hypot(rows[:, 1] - np.interp(rows[:, 0], world.t, world.truth[:, 0]),
                    rows[:, 2] - np.interp(rows[:, 0], world.t, world.truth[:, 1]))


# ------------------------------------------------------------------------------------------------ tests


def test_localizer_tracks_a_drive_reinitialises_and_counts_bad_input(world, tmp_path, ros_env):
    from gp_mapping.localization.motion import compose

    params = {"map": str(world.state), "num_particles": 500, "max_particles": 2000, "seed": 1,
              "particles_period": 0.2, "queue_depth": 2000}
    n = len(world.t)
    k_init, k_jump, k_reinit = 50, n // 2, int(0.75 * n)          # 2 s without a pose, the jump, the late restart
    nan_at = (k_jump - 60, k_jump - 40, k_jump - 20)
    with RosHarness("localizer_test") as harness, LocalizerProcess(tmp_path, node_env(ros_env, tmp_path),
                                                                   params) as proc:
        out = subscribe(harness, proc)
        player = Player(harness, proc, world)
        player.jump_at = k_jump
        harness.spin_until(lambda: (proc.check_alive(), bool(out.maps))[1], 60.0, "the localizer's map")
        player.wait_matched()

        # Without an initial pose the node takes readings and publishes no pose.
        player.play(0, k_init)
        harness.spin_for(0.5)
        assert not out.poses
        player.initial_pose([0.0, 0.0, 0.0], [0.1, 0.1, 0.05], frame="odom")   # another frame: refused
        player.initial_pose(world.truth[k_init], [0.1, 0.1, 0.05])
        player.play(k_init, k_reinit, nan_at=nan_at)
        harness.spin_until(lambda: out.poses and stamp_seconds(out.poses[-1]) >= world.t[k_reinit - 10], 20.0,
                           "the poses of the drive")
        tracked = _pose_rows(out)
        # The late /initialpose: 1 m off the truth; the filter restarts there.
        wrong = world.truth[k_reinit] + np.array([1.0, 0.0, 0.0])
        player.initial_pose(wrong, [0.05, 0.05, 0.02])
        player.play(k_reinit, n)
        harness.spin_until(lambda: (proc.check_alive(), len(out.diagnostics) > 0
                                    and out.values().get("node/initial_poses") == "2"
                                    and float(out.values().get("pose/x", "nan")) != tracked[-1, 1])[1],
                           20.0, "diagnostics after the restart")
        harness.spin_for(1.2)
        assert proc.poll() is None, proc.output[-3000:]
    rows = _pose_rows(out)
    log = proc.log_path.read_text(errors="replace")

    # ~/pose tracks the true path (the odometry alone drifts metres away), with its covariance.
    err = _errors(tracked, world)
    assert len(tracked) > 60, f"only {len(tracked)} poses"
    assert tracked[0, 0] >= world.t[k_init] and np.all(np.diff(tracked[:, 0]) > 0)
    assert np.sqrt(np.mean(err ** 2)) < 0.4 and err[-20:].max() < 0.6, err
    assert np.all(tracked[:, 4:] > 0) and out.poses[0].header.frame_id == "map"
    # The late /initialpose restarted the filter where it was told (1 m off the truth).
    after = rows[rows[:, 0] >= world.t[k_reinit]]
    assert len(after) > 0
    assert math.hypot(*(after[0, 1:3] - wrong[:2])) < 0.3 and _errors(after[:1], world)[0] > 0.6

    # ~/particles: the filter's cloud around the estimate, in the map frame, at most every particles_period.
    assert 5 <= len(out.particles) < len(out.poses)
    cloud = out.particles[len(out.particles) // 2]
    assert cloud.header.frame_id == "map" and 500 <= len(cloud.poses) <= 2000
    xy = np.array([(p.position.x, p.position.y) for p in cloud.poses])
    nearest = rows[np.argmin(np.abs(rows[:, 0] - stamp_seconds(cloud)))]
    assert np.hypot(*(xy.mean(axis=0) - nearest[1:3])) < 0.3

    # map -> odom on /tf, stamped transform_tolerance after the reading: composed with the odometry as sent it
    # gives the published pose, before and after the odometry's frame jumped.
    tf = np.array(out.transforms)
    assert len(tf) >= len(rows)
    checked = 0
    for row in tracked[::5]:
        k = int(np.argmin(np.abs(world.t - row[0])))
        match = tf[np.abs(tf[:, 0] - (row[0] + 0.1)) < 1e-6]
        assert len(match), f"no map -> odom for the pose at {row[0]}"
        pose = compose(match[-1, 1:], player.raw_odometry(k))
        assert np.allclose(pose[:2], row[1:3], atol=1e-3) and abs(math.remainder(pose[2] - row[3], 2 * math.pi)) < 1e-3
        checked += world.t[k] > world.t[k_jump]
    assert checked > 3  # some after the jump

    # The map the filter looks up, latched for RViz.
    assert out.maps and out.maps[0].header.frame_id == "map" and max(out.maps[0].data) == 100

    # /diagnostics: the filter's health and what was refused, by reason.
    values = [out.values(i) for i in range(len(out.diagnostics))]
    last = values[-1]
    assert out.diagnostics[0].level == bytes([1]) and "no initial pose" in out.diagnostics[0].message
    assert k_init - 5 <= int(last["rejected/reading_before_init"]) <= k_init  # the readings before /initialpose
    assert int(last["rejected/reading_nonfinite"]) == NAN_READINGS
    assert int(last["rejected/odometry_jump"]) == 1 and int(last["odometry_jumps"]) == 1
    assert int(last["node/rejected/initialpose_frame"]) == 1 and int(last["reinitialisations"]) == 1
    assert int(last["updates"]) == len(rows) and int(last["node/poses_published"]) == len(rows)
    assert int(last["readings"]) == n and last["map"] == str(world.state) and last["map_frame"] == "map"
    converged = [(v, s) for v, s in zip(values, out.diagnostics) if v.get("converged") == "True"]
    assert converged and any(s.level == bytes([0]) and s.message == "converged" for _, s in converged)
    for v in converged:
        assert 0 < float(v[0]["ess"]) <= float(v[0]["particles"]) and math.isfinite(float(v[0]["nis_mean"]))
        assert len(yaml.safe_load(v[0]["bias"])) == 1 and float(v[0]["std/x"]) < 0.3
    # Refusals are logged by reason.
    assert "reading_nonfinite" in log and "odometry_jump" in log and "Traceback" not in log


def test_odometry_from_tf_and_no_transform_without_tf_broadcast(world, tmp_path, ros_env):
    """odom_source tf: odometry from /tf (odom -> base_link); tf_broadcast false: no map -> odom from the node."""
    k0 = 200
    params = {"map": str(world.state), "num_particles": 300, "max_particles": 1000, "odom_source": "tf",
              "tf_broadcast": False, "initial_pose": [float(v) for v in world.truth[k0]]}
    with RosHarness("localizer_tf_test") as harness, LocalizerProcess(tmp_path, node_env(ros_env, tmp_path),
                                                                      params) as proc:
        out = subscribe(harness, proc)
        player = Player(harness, proc, world, tf=True)
        harness.spin_until(lambda: (proc.check_alive(), bool(out.maps))[1], 60.0, "the localizer's map")
        player.wait_matched()
        player.play(k0, k0 + 300)
        harness.spin_until(lambda: out.poses and stamp_seconds(out.poses[-1]) >= world.t[k0 + 280], 20.0,
                           "poses from tf odometry")
        harness.spin_for(1.2)
    rows = _pose_rows(out)
    err = _errors(rows, world)
    assert len(rows) > 20 and np.sqrt(np.mean(err ** 2)) < 0.4, err
    assert not out.transforms  # tf_broadcast false
    values = out.values()
    assert int(values["node/tf_messages"]) >= 250 and int(values["node/rejected/odometry_tf"]) == 0
    assert int(values["rejected/reading_no_odometry"]) <= 2


@pytest.mark.parametrize("case", ["missing map", "other frame", "bad parameter", "lifecycle missing map"])
def test_a_map_or_parameter_that_cannot_be_used_ends_the_node_with_status_2(world, tmp_path, ros_env, case):
    params = {"missing map": {"map": str(tmp_path / "absent.safetensors")},
              "other frame": {"map": str(world.state), "global_frame": "world"},
              "bad parameter": {"map": str(world.state), "num_particles": 0},
              "lifecycle missing map": {"map": str(tmp_path / "absent.safetensors")}}[case]
    proc = LocalizerProcess(tmp_path, node_env(ros_env, tmp_path), params, lifecycle=case.startswith("lifecycle"))
    with proc:
        status = proc.wait(60.0)
    log = proc.log_path.read_text(errors="replace")
    assert status == 2, log[-3000:]
    expected = {"missing map": "absent.safetensors does not exist", "other frame": "is in frame 'map', not 'world'",
                "bad parameter": "config key 'localizer.num_particles': 0 is too small",
                "lifecycle missing map": "absent.safetensors does not exist"}[case]
    assert expected in log and ("localizer.map" in log or case == "bad parameter"), log[-3000:]
    assert "Traceback" not in log


def test_the_shipped_parameter_file_holds_every_key_at_its_default():
    """config/localizer.yaml: every parameter of the node (the filter's and its own) at its default, read by the
    node's schema and by gp-mapping localize (which skips the node's keys)."""
    from gp_mapping.localization.config import (LocalizerSettings, field_specs, load_localizer_config,
                                                node_field_specs, settings_from_parameters, settings_to_parameters)

    path = Path(__file__).resolve().parents[2] / "config" / "localizer.yaml"
    section = yaml.safe_load(path.read_text())["/**"]["ros__parameters"]["localizer"]
    names = {f"localizer.{k}" for k in section}
    assert names == set(field_specs()) | set(node_field_specs())
    settings = settings_from_parameters({f"localizer.{k}": v for k, v in section.items()})
    assert settings_to_parameters(settings) == settings_to_parameters(LocalizerSettings())
    assert load_localizer_config(path) == LocalizerSettings().filter


def test_a_live_map_change_bad_messages_and_the_lifecycle_in_process(world, tmp_path):
    """Through the callbacks, without DDS: localizer.map changed while running is loaded before it is accepted (a
    missing file or a map of another frame refused with the reason and counted, the old map kept; a good one
    restarts the filter around the last estimate); odometry of another frame, an unusable /initialpose and an
    error inside a callback are counted, never raised; the managed node fails configure without a map and comes
    up once it has one."""
    import shutil

    import rclpy
    from nav_msgs.msg import Odometry
    from rclpy.context import Context
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import MagneticField

    from gp_mapping.mapping.state import read_state, write_state
    from gp_mapping.ros.conversions import pose_with_covariance_msg, seconds_to_stamp
    from gp_mapping.ros.localizer_node import LifecycleLocalizerNode, LocalizerNode

    other_frame = tmp_path / "world.safetensors"
    state = read_state(world.state)
    state.config["grid"]["frame_id"] = "world"
    write_state(other_frame, state)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(world.state, copy)
    context = Context()
    rclpy.init(context=context)
    node = LocalizerNode(context=context, parameter_overrides=[
        Parameter("localizer.map", value=str(world.state)), Parameter("localizer.num_particles", value=300),
        Parameter("localizer.initial_pose", value=[float(v) for v in world.truth[0]])])
    managed = LifecycleLocalizerNode(context=context, parameter_overrides=[
        Parameter("localizer.map", value=str(tmp_path / "absent.safetensors"))])
    try:
        for k in range(150):
            odom = Odometry()
            odom.header.stamp, odom.header.frame_id = seconds_to_stamp(world.t[k]), "odom"
            p, q = odom.pose.pose.position, odom.pose.pose.orientation
            p.x, p.y = (float(v) for v in world.odom_position[k, :2])
            q.x, q.y, q.z, q.w = (float(v) for v in world.odom_orientation[k])
            node.on_odom(odom)
            mag = MagneticField()
            mag.header.stamp = odom.header.stamp
            mag.magnetic_field.x, mag.magnetic_field.y, mag.magnetic_field.z = (float(v) for v in world.field_tesla[k])
            node.on_mag(mag)
        before = node.localizer.last_estimate
        assert before is not None and node._counts["poses_published"] == node.localizer.updates > 5

        for path, reason in ((tmp_path / "absent.safetensors", "does not exist"),
                             (other_frame, "is in frame 'world', not 'map'")):
            (result,) = node.set_parameters([Parameter("localizer.map", value=str(path))])
            assert not result.successful and "localizer.map" in result.reason and reason in result.reason
            assert node.get_parameter("localizer.map").value == str(world.state)
            assert node.localizer.last_estimate is before  # the old map and filter go on
        assert node._node_rejected["map_refused"] == 2
        (result,) = node.set_parameters([Parameter("localizer.map", value=str(copy))])
        assert result.successful and node.map.source == str(copy) and node._counts["maps_loaded"] == 2
        assert node.localizer.filter.initialised and node.localizer.last_estimate is None
        assert np.hypot(*(node.localizer.filter.poses[:, :2].mean(axis=0) - before.pose[:2])) < 0.1

        odom.header.frame_id = "map"
        node.on_odom(odom)
        assert node._node_rejected["odometry_frame"] == 1
        bad = pose_with_covariance_msg(seconds_to_stamp(1.0), "map", [0.0, 0.0, 0.0], np.eye(3))
        bad.pose.pose.orientation.w = 0.0  # a zero quaternion
        node.on_initial_pose(bad)
        assert node._node_rejected["initialpose_invalid"] == 1 and node._counts["initial_poses"] == 0
        node.on_mag(object())  # a message the conversion cannot read: reported, not raised
        assert node._counts["errors"] == 1 and "on_mag failed" in node._last_error

        # A vector map publishes its layers as the mapper does (x, y, z, norm; the variance a reading's).
        from gp_mapping.localization.field_map import MagneticMap
        from gp_mapping.ros.localizer_node import published_topics

        m = node.map
        node.map = MagneticMap.from_arrays(m.spec, np.concatenate([m.mean * 0.6, m.mean * 0.8, -m.mean], axis=2),
                                           np.repeat(m.var, 3, axis=2), m.known, target="vector")
        grid = node.map.map_grid()
        assert list(grid.layers) == ["x", "y", "z", "norm"]
        np.testing.assert_allclose(grid.layers["norm"][0][m.known], np.hypot(1.0, 1.0) * m.mean[..., 0][m.known])
        node._publish_map()
        topics = {name for name, _types in node.get_publisher_names_and_types_by_node(node.get_name(),
                                                                                      node.get_namespace())}
        assert {t.replace("~", "/localizer") for t in published_topics("vector")} - {"/tf", "/diagnostics"} <= topics

        assert managed.trigger_configure() == TransitionCallbackReturn.FAILURE and managed.localizer is None
        managed.set_parameters([Parameter("localizer.map", value=str(world.state))])
        assert managed.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert managed.trigger_activate() == TransitionCallbackReturn.SUCCESS and managed._active
        assert managed.trigger_deactivate() == TransitionCallbackReturn.SUCCESS and not managed._active
        assert managed.trigger_cleanup() == TransitionCallbackReturn.SUCCESS and managed.localizer is None
        assert managed.trigger_configure() == TransitionCallbackReturn.SUCCESS and managed.localizer is not None
    finally:
        node.close()
        managed.close()
        context.try_shutdown()
