"""The demo bag: written with rosbags, read back message by message, its ground truth, its CLI, and the shipped
bags/demo."""
from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from rosbags.highlevel import AnyReader
from rosbags.interfaces import QosDurability, QosReliability
from rosbags.rosbag2 import Reader

from gp_mapping import cli
from gp_mapping.sim.demo_bag import (
    GROUND_TRUTH_FILE,
    DemoBagError,
    add_arguments,
    body_twist,
    configs_from_args,
    load_ground_truth,
    write_demo_bag,
)
from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "bags" / "demo"
START = 1_700_000_123.25


def _stamp_ns(header) -> int:
    return header.stamp.sec * 10**9 + header.stamp.nanosec


@pytest.fixture(scope="module")
def recording():
    traj = TrajectoryConfig(duration=6.0, rate=50.0, roll_amplitude_deg=3.0, pitch_amplitude_deg=3.0)
    ext = (0.0, 0.0, math.sin(math.pi / 8), math.cos(math.pi / 8))  # 45 deg about z
    sensor = SensorConfig(noise_std=0.2e-6, bias=(1e-7, 2e-7, -3e-7), spike_rate=0.05, dropout_rate=0.1,
                          translation=(0.1, 0.0, 0.3), rotation=ext)
    rec = simulate(WorldConfig(n_dipoles=6), traj, sensor, seed=5)
    assert 0 < rec.dropped.sum() < len(rec) and rec.is_spike.any()
    return rec


@pytest.fixture(scope="module")
def written(recording, tmp_path_factory):
    out = tmp_path_factory.mktemp("bags") / "sim"
    summary = write_demo_bag(out, recording, start_time=START, pose_every=1, odom_every=2, tf_every=5,
                             grid_resolution=0.25)
    return out, summary


def _custom_data(bag: Path) -> dict[str, str]:
    return yaml.safe_load((bag / "metadata.yaml").read_text())["rosbag2_bagfile_information"]["custom_data"]


def _read_all(path: Path) -> dict[str, list]:
    got: dict[str, list] = {}
    with AnyReader([path]) as reader:
        for conn, t, raw in reader.messages():
            got.setdefault(conn.topic, []).append((t, reader.deserialize(raw, conn.msgtype), conn.msgtype))
    return got


def test_bag_reads_back_the_same_messages(recording, written):
    out, summary = written
    n = len(recording)
    received = np.flatnonzero(recording.received)
    expected_counts = {"/mag": len(received), "/pose": n, "/odom": math.ceil(n / 2), "/tf": math.ceil(n / 5),
                       "/tf_static": 1}
    assert summary.counts == expected_counts
    got = _read_all(out)
    assert {topic: len(msgs) for topic, msgs in got.items()} == expected_counts
    stamps = round(START * 1e9) + np.round(recording.t * 1e9).astype(np.int64)
    assert stamps[1] - stamps[0] == 20_000_000

    mags = got["/mag"]
    assert {m[2] for m in mags} == {"sensor_msgs/msg/MagneticField"}
    np.testing.assert_array_equal([t for t, _, _ in mags], stamps[received])
    np.testing.assert_array_equal([_stamp_ns(m.header) for _, m, _ in mags], stamps[received])
    assert {m.header.frame_id for _, m, _ in mags} == {"magnetometer"}
    values = np.array([[m.magnetic_field.x, m.magnetic_field.y, m.magnetic_field.z] for _, m, _ in mags])
    np.testing.assert_array_equal(values, recording.field_sensor_tesla[received])  # float64 in CDR: exact
    np.testing.assert_array_equal(mags[0][1].magnetic_field_covariance, np.diag([0.2e-6**2] * 3).ravel())

    poses = got["/pose"]
    assert {m.header.frame_id for _, m, _ in poses} == {"map"}
    np.testing.assert_array_equal([_stamp_ns(m.header) for _, m, _ in poses], stamps)
    p = np.array([[m.pose.position.x, m.pose.position.y, m.pose.position.z] for _, m, _ in poses])
    q = np.array([[m.pose.orientation.x, m.pose.orientation.y, m.pose.orientation.z, m.pose.orientation.w]
                  for _, m, _ in poses])
    np.testing.assert_array_equal(p, recording.position)
    np.testing.assert_array_equal(q, recording.orientation_xyzw)

    odoms = got["/odom"]
    assert {(m.header.frame_id, m.child_frame_id) for _, m, _ in odoms} == {("map", "base_link")}
    np.testing.assert_array_equal([_stamp_ns(m.header) for _, m, _ in odoms], stamps[::2])
    op = np.array([[m.pose.pose.position.x, m.pose.pose.position.y, m.pose.pose.position.z] for _, m, _ in odoms])
    np.testing.assert_array_equal(op, recording.position[::2])
    # twist in base_link: forward at the driving speed, no sideways motion beyond the wobble
    v = np.array([[m.twist.twist.linear.x, m.twist.twist.linear.y] for _, m, _ in odoms])
    np.testing.assert_allclose(v[:, 0], recording.trajectory.speed, rtol=0.03)
    assert np.abs(v[:, 1]).max() < 0.05 * recording.trajectory.speed

    tfs = got["/tf"]
    assert all(len(m.transforms) == 1 for _, m, _ in tfs)
    assert {(m.transforms[0].header.frame_id, m.transforms[0].child_frame_id) for _, m, _ in tfs} == \
        {("map", "base_link")}
    np.testing.assert_array_equal([_stamp_ns(m.transforms[0].header) for _, m, _ in tfs], stamps[::5])
    tr = np.array([[m.transforms[0].transform.translation.x, m.transforms[0].transform.translation.y,
                    m.transforms[0].transform.translation.z] for _, m, _ in tfs])
    np.testing.assert_array_equal(tr, recording.position[::5])

    (static_t, static, _), = got["/tf_static"]
    assert static_t == stamps[0]
    (ext,) = static.transforms
    assert (ext.header.frame_id, ext.child_frame_id) == ("base_link", "magnetometer")
    tt, rr = ext.transform.translation, ext.transform.rotation
    np.testing.assert_array_equal([tt.x, tt.y, tt.z], recording.sensor.translation)
    np.testing.assert_array_equal([rr.x, rr.y, rr.z, rr.w], recording.sensor.rotation)


def test_bag_metadata_and_extra_file_are_tolerated_by_the_rosbag2_reader(written):
    out, _ = written
    assert (out / GROUND_TRUTH_FILE).is_file()
    assert sorted(p.suffix for p in out.iterdir()) == [".mcap", ".npz", ".yaml"]
    custom = _custom_data(out)
    assert custom["gp_mapping.ground_truth"] == GROUND_TRUTH_FILE and custom["gp_mapping.seed"] == "5"
    with Reader(out) as reader:  # opens only what metadata.yaml lists: the extra .npz is no obstacle
        conns = {c.topic: c for c in reader.connections}
        (qos,) = conns["/tf_static"].ext.offered_qos_profiles
        assert qos.durability == QosDurability.TRANSIENT_LOCAL and qos.reliability == QosReliability.RELIABLE
        assert reader.message_count == sum(1 for _ in reader.messages())
    data = (out / "sim.mcap").read_bytes()
    assert data[:8] == b"\x89MCAP0\r\n" and b"zstd" in data  # MCAP with zstd-compressed chunks


def test_ground_truth_holds_the_world_and_every_sample(recording, written):
    out, summary = written
    gt = load_ground_truth(out)
    assert summary.ground_truth == out / GROUND_TRUTH_FILE
    assert load_ground_truth(out / "sim.mcap").path == gt.path  # a file inside the bag works too
    np.testing.assert_array_equal(gt.t, recording.t)
    np.testing.assert_array_equal(gt.position, recording.position)
    np.testing.assert_array_equal(gt.sensor_position, recording.sensor_position)
    np.testing.assert_allclose(gt.field_map_true_ut, recording.field_map_tesla_true * 1e6, rtol=1e-15)
    np.testing.assert_allclose(gt.magnitude_true_ut, np.linalg.norm(gt.field_map_true_ut, axis=1), rtol=1e-15)
    np.testing.assert_array_equal(gt.is_spike, recording.is_spike)
    np.testing.assert_array_equal(gt.dropped, recording.dropped)
    # the grid is the world's field at the grid's cells and the sensor's height
    assert gt.field_grid_ut.shape == (len(gt.ys), len(gt.xs), 3) == (41, 41, 3)
    iy, ix = 7, 30
    cell = np.array([[gt.xs[ix], gt.ys[iy], float(gt.height)]])
    np.testing.assert_allclose(gt.field_grid_ut[iy, ix], recording.world.field(cell)[0] * 1e6, rtol=1e-12)
    np.testing.assert_allclose(gt.magnitude_grid_ut, np.linalg.norm(gt.field_grid_ut, axis=2), rtol=1e-14)
    # the stored world rebuilds the same field anywhere
    pts = recording.sensor_position[::17]
    np.testing.assert_allclose(gt.field_ut(pts), recording.world.field(pts) * 1e6, rtol=1e-12)
    with pytest.raises(AttributeError, match="no array"):
        gt.not_there


def test_missing_ground_truth_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ground truth"):
        load_ground_truth(tmp_path)


def test_sqlite3_storage_reads_back(recording, tmp_path):
    out = tmp_path / "db"
    summary = write_demo_bag(out, recording, storage="sqlite3", ground_truth=False)
    assert not (out / GROUND_TRUTH_FILE).exists() and summary.ground_truth is None
    got = _read_all(out)
    assert {t: len(m) for t, m in got.items()} == summary.counts
    assert list(out.glob("*.db3"))


def test_writer_refuses_an_existing_directory_and_bad_rates(recording, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(DemoBagError, match="exists already"):
        write_demo_bag(tmp_path, recording)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    with pytest.raises(DemoBagError, match="odom_every"):
        write_demo_bag(tmp_path / "new", recording, odom_every=0)
    assert not (tmp_path / "new").exists()


def test_body_twist_of_a_circle():
    # a body driving a circle of radius 2 at 1 m/s, heading along the tangent: v = (1, 0, 0), w = (0, 0, 0.5)
    from scipy.spatial.transform import Rotation

    t = np.linspace(0.0, 10.0, 1001)
    ang = 0.5 * t
    pos = np.column_stack([2 * np.cos(ang), 2 * np.sin(ang), np.zeros_like(t)])
    q = Rotation.from_euler("z", (ang + np.pi / 2)[:, None]).as_quat()
    lin, omega = body_twist(t, pos, q)
    np.testing.assert_allclose(lin[1:-1], np.tile([1.0, 0.0, 0.0], (999, 1)), atol=1e-4)
    np.testing.assert_allclose(omega, np.tile([0.0, 0.0, 0.5], (1001, 1)), atol=1e-9)


# ----------------------------------------------------------------------------------------------- command


def test_cli_writes_a_bag(tmp_path, capsys):
    out = tmp_path / "cli_bag"
    rc = cli.main(["demo-bag", str(out), "--duration", "3", "--seed", "4", "--odom-rate", "10",
                   "--patterns", "random_walk", "--storage", "mcap", "--height", "0.5", "--height-amplitude", "0.2",
                   "--no-compression"])
    assert rc == 0
    assert "wrote" in capsys.readouterr().out
    got = _read_all(out)
    assert len(got["/pose"]) == 150 and len(got["/odom"]) == 30 and len(got["/tf_static"]) == 1
    assert 140 <= len(got["/mag"]) <= 150
    gt = load_ground_truth(out)
    assert int(gt.seed) == 4
    z = gt.position[:, 2]
    assert np.all(np.abs(z - 0.5) <= 0.2 + 1e-12) and np.ptp(z) > 0.01  # a 3-D path about z = 0.5
    assert np.all(gt.dipole_positions[:, 2] <= 0.5 - 0.5)  # buried at least 0.5 m below the sensor's plane
    # the metadata records the command that reproduces it
    command = _custom_data(out)["gp_mapping.command"]
    assert command.startswith(f"gp-mapping demo-bag {out} --seed 4 --duration 3.0")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    again = parser.parse_args(shlex.split(command)[2:])
    assert again.no_compression and again.patterns == ["random_walk"] and again.height_amplitude == 0.2
    assert configs_from_args(again) == configs_from_args(parser.parse_args([str(out), "--duration", "3", "--seed",
                                                                             "4", "--patterns", "random_walk",
                                                                             "--height", "0.5",
                                                                             "--height-amplitude", "0.2"]))
    assert b"zstd" not in next(out.glob("*.mcap")).read_bytes()


@pytest.mark.parametrize("extra, message", [
    (["--duration", "-5"], "duration"),
    (["--duration", "nan"], "duration"),
    (["--rate", "0"], "rate"),
    (["--odom-rate", "7"], "--odom-rate"),
    (["--pose-rate", "100"], "--pose-rate"),
    (["--patterns", "spiral"], "spiral"),
    (["--dropout-rate", "1.5"], "dropout_rate"),
    (["--seed", "-1"], "seed"),
    (["--sensor-rotation", "0", "0", "0", "0"], "sensor-rotation"),
    (["--area", "0", "0", "-1", "5"], "area"),
    (["--grid-resolution", "0"], "grid-resolution"),
    (["--height-amplitude", "-1"], "height_amplitude"),
])
def test_cli_refuses_bad_arguments(tmp_path, capsys, extra, message):
    out = tmp_path / "bad"
    rc = cli.main(["demo-bag", str(out), "--duration", "2", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "error" in err
    assert not out.exists()


def test_cli_refuses_an_existing_output_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gp_mapping.cli", "demo-bag", str(tmp_path), "--duration", "1"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "exists already" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(SystemExit) as exc:  # argparse: a non-number
        cli.main(["demo-bag", str(tmp_path / "x"), "--duration", "long"])
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------------ shipped bag


def test_shipped_demo_bag_is_small_complete_and_reproducible():
    assert (SHIPPED / "metadata.yaml").is_file(), "bags/demo is missing: see bags/README.md"
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size < 5_000_000
    with AnyReader([SHIPPED]) as reader:
        topics = {name: (info.msgtype, info.msgcount) for name, info in reader.topics.items()}
        assert topics["/mag"][0] == "sensor_msgs/msg/MagneticField"
        assert topics["/pose"] == ("geometry_msgs/msg/PoseStamped", 9000)
        assert topics["/odom"] == ("nav_msgs/msg/Odometry", 4500)
        assert topics["/tf"] == ("tf2_msgs/msg/TFMessage", 9000)
        assert topics["/tf_static"] == ("tf2_msgs/msg/TFMessage", 1)
        assert 0.98 * 9000 <= topics["/mag"][1] < 9000  # 50 Hz for 3 min, a few dropouts
        assert reader.duration == pytest.approx(179.98e9, abs=1e6)
        mag_conns = [c for c in reader.connections if c.topic == "/mag"]
        mags = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages(connections=mag_conns)]
    gt = load_ground_truth(SHIPPED)
    reading = np.array([[m.magnetic_field.x, m.magnetic_field.y, m.magnetic_field.z] for m in mags]) * 1e6
    np.testing.assert_allclose(reading, gt.field_sensor_ut[~gt.dropped], rtol=1e-12)
    # a real map: anomalies of several uT over a 10 m x 10 m area around the Earth's 50 uT
    assert gt.xs[0] == -5.0 and gt.xs[-1] == pytest.approx(5.0) and gt.ys[-1] == pytest.approx(5.0)
    assert 45.0 < np.median(gt.magnitude_grid_ut) < 55.0 and np.ptp(gt.magnitude_grid_ut) > 10.0
    assert np.all(np.abs(gt.position[:, :2]) <= 5.0)
    # the command stored in the metadata reproduces the ground truth
    command = _custom_data(SHIPPED)["gp_mapping.command"]
    argv = shlex.split(command)
    assert argv[:3] == ["gp-mapping", "demo-bag", "bags/demo"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[2:])
    world, traj, sensor = configs_from_args(args)
    rec = simulate(world, traj, sensor, seed=args.seed)
    np.testing.assert_allclose(rec.field_sensor_tesla * 1e6, gt.field_sensor_ut, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(rec.dropped, gt.dropped)
    readme = (REPO / "bags" / "README.md").read_text()
    assert "gp-mapping demo-bag bags/demo" in readme
