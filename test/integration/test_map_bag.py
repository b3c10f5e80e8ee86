"""The replay's map bag is a bag that plays (issue 40, part 3): a rosbag2 folder ``maps/`` with ``metadata.yaml``
and the MCAP inside, laid out as rosbag2 lays a bag out, so ``ros2 bag play maps/`` needs no flags (Humble's
included) and rosbags (and any rosbag2 reader) opens it; the bare ``maps.mcap`` stays for a path ending in
``.mcap`` (``gp-mapping replay --bare-mcap``)."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from gp_mapping.bag import MapBagError, MapBagWriter
from gp_mapping.mapping.grid import GridSpec
from gp_mapping.mapping.mapper import MapGrid

# metadata.yaml as rosbag2 itself writes it for an MCAP bag at version 8 (Iron's `ros2 bag record -s mcap`, one
# topic): the reference for the layout. Humble writes version 5, the same without the last three keys; its reader
# takes offered_qos_profiles as a string holding YAML, as version 8 has it (version 9 made it a list).
ROSBAG2_METADATA = """
rosbag2_bagfile_information:
  version: 8
  storage_identifier: mcap
  duration:
    nanoseconds: 2000000000
  starting_time:
    nanoseconds_since_epoch: 1700000000000000000
  message_count: 4
  topics_with_message_count:
    - topic_metadata:
        name: /chatter
        type: std_msgs/msg/String
        serialization_format: cdr
        offered_qos_profiles: "- history: 3\\n  depth: 0\\n  reliability: 1\\n  durability: 2\\n  deadline:\\n    sec: 9223372036\\n    nsec: 854775807\\n  lifespan:\\n    sec: 9223372036\\n    nsec: 854775807\\n  liveliness: 1\\n  liveliness_lease_duration:\\n    sec: 9223372036\\n    nsec: 854775807\\n  avoid_ros_namespace_conventions: false"
        type_description_hash: RIHS01_df668c740482bbd48fb39d76a70dfd4bd59db1288021743503259e948f6b1a18
      message_count: 4
  compression_format: ""
  compression_mode: ""
  relative_file_paths:
    - rosbag2_0.mcap
  files:
    - path: rosbag2_0.mcap
      starting_time:
        nanoseconds_since_epoch: 1700000000000000000
      duration:
        nanoseconds: 2000000000
      message_count: 4
  custom_data: ~
  ros_distro: iron
"""
HUMBLE_KEYS = {"version", "storage_identifier", "duration", "starting_time", "message_count",
               "topics_with_message_count", "compression_format", "compression_mode", "relative_file_paths", "files"}


def _grid(stamp: float) -> MapGrid:
    rng = np.random.default_rng(int(stamp))
    spec = GridSpec(-1.0, -0.5, 0.25, 6, 4)
    mean, var = rng.normal(48.0, 2.0, (4, 6)), rng.uniform(0.01, 0.5, (4, 6))
    return MapGrid(spec=spec, frame_id="map", field_unit="microtesla", layers={"magnitude": (mean, var)},
                   known=np.ones((4, 6), dtype=bool), stamp=stamp, height=0.0)


def _write(path, times=(100.0, 105.0, 110.0), **kwargs):
    with MapBagWriter(path, "microtesla", **kwargs) as writer:
        for t in times:
            writer.write(_grid(t - 1.0), t)
    return path


def _same_layout(ours, reference, where="rosbag2_bagfile_information"):
    """Every key of ``reference`` is in ``ours`` with a value of the same kind, recursively (lists: their first
    items); custom_data may be a map or empty (~)."""
    if isinstance(reference, dict):
        assert isinstance(ours, dict), where
        for key, value in reference.items():
            assert key in ours, f"{where}.{key} is missing"
            if key == "custom_data":
                assert ours[key] is None or isinstance(ours[key], dict), where
            else:
                _same_layout(ours[key], value, f"{where}.{key}")
    elif isinstance(reference, list):
        assert isinstance(ours, list) and ours, where
        for item in ours:
            _same_layout(item, reference[0], f"{where}[]")
    else:
        assert type(ours) is type(reference), f"{where}: {type(ours).__name__}, rosbag2 writes {type(reference).__name__}"


def test_the_map_bag_is_a_rosbag2_folder_laid_out_as_rosbag2_writes_it(tmp_path):
    bag = _write(tmp_path / "maps")
    assert sorted(p.name for p in bag.iterdir()) == ["maps.mcap", "metadata.yaml"]
    assert not list(tmp_path.glob(".maps-*"))  # the temporary folder is gone
    metadata = yaml.safe_load((bag / "metadata.yaml").read_text())
    reference = yaml.safe_load(ROSBAG2_METADATA)
    assert set(metadata) == {"rosbag2_bagfile_information"}
    info = metadata["rosbag2_bagfile_information"]
    _same_layout(info, reference["rosbag2_bagfile_information"])
    assert set(info) == set(reference["rosbag2_bagfile_information"])  # no key rosbag2 does not write
    assert HUMBLE_KEYS <= set(info)

    # The values: what a player needs to find and time the messages.
    assert info["version"] == 8 and info["storage_identifier"] == "mcap"
    assert info["relative_file_paths"] == ["maps.mcap"] and [f["path"] for f in info["files"]] == ["maps.mcap"]
    assert info["starting_time"] == {"nanoseconds_since_epoch": 100 * 10**9}
    assert info["duration"] == {"nanoseconds": 10 * 10**9}
    topics = {t["topic_metadata"]["name"]: t for t in info["topics_with_message_count"]}
    assert set(topics) == {"/mapper/scale", "/mapper/mean", "/mapper/variance", "/mapper/cloud"}
    assert all(t["message_count"] == 3 for t in topics.values())
    assert info["message_count"] == 12 == info["files"][0]["message_count"]
    assert (info["compression_format"], info["compression_mode"]) == ("", "")  # zstd inside the MCAP's chunks
    assert info["custom_data"]["gp_mapping.field_unit"] == "microtesla"
    for topic in topics.values():
        meta = topic["topic_metadata"]
        assert meta["serialization_format"] == "cdr" and meta["type_description_hash"].startswith("RIHS01_")
        # Humble's reader parses this string as a list of QoS profiles: reliable (1), transient local (1), depth 1.
        (qos,) = yaml.safe_load(meta["offered_qos_profiles"])
        assert (qos["reliability"], qos["durability"], qos["depth"]) == (1, 1, 1)
    assert topics["/mapper/mean"]["topic_metadata"]["type"] == "nav_msgs/msg/OccupancyGrid"


def test_rosbags_reads_the_folder_its_metadata_and_its_mcap(tmp_path):
    from rosbags.highlevel import AnyReader
    from rosbags.rosbag2 import Reader

    from gp_mapping.bag import Bag

    bag = _write(tmp_path / "maps")
    with Reader(bag) as reader:  # rosbags' rosbag2 reader: metadata.yaml, then the MCAP it names
        assert reader.ros_distro == "rosbags"  # read from metadata.yaml, as are the counts and the times
        assert reader.message_count == 12 and reader.start_time == 100 * 10**9
        assert reader.duration == 10 * 10**9 + 1  # rosbags counts the end inclusive
        assert {c.topic: c.msgcount for c in reader.connections}["/mapper/mean"] == 3
        assert {(q.reliability.name, q.durability.name, q.depth)
                for c in reader.connections for q in c.ext.offered_qos_profiles} == {("RELIABLE", "TRANSIENT_LOCAL", 1)}
        stamps = sorted({t for _, t, _ in reader.messages()})
    assert stamps == [100 * 10**9, 105 * 10**9, 110 * 10**9]
    with AnyReader([bag]) as reader:
        grids = [reader.deserialize(data, conn.msgtype) for conn, _, data in reader.messages()
                 if conn.topic == "/mapper/mean"]
    assert [(g.info.width, g.info.height, g.header.stamp.sec) for g in grids] == [(6, 4, 99), (6, 4, 104), (6, 4, 109)]
    with Bag(bag) as ours:  # the replay reads it back too (a map bag replayed is refused for want of a magnetometer)
        assert ours.counts["/mapper/cloud"] == 3


def test_a_path_ending_in_mcap_gives_the_bare_file(tmp_path):
    from rosbags.highlevel import AnyReader

    path = _write(tmp_path / "maps.mcap")
    assert path.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["maps.mcap"]
    with AnyReader([path]) as reader:
        assert sum(1 for _ in reader.messages()) == 12


def test_overwrite_replaces_an_earlier_bag_and_never_another_folder(tmp_path):
    from rosbags.rosbag2 import Reader

    bag = _write(tmp_path / "maps")
    with pytest.raises(MapBagError, match="exists already"):
        MapBagWriter(bag, "microtesla")
    _write(bag, times=(200.0,), overwrite=True)
    with Reader(bag) as reader:
        assert reader.message_count == 4 and reader.start_time == 200 * 10**9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps"]

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(MapBagError, match="not a bag"):
        MapBagWriter(other, "microtesla", overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".maps-*"))

    # A failed write leaves the earlier bag as it was and no temporary folder.
    with pytest.raises(RuntimeError):
        with MapBagWriter(bag, "microtesla", overwrite=True) as writer:
            writer.write(_grid(299.0), 300.0)
            raise RuntimeError("the replay broke")
    with Reader(bag) as reader:
        assert reader.start_time == 200 * 10**9
    assert not list(tmp_path.glob(".maps-*"))


@pytest.fixture(scope="module")
def short_bag(tmp_path_factory):
    """A 12 s simulated drive as a ROS 2 bag."""
    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import write_demo_bag

    area = (-2.0, -2.0, 2.0, 2.0)
    rec = sim.simulate(sim.WorldConfig(area=area, n_dipoles=4),
                       sim.TrajectoryConfig(patterns=("lawnmower",), area=area, speed=1.0, rate=20.0, duration=12.0),
                       sim.SensorConfig(), seed=5)
    bag = tmp_path_factory.mktemp("map_bag") / "drive"
    write_demo_bag(bag, rec, ground_truth=False)
    return bag


def test_replay_writes_the_folder_and_the_bare_file_on_request(short_bag, tmp_path):
    import subprocess
    import sys

    from rosbags.rosbag2 import Reader

    config = tmp_path / "params.yaml"
    config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "model": {"learn_hyperparameters": False, "lengthscale": 1.0, "device": "cpu", "num_inducing": 32},
        "batching": {"size": 100}, "grid": {"resolution": 0.25}, "node": {"publish_period": 4.0}}}}))
    for flags, bag in (([], tmp_path / "out" / "maps"), (["--bare-mcap"], tmp_path / "out" / "maps.mcap")):
        proc = subprocess.run([sys.executable, "-m", "gp_mapping.cli", "replay", str(short_bag), "--config",
                               str(config), "--out", str(tmp_path / "out"), "--no-progress", *flags],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert f"wrote {bag.resolve()}" in proc.stdout
    assert (tmp_path / "out" / "maps" / "metadata.yaml").is_file() and (tmp_path / "out" / "maps.mcap").is_file()
    with Reader(tmp_path / "out" / "maps") as folder, Reader(tmp_path / "out" / "maps.mcap") as bare:
        assert folder.message_count == bare.message_count > 0  # the same snapshots, one layout each
    metadata = yaml.safe_load((tmp_path / "out" / "maps" / "metadata.yaml").read_text())
    assert metadata["rosbag2_bagfile_information"]["relative_file_paths"] == ["maps.mcap"]
