"""Offline replay and bag I/O: real ROS 1 bags, tf chains against homogeneous matrices, the demo bag end to end."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from support.paths import REPO_ROOT, shared_data
from gp_mapping import bag as bag_io
from gp_mapping.bag import TransformBuffer, TransformSample
from support.replay import _plain, one_torch_thread  # noqa: F401  (one_torch_thread: autouse fixture)


# ------------------------------------------------------------------------------------ ROS 1 MagneticField


def _decode_ros1_magnetic_field(raw: bytes) -> tuple[float, np.ndarray]:
    """Independent decoding of a ROS 1 sensor_msgs/MagneticField from its serialised bytes (little endian):
    Header{uint32 seq, time stamp (uint32 sec, uint32 nsec), string frame_id}, Vector3 (3 float64), 9 float64."""
    _, sec, nsec, n = struct.unpack_from("<IIII", raw, 0)
    off = 16 + n
    field = np.array(struct.unpack_from("<3d", raw, off))
    assert len(raw) == off + 12 * 8
    return sec + nsec * 1e-9, field


def test_magnetic_field_from_ros1_bag_matches_raw_bytes_and_counts_nan():
    path = shared_data("imu_tools_bags", "phidgets_imu_upside_down.bag")
    series = bag_io.read_magnetic_field(path)
    assert series.topic == "/imu/mag" and series.frame_id == "imu"

    from rosbags.rosbag1 import Reader
    stamps, fields = [], []
    with Reader(path) as reader:
        conns = [c for c in reader.connections if c.topic == "/imu/mag"]
        for _, _, raw in reader.messages(connections=conns):
            s, f = _decode_ros1_magnetic_field(raw)
            stamps.append(s)
            fields.append(f)
    fields = np.array(fields)
    assert len(series) == len(fields) == 13964
    nan_rows = ~np.isfinite(fields).all(axis=1)
    assert series.non_finite == int(nan_rows.sum()) == 6990  # the README's warning: this bag holds NaN readings
    np.testing.assert_array_equal(np.isnan(series.field), np.isnan(fields))
    np.testing.assert_array_equal(series.field[~nan_rows], fields[~nan_rows])
    np.testing.assert_allclose(series.stamps, stamps, rtol=0, atol=1e-6)
    # Tesla, as ROS requires: the Earth's field is 25-65 uT.
    magnitude = np.linalg.norm(series.field[~nan_rows], axis=1)
    assert 25e-6 < np.median(magnitude) < 65e-6


def test_ros1_bag_without_pose_is_refused_with_a_clear_message(tmp_path):
    path = shared_data("imu_tools_bags", "ardrone_imu.bag")
    with bag_io.Bag(path) as bag:
        assert not bag.is_ros2
        assert bag.mag_topic() == "/ardrone/mag"
        with pytest.raises(bag_io.NoPoseSourceError, match="no pose source"):
            bag_io.choose_pose_source(bag, mag_frame="ardrone_base_link")
    proc = _cli("replay", str(path), "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode != 0
    assert "no pose source" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "map.npz").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gp_mapping.cli", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)


def _bad_path(kind: str, d: Path) -> Path:
    """A path that is not a usable bag, of the given kind."""
    if kind == "missing":
        return d / "missing.bag"
    if kind == "text":
        (d / "notes.txt").write_text("hello")
        return d / "notes.txt"
    if kind == "ros1_junk":  # a ROS 1 bag header followed by garbage
        (d / "junk.bag").write_bytes(b"#ROSBAG V2.0\n" + bytes(range(256)) * 4)
        return d / "junk.bag"
    if kind == "mcap_junk":
        (d / "junk.mcap").write_bytes(bytes(1000))
        return d / "junk.mcap"
    (d / "emptydir").mkdir()
    return d / "emptydir"


@pytest.mark.parametrize("kind, match", [("missing", "does not exist"), ("text", "not a readable"),
                                         ("ros1_junk", "not a readable"), ("mcap_junk", "not a readable"),
                                         ("empty_dir", "not a rosbag2 bag")])
def test_bad_bag_paths_give_clear_errors(tmp_path, kind, match):
    path = _bad_path(kind, tmp_path)
    with pytest.raises(bag_io.BagError, match=match):
        bag_io.Bag(path)
    proc = _cli("replay", str(path), "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode != 0
    assert match in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ tf chains


def _matrix(t, q_xyzw) -> np.ndarray:
    m = np.eye(4)
    m[:3, :3] = Rotation.from_quat(q_xyzw).as_matrix()
    m[:3, 3] = t
    return m


def _sample(stamp, parent, child, t, q) -> TransformSample:
    return TransformSample(stamp, parent, child, np.asarray(t, float), np.asarray(q, float))


def test_tf_chain_composes_interpolates_and_inverts_like_homogeneous_matrices():
    buf = TransformBuffer()
    q_static = Rotation.from_euler("xyz", [0.3, -0.2, 1.1]).as_quat()
    t_static = np.array([0.2, -0.1, 0.4])
    buf.add(_sample(0.0, "base_link", "magnetometer", t_static, q_static), static=True)
    buf.add(_sample(0.0, "base_link", "lidar", [1.0, 0.0, 0.3], [0, 0, 0, 1]), static=True)
    # map -> odom slow and dynamic, odom -> base_link fast and dynamic; added out of order on purpose.
    for k in (2, 0, 1):
        buf.add(_sample(float(k), "map", "odom", [0.5 * k, -0.2 * k, 0.0],
                        Rotation.from_euler("z", 0.1 * k).as_quat()))
    for k in range(21):
        s = 0.1 * k
        buf.add(_sample(s, "/odom", "/base_link", [np.cos(s), np.sin(s), 0.05 * s],
                        Rotation.from_euler("zyx", [s, 0.1 * s, -0.05 * s]).as_quat()))
    buf.freeze()
    assert buf.connected("map", "magnetometer") and not buf.connected("map", "camera")
    assert buf.frames == ["base_link", "lidar", "magnetometer", "map", "odom"]

    # At a stamp on both edges' sample times the lookup is the exact matrix product.
    t_map_mag, q_map_mag = buf.lookup("map", "magnetometer", 1.0)
    expected = (_matrix([0.5, -0.2, 0], Rotation.from_euler("z", 0.1).as_quat())
                @ _matrix([np.cos(1.0), np.sin(1.0), 0.05], Rotation.from_euler("zyx", [1.0, 0.1, -0.05]).as_quat())
                @ _matrix(t_static, q_static))
    np.testing.assert_allclose(_matrix(t_map_mag, q_map_mag), expected, atol=1e-12)

    # Between samples: each edge interpolated (lerp + slerp) and then composed.
    s = 1.234
    w_odom = s - 1.0
    q_odom = Rotation.from_euler("z", 0.1 * s).as_quat()  # slerp about one fixed axis is linear in the angle
    k = int(np.floor(s / 0.1 + 1e-9))
    w = (s - 0.1 * k) / 0.1
    r0 = Rotation.from_euler("zyx", [0.1 * k, 0.01 * k, -0.005 * k])
    r1 = Rotation.from_euler("zyx", [0.1 * (k + 1), 0.01 * (k + 1), -0.005 * (k + 1)])
    rel = (r0.inv() * r1).as_rotvec()
    r_base = r0 * Rotation.from_rotvec(w * rel)  # slerp written as a geodesic step
    p0 = np.array([np.cos(0.1 * k), np.sin(0.1 * k), 0.005 * k])
    p1 = np.array([np.cos(0.1 * (k + 1)), np.sin(0.1 * (k + 1)), 0.005 * (k + 1)])
    expected = (_matrix([0.5 * s, -0.2 * s, 0], q_odom) @ _matrix((1 - w) * p0 + w * p1, r_base.as_quat())
                @ _matrix(t_static, q_static))
    t_map_mag, q_map_mag = buf.lookup("map", "magnetometer", s, max_gap=1.0)
    assert 0 < w_odom < 1
    np.testing.assert_allclose(_matrix(t_map_mag, q_map_mag), expected, atol=1e-12)

    # The reverse lookup is the inverse; siblings go through their common parent.
    np.testing.assert_allclose(_matrix(*buf.lookup("magnetometer", "map", s)), np.linalg.inv(expected), atol=1e-12)
    np.testing.assert_allclose(_matrix(*buf.lookup("lidar", "magnetometer", 0.5)),
                               np.linalg.inv(_matrix([1.0, 0.0, 0.3], [0, 0, 0, 1])) @ _matrix(t_static, q_static),
                               atol=1e-12)
    assert buf.chain_is_static("lidar", "magnetometer") and not buf.chain_is_static("map", "magnetometer")

    # No extrapolation, and both neighbours must lie within the gap.
    with pytest.raises(bag_io.TransformError, match="no transform at"):
        buf.lookup("map", "magnetometer", 2.5)
    with pytest.raises(bag_io.TransformError, match="max_pose_gap"):
        buf.lookup("map", "magnetometer", 1.5, max_gap=0.4)
    with pytest.raises(bag_io.TransformError, match="not connected"):
        buf.lookup("map", "camera", 1.0)
    # Bad transforms are counted, not stored.
    buf.add(_sample(3.0, "map", "odom", [np.nan, 0, 0], [0, 0, 0, 1]))
    buf.add(_sample(3.0, "map", "odom", [0, 0, 0], [0, 0, 0, 0]))
    assert buf.rejected == 2
    # A new parent takes the child over from its stamp on (tf2's TF_REPARENT); earlier lookups keep the old one.
    buf.add(_sample(3.0, "world", "odom", [0, 0, 0], [0, 0, 0, 1]))
    assert buf.rejected == 2 and buf.reparents == 1
    assert buf.connected("map", "magnetometer", 1.0) and not buf.connected("map", "magnetometer", 3.0)


# ------------------------------------------------------------------------------------ the demo bag, end to end

DEMO_BAG = REPO_ROOT / "bags" / "demo"
# A quick configuration: hyperparameters fixed (Matern-5/2, lengthscale 1 m), batches of 500, a snapshot every
# 20 s of bag time. The shipped config learns hyperparameters online, which costs minutes on a shared CPU.
FAST = {"model": {"learn_hyperparameters": False, "lengthscale": 1.0, "device": "cpu"}, "batching": {"size": 500},
        "node": {"publish_period": 20.0}}


def _fast_config(**sections):
    from gp_mapping.config import config_from_dict

    merged = {k: dict(v) for k, v in FAST.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return config_from_dict(merged)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo bag replayed once through the PoseStamped topic, with all three output files."""
    from gp_mapping.replay import replay_bag

    if not (DEMO_BAG / "metadata.yaml").is_file():
        pytest.skip("bags/demo is absent (make it with `gp-mapping demo-bag bags/demo`)")
    out = tmp_path_factory.mktemp("demo_out")
    result = replay_bag(DEMO_BAG, _fast_config(), out_dir=out)
    print(f"demo replay: {result.bag_duration:.0f} s of bag in {result.processing_seconds:.1f} s "
          f"({result.real_time_factor:.1f}x real time)")
    with np.load(out / "map.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return result, out, arrays


def test_demo_replay_writes_the_three_files_with_the_right_shapes(demo):
    result, out, npz = demo
    assert {k: p.name for k, p in result.files.items()} == {"npz": "map.npz", "png": "map.png", "bag": "maps"}
    assert all((out / name).is_file() for name in ("map.npz", "map.png", "maps/metadata.yaml", "maps/maps.mcap"))
    assert not list(out.glob(".maps-*"))  # the temporary rosbag2 folder is gone
    assert (out / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The auto-detected sources: the single MagneticField topic, PoseStamped preferred over Odometry and /tf.
    assert result.mag_topic == "/mag" and result.pose_source.topic == "/pose"
    diag = result.counts["mapper"]
    assert result.counts["mag_messages"] == 8944 and result.counts["pose_messages"] == 9000
    assert diag["accepted"] == 8944 and diag["rejected_total"] == 0 and diag["updates"] == 18
    assert result.real_time_factor > 0 and result.bag_duration == pytest.approx(179.98, abs=0.01)

    h, w = npz["known"].shape
    assert npz["x"].shape == (w,) and npz["y"].shape == (h,) and npz["known"].dtype == bool
    assert list(npz["layers"]) == ["magnitude"] and str(npz["field_unit"]) == "microtesla"
    assert str(npz["frame_id"]) == "map" and npz["trajectory"].ndim == 2 and npz["trajectory"].shape[1] == 2
    res, (ox, oy) = float(npz["resolution"]), npz["origin"]
    np.testing.assert_allclose(npz["x"], ox + (np.arange(w) + 0.5) * res)
    np.testing.assert_allclose(npz["y"], oy + (np.arange(h) + 0.5) * res)
    for key in ("magnitude_mean", "magnitude_variance"):
        assert npz[key].shape == (h, w) and np.all(np.isfinite(npz[key]))
    assert np.all(npz["magnitude_variance"] >= 0)
    # The map covers the driven area (-5..5 m) and knows most of it.
    assert ox <= -5.0 and oy <= -5.0 and ox + w * res >= 5.0 and oy + h * res >= 5.0
    assert npz["known"].mean() > 0.8
    np.testing.assert_array_equal(npz["magnitude_mean"], result.grid.layers["magnitude"][0])


def test_demo_map_matches_the_ground_truth(demo):
    """RMSE against the simulated world's true |B| at the cell centres (z = the sensor height).

    Bounds and why: the readings carry 0.1 uT noise and a constant sensor-frame bias (0.4, -0.3, 0.2) uT, which
    shifts |B| by its projection on the field direction, up to 0.54 uT and varying with the heading, so no map
    of |B| from these readings gets much below ~0.3 uT. An exact GP with the same kernel on 3000 of the samples
    gives 0.44 uT within 0.5 m of the path and 0.81 uT on all known cells (measured once, offline); this
    replay measured 0.41 and 0.75 uT with one kernel and 0.45 and 0.91 uT with the shipped two kernel scales
    (model.kernel_scales, docs/calibration.md, Several scales: a trade the defaults table made for the worst
    recording). The bag's 16 spikes (20-100 uT) are dropped by the spike gate
    (gp/outliers.py; 13 of them, the others at a batch's edge): with the gate off the replay measured 0.51
    and 1.01 uT, so the bounds below fail without it. Known cells reach 1 m beyond the path
    (grid.unknown_distance), where the map extrapolates towards dipoles outside the driven area; hence the
    looser bound there. Both must be well below the spread of the true field (2.6 uT), i.e. far better than a
    constant map.
    """
    from scipy.spatial import cKDTree

    from gp_mapping.sim.demo_bag import load_ground_truth

    _, _, npz = demo
    gt = load_ground_truth(DEMO_BAG)
    xx, yy = np.meshgrid(npz["x"], npz["y"])
    points = np.stack([xx.ravel(), yy.ravel(), np.full(xx.size, float(gt.height))], axis=1)
    truth = np.linalg.norm(gt.field_ut(points), axis=1).reshape(xx.shape)
    known = npz["known"]
    error = npz["magnitude_mean"] - truth
    distance = cKDTree(gt.sensor_position[:, :2]).query(np.stack([xx.ravel(), yy.ravel()], axis=1))[0]
    near = known & (distance.reshape(xx.shape) <= 0.5)
    rmse_near = float(np.sqrt(np.mean(error[near] ** 2)))
    rmse_known = float(np.sqrt(np.mean(error[known] ** 2)))
    spread = float(truth[known].std())
    print(f"demo |B| map: RMSE {rmse_near:.3f} uT within 0.5 m of the path ({near.sum()} cells), {rmse_known:.3f} uT "
          f"on all {known.sum()} known cells; true field std {spread:.2f} uT")
    assert near.sum() > 0.6 * known.sum()
    assert rmse_near < 0.47 and rmse_known < 0.95
    assert rmse_known < 0.5 * spread


def test_map_bag_reads_back_as_the_node_publishes(demo):
    """The map bag maps/ holds the node's topics; decoded with the node's own parsers it gives the npz map."""
    from rosbags.highlevel import AnyReader
    from rosbags.interfaces import QosDurability

    from gp_mapping.ros.conversions import decode_occupancy_msg, scale_from_msg

    result, out, npz = demo
    by_topic: dict[str, list] = {}
    with AnyReader([out / "maps"]) as reader:
        types = {c.topic: c.msgtype for c in reader.connections}
        assert types == {"/mapper/mean": "nav_msgs/msg/OccupancyGrid", "/mapper/variance": "nav_msgs/msg/OccupancyGrid",
                         "/mapper/cloud": "sensor_msgs/msg/PointCloud2",
                         "/mapper/scale": "std_msgs/msg/Float64MultiArray"}
        for conn in reader.connections:  # offered latched, as the node does, so RViz gets the map on playback
            assert conn.ext.offered_qos_profiles[0].durability == QosDurability.TRANSIENT_LOCAL
        order = []
        for conn, t, raw in reader.messages():
            by_topic.setdefault(conn.topic, []).append((t, reader.deserialize(raw, conn.msgtype)))
            order.append(conn.topic)
    snapshots = result.counts["snapshots"]
    assert snapshots >= 180 / 20 - 1 and all(len(v) == snapshots for v in by_topic.values())
    assert order[0] == "/mapper/scale"  # the scale precedes the grids it decodes
    log_times = np.array([t for t, _ in by_topic["/mapper/mean"]]) * 1e-9
    assert np.all(np.diff(log_times[:-1]) >= 20.0 - 1e-9)  # one map per publish period of bag time at most

    mean_msg, var_msg = by_topic["/mapper/mean"][-1][1], by_topic["/mapper/variance"][-1][1]
    scales, unit = scale_from_msg(by_topic["/mapper/scale"][-1][1])
    assert unit == "microtesla" and list(scales) == ["magnitude"]
    known = npz["known"]
    assert (mean_msg.info.height, mean_msg.info.width) == known.shape
    assert mean_msg.info.resolution == pytest.approx(float(npz["resolution"]))
    assert (mean_msg.info.origin.position.x, mean_msg.info.origin.position.y) == tuple(npz["origin"])
    assert mean_msg.header.frame_id == "map"
    assert mean_msg.header.stamp.sec + 1e-9 * mean_msg.header.stamp.nanosec == pytest.approx(float(npz["stamp"]),
                                                                                              abs=1e-6)
    for msg, key, stat in ((mean_msg, "magnitude_mean", "mean"), (var_msg, "magnitude_variance", "variance")):
        offset, scale = scales["magnitude"][stat]
        data = np.asarray(msg.data, dtype=np.int8).reshape(known.shape)
        np.testing.assert_array_equal(data >= 0, known)
        assert data[known].min() == 0 and data[known].max() == 100
        decoded = decode_occupancy_msg(msg, offset, scale)
        # Within half a quantisation step of the float map.
        assert np.max(np.abs(decoded[known] - npz[key][known])) <= scale / 2 * (1 + 1e-9)
    cloud = by_topic["/mapper/cloud"][-1][1]
    assert [f.name for f in cloud.fields] == ["x", "y", "z", "mean", "variance"] and cloud.width == known.sum()
    points = np.frombuffer(bytes(cloud.data), dtype="<f4").reshape(cloud.width, 5)
    np.testing.assert_allclose(points[:, 3], npz["magnitude_mean"][known], rtol=1e-6)
    xx, yy = np.meshgrid(npz["x"], npz["y"])
    np.testing.assert_allclose(points[:, 0], xx[known], atol=1e-5)
    np.testing.assert_allclose(points[:, 1], yy[known], atol=1e-5)


def test_tf_chain_gives_the_map_of_the_pose_topic(demo):
    """/tf (map -> base_link) + /tf_static (base_link -> magnetometer), looked up at each magnetometer stamp,
    gives the same sensor poses as /pose with the config's (identity) extrinsic, hence the same map."""
    from gp_mapping.replay import replay_bag

    result, _, npz = demo
    tf = replay_bag(DEMO_BAG, _fast_config(), tf_frames=("map", "magnetometer"))
    assert tf.pose_source.kind == "tf" and tf.counts["tf_lookups_failed"] == 0
    assert tf.counts["mapper"]["accepted"] == 8944 and tf.counts["pose_messages"] == 0
    grid = tf.grid
    assert grid.spec == result.grid.spec
    np.testing.assert_array_equal(grid.known, npz["known"])
    np.testing.assert_allclose(grid.layers["magnitude"][0], npz["magnitude_mean"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(grid.layers["magnitude"][1], npz["magnitude_variance"], rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------ short simulated bags

EXTRINSIC_T = (0.3, -0.1, 0.2)
EXTRINSIC_Q = tuple(float(v) for v in Rotation.from_euler("zyx", [50.0, 10.0, -5.0], degrees=True).as_quat())


@pytest.fixture(scope="module")
def short_bag(tmp_path_factory):
    """20 s of lawnmower at 20 Hz with the magnetometer mounted off-centre and rotated on the body."""
    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import write_demo_bag

    area = (-2.0, -2.0, 2.0, 2.0)
    rec = sim.simulate(sim.WorldConfig(area=area, n_dipoles=5),
                       sim.TrajectoryConfig(patterns=("lawnmower",), area=area, speed=1.0, rate=20.0, duration=20.0,
                                            roll_amplitude_deg=5.0, pitch_amplitude_deg=5.0),
                       sim.SensorConfig(translation=EXTRINSIC_T, rotation=EXTRINSIC_Q), seed=11)
    bag = tmp_path_factory.mktemp("short") / "bag"
    write_demo_bag(bag, rec, ground_truth=False, tf_every=1)
    return bag


def _vector_config(translation=EXTRINSIC_T, rotation=EXTRINSIC_Q):
    return _fast_config(sync={"target": "vector", "sensor_translation": list(translation),
                              "sensor_rotation": list(rotation)},
                        batching={"size": 100}, grid={"resolution": 0.2})


def _max_difference(a, b) -> float:
    assert a.spec == b.spec and list(a.layers) == list(b.layers)
    return max(float(np.max(np.abs(a.layers[n][0] - b.layers[n][0]))) for n in a.layers)


def test_sensor_extrinsic_from_tf_or_from_the_config_gives_one_map(short_bag):
    """Three ways to place the off-centre, rotated magnetometer give the same 3-axis map: /pose plus the config
    extrinsic; the tf chain to the magnetometer frame (its /tf_static holds the extrinsic, so the config's is
    not applied again, with a note); the tf chain to base_link plus the config extrinsic. Ignoring the
    extrinsic gives a different map, so the comparison can fail."""
    from gp_mapping.replay import replay_bag

    topic = replay_bag(short_bag, _vector_config())
    to_sensor = replay_bag(short_bag, _vector_config(), tf_frames=("map", "magnetometer"))
    to_body = replay_bag(short_bag, _vector_config(), tf_frames=("map", "base_link"))
    assert topic.pose_source.topic == "/pose" and to_sensor.pose_source.child == "magnetometer"
    assert any("not applied on top" in note for note in to_sensor.notes) and not to_body.notes
    for other in (to_sensor, to_body):
        assert other.counts["tf_lookups_failed"] == 0
        assert other.counts["mapper"]["accepted"] == topic.counts["mapper"]["accepted"] > 300
        assert _max_difference(topic.grid, other.grid) < 1e-6
    ignored = replay_bag(short_bag, _vector_config(rotation=(0, 0, 0, 1)))
    assert _max_difference(topic.grid, ignored.grid) > 10.0  # uT: a 50 degree turn of the ~50 uT vector


def test_cli_replays_a_bag_and_prints_the_files(short_bag, tmp_path):
    import yaml

    config = tmp_path / "params.yaml"
    config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "model": FAST["model"], "batching": {"size": 100}, "node": {"publish_period": 5.0},
        "sync": {"sensor_translation": list(EXTRINSIC_T), "sensor_rotation": list(EXTRINSIC_Q)}}}}))
    out = tmp_path / "out"
    proc = _cli("replay", str(short_bag), "--config", str(config), "--out", str(out), "--pose-topic", "/odom",
                "--no-progress")
    assert proc.returncode == 0, proc.stderr
    for name in ("map.npz", "map.png", "maps"):
        assert f"wrote {(out / name).resolve()}" in proc.stdout
    assert "/odom (nav_msgs/msg/Odometry)" in proc.stdout and "real time" in proc.stdout
    with np.load(out / "map.npz", allow_pickle=False) as npz:
        assert str(npz["pose_source"]) == "/odom (nav_msgs/msg/Odometry)"
    # An unknown config key is refused by name, without a traceback.
    config.write_text("model:\n  kernal: rbf\n")
    proc = _cli("replay", str(short_bag), "--config", str(config), "--out", str(out), "--no-progress")
    assert proc.returncode != 0 and "model.kernal" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ topic auto-detection


def _write_bag(path: Path, messages: list[tuple[str, str, object]]) -> Path:
    """A ROS 2 MCAP bag of (topic, msgtype, message) written one per millisecond."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    ts = get_typestore(Stores.ROS2_KILTED)
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conns = {}
        for k, (topic, msgtype, msg) in enumerate(messages):
            if topic not in conns:
                conns[topic] = writer.add_connection(topic, msgtype, typestore=ts)
            writer.write(conns[topic], 1_000_000_000 + k * 1_000_000, ts.serialize_cdr(msg, msgtype))
    return path


def _msgs():
    from rosbags.typesys import Stores, get_typestore

    T = get_typestore(Stores.ROS2_KILTED).types
    header = lambda frame: T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=1, nanosec=0),
                                                    frame_id=frame)
    pose = T["geometry_msgs/msg/Pose"](position=T["geometry_msgs/msg/Point"](x=0.0, y=0.0, z=0.0),
                                       orientation=T["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0))
    mag = ("sensor_msgs/msg/MagneticField", T["sensor_msgs/msg/MagneticField"](
        header=header("imu"), magnetic_field=T["geometry_msgs/msg/Vector3"](x=2e-5, y=0.0, z=-4e-5),
        magnetic_field_covariance=np.zeros(9)))
    stamped = ("geometry_msgs/msg/PoseStamped", T["geometry_msgs/msg/PoseStamped"](header=header("map"), pose=pose))
    odom = ("nav_msgs/msg/Odometry", T["nav_msgs/msg/Odometry"](
        header=header("map"), child_frame_id="base_link",
        pose=T["geometry_msgs/msg/PoseWithCovariance"](pose=pose, covariance=np.zeros(36)),
        twist=T["geometry_msgs/msg/TwistWithCovariance"](twist=T["geometry_msgs/msg/Twist"](
            linear=T["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0),
            angular=T["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0)), covariance=np.zeros(36))))

    def tf(parent, child):
        transform = T["geometry_msgs/msg/TransformStamped"](
            header=header(parent), child_frame_id=child, transform=T["geometry_msgs/msg/Transform"](
                translation=T["geometry_msgs/msg/Vector3"](x=1.0, y=0.0, z=0.0),
                rotation=T["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0)))
        return ("tf2_msgs/msg/TFMessage", T["tf2_msgs/msg/TFMessage"](transforms=[transform]))
    return mag, stamped, odom, tf


def test_topic_auto_detection_and_its_errors(tmp_path):
    mag, stamped, odom, tf = _msgs()

    def bag(name, *topics):
        return bag_io.Bag(_write_bag(tmp_path / name, [(t, m[0], m[1]) for t, m in topics]))

    with bag("all", ("/mag", mag), ("/odom", odom), ("/pose", stamped), ("/tf", tf("map", "imu"))) as b:
        assert b.is_ros2 and b.mag_topic() == "/mag" and b.first_frame_id("/mag") == "imu"
        source, buffer = bag_io.choose_pose_source(b, mag_frame="imu")
        assert (source.kind, source.topic, buffer) == ("topic", "/pose", None)  # PoseStamped first
        source, _ = bag_io.choose_pose_source(b, pose_topic="/odom")
        assert source.msgtype == "nav_msgs/msg/Odometry"
        with pytest.raises(bag_io.TopicError, match="has type sensor_msgs/msg/MagneticField"):
            bag_io.choose_pose_source(b, pose_topic="/mag")
        with pytest.raises(bag_io.TopicError, match="not in"):
            bag_io.choose_pose_source(b, pose_topic="/missing")
        with pytest.raises(bag_io.TopicError, match="not both"):
            bag_io.choose_pose_source(b, pose_topic="/pose", tf_frames=("map", "imu"))
    with bag("odom_only", ("/mag", mag), ("/odom", odom), ("/tf", tf("map", "imu"))) as b:
        assert bag_io.choose_pose_source(b, mag_frame="imu")[0].topic == "/odom"
    with bag("tf_only", ("/mag", mag), ("/tf", tf("map", "base_link")), ("/tf_static", tf("base_link", "imu"))) as b:
        source, buffer = bag_io.choose_pose_source(b, mag_frame="imu")
        assert (source.kind, source.parent, source.child) == ("tf", "map", "imu")
        assert buffer.chain_is_static("base_link", "imu") and not buffer.chain_is_static("map", "imu")
        with pytest.raises(bag_io.NoPoseSourceError, match="does not connect 'map' to the magnetometer frame 'lidar'"):
            bag_io.choose_pose_source(b, mag_frame="lidar")
        with pytest.raises(bag_io.TransformError, match="not connected"):
            bag_io.choose_pose_source(b, tf_frames=("odom", "imu"))
    with bag("two_poses", ("/mag", mag), ("/a", stamped), ("/b", stamped)) as b:
        with pytest.raises(bag_io.TopicError, match="several geometry_msgs/msg/PoseStamped topics"):
            bag_io.choose_pose_source(b, mag_frame="imu")
        assert bag_io.choose_pose_source(b, pose_topic="/b")[0].topic == "/b"
    with bag("two_mags", ("/mag1", mag), ("/mag2", mag), ("/pose", stamped)) as b:
        with pytest.raises(bag_io.TopicError, match="choose one with --mag-topic"):
            b.mag_topic()
        assert b.mag_topic("/mag2") == "/mag2"
    with bag("no_mag", ("/pose", stamped)) as b:
        with pytest.raises(bag_io.NoMagneticFieldError, match="no sensor_msgs/msg/MagneticField topic"):
            b.mag_topic()
    proc = _cli("replay", str(tmp_path / "no_mag"), "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode != 0 and "no sensor_msgs/msg/MagneticField topic" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _cli("replay", str(tmp_path / "two_mags"), "--mag-topic", "/mag1", "--pose-topic", "/pose", "--tf", "a", "b")
    assert proc.returncode != 0 and "not allowed with argument" in proc.stderr  # argparse: one pose source


# ------------------------------------------------------------------------------------ map bag format


def test_map_bag_messages_equal_the_nodes_conversions(tmp_path):
    """MapBagWriter (rosbags messages) and the node's conversions (rclpy messages) encode a grid identically."""
    from rclpy.serialization import serialize_message
    from rosbags.highlevel import AnyReader

    from gp_mapping.mapping.grid import GridSpec
    from gp_mapping.mapping.mapper import MapGrid, vector_layers
    from gp_mapping.ros import conversions

    rng = np.random.default_rng(5)
    spec = GridSpec(-1.2, 0.4, 0.25, 7, 5)
    mean = rng.normal(20.0, 5.0, (5, 7, 3))
    var = rng.uniform(0.01, 0.5, (5, 7, 3))
    known = rng.random((5, 7)) > 0.3
    grid = MapGrid(spec=spec, frame_id="map", field_unit="microtesla", layers=vector_layers(mean, var),
                   known=known, stamp=1234.5, height=0.7)
    path = tmp_path / "maps.mcap"
    with bag_io.MapBagWriter(path, "microtesla") as writer:
        writer.write(grid, 1240.0)
    raw: dict[str, bytes] = {}
    with AnyReader([path]) as reader:
        for conn, t, data in reader.messages():
            assert t == 1240 * 10**9
            raw[conn.topic] = bytes(data)

    stamp = conversions.seconds_to_stamp(grid.stamp)
    layers = conversions.encode_layers(grid)
    expected = {"/mapper/scale": conversions.scale_to_msg(layers, "microtesla"),
                "/mapper/cloud": conversions.cloud_msg(grid, stamp, z=grid.height)}
    for layer in layers:
        expected[f"/mapper/mean/{layer.name}"] = conversions.occupancy_msg(grid, layer.mean_data, stamp)
        expected[f"/mapper/variance/{layer.name}"] = conversions.occupancy_msg(grid, layer.variance_data, stamp)
    assert sorted(raw) == sorted(expected)
    from rosbags.typesys import Stores, get_typestore

    ts = get_typestore(Stores.ROS2_KILTED)
    for topic, msg in expected.items():
        msgtype = msg.__class__.__module__.split(".")[0] + "/msg/" + type(msg).__name__
        # Compared field by field (CDR padding bytes are unspecified, so raw bytes may differ there).
        ours = _plain(ts.deserialize_cdr(raw[topic], msgtype))
        nodes = _plain(ts.deserialize_cdr(bytes(serialize_message(msg)), msgtype))
        assert ours == nodes, topic


def test_poses_in_another_frame_are_refused_like_the_node_does(short_bag, tmp_path):
    from gp_mapping.replay import ReplayError, replay_bag

    config = _fast_config(grid={"frame_id": "odom"})
    with pytest.raises(ReplayError, match=r"no magnetometer sample .* poses not in grid.frame_id 400"):
        replay_bag(short_bag, config, out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "maps").exists() and not list((tmp_path / "out").glob(".maps-*"))
    result = replay_bag(short_bag, config)
    assert result.grid is None and result.counts["pose_frame_mismatch"] == 400
    assert any("refused as the node refuses them" in note for note in result.notes)
    # Along tf the map is in the chain's parent frame, and says so.
    tf = replay_bag(short_bag, config, tf_frames=("map", "base_link"))
    assert tf.grid.frame_id == "map" and any("parent frame 'map'" in note for note in tf.notes)
