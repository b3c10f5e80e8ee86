"""Offline replay and bag I/O: real ROS 1 bags, tf chains against homogeneous matrices, the demo bag end to end."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from conftest import REPO_ROOT, shared_data
from gp_mapping import bag_io
from gp_mapping.bag_io import TransformBuffer, TransformSample

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
    buf.add(_sample(3.0, "world", "odom", [0, 0, 0], [0, 0, 0, 1]))
    assert buf.rejected == 3
