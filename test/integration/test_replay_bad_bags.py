"""`gp-mapping replay` on broken bags: a clear message and a non-zero exit, never a traceback; a bag that breaks
part way still gets the map of what was read before the break written."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.paths import REPO_ROOT
from gp_mapping import bag as bag_io

START = 1_700_000_000.0  # the bag's first stamp (write_demo_bag's default start time)


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    """A 60 s simulated bag (MCAP, and the same as sqlite3), a fast config, and the recording."""
    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import write_demo_bag

    root = tmp_path_factory.mktemp("bad_bags")
    area = (-2.0, -2.0, 2.0, 2.0)
    rec = sim.simulate(sim.WorldConfig(area=area, n_dipoles=3),
                       sim.TrajectoryConfig(patterns=("lawnmower",), area=area, speed=1.0, rate=20.0, duration=60.0),
                       sim.SensorConfig(), seed=2)
    for storage in ("mcap", "sqlite3"):
        write_demo_bag(root / storage, rec, ground_truth=False, storage=storage, odom_every=1000, tf_every=1000)
    config = root / "params.yaml"
    config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "model": {"learn_hyperparameters": False, "num_inducing": 32, "device": "cpu"},
        "batching": {"size": 200}, "node": {"publish_period": 20.0}, "grid": {"resolution": 0.25}}}}))
    return root, config, rec


def _storage(bag: Path) -> Path:
    return next(p for p in bag.iterdir() if p.suffix in (".mcap", ".db3"))


def _broken_copy(root: Path, storage: str, mode: str, at: float = 0.6) -> Path:
    """A copy of the bag with its storage file cut at ``at`` of its length, or 3000 bytes flipped there."""
    bag = root / f"{storage}_{mode}_{at}"
    if bag.exists():
        return bag
    shutil.copytree(root / storage, bag)
    f = _storage(bag)
    data = bytearray(f.read_bytes())
    k = int(len(data) * at)
    if mode == "cut":
        del data[k:]
    else:
        for i in range(k, k + 3000):
            data[i] ^= 0x5A
    f.write_bytes(bytes(data))
    return bag


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gp_mapping.cli", "replay", *args, "--no-progress"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def test_corrupt_bag_writes_the_map_read_so_far_and_exits_non_zero(bags, tmp_path):
    root, config, rec = bags
    bag = _broken_copy(root, "mcap", "flip", 0.35)
    out = tmp_path / "out"
    proc = _cli(str(bag), "--config", str(config), "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "corrupt" in proc.stderr or "cannot decode" in proc.stderr, proc.stderr
    assert "magnetometer messages read before it was written" in proc.stderr
    for name in ("map.npz", "map.png", "maps"):
        assert (out / name).exists() and f"wrote {(out / name).resolve()} (partial)" in proc.stdout
    assert (out / "maps" / "metadata.yaml").is_file()
    with np.load(out / "map.npz", allow_pickle=False) as npz:
        stamp, mean, known = float(npz["stamp"]), npz["magnitude_mean"], npz["known"]
    # The map ends where the bag broke: later than the start, well before the end of the recording.
    assert START + 5.0 < stamp < START + float(rec.t[-1]) - 10.0
    assert known.sum() > 20 and np.all(np.isfinite(mean[known]))


def test_corrupt_bag_through_the_python_api_carries_the_partial_result(bags):
    from gp_mapping.replay import IncompleteReplayError, replay_bag

    root, config, _ = bags
    with pytest.raises(IncompleteReplayError) as err:
        replay_bag(_broken_copy(root, "mcap", "flip", 0.35), config)
    result = err.value.result
    assert isinstance(err.value.cause, bag_io.CorruptBagError) and err.value.cause.messages_read > 100
    assert result.grid is not None and result.error and result.counts["mapper"]["accepted"] > 100


@pytest.mark.parametrize("storage, mode, at, match", [
    ("mcap", "cut", 0.6, "File end magic"),          # a recorder killed mid-write: no MCAP footer
    ("sqlite3", "cut", 0.6, "not a readable"),
    ("sqlite3", "flip", 0.0, "not a readable"),       # a corrupt database header
    ("mcap", "flip", 0.0005, "truncated or corrupt"),  # the first chunk is corrupt
])
def test_truncated_or_corrupt_bag_that_cannot_be_read_at_all(bags, tmp_path, storage, mode, at, match):
    root, config, _ = bags
    bag = _broken_copy(root, storage, mode, at)
    out = tmp_path / "out"
    proc = _cli(str(bag), "--config", str(config), "--out", str(out))
    assert proc.returncode == 1 and match in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and str(bag) in proc.stderr
    assert not (out / "map.npz").exists()  # nothing was read, so nothing was mapped


def test_missing_topics_and_unsupported_types_are_named(bags, tmp_path):
    from gp_mapping.replay import replay_bag

    root, config, _ = bags
    bag = root / "mcap"
    cases = [
        ({"mag_topic": "/no_such_mag"}, ["/no_such_mag", "not in", "/mag (sensor_msgs/msg/MagneticField"]),
        ({"pose_topic": "/no_such_pose"}, ["/no_such_pose", "not in"]),
        ({"pose_topic": "/mag"}, ["pose topic /mag has type sensor_msgs/msg/MagneticField", "PoseStamped"]),
        ({"mag_topic": "/pose"}, ["magnetometer topic /pose has type geometry_msgs/msg/PoseStamped"]),
        ({"tf_frames": ("map", "nowhere")}, ["'nowhere'", "not connected"]),
    ]
    for kwargs, fragments in cases:
        with pytest.raises(bag_io.BagError) as err:
            replay_bag(bag, config, out_dir=tmp_path / "out", **kwargs)
        for fragment in fragments:
            assert fragment in str(err.value), (kwargs, str(err.value))
    # and the command says the same, exits 1, writes nothing
    proc = _cli(str(bag), "--config", str(config), "--out", str(tmp_path / "out"), "--mag-topic", "/no_such_mag")
    assert proc.returncode == 1 and "/no_such_mag" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "map.npz").exists()


def test_bag_without_a_supported_pose_type(tmp_path):
    """A bag whose only pose-like topic has a type the replay does not take (PointStamped) has no pose source."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    ts = get_typestore(Stores.ROS2_KILTED)
    T = ts.types
    header = T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=1, nanosec=0), frame_id="map")
    point = T["geometry_msgs/msg/PointStamped"](header=header, point=T["geometry_msgs/msg/Point"](x=0.0, y=0.0, z=0.0))
    mag = T["sensor_msgs/msg/MagneticField"](header=header, magnetic_field=T["geometry_msgs/msg/Vector3"](
        x=2e-5, y=0.0, z=-4e-5), magnetic_field_covariance=np.zeros(9))
    bag = tmp_path / "bag"
    with Writer(bag, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        c_point = writer.add_connection("/position", "geometry_msgs/msg/PointStamped", typestore=ts)
        c_mag = writer.add_connection("/mag", "sensor_msgs/msg/MagneticField", typestore=ts)
        for k in range(10):
            writer.write(c_point, 10**9 + k, ts.serialize_cdr(point, "geometry_msgs/msg/PointStamped"))
            writer.write(c_mag, 10**9 + k, ts.serialize_cdr(mag, "sensor_msgs/msg/MagneticField"))
    proc = _cli(str(bag), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and "no pose source" in proc.stderr and "PointStamped" in proc.stderr, proc.stderr
    proc = _cli(str(bag), "--out", str(tmp_path / "out"), "--pose-topic", "/position")
    assert proc.returncode == 1 and "has type geometry_msgs/msg/PointStamped" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
