"""``gp-mapping calibrate BAG [--topic T] [--out calib.yaml]``: the robot's hard- and soft-iron calibration from a
calibration drive (docs/magnetometer.md).

The bag's magnetometer readings, and where the bag has one its pose (a pose topic, or /tf), go to
:func:`gp_mapping.mapping.magnetometer.fit_iron_calibration`; the result is printed (offset, matrix, residual,
what the turns could determine) and written as a parameter file with ``sync.hard_iron`` and ``sync.soft_iron``,
which the node (``--params-file``, after the main one) and the replay (``--config``) accept. With ``--config FILE``
the written file is that whole configuration with the two keys replaced, so the replay needs nothing else. The
sensor's extrinsic (``sync.sensor_translation`` / ``sync.sensor_rotation``) and the field unit come from that
configuration (the defaults without one). A refusal (too few readings, not turned enough, turns only while
driving on) ends with its reason and exit status 1, and no file is written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gp-mapping calibrate``."""
    parser.add_argument("bag", type=Path, help="ROS 1 .bag file, ROS 2 bag folder, or .mcap / .db3 file of a "
                        "calibration drive (the robot turning in place, a hand-held figure eight)")
    parser.add_argument("--topic", default=None, help="sensor_msgs/MagneticField topic (default: the only one)")
    parser.add_argument("--out", type=Path, default=Path("calib.yaml"),
                        help="parameter file to write (default: calib.yaml)")
    parser.add_argument("--config", type=Path, default=None, help="parameter YAML (config/mapper.yaml form): its "
                        "sensor extrinsic, field unit and max_pose_gap are used, and --out holds all of it with the "
                        "calibration (default: the built-in defaults, and --out holds the two keys only)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pose-topic", default=None, help="PoseStamped / Odometry / PoseWithCovarianceStamped "
                        "topic (default: as the replay chooses)")
    source.add_argument("--tf", nargs=2, metavar=("PARENT", "CHILD"), default=None,
                        help="take the pose from the bag's /tf, PARENT (map frame) to CHILD (the magnetometer frame, "
                             "or the body frame with the config's extrinsic)")
    source.add_argument("--no-pose", action="store_true", help="ignore any pose: fit an ellipsoid to the readings "
                        "alone (biased where the field's strength changes from place to place)")
    parser.add_argument("--mode", choices=("auto", "full", "planar"), default="auto",
                        help="what to fit: auto (everything the turns determine), full (all of it), planar (turns "
                             "about one axis: its offset and gain kept) (default auto)")
    parser.add_argument("--degree", type=int, default=None, help="the world field's polynomial degree (default: "
                        "chosen by cross-validation)")


def read_calibration_drive(bag_path: Path, topic: str | None = None, config=None, pose_topic: str | None = None,
                           tf_frames=None, use_pose: bool = True) -> dict:
    """The bag's readings in the config's field unit (sensor frame) and, where it has a pose, the sensor's
    orientation (sensor to map, [x, y, z, w]) and position at each reading: ``{"readings", "orientations",
    "positions", "topic", "pose_source", "without_pose"}`` (the last: readings without a pose within
    ``sync.max_pose_gap``, left out)."""
    from gp_mapping.bag import Bag, NoPoseSourceError, choose_pose_source, decode_magnetic_field, decode_pose
    from gp_mapping.config import MapperConfig
    from gp_mapping.mapping.frames import normalize_quaternion, quaternion_multiply, rotate_vectors
    from gp_mapping.mapping.measurements import field_scale
    from gp_mapping.mapping.poses import interpolate_poses
    from gp_mapping.mapping.transforms import TransformError, body_pose_from_tf

    config = config or MapperConfig()
    sync = config.sync
    scale = field_scale(sync.field_unit)
    with Bag(bag_path) as bag:
        topic = bag.mag_topic(topic)
        mag_frame = bag.first_frame_id(topic)
        source, buffer = None, None
        if use_pose:
            try:
                source, buffer = choose_pose_source(bag, pose_topic=pose_topic, tf_frames=tf_frames,
                                                    map_frame=config.grid.frame_id, mag_frame=mag_frame)
            except NoPoseSourceError:
                if pose_topic or tf_frames:
                    raise
        topics = [topic] + ([source.topic] if source is not None and source.kind == "topic" else [])
        stamps, fields, poses = [], [], []
        for name, bag_time, msgtype, msg in bag.messages(topics):
            if name == topic:
                sample = decode_magnetic_field(msg, bag_time)
                stamps.append(sample.stamp)
                fields.append(sample.field)
            else:
                p = decode_pose(msg, msgtype, bag_time)
                poses.append((p.stamp, p.position, p.orientation))
    t = np.asarray(stamps, dtype=np.float64)
    readings = np.asarray(fields, dtype=np.float64).reshape(-1, 3) * scale
    out = {"readings": readings, "orientations": None, "positions": None, "topic": topic,
           "pose_source": source.describe() if source is not None else "none", "without_pose": 0}
    if source is None:
        return out
    t_ext = np.asarray(sync.sensor_translation, dtype=np.float64)
    q_ext = normalize_quaternion(sync.sensor_rotation)
    n = t.shape[0]
    body_p, body_q, ok = np.zeros((n, 3)), np.tile([0.0, 0.0, 0.0, 1.0], (n, 1)), np.zeros(n, dtype=bool)
    if source.kind == "topic":
        good = [(s, p, q) for s, p, q in poses if np.isfinite(s) and np.all(np.isfinite(p)) and np.all(np.isfinite(q))
                and np.linalg.norm(q) > 1e-6]
        if good:
            order = np.argsort([s for s, _, _ in good], kind="stable")
            ps = np.array([good[i][0] for i in order])
            keep = np.concatenate([[True], np.diff(ps) > 0])
            pp = np.array([good[i][1] for i in order])[keep]
            pq = np.array([normalize_quaternion(good[i][2]) for i in order])[keep]
            finite = np.isfinite(t)
            pos, quat, _, within, _, _ = interpolate_poses(ps[keep], pp, pq, np.where(finite, t, 0.0),
                                                           float(sync.max_pose_gap))
            ok = within & finite & (t <= ps[keep][-1])
            body_p[ok], body_q[ok] = pos[ok], quat[ok]
    else:
        for k, stamp in enumerate(t):
            try:
                position, orientation = body_pose_from_tf(buffer, source.parent, source.child, float(stamp),
                                                          float(sync.max_pose_gap), (t_ext, q_ext),
                                                          frame_is_sensor=source.child == mag_frame)
            except (TransformError, ValueError):
                continue
            body_p[k], body_q[k], ok[k] = position, orientation, True
    q_sensor = quaternion_multiply(body_q, np.tile(q_ext, (n, 1))) if n else body_q
    p_sensor = body_p + rotate_vectors(body_q, t_ext) if n else body_p
    out["orientations"] = np.where(ok[:, None], q_sensor, np.nan)
    out["positions"] = np.where(ok[:, None], p_sensor, np.nan)
    out["without_pose"] = int(np.count_nonzero(~ok))
    return out


def parameter_document(calibration, config=None, command: str = "") -> str:
    """The parameter file: ``/**: ros__parameters:`` with ``sync.hard_iron`` and ``sync.soft_iron`` (and, with
    ``config``, every other key of it)."""
    from gp_mapping.config import to_dict

    values = calibration.parameters()
    if config is not None:
        params = to_dict(config)
        params["sync"].update(values)
    else:
        params = {"sync": values}
    header = "\n".join(f"# {line}" for line in (
        [f"written by: {command}"] if command else []) + [
        "Magnetometer calibration (docs/magnetometer.md): corrected = soft_iron @ (raw - hard_iron), soft_iron",
        "row-major, hard_iron in sync.field_unit. Node: --params-file config/mapper.yaml --params-file THIS;",
        "replay: --config THIS (with --config given to gp-mapping calibrate it holds the whole configuration)."])
    return header + "\n" + yaml.safe_dump({"/**": {"ros__parameters": params}}, sort_keys=False, default_flow_style=None)


def run(args: argparse.Namespace) -> int:
    """Fit, report, write; 0 on success, 1 with the reason on a refusal or a bad input."""
    from gp_mapping.config import ConfigError, load_config
    from gp_mapping.mapping.magnetometer import CalibrationError, fit_iron_calibration
    from gp_mapping.mapping.measurements import UNIT_SYMBOL

    from gp_mapping.mapping.map_files import unwritable_folder

    prog = "gp-mapping calibrate"
    problem = unwritable_folder(args.out.parent)
    if problem:  # before the bag is read
        print(f"{prog}: error: --out: {problem}", file=sys.stderr)
        return 1
    try:
        config = load_config(args.config) if args.config is not None else None
    except ConfigError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    if args.degree is not None and not 1 <= args.degree <= 12:
        print(f"{prog}: error: --degree must be between 1 and 12, got {args.degree}", file=sys.stderr)
        return 1
    drive = read_calibration_drive(args.bag, args.topic, config, args.pose_topic, args.tf, not args.no_pose)
    unit = UNIT_SYMBOL[(config.sync if config else load_config(None).sync).field_unit]
    print(f"{args.bag}: {len(drive['readings'])} readings on {drive['topic']}, pose from {drive['pose_source']}"
          + (f" ({drive['without_pose']} readings without a pose within sync.max_pose_gap)"
             if drive["without_pose"] else ""))
    try:
        result = fit_iron_calibration(drive["readings"], drive["orientations"], drive["positions"], mode=args.mode,
                                      degree=args.degree)
    except CalibrationError as err:
        print(f"{prog}: refused: {err}", file=sys.stderr)
        return 1
    print(result.report(unit))
    command = " ".join(["gp-mapping", "calibrate", *map(str, sys.argv[2:])]) if sys.argv[1:2] == ["calibrate"] \
        else "gp-mapping calibrate"
    args.out.write_text(parameter_document(result, config, command))
    print(f"wrote {args.out}")
    return 0
