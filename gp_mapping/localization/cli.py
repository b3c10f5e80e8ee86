"""``gp-mapping localize BAG --map STATE --out DIR``: localize a recorded drive on a saved magnetic map.

    gp-mapping localize BAG --map STATE.safetensors --out DIR [--config FILE]
        [--initial-pose X Y YAW | --global] [--ground-truth TOPIC]
        [--mag-topic TOPIC] [--odom-topic TOPIC | --odom-tf ODOM BASE] [--particles N] [--seed N]

The bag (ROS 1 ``.bag``, ROS 2 folder, ``.mcap`` or ``.db3``) needs a ``sensor_msgs/MagneticField`` topic and
odometry: a ``nav_msgs/Odometry`` topic (the only one, or ``--odom-topic``) or the tf chain ``odom -> base_link``
(``--odom-tf``, the default when the bag has no Odometry topic). Messages go to a
:class:`~gp_mapping.localization.Localizer` in bag order; the sensor's place on the robot is the map's
(``sync.sensor_translation`` / ``sync.sensor_rotation`` of the map's config: the robot that made the map).

Start: ``--initial-pose X Y YAW`` (a Gaussian of ``initial_std`` around it), ``--global`` (uniform over the map's
known cells), or, with neither, the first ground-truth pose when ``--ground-truth`` is given, else global.

Outputs, in DIR:

* ``poses.csv``: ``stamp,x,y,yaw,sd_x,sd_y,sd_yaw``, one row per filter update (map frame, metres, radians);
* ``summary.json``: counts, the offset estimate (``bias``, ``bias_std``, in the map's unit), timing; with
  ``--ground-truth`` (a ``geometry_msgs/PoseStamped`` topic in the map's frame; Odometry and
  PoseWithCovarianceStamped are read as well) ``rmse_m``, ``max_error_m``, ``final_error_m``,
  ``dead_reckoning_rmse_m`` (the odometry alone from the same start), ``converged_after_s`` (when the error
  falls below CONVERGED_M for good; null if never);
* ``localization.png``: the map's |B|, the estimate, dead reckoning and the ground truth.

Bad input (a missing or unreadable bag or map, a topic that is absent or of the wrong type, a map of another
frame than the ground truth, a bad config) ends with one line on stderr and exit status 1, as ``replay`` does.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gp_mapping.bag import (ODOMETRY, POSE_TYPES, Bag, BagError, CorruptBagError, TopicError, decode_magnetic_field,
                            decode_pose)
from gp_mapping.bag.decode import TF_TYPES
from gp_mapping.bag.tf import transform_buffer_from_bag
from gp_mapping.gp.errors import ConfigError
from gp_mapping.localization.config import (LocalizationError, LocalizerConfig, MapLoadError, config_from_dict,
                                            load_localizer_config)
from gp_mapping.localization.field_map import MagneticMap
from gp_mapping.localization.localizer import Localizer
from gp_mapping.localization.motion import compose, inverse
from gp_mapping.mapping.frames import yaw_of
from gp_mapping.mapping.transforms import TransformError

POSES_NAME = "poses.csv"
SUMMARY_NAME = "summary.json"
PNG_NAME = "localization.png"
POSES_HEADER = ("stamp", "x", "y", "yaw", "sd_x", "sd_y", "sd_yaw")
#: the error below which a run has converged (and must stay to the end) [m]
CONVERGED_M = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gp-mapping localize``."""
    parser.add_argument("bag", type=Path, help="ROS 1 .bag file, ROS 2 bag folder, or .mcap / .db3 file")
    parser.add_argument("--map", type=Path, required=True, metavar="STATE",
                        help="map state file (gp-mapping replay --save-state, the node's ~/save_map)")
    parser.add_argument("--out", type=Path, default=Path("localization"),
                        help="output folder for poses.csv, summary.json, localization.png (default: localization)")
    parser.add_argument("--config", type=Path, default=None,
                        help="localizer settings YAML (keys of the 'localizer' section; a ROS parameter file "
                             "works); default: the built-in defaults")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--initial-pose", type=float, nargs=3, metavar=("X", "Y", "YAW"), default=None,
                       help="start pose in the map frame [m, m, rad]")
    start.add_argument("--global", dest="global_init", action="store_true",
                       help="global localization: particles uniform over the map's known cells")
    parser.add_argument("--ground-truth", default=None, metavar="TOPIC",
                        help="PoseStamped topic (map frame) to score the estimate against")
    parser.add_argument("--mag-topic", default=None, help="MagneticField topic (default: the only one)")
    odom = parser.add_mutually_exclusive_group()
    odom.add_argument("--odom-topic", default=None, help="nav_msgs/Odometry topic (default: the only one)")
    odom.add_argument("--odom-tf", nargs=2, metavar=("ODOM", "BASE"), default=None,
                      help="take odometry from the bag's tf chain ODOM -> BASE (default odom base_link when the "
                           "bag has no Odometry topic)")
    parser.add_argument("--particles", type=int, default=None, help="number of particles (overrides the config)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (overrides the config)")


class _Odometry:
    """Where odometry comes from: a topic, or a tf chain looked up at each reading's stamp."""

    def __init__(self, bag: Bag, topic: str | None, tf_frames, max_gap: float) -> None:
        self.topic, self.msgtype, self.buffer, self.frames = None, None, None, None
        self.max_gap = max_gap
        if topic:
            self.msgtype = bag.require_type(topic, tuple(POSE_TYPES), "odometry")
            self.topic = topic
            return
        if tf_frames is None:
            candidates = bag.topics_of_type((ODOMETRY,))
            if len(candidates) > 1:
                raise TopicError(f"{bag.path} has several {ODOMETRY} topics ({', '.join(candidates)}); choose one "
                                 "with --odom-topic")
            if candidates:
                self.topic, self.msgtype = candidates[0], ODOMETRY
                return
            tf_frames = ("odom", "base_link")
        tf_topics = bag.topics_of_type(TF_TYPES)
        if not tf_topics:
            raise TopicError(f"{bag.path} has no {ODOMETRY} topic and no tf to take odometry from; "
                             f"{bag.describe_topics()}")
        self.buffer = transform_buffer_from_bag(bag, tf_topics)
        self.frames = tuple(tf_frames)
        try:
            self.buffer.check_connected(*self.frames)
        except TransformError as err:
            raise TopicError(f"{bag.path}: no odometry: {err} (pass --odom-topic or --odom-tf ODOM BASE)") from None

    def describe(self) -> str:
        return f"{self.topic} ({self.msgtype})" if self.topic else f"/tf chain {self.frames[0]} -> {self.frames[1]}"

    def at(self, stamp: float):
        """tf source: (position, orientation) of BASE in ODOM at ``stamp``, or None."""
        try:
            return self.buffer.lookup(self.frames[0], self.frames[1], stamp, self.max_gap)
        except TransformError:
            return None


def _config(args: argparse.Namespace) -> LocalizerConfig:
    cfg = load_localizer_config(args.config) if args.config else LocalizerConfig()
    overrides = {}
    if args.particles is not None:
        overrides["num_particles"] = args.particles
    if args.seed is not None:
        overrides["seed"] = args.seed
    if overrides:
        cfg = config_from_dict({**asdict(cfg), **overrides})
    return cfg


def localize_bag(bag_path: str | Path, map_path: str | Path, config: LocalizerConfig | None = None,
                 initial_pose=None, global_init: bool = False, ground_truth: str | None = None,
                 mag_topic: str | None = None, odom_topic: str | None = None, odom_tf=None) -> dict[str, Any]:
    """Run the localizer over a bag (module docstring); returns the estimates, the odometry, the ground truth,
    the localizer and notes. Raises BagError, TransformError, ConfigError or LocalizationError on bad input."""
    cfg = config if config is not None else LocalizerConfig()
    fmap = MagneticMap.load(map_path, resolution=cfg.grid_resolution)
    notes: list[str] = []
    with Bag(bag_path) as bag:
        mag = bag.mag_topic(mag_topic)
        odom = _Odometry(bag, odom_topic, odom_tf, cfg.max_odometry_gap)
        if ground_truth:
            gt_type = bag.require_type(ground_truth, tuple(POSE_TYPES), "ground-truth")
        loc = Localizer(fmap, cfg, fmap.sensor_translation, fmap.sensor_rotation)
        topics = list(dict.fromkeys([mag] + ([odom.topic] if odom.topic else []) + ([ground_truth] if ground_truth else [])))
        estimates, odometry, truth = [], [], []
        gt_frames: set[str] = set()
        started = initial_pose is not None or global_init
        if initial_pose is not None:
            loc.initialise(initial_pose)
        elif global_init:
            loc.initialise_global()
        elif not ground_truth:
            loc.initialise_global()
            started = True
            notes.append("no --initial-pose, --global or --ground-truth: global localization")
        begin = time.perf_counter()
        error = ""
        try:
            for topic, bag_time, msgtype, msg in bag.messages(topics):
                if topic == ground_truth:
                    p = decode_pose(msg, gt_type, bag_time)
                    gt_frames.add(p.frame_id)
                    if np.all(np.isfinite(p.position)) and np.all(np.isfinite(p.orientation)) and \
                            np.linalg.norm(p.orientation) > 1e-9:
                        truth.append((p.stamp, p.position[0], p.position[1], float(yaw_of(p.orientation))))
                        if not started and gt_frames == {fmap.frame_id}:
                            loc.initialise(truth[-1][1:])
                            started = True
                            notes.append(f"started from the first ground-truth pose ({truth[-1][1]:.2f}, "
                                         f"{truth[-1][2]:.2f}, {truth[-1][3]:.2f})")
                if topic == odom.topic:
                    p = decode_pose(msg, msgtype, bag_time)
                    estimates += loc.add_odometry(p.stamp, p.position, p.orientation)
                    if np.all(np.isfinite(p.position)) and np.all(np.isfinite(p.orientation)):
                        odometry.append((p.stamp, p.position[0], p.position[1], _yaw_or_nan(p.orientation)))
                if topic != mag:
                    continue
                sample = decode_magnetic_field(msg, bag_time)
                if odom.buffer is not None:
                    at = odom.at(sample.stamp)
                    if at is not None:
                        estimates += loc.add_odometry(sample.stamp, at[0], at[1])
                        odometry.append((sample.stamp, at[0][0], at[0][1], float(yaw_of(at[1]))))
                estimates += loc.add_magnetic_field(sample.stamp, sample.field)
        except CorruptBagError as err:
            error = str(err)
        loc.finish()
        seconds = time.perf_counter() - begin
    if ground_truth and gt_frames and gt_frames != {fmap.frame_id}:
        raise LocalizationError(f"the ground truth on {ground_truth} is in frame(s) "
                                f"{', '.join(sorted(repr(f) for f in gt_frames))} but the map {map_path} is in "
                                f"'{fmap.frame_id}'; localization and its score are in the map's frame")
    if ground_truth and not truth:
        notes.append(f"the ground-truth topic {ground_truth} held no usable pose")
    if not started:
        raise LocalizationError(f"no start pose: the ground truth {ground_truth} held no pose and neither "
                                "--initial-pose nor --global was given")
    return {"map": fmap, "localizer": loc, "estimates": estimates, "odometry": odometry, "truth": truth,
            "mag_topic": mag, "odometry_source": odom.describe(), "seconds": seconds, "notes": notes, "error": error}


def _yaw_or_nan(q) -> float:
    try:
        return float(yaw_of(q))
    except ValueError:
        return math.nan


# --------------------------------------------------------------------------------------------- scoring


def score(result: dict[str, Any], initial_pose=None) -> dict[str, Any]:
    """The summary's numbers: counts, bias, timing and, with ground truth, the errors."""
    loc: Localizer = result["localizer"]
    est = result["estimates"]
    diag = loc.diagnostics()
    out: dict[str, Any] = {
        "updates": len(est), "particles": loc.config.num_particles, "mag_topic": result["mag_topic"],
        "odometry": result["odometry_source"], "map_frame": result["map"].frame_id,
        "field_unit": result["map"].field_unit, "target": result["map"].target,
        "bias": diag["bias"], "bias_std": diag["bias_std"], "median_update_ms": diag["median_update_ms"],
        "processing_s": result["seconds"], "readings": diag["readings"], "skipped": diag["skipped"],
        "rejected": diag["rejected"], "odometry_jumps": diag["odometry_jumps"], "converged": diag["converged"],
        "notes": result["notes"], "error": result["error"]}
    truth = np.array(result["truth"], dtype=np.float64).reshape(-1, 4)
    if truth.shape[0] < 2 or not est:
        return out
    order = np.argsort(truth[:, 0])
    truth = truth[order]
    stamps = np.array([e.stamp for e in est])
    poses = np.array([e.pose for e in est])
    inside = (stamps >= truth[0, 0]) & (stamps <= truth[-1, 0])
    if not inside.any():
        out["notes"] = out["notes"] + ["no filter update lies within the ground truth's time span"]
        return out
    tx, ty = np.interp(stamps, truth[:, 0], truth[:, 1]), np.interp(stamps, truth[:, 0], truth[:, 2])
    err = np.hypot(poses[:, 0] - tx, poses[:, 1] - ty)[inside]
    out.update({"rmse_m": float(np.sqrt(np.mean(err ** 2))), "max_error_m": float(err.max()),
                "final_error_m": float(err[-1]), "scored_updates": int(err.size)})
    above = np.flatnonzero(err >= CONVERGED_M)
    s_in = stamps[inside]
    out["converged_after_s"] = (0.0 if above.size == 0 else
                                None if above[-1] == err.size - 1 else float(s_in[above[-1] + 1] - s_in[0]))
    dr = dead_reckoning(result, initial_pose)
    if dr is not None:
        t_dr, p_dr = dr
        keep = (t_dr >= truth[0, 0]) & (t_dr <= truth[-1, 0])
        if keep.any():
            e = np.hypot(p_dr[keep, 0] - np.interp(t_dr[keep], truth[:, 0], truth[:, 1]),
                         p_dr[keep, 1] - np.interp(t_dr[keep], truth[:, 0], truth[:, 2]))
            out.update({"dead_reckoning_rmse_m": float(np.sqrt(np.mean(e ** 2))),
                        "dead_reckoning_final_error_m": float(e[-1])})
    return out


def dead_reckoning(result: dict[str, Any], initial_pose=None) -> tuple[np.ndarray, np.ndarray] | None:
    """The odometry carried into the map frame from the start: ``initial_pose`` at the first filter update, else
    the ground truth there. (stamps, poses (K, 3)) or None without odometry or a start."""
    odo = np.array(result["odometry"], dtype=np.float64).reshape(-1, 4)
    odo = odo[np.all(np.isfinite(odo), axis=1)]
    est = result["estimates"]
    if odo.shape[0] < 2 or not est:
        return None
    t0 = est[0].stamp
    if initial_pose is not None:
        start = np.asarray(initial_pose, dtype=np.float64)
    else:
        truth = np.array(result["truth"], dtype=np.float64).reshape(-1, 4)
        if truth.shape[0] < 2:
            return None
        truth = truth[np.argsort(truth[:, 0])]
        k = int(np.clip(np.searchsorted(truth[:, 0], t0), 0, truth.shape[0] - 1))
        start = truth[k, 1:]
    k = int(np.clip(np.searchsorted(odo[:, 0], t0), 0, odo.shape[0] - 1))
    anchor = compose(start, inverse(odo[k, 1:]))
    return odo[:, 0], compose(anchor, odo[:, 1:])


# --------------------------------------------------------------------------------------------- files


def write_poses(path: Path, estimates) -> Path:
    """poses.csv (header POSES_HEADER), one row per filter update."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(POSES_HEADER)
        for e in estimates:
            sd = e.std
            w.writerow([f"{e.stamp:.9f}", f"{e.pose[0]:.6f}", f"{e.pose[1]:.6f}", f"{e.pose[2]:.6f}",
                        f"{sd[0]:.6f}", f"{sd[1]:.6f}", f"{sd[2]:.6f}"])
    return path


def draw(path: Path, result: dict[str, Any], initial_pose=None, title: str = "") -> Path:
    """The map's |B| (known cells), the estimate, dead reckoning and the ground truth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmap: MagneticMap = result["map"]
    values = np.linalg.norm(fmap.mean, axis=2) if fmap.target == "vector" else fmap.mean[..., 0]
    values = np.where(fmap.known, values, np.nan)
    fig, ax = plt.subplots(figsize=(7.5, 6.5))
    x0, x1, y0, y1 = fmap.extent
    im = ax.imshow(values, origin="lower", extent=(x0, x1, y0, y1), cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, shrink=0.8, label=f"|B| mean [{fmap.field_unit}]")
    truth = np.array(result["truth"], dtype=np.float64).reshape(-1, 4)
    if truth.size:
        truth = truth[np.argsort(truth[:, 0])]
        ax.plot(truth[:, 1], truth[:, 2], color="black", lw=1.2, label="ground truth")
    dr = dead_reckoning(result, initial_pose)
    if dr is not None:
        ax.plot(dr[1][:, 0], dr[1][:, 1], color="tab:red", lw=1.0, ls="--", label="dead reckoning")
    if result["estimates"]:
        p = np.array([e.pose for e in result["estimates"]])
        ax.plot(p[:, 0], p[:, 1], color="white", lw=2.2)
        ax.plot(p[:, 0], p[:, 1], color="tab:orange", lw=1.2, label="estimate")
        ax.plot(p[0, 0], p[0, 1], "o", color="tab:orange", mec="black", label="first update")
    ax.set_xlabel(f"x [m] ({fmap.frame_id})")
    ax.set_ylabel("y [m]")
    ax.set_aspect("equal")
    ax.set_facecolor("0.85")
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    """Localize, write the outputs, print where they are; 0 on success, 1 with a message on failure."""
    from gp_mapping.mapping.grid import GridError

    from gp_mapping.mapping.map_files import unwritable_folder

    name = "gp-mapping localize"
    problem = unwritable_folder(Path(args.out))  # before the work: a typo costs no filtering
    if problem:
        print(f"{name}: error: --out: {problem}", file=sys.stderr)
        return 1
    try:
        cfg = _config(args)
        result = localize_bag(args.bag, args.map, cfg, initial_pose=args.initial_pose, global_init=args.global_init,
                              ground_truth=args.ground_truth, mag_topic=args.mag_topic, odom_topic=args.odom_topic,
                              odom_tf=args.odom_tf)
        if not result["estimates"]:
            diag = result["localizer"].diagnostics()
            why = ", ".join(f"{k} {v}" for k, v in diag["rejected"].items() if v) or "none refused"
            raise LocalizationError(f"no filter update: {diag['readings']} magnetometer readings, none with odometry "
                                    f"around it and a start pose ({why}); odometry from {result['odometry_source']}")
        summary = score(result, args.initial_pose)
        summary.update({"bag": str(args.bag), "map": str(args.map), "config": asdict(cfg)})
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = [write_poses(out / POSES_NAME, result["estimates"])]
        (out / SUMMARY_NAME).write_text(json.dumps(_plain(summary), indent=1, allow_nan=False) + "\n")
        files.append(out / SUMMARY_NAME)
        files.append(draw(out / PNG_NAME, result, args.initial_pose, title=f"{Path(args.bag).name} on "
                          f"{Path(args.map).name}"))
    except (BagError, TransformError, ConfigError, LocalizationError, MapLoadError, GridError, OSError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 1
    for note in summary["notes"]:
        print(f"{name}: note: {note}", file=sys.stderr)
    line = f"{summary['updates']} filter updates from {summary['readings']} readings, odometry from {summary['odometry']}"
    if "rmse_m" in summary:
        line += (f"; error against {args.ground_truth}: RMSE {summary['rmse_m']:.3f} m, final "
                 f"{summary['final_error_m']:.3f} m")
        if "dead_reckoning_rmse_m" in summary:
            line += f" (dead reckoning {summary['dead_reckoning_rmse_m']:.3f} m)"
    print(line)
    for path in files:
        print(f"wrote {path.resolve()}")
    if result["error"]:
        print(f"{name}: error: the bag broke part way: {result['error']}; the outputs cover what was read before",
              file=sys.stderr)
        return 1
    return 0


def _plain(value):
    """JSON-safe: numpy to Python, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


__all__ = ["CONVERGED_M", "POSES_HEADER", "add_arguments", "localize_bag", "run", "score"]
