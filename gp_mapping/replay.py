"""Offline replay: map a recorded bag with the same :class:`~gp_mapping.mapping.mapper.Mapper` as the live node.

``gp-mapping replay BAG [--config FILE] [--out DIR] [--mag-topic T] [--pose-topic T | --tf PARENT CHILD]
[--initial-map FILE [--same-session]] [--save-state FILE]``

Several bags make one map in turn: ``--save-state`` after one, ``--initial-map`` for the next; each bag is then a
session whose constant offset to the map before it is learned (docs/calibration.md, "Session offsets").

The bag's magnetometer and pose messages are fed to the Mapper in bag-time order, as fast as the machine goes.
Every ``node.publish_period`` seconds of bag time the current map is recorded, as the node would publish it;
the recordings go to the map bag ``DIR/maps/``, a rosbag2 folder (``metadata.yaml`` and ``maps.mcap``) that
``ros2 bag play DIR/maps`` plays to RViz with no flags (``--bare-mcap``: the one file ``DIR/maps.mcap`` instead, as
before; Humble's ``ros2 bag play`` needs ``-s mcap`` for it). At the end of the bag
the final map is written to ``DIR/map.npz`` (arrays only, no pickles) and drawn in ``DIR/map.png``
(:mod:`gp_mapping.mapping.map_files`).

Pose source. A pose topic (PoseStamped, Odometry or PoseWithCovarianceStamped, its type read from the bag, so
``node.pose_type`` is not needed) gives the body pose, and the config's ``sync.sensor_translation`` /
``sync.sensor_rotation`` place the magnetometer on the body, exactly as in the node; as in the node, a pose
whose ``header.frame_id`` is not ``grid.frame_id`` is refused and counted (``pose_frame_mismatch``). With the tf tree (``--tf PARENT CHILD``, or auto-detected from ``grid.frame_id`` to the
magnetometer's ``header.frame_id``) the chain is looked up at each magnetometer stamp (interpolated, never
extrapolated, both neighbouring transforms within ``sync.max_pose_gap``). When the chain ends at the
magnetometer's own frame it already contains the sensor extrinsic, so the replay uses an identity extrinsic
and says so if the config held another one (applying both would place the sensor twice). When the chain ends
at another frame (``--tf map base_link`` for a bag whose tf lacks the magnetometer), the config's extrinsic
applies as with a pose topic. The map is labelled with the chain's parent frame.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gp_mapping.bag import (Bag, BagError, CorruptBagError, MapBagWriter, PoseSource, TransformBuffer,
                            choose_pose_source, decode_magnetic_field, decode_pose, is_identity_extrinsic)
from gp_mapping.config import ConfigError, MapperConfig, load_config
from gp_mapping.gp import warm_up
from gp_mapping.mapping.map_files import (MAP_BAG_NAME, MCAP_NAME, NPZ_NAME, PNG_NAME, draw_map, unwritable_folder,
                                          write_map_npz)
from gp_mapping.mapping.transforms import TransformError, body_pose_from_tf  # a lookup's (the bag's own: a subclass)



class ReplayError(Exception):
    """The replay cannot run with the given inputs (the message says why)."""


class IncompleteReplayError(ReplayError):
    """The bag broke part way (truncated, corrupt, an undecodable message). What was read before was mapped and
    its outputs written (``result.files``); ``cause`` is the bag error."""

    def __init__(self, message: str, result: "ReplayResult", cause: Exception) -> None:
        super().__init__(message)
        self.result = result
        self.cause = cause


@dataclass
class ReplayResult:
    """What a replay produced: the mapper (with its model and diagnostics), the final grid, counts and timing."""

    bag_path: Path
    mag_topic: str
    pose_source: PoseSource
    mapper: Any
    grid: Any                     # the final MapGrid, or None when no sample was accepted
    counts: dict[str, Any]        # messages read, poses fed, tf lookups refused, updates, snapshots, mapper counters
    processing_seconds: float     # wall time of reading, mapping and recording snapshots (not the PNG)
    bag_duration: float           # seconds of bag time between the first and last message
    files: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str = ""               # why the bag could not be read to its end ("" when it was)

    @property
    def real_time_factor(self) -> float:
        """Bag seconds mapped per wall-clock second (above 1: faster than real time)."""
        return self.bag_duration / self.processing_seconds if self.processing_seconds > 0 else math.inf


def _as_config(config: MapperConfig | str | Path | None) -> MapperConfig:
    if isinstance(config, MapperConfig):
        return config
    return load_config(config)


def _tf_config(config: MapperConfig, source: PoseSource, mag_frame: str, notes: list[str]) -> MapperConfig:
    """The config to map with along a tf chain: the map lives in the chain's parent frame. A chain that ends at
    the magnetometer frame already places the sensor: the pose handed to the mapper is then the body pose that
    the config's extrinsic turns into it (:func:`gp_mapping.mapping.transforms.body_pose_from_tf`), so the
    extrinsic is not applied on top of the chain's."""
    if source.kind != "tf":
        return config
    if source.parent != config.grid.frame_id:
        notes.append(f"the map is in the tf chain's parent frame '{source.parent}', not the config's grid.frame_id "
                     f"'{config.grid.frame_id}'")
        config = dataclasses.replace(config, grid=dataclasses.replace(config.grid, frame_id=source.parent))
    sync = config.sync
    if source.child == mag_frame and not is_identity_extrinsic(sync.sensor_translation, sync.sensor_rotation):
        notes.append(f"the tf chain {source.parent} -> {source.child} already places the magnetometer; the "
                     f"config's sync.sensor_translation {sync.sensor_translation} and sync.sensor_rotation "
                     f"{sync.sensor_rotation} are not applied on top of it")
    return config


def replay_bag(bag_path: str | Path, config: MapperConfig | str | Path | None = None, out_dir: str | Path | None = None,
               mag_topic: str | None = None, pose_topic: str | None = None,
               tf_frames: tuple[str, str] | list[str] | None = None, progress: bool = False,
               bare_mcap: bool = False, initial_map: str | Path | None = None) -> ReplayResult:
    """Map the bag at ``bag_path`` with ``config`` (a MapperConfig, a YAML path, or None for the defaults).

    Messages go to the Mapper in bag-time order; ``Mapper.process`` runs after each one, so batches close in
    data time exactly as in the node. Every ``node.publish_period`` seconds of bag time, if the model changed
    since the last snapshot (the node's rule), the map is predicted and recorded; the final map is recorded
    after the last message and ``Mapper.flush``. With ``out_dir`` the snapshots go to the map bag
    ``out_dir/maps/`` (a rosbag2 folder; ``bare_mcap``: the file ``out_dir/maps.mcap``) and the final map to
    ``out_dir/map.npz`` and ``out_dir/map.png`` (files of those names, and an earlier map bag, are replaced);
    without it no snapshot is predicted, only the final map.

    ``initial_map``: a state file (``--save-state`` of an earlier replay, the node's ``~/save_map``) to map the
    bag on top of; with ``node.new_session_on_load`` (the default) the bag's readings are a new session, whose
    constant offset to that map is learned and removed (another day or sensor, docs/calibration.md). Its
    messages must be newer than the map's last reading (bags replayed in the order they were recorded).

    Raises :class:`gp_mapping.bag.BagError` (bag, topic or pose-source problems), ConfigError, or
    ReplayError when no sample could be matched with a pose. A bag that breaks part way (truncated, corrupt, a
    message that cannot be decoded) ends the reading there: what was read is mapped and written as usual, then
    :class:`IncompleteReplayError` (carrying the result) is raised.
    """
    from tqdm import tqdm

    from gp_mapping.mapping.mapper import Mapper

    config = _as_config(config)
    bag_path = Path(bag_path)
    notes: list[str] = []
    out = Path(out_dir) if out_dir is not None else None
    with Bag(bag_path) as bag:
        mag_topic = bag.mag_topic(mag_topic)
        mag_frame = bag.first_frame_id(mag_topic)
        source, tf_buffer = choose_pose_source(bag, pose_topic=pose_topic, tf_frames=tf_frames,
                                                      map_frame=config.grid.frame_id, mag_frame=mag_frame)
        config = _tf_config(config, source, mag_frame, notes)
        if initial_map is None:
            mapper = Mapper(config)
        else:
            from gp_mapping.mapping.state import MapStateError

            try:
                mapper = Mapper.load(initial_map, config=config, new_session=config.node.new_session_on_load)
            except (MapStateError, OSError) as err:
                raise ReplayError(f"--initial-map {initial_map}: {err}") from err
            if mapper.session:
                notes.append(f"the bag's readings are session {mapper.session} on the map of {initial_map}")
        topics = [mag_topic] + ([source.topic] if source.kind == "topic" else [])
        counts: dict[str, Any] = {"mag_messages": 0, "pose_messages": 0, "pose_frame_mismatch": 0,
                                  "tf_lookups_failed": 0, "updates": 0, "snapshots": 0}
        period, max_gap = float(config.node.publish_period), float(config.sync.max_pose_gap)
        writer = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            writer = MapBagWriter(out / (MCAP_NAME if bare_mcap else MAP_BAG_NAME), config.sync.field_unit,
                                  overwrite=True, mean_range=config.grid.mean_range,
                                  variance_range=config.grid.variance_range)
        warm_up()  # torch's lazy imports (seconds) belong to start-up, as in the node, not to mapping
        started = time.perf_counter()
        broken: list[CorruptBagError] = []
        try:
            next_snapshot, bag_time = None, bag.start_time
            with tqdm(total=sum(bag.counts.get(t, 0) for t in topics), unit="msg", desc=bag_path.name,
                      disable=not progress, file=sys.stderr, mininterval=0.5) as bar:
                for topic, bag_time_ns, msgtype, msg in _until_broken(bag.messages(topics), broken):
                    bar.update()
                    bag_time = bag_time_ns * 1e-9
                    if topic == mag_topic:
                        counts["mag_messages"] += 1
                        sample = decode_magnetic_field(msg, bag_time_ns)
                        if tf_buffer is None or _feed_tf_pose(mapper, tf_buffer, source, sample.stamp, max_gap,
                                                              config, source.child == mag_frame):
                            mapper.add_magnetic_field(sample.stamp, sample.field, frame_id=sample.frame_id,
                                                      receive_time=bag_time)
                        else:
                            counts["tf_lookups_failed"] += 1
                    else:
                        counts["pose_messages"] += 1
                        pose = decode_pose(msg, msgtype, bag_time_ns)
                        # The Mapper's rule, as in the node: a pose in another frame is refused (no tf lookup).
                        mapper.add_pose(pose.stamp, pose.position, pose.orientation, receive_time=bag_time,
                                        frame_id=pose.frame_id)
                    counts["updates"] += len(mapper.process())
                    if writer is None:
                        continue
                    if next_snapshot is None:
                        next_snapshot = bag_time + period
                    elif bag_time >= next_snapshot:
                        next_snapshot += period * (math.floor((bag_time - next_snapshot) / period) + 1)
                        if mapper.map_changed:  # the Mapper's rule, as in the node: only a changed map
                            mapper.mark_published()
                            window = mapper.grid(predict_unknown=False, incremental=True)
                            counts["snapshots"] += _snapshot(writer, window, bag_time)
            counts["updates"] += len(mapper.flush())
            counts["pose_frame_mismatch"] = mapper.pose_frame_mismatch
            # map.npz holds the whole map (the visited area plus margin) when it fits grid.max_cells, else the
            # window around the newest position (grid.extent says which); the map bag gets what the node publishes.
            grid = mapper.export_grid()
            if grid is not None and grid.extent == "window" and mapper.config.grid.mode == "grow":
                notes.append(f"the whole map is larger than grid.max_cells = {mapper.config.grid.max_cells}: map.npz "
                             f"and map.png hold the {mapper.config.grid.window} m window around the last position")
            if writer is not None and grid is not None:
                last = grid if grid.spec == mapper.grid_spec() else mapper.grid(predict_unknown=False, incremental=True)
                counts["snapshots"] += _snapshot(writer, last, bag_time)
            processing = time.perf_counter() - started
            if broken and grid is None:
                raise broken[0]  # nothing was mapped before the bag broke: the bag error is the whole story
            if out is not None and grid is None:
                raise ReplayError(f"no magnetometer sample of {bag_path} could be matched with a pose, so there is "
                                  f"no map to write ({_rejections(mapper.diagnostics(), counts)})")
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        bag_duration = bag.duration
    files: dict[str, Path] = {}
    if tf_buffer is not None and tf_buffer.rejected:
        notes.append(f"{tf_buffer.rejected} tf transforms were unusable (non-finite, non-unit quaternion, a loop, "
                     "the map frame as a child, or a late change of parent) and were left out")
    if tf_buffer is not None and tf_buffer.reparents:
        notes.append(f"{tf_buffer.reparents} times a tf frame changed its parent (the latest parent was used from "
                     "its stamp on, as tf2 does)")
    if mapper.pose_frame_mismatch:
        notes.append(f"{counts['pose_frame_mismatch']} poses on {source.topic} are in frame(s) "
                     f"{', '.join(repr(f) for f in sorted(mapper.refused_pose_frames))}, not grid.frame_id "
                     f"'{config.grid.frame_id}', and were refused as the node refuses them; set grid.frame_id in "
                     "the config to map in their frame")
    counts["mapper"] = mapper.diagnostics()
    result = ReplayResult(bag_path=bag_path, mag_topic=mag_topic, pose_source=source, mapper=mapper, grid=grid,
                          counts=counts, processing_seconds=processing, bag_duration=bag_duration, files=files,
                          notes=notes, error=str(broken[0]) if broken else "")
    if out is not None:
        files["bag"] = writer.close()
        files["npz"] = write_map_npz(out / NPZ_NAME, grid, mapper.trajectory,
                                     {"bag": str(bag_path), "mag_topic": mag_topic, "pose_source": source.describe()})
        files["png"] = draw_map(out / PNG_NAME, grid, mapper.trajectory, bag_path.name)
    if broken:
        raise IncompleteReplayError(f"{broken[0]}; the map of the {counts['mag_messages']} magnetometer messages "
                                    "read before it was written", result, broken[0])
    return result


def _until_broken(messages, broken: list):
    """The messages of ``messages`` until the bag breaks; the CorruptBagError, if any, is appended to ``broken``."""
    try:
        yield from messages
    except CorruptBagError as err:
        broken.append(err)


def _feed_tf_pose(mapper, tf_buffer: TransformBuffer, source: PoseSource, stamp: float, max_gap: float,
                  config: MapperConfig, chain_ends_at_sensor: bool) -> bool:
    """Give the mapper the body pose the tf chain implies at ``stamp`` (the node's rule); False when tf has no
    transform there (tf2 semantics)."""
    extrinsic = (config.sync.sensor_translation, config.sync.sensor_rotation)
    try:
        position, orientation = body_pose_from_tf(tf_buffer, source.parent, source.child, stamp, max_gap,
                                                  extrinsic, frame_is_sensor=chain_ends_at_sensor)
    except TransformError:
        return False
    mapper.add_pose(stamp, position, orientation)
    return True


def _snapshot(writer: MapBagWriter, grid, bag_time: float) -> int:
    if grid is None:
        return 0
    writer.write(grid, bag_time)
    return 1


def _rejections(diagnostics: dict[str, Any], counts: dict[str, Any]) -> str:
    """``accepted 0; rejected: pose_gap 12, ...; dropped: spikes 12`` for messages."""
    parts = [f"{k} {v}" for k, v in diagnostics.get("rejected", {}).items() if v]
    if counts.get("tf_lookups_failed"):
        parts.append(f"no tf transform {counts['tf_lookups_failed']}")
    if counts.get("pose_frame_mismatch"):
        parts.append(f"poses not in grid.frame_id {counts['pose_frame_mismatch']}")
    dropped = [f"{k[len('dropped_'):].replace('_', ' ')} {diagnostics[k]}" for k in
               ("dropped_spikes", "dropped_overflow", "dropped_failed_update") if diagnostics.get(k)]
    return (f"{counts.get('mag_messages', 0)} magnetometer messages, {diagnostics.get('accepted', 0)} accepted; "
            f"rejected: {', '.join(parts) or 'none'}" + (f"; dropped: {', '.join(dropped)}" if dropped else ""))


# --------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gp-mapping replay``."""
    parser.add_argument("bag", type=Path, help="ROS 1 .bag file, ROS 2 bag folder, or .mcap / .db3 file")
    parser.add_argument("--config", type=Path, default=None,
                        help="parameter YAML (config/mapper.yaml form); default: the built-in defaults")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="output folder for map.npz, map.png and the map bag maps/ (default: out)")
    parser.add_argument("--mag-topic", default=None, help="sensor_msgs/MagneticField topic (default: the only one)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pose-topic", default=None,
                        help="PoseStamped / Odometry / PoseWithCovarianceStamped topic (type read from the bag)")
    source.add_argument("--tf", nargs=2, metavar=("PARENT", "CHILD"), default=None,
                        help="take the pose from the bag's /tf and /tf_static, PARENT (map frame) to CHILD (the "
                             "magnetometer frame, or the body frame to apply the config's sensor extrinsic)")
    parser.add_argument("--initial-map", type=Path, default=None, metavar="FILE",
                        help="map the bag on top of this state file (--save-state of an earlier bag, the node's "
                             "~/save_map); the bag's readings are a new session whose constant offset to that map "
                             "is learned and removed (another day or sensor), unless --same-session")
    parser.add_argument("--same-session", action="store_true",
                        help="with --initial-map: the bag continues the loaded map's session (the same sensor and "
                             "day; node.new_session_on_load false)")
    parser.add_argument("--save-state", type=Path, default=None, metavar="FILE",
                        help="also write the mapper's whole state (safetensors) to FILE; the node starts from it "
                             "with node.initial_map, `gp-mapping export FILE` turns it into nav2 map files")
    parser.add_argument("--bare-mcap", action="store_true",
                        help="write the map bag as the one file maps.mcap (rosbag2 metadata inside it) instead of "
                             "the rosbag2 folder maps/ (metadata.yaml + maps.mcap) that `ros2 bag play` takes with no "
                             "flags; Humble's `ros2 bag play` needs `-s mcap` for the bare file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Replay, write the outputs, print where they are; 0 on success, 1 with a message on failure."""
    from gp_mapping.mapping.grid import GridError
    from gp_mapping.mapping.state import MapStateError

    if args.same_session and args.initial_map is None:
        print("gp-mapping replay: error: --same-session goes with --initial-map (the session to continue)",
              file=sys.stderr)
        return 1
    # Before minutes of replay: the outputs must be writable where they go.
    state_folder = args.save_state.parent if args.save_state else None
    for option, folder in (("--out", args.out), ("--save-state", state_folder)):
        problem = unwritable_folder(folder)
        if problem:
            print(f"gp-mapping replay: error: {option}: {problem}", file=sys.stderr)
            return 1
    if args.save_state is not None and args.save_state.is_dir():
        print(f"gp-mapping replay: error: --save-state: {args.save_state} is a folder; name the file to write",
              file=sys.stderr)
        return 1
    try:
        config = load_config(args.config)  # None: the defaults
        if args.same_session:
            config = dataclasses.replace(config, node=dataclasses.replace(config.node, new_session_on_load=False))
        result = replay_bag(args.bag, config, out_dir=args.out, mag_topic=args.mag_topic,
                            pose_topic=args.pose_topic, tf_frames=args.tf, progress=not args.no_progress,
                            bare_mcap=args.bare_mcap, initial_map=args.initial_map)
    except IncompleteReplayError as err:
        print(f"gp-mapping replay: error: {err}", file=sys.stderr)
        try:
            _save_state(err.result, args.save_state)
        except (OSError, MapStateError) as save_err:
            print(f"gp-mapping replay: error: cannot write the state file {args.save_state}: {save_err}",
                  file=sys.stderr)
        for kind in ("npz", "png", "bag", "state"):
            if kind in err.result.files:
                print(f"wrote {err.result.files[kind].resolve()} (partial)")
        return 1
    except (BagError, TransformError, ConfigError, ReplayError, GridError) as err:
        print(f"gp-mapping replay: error: {err}", file=sys.stderr)
        return 1
    for note in result.notes:
        print(f"gp-mapping replay: note: {note}", file=sys.stderr)
    diag = result.counts["mapper"]
    print(f"{result.bag_path}: {result.counts['mag_messages']} magnetometer messages on {result.mag_topic}, pose "
          f"from {result.pose_source.describe()}; {diag['num_seen']} samples mapped in {diag['updates']} updates "
          f"({_rejections(diag, result.counts)})")
    if diag["session"]:
        print(f"session {diag['session']}: constant offset to the loaded map "
              f"{', '.join(f'{v:+.3g}' for v in diag['session_offset'])} {result.mapper.config.sync.field_unit}")
    print(f"{result.bag_duration:.1f} s of bag in {result.processing_seconds:.1f} s "
          f"({result.real_time_factor:.1f}x real time); {result.counts['snapshots']} map snapshots")
    try:
        _save_state(result, args.save_state)
    except (OSError, MapStateError) as err:
        print(f"gp-mapping replay: error: cannot write the state file {args.save_state}: {err}", file=sys.stderr)
        return 1
    for kind in ("npz", "png", "bag", "state"):
        if kind in result.files:
            print(f"wrote {result.files[kind].resolve()}")
    return 0


def _save_state(result: ReplayResult, path: Path | None) -> None:
    """``--save-state``: the mapper's whole state, as the node's ~/save_map writes it, then read back with the
    checks every loader runs (a node's node.initial_map, export, merge): a file that would be refused there is
    reported here (MapStateError) instead of handed out."""
    if path is None:
        return
    from gp_mapping.mapping.mapper import Mapper

    path.parent.mkdir(parents=True, exist_ok=True)
    result.mapper.save(path)
    Mapper.load(path, config=result.mapper.config)
    result.files["state"] = path
