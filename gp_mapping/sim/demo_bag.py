"""`gp-mapping demo-bag OUT`: a simulated ROS 2 bag (MCAP) of a robot mapping a magnetic field, with ground truth.

The bag holds what a real robot would record (topic names are the defaults in :data:`TOPICS`):

- ``/mag``: ``sensor_msgs/msg/MagneticField`` in tesla, frame ``magnetometer``, covariance diag(noise_std^2);
  dropped samples are absent, spikes are present (as a real faulty sensor would send them).
- ``/pose``: ``geometry_msgs/msg/PoseStamped``, frame ``map``, the pose of ``base_link``.
- ``/odom``: ``nav_msgs/msg/Odometry``, frame ``map``, child ``base_link``, twist in ``base_link``.
- ``/tf``: ``tf2_msgs/msg/TFMessage`` with ``map -> base_link``; ``/tf_static``: one message with
  ``base_link -> magnetometer`` (the sensor extrinsic), offered as reliable + transient-local (latched).

A second drive in the same world for localization (``--drive-seed N``: the world of ``--seed``, the path and sensor
of N) may carry drifting odometry (``--odometry-drift SCALE DEG_PER_S``): ``/odom`` then holds the pose a wheel
odometry would integrate, in frame ``odom`` (starting at its origin), with that scale error, that heading drift
and a little noise; ``/pose`` and ``/tf`` keep the true pose in ``map`` (the ground truth to score against).

Beside the storage file, inside the bag directory, ``ground_truth.npz`` (plain arrays, no pickles) holds the
true field on a grid, the truth at every sample and the world's parameters; :func:`load_ground_truth` reads
it. rosbags' readers (and rosbag2) open only the files that ``metadata.yaml`` lists, so the extra file is
harmless. Message stamps equal the bag's log times.
"""
from __future__ import annotations

import argparse
import math
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.spatial.transform import Rotation

from gp_mapping.bag.ros2 import latched_qos, ros2_typestore
from gp_mapping.sim.simulation import (
    PATTERNS,
    SensorConfig,
    SimRecording,
    SimulationError,
    TrajectoryConfig,
    World,
    WorldConfig,
    simulate,
    truth_grid,
)

TOPICS = {"mag": "/mag", "pose": "/pose", "odom": "/odom", "tf": "/tf", "tf_static": "/tf_static"}
MSGTYPES = {
    "mag": "sensor_msgs/msg/MagneticField",
    "pose": "geometry_msgs/msg/PoseStamped",
    "odom": "nav_msgs/msg/Odometry",
    "tf": "tf2_msgs/msg/TFMessage",
    "tf_static": "tf2_msgs/msg/TFMessage",
}
MAP_FRAME, BASE_FRAME, SENSOR_FRAME = "map", "base_link", "magnetometer"
ODOM_FRAME = "odom"  # the frame of drifting odometry (--odometry-drift)
ODOMETRY_TRANS_NOISE = 0.01  # drifting odometry: white noise on every increment, this fraction of its length
ODOMETRY_YAW_NOISE = 0.0005  # and this much heading [rad] per increment
GROUND_TRUTH_FILE = "ground_truth.npz"
GROUND_TRUTH_VERSION = 1
DEFAULT_START_TIME = 1_700_000_000.0  # seconds since the epoch of the first sample (November 2023)
POSE_VARIANCE = 1e-6  # the simulated pose is exact; a motion-capture-like 1 mm / 1 mrad std is declared
TWIST_VARIANCE = 1e-4
UT = 1e6  # tesla -> microtesla


class DemoBagError(ValueError):
    """A demo-bag argument is invalid (existing output, rates that do not divide, ...)."""


def body_twist(t: np.ndarray, position: np.ndarray, orientation_xyzw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Linear (N, 3) [m/s] and angular (N, 3) [rad/s] velocity of the body expressed in the body frame, by
    central differences of the pose (one-sided at the ends)."""
    n = len(t)
    if n < 2:
        return np.zeros((n, 3)), np.zeros((n, 3))
    rot = Rotation.from_quat(orientation_xyzw)
    v_map = np.gradient(position, t, axis=0)
    lo = np.concatenate([[0], np.arange(n - 2), [n - 2]])
    hi = np.concatenate([[1], np.arange(2, n), [n - 1]])
    omega = (rot[lo].inv() * rot[hi]).as_rotvec() / (t[hi] - t[lo])[:, None]
    return rot.apply(v_map, inverse=True), omega


def drifting_odometry(t: np.ndarray, position: np.ndarray, orientation_xyzw: np.ndarray, scale_error: float,
                      drift_deg_s: float, seed: int = 0, trans_noise: float = ODOMETRY_TRANS_NOISE,
                      yaw_noise: float = ODOMETRY_YAW_NOISE) -> tuple[np.ndarray, np.ndarray]:
    """What wheel odometry integrates along a true planar pose track: each increment (body frame, between two
    instants) with its length scaled by ``1 + scale_error``, its heading change plus ``drift_deg_s`` deg/s, and
    white noise (``trans_noise`` of its length, ``yaw_noise`` rad), summed from the origin of an odom frame.
    Returns positions (N, 3) (z the true z) and orientations (N, 4) [x, y, z, w] (the true roll and pitch, the
    odometry's heading)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x0D0]))
    rot = Rotation.from_quat(orientation_xyzw)
    roll, pitch, yaw = rot.as_euler("xyz").T
    c, s = np.cos(yaw[:-1]), np.sin(yaw[:-1])
    dx, dy = np.diff(position[:, 0]), np.diff(position[:, 1])
    fwd, left = c * dx + s * dy, -s * dx + c * dy  # the true increments in the body frame
    dyaw = np.angle(np.exp(1j * np.diff(yaw)))
    step = np.hypot(fwd, left)
    n = len(step)
    fwd = fwd * (1.0 + scale_error) + rng.standard_normal(n) * trans_noise * step
    left = left * (1.0 + scale_error) + rng.standard_normal(n) * trans_noise * step
    dyaw = dyaw + math.radians(drift_deg_s) * np.diff(t) + rng.standard_normal(n) * yaw_noise
    heading = np.concatenate([[0.0], np.cumsum(dyaw)])
    ch, sh = np.cos(heading[:-1]), np.sin(heading[:-1])
    xy = np.vstack([[0.0, 0.0], np.cumsum(np.column_stack([ch * fwd - sh * left, sh * fwd + ch * left]), axis=0)])
    odom_q = Rotation.from_euler("xyz", np.column_stack([roll, pitch, heading])).as_quat()
    return np.column_stack([xy, position[:, 2]]), odom_q


def _stamps_ns(t: np.ndarray, start_time: float) -> np.ndarray:
    return int(round(start_time * 1e9)) + np.round(np.asarray(t) * 1e9).astype(np.int64)


@dataclass
class BagSummary:
    """What :func:`write_demo_bag` wrote."""

    path: Path
    counts: dict[str, int]  # topic -> messages
    size_bytes: int  # the whole directory, ground truth included
    ground_truth: Path | None


def write_demo_bag(out_dir: str | Path, recording: SimRecording, *, start_time: float = DEFAULT_START_TIME,
                   pose_every: int = 1, odom_every: int = 2, tf_every: int = 1, storage: str = "mcap",
                   compress: bool = True, grid_resolution: float = 0.1, grid_area: Sequence[float] | None = None,
                   ground_truth: bool = True, custom_data: Mapping[str, str] | None = None,
                   odometry: tuple[np.ndarray, np.ndarray] | None = None) -> BagSummary:
    """Write ``recording`` as a ROS 2 bag directory ``out_dir`` (which must not exist).

    /mag carries every delivered sample; /pose, /odom and /tf every ``pose_every``-th, ``odom_every``-th and
    ``tf_every``-th instant of the timeline. ``storage`` is ``mcap`` (zstd chunk compression when
    ``compress``) or ``sqlite3`` (uncompressed). The ground truth grid covers ``grid_area`` (default: the
    trajectory's area) every ``grid_resolution`` metres at the sensor's mean height. ``odometry`` (positions
    (N, 3), orientations (N, 4), e.g. :func:`drifting_odometry`): /odom carries these poses in frame ``odom``
    instead of the true pose in ``map``.
    """
    from rosbags.rosbag2 import CompressionFormat, CompressionMode, StoragePlugin, Writer

    out = Path(out_dir)
    if out.exists():
        raise DemoBagError(f"output {out} exists already; choose a new directory (bags are never overwritten)")
    for name, every in (("pose_every", pose_every), ("odom_every", odom_every), ("tf_every", tf_every)):
        if not isinstance(every, (int, np.integer)) or every < 1:
            raise DemoBagError(f"{name} must be an integer >= 1, got {every!r}")
    if storage not in ("mcap", "sqlite3"):
        raise DemoBagError(f"storage must be 'mcap' or 'sqlite3', got {storage!r}")
    if not (math.isfinite(start_time) and 0.0 <= start_time < 2**63 / 1e9 - 1e6):
        raise DemoBagError(f"start_time must be seconds since the epoch >= 0, got {start_time!r}")
    area = tuple(recording.trajectory.area) if grid_area is None else tuple(grid_area)
    height = float(np.mean(recording.sensor_position[:, 2]))
    xs, ys, grid = truth_grid(recording.world, area, grid_resolution, height) if ground_truth else (None, None, None)

    ts = ros2_typestore()
    T = ts.types
    stamps = _stamps_ns(recording.t, start_time)

    def header(ns: int, frame: str):
        return T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=int(ns // 10**9),
                                                                                nanosec=int(ns % 10**9)),
                                        frame_id=frame)

    def vec3(v) -> Any:
        return T["geometry_msgs/msg/Vector3"](x=float(v[0]), y=float(v[1]), z=float(v[2]))

    def quat(q) -> Any:
        return T["geometry_msgs/msg/Quaternion"](x=float(q[0]), y=float(q[1]), z=float(q[2]), w=float(q[3]))

    def pose(p, q) -> Any:
        return T["geometry_msgs/msg/Pose"](position=T["geometry_msgs/msg/Point"](x=float(p[0]), y=float(p[1]),
                                                                                   z=float(p[2])),
                                           orientation=quat(q))

    def transform(ns: int, parent: str, child: str, p, q) -> Any:
        return T["geometry_msgs/msg/TransformStamped"](
            header=header(ns, parent), child_frame_id=child,
            transform=T["geometry_msgs/msg/Transform"](translation=vec3(p), rotation=quat(q)))

    messages: list[tuple[int, int, str, Any]] = []  # (log time, order, key, message): sorted before writing
    static = transform(int(stamps[0]), BASE_FRAME, SENSOR_FRAME, recording.sensor.translation,
                       recording.sensor.rotation)
    messages.append((int(stamps[0]), 0, "tf_static", T["tf2_msgs/msg/TFMessage"](transforms=[static])))
    cov = recording.sensor.covariance.ravel()
    for k in np.flatnonzero(recording.received):
        ns = int(stamps[k])
        messages.append((ns, 1, "mag", T["sensor_msgs/msg/MagneticField"](
            header=header(ns, SENSOR_FRAME), magnetic_field=vec3(recording.field_sensor_tesla[k]),
            magnetic_field_covariance=cov.copy())))
    pos, q = recording.position, recording.orientation_xyzw
    for k in range(0, len(recording), pose_every):
        ns = int(stamps[k])
        messages.append((ns, 2, "pose", T["geometry_msgs/msg/PoseStamped"](header=header(ns, MAP_FRAME),
                                                                          pose=pose(pos[k], q[k]))))
    for k in range(0, len(recording), tf_every):
        ns = int(stamps[k])
        messages.append((ns, 3, "tf", T["tf2_msgs/msg/TFMessage"](
            transforms=[transform(ns, MAP_FRAME, BASE_FRAME, pos[k], q[k])])))
    lin, ang = body_twist(recording.t, pos, q)
    pose_cov = np.diag([POSE_VARIANCE] * 6).ravel()
    twist_cov = np.diag([TWIST_VARIANCE] * 6).ravel()
    odom_pos, odom_q, odom_frame = (pos, q, MAP_FRAME) if odometry is None else (*odometry, ODOM_FRAME)
    for k in range(0, len(recording), odom_every):
        ns = int(stamps[k])
        messages.append((ns, 4, "odom", T["nav_msgs/msg/Odometry"](
            header=header(ns, odom_frame), child_frame_id=BASE_FRAME,
            pose=T["geometry_msgs/msg/PoseWithCovariance"](pose=pose(odom_pos[k], odom_q[k]),
                                                           covariance=pose_cov.copy()),
            twist=T["geometry_msgs/msg/TwistWithCovariance"](
                twist=T["geometry_msgs/msg/Twist"](linear=vec3(lin[k]), angular=vec3(ang[k])),
                covariance=twist_cov.copy()))))
    messages.sort(key=lambda m: (m[0], m[1]))

    writer = Writer(out, version=Writer.VERSION_LATEST,
                    storage_plugin=StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3)
    if storage == "mcap" and compress:
        writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
    data = {"gp_mapping.generator": "gp_mapping.sim.demo_bag", "gp_mapping.seed": str(recording.seed),
            "gp_mapping.ground_truth": GROUND_TRUTH_FILE if ground_truth else ""}
    for key, value in (custom_data or {}).items():
        data[str(key)] = str(value)
    counts = {TOPICS[key]: 0 for key in TOPICS}
    try:
        writer.open()
        conns = {key: writer.add_connection(TOPICS[key], MSGTYPES[key], typestore=ts,
                                            offered_qos_profiles=latched_qos() if key == "tf_static" else ())
                 for key in TOPICS}
        for key, value in data.items():
            writer.set_custom_data(key, value)
        for ns, _, key, msg in messages:
            writer.write(conns[key], ns, ts.serialize_cdr(msg, MSGTYPES[key]))
            counts[TOPICS[key]] += 1
        writer.close()
        gt_path = None
        if ground_truth:
            gt_path = out / GROUND_TRUTH_FILE
            _save_ground_truth(gt_path, recording, stamps, xs, ys, grid, height, odometry)
    except BaseException:
        if writer.storage is not None:
            writer.abort()
        shutil.rmtree(out, ignore_errors=True)  # the directory is ours: Writer refused an existing one
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return BagSummary(path=out, counts=counts, size_bytes=size, ground_truth=gt_path)


def _save_ground_truth(path: Path, rec: SimRecording, stamps: np.ndarray, xs: np.ndarray, ys: np.ndarray,
                       grid: np.ndarray, height: float, odometry: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    grid_ut = grid * UT
    b_true_ut = rec.field_map_tesla_true * UT
    extra = {} if odometry is None else {"odometry_position": odometry[0], "odometry_orientation_xyzw": odometry[1]}
    np.savez_compressed(
        path,
        format_version=np.int64(GROUND_TRUTH_VERSION),
        # the grid: rows are y, columns x (as OccupancyGrid data), at z = height
        xs=xs, ys=ys, height=np.float64(height),
        field_grid_ut=grid_ut, magnitude_grid_ut=np.linalg.norm(grid_ut, axis=2),
        # every instant of the timeline
        t=rec.t, stamp_ns=stamps, position=rec.position, orientation_xyzw=rec.orientation_xyzw,
        sensor_position=rec.sensor_position, sensor_orientation_xyzw=rec.sensor_orientation_xyzw,
        field_map_true_ut=b_true_ut, magnitude_true_ut=np.linalg.norm(b_true_ut, axis=1),
        field_sensor_ut=rec.field_sensor_tesla * UT, is_spike=rec.is_spike, dropped=rec.dropped,
        # the world and the sensor
        earth_field_ut=rec.world.earth * UT, dipole_positions=rec.world.dipole_positions,
        dipole_moments=rec.world.dipole_moments,
        sensor_translation=np.asarray(rec.sensor.translation, dtype=float),
        sensor_rotation_xyzw=np.asarray(rec.sensor.rotation, dtype=float),
        noise_std_ut=np.float64(rec.sensor.noise_std * UT), bias_ut=np.asarray(rec.sensor.bias, dtype=float) * UT,
        seed=np.int64(rec.seed),
        **extra,
    )


@dataclass(frozen=True)
class GroundTruth:
    """The contents of ``ground_truth.npz`` (fields in microtesla, positions in metres, map frame ENU)."""

    arrays: Mapping[str, np.ndarray]
    path: Path

    def __getattr__(self, name: str) -> np.ndarray:
        arrays = object.__getattribute__(self, "arrays")
        if name in arrays:
            return arrays[name]
        raise AttributeError(f"ground truth has no array {name!r}; it has {', '.join(sorted(arrays))}")

    def keys(self) -> list[str]:
        return sorted(self.arrays)

    @property
    def world(self) -> World:
        """The simulated world, to evaluate the true field anywhere (``world.field(points)`` in tesla)."""
        return World(self.arrays["earth_field_ut"] / UT, self.arrays["dipole_positions"],
                     self.arrays["dipole_moments"])

    def field_ut(self, points: np.ndarray) -> np.ndarray:
        """True field (N, 3) [uT] in the map frame at ``points`` (N, 3) [m]."""
        return self.world.field(points) * UT


def ground_truth_path(bag: str | Path) -> Path:
    """Where the ground truth of ``bag`` (its directory, or a file inside it) lives."""
    bag = Path(bag)
    bag_dir = bag.parent if bag.is_file() else bag
    return bag_dir / GROUND_TRUTH_FILE


def load_ground_truth(bag: str | Path) -> GroundTruth:
    """Read the ground truth written with a demo bag (``bag`` is the bag directory or a file in it)."""
    path = ground_truth_path(bag)
    if not path.is_file():
        raise FileNotFoundError(f"no ground truth for bag {bag}: {path} does not exist (only bags written by "
                                "`gp-mapping demo-bag` have one)")
    with np.load(path, allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    version = int(arrays.get("format_version", -1))
    if version != GROUND_TRUTH_VERSION:
        raise ValueError(f"{path}: ground truth format version {version}, this gp_mapping reads "
                         f"{GROUND_TRUTH_VERSION}")
    return GroundTruth(arrays=arrays, path=path)


# -------------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `gp-mapping demo-bag` (fields in microtesla on the command line)."""
    parser.add_argument("out", type=Path, help="bag directory to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of world, path and sensor (default 0)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of driving (default 180)")
    parser.add_argument("--rate", type=float, default=50.0, help="magnetometer rate [Hz] (default 50)")
    parser.add_argument("--pose-rate", type=float, default=None, help="/pose and /tf rate [Hz]; must divide "
                        "--rate (default: --rate)")
    parser.add_argument("--odom-rate", type=float, default=25.0, help="/odom rate [Hz]; must divide --rate "
                        "(default 25)")
    parser.add_argument("--speed", type=float, default=0.6, help="driving speed [m/s] (default 0.6)")
    parser.add_argument("--area", type=float, nargs=4, default=[-5.0, -5.0, 5.0, 5.0],
                        metavar=("XMIN", "YMIN", "XMAX", "YMAX"), help="driven area [m] (default -5 -5 5 5)")
    parser.add_argument("--patterns", nargs="+", default=["lawnmower", "loop"], metavar="PATTERN",
                        help=f"path patterns driven in order, from {', '.join(PATTERNS)} (default lawnmower loop)")
    parser.add_argument("--line-spacing", type=float, default=1.0, help="lawnmower row spacing [m] (default 1)")
    parser.add_argument("--height", type=float, default=0.0, help="z of base_link [m] (default 0)")
    parser.add_argument("--height-amplitude", type=float, default=0.0, help="slow up-and-down motion of the "
                        "path [m], for 3-D maps (default 0: a 2-D survey at a fixed height)")
    parser.add_argument("--roll-pitch", type=float, default=2.0, help="roll and pitch wobble amplitude [deg] "
                        "(default 2)")
    parser.add_argument("--dipoles", type=int, default=14, help="number of buried steel objects (default 14)")
    parser.add_argument("--depth-range", type=float, nargs=2, default=[0.5, 2.0], metavar=("LOW", "HIGH"),
                        help="dipole depth below the sensor [m] (default 0.5 2)")
    parser.add_argument("--anomaly-range", type=float, nargs=2, default=[2.0, 20.0], metavar=("LOW", "HIGH"),
                        help="peak anomaly of one dipole [uT] (default 2 20)")
    parser.add_argument("--intensity", type=float, default=50.0, help="Earth's field intensity [uT] (default 50)")
    parser.add_argument("--inclination", type=float, default=60.0, help="inclination [deg] (default 60)")
    parser.add_argument("--declination", type=float, default=5.0, help="declination [deg] (default 5)")
    parser.add_argument("--noise-std", type=float, default=0.1, help="magnetometer noise std per axis [uT] "
                        "(default 0.1)")
    parser.add_argument("--bias", type=float, nargs=3, default=[0.4, -0.3, 0.2], metavar=("BX", "BY", "BZ"),
                        help="constant sensor-frame bias [uT] (default 0.4 -0.3 0.2)")
    parser.add_argument("--soft-iron", type=float, nargs=9, default=None, metavar="D",
                        help="the robot's soft iron: the sensor reads D @ field + bias, D 3x3 row-major (the "
                        "calibration that undoes it: sync.soft_iron = D^-1, sync.hard_iron = --bias); with --bias of "
                        "tens of uT, a robot whose own magnetism the map must be calibrated for (docs/magnetometer.md) "
                        "(default: identity)")
    parser.add_argument("--spike-rate", type=float, default=0.002, help="probability of a spike per sample "
                        "(default 0.002)")
    parser.add_argument("--dropout-rate", type=float, default=0.005, help="probability of a missing sample "
                        "(default 0.005)")
    parser.add_argument("--sensor-translation", type=float, nargs=3, default=[0.0, 0.0, 0.0],
                        metavar=("X", "Y", "Z"), help="magnetometer position in base_link [m] (default 0 0 0)")
    parser.add_argument("--sensor-rotation", type=float, nargs=4, default=[0.0, 0.0, 0.0, 1.0],
                        metavar=("X", "Y", "Z", "W"), help="magnetometer-to-base_link quaternion (default identity)")
    parser.add_argument("--grid-resolution", type=float, default=0.1, help="ground-truth grid step [m] "
                        "(default 0.1)")
    parser.add_argument("--start-time", type=float, default=DEFAULT_START_TIME,
                        help=f"stamp of the first sample [s since the epoch] (default {DEFAULT_START_TIME:.0f})")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap", help="bag storage (default mcap)")
    parser.add_argument("--drive-seed", type=int, default=None, help="a second drive in the world of --seed: the "
                        "path and the sensor drawn from this seed instead (default: --seed)")
    parser.add_argument("--odometry-drift", type=float, nargs=2, default=None, metavar=("SCALE", "DEG_PER_S"),
                        help="/odom as drifting wheel odometry in frame odom: a scale error (0.03: 3 %% too long) and "
                             "a heading drift [deg/s] (default: /odom is the true pose in map)")
    parser.add_argument("--no-compression", action="store_true", help="write MCAP chunks uncompressed")


def _divisor(rate: float, sub_rate: float, name: str) -> int:
    if not (math.isfinite(sub_rate) and sub_rate > 0.0):
        raise DemoBagError(f"{name} must be a positive number of Hz, got {sub_rate!r}")
    every = rate / sub_rate
    if every < 1.0 - 1e-9 or abs(every - round(every)) > 1e-6:
        raise DemoBagError(f"{name} {sub_rate:g} Hz must divide --rate {rate:g} Hz (rate / {name} an integer)")
    return int(round(every))


def configs_from_args(args: argparse.Namespace) -> tuple[WorldConfig, TrajectoryConfig, SensorConfig]:
    """The simulation configs the command-line arguments describe (raises SimulationError on bad values)."""
    translation = tuple(args.sensor_translation)
    trajectory = TrajectoryConfig(
        patterns=tuple(args.patterns), area=tuple(args.area), height=args.height, speed=args.speed,
        duration=args.duration, rate=args.rate, line_spacing=args.line_spacing,
        roll_amplitude_deg=args.roll_pitch, pitch_amplitude_deg=args.roll_pitch,
        height_amplitude=args.height_amplitude)
    world = WorldConfig(
        intensity=args.intensity / UT, inclination_deg=args.inclination, declination_deg=args.declination,
        area=tuple(args.area), plane_height=args.height + translation[2], n_dipoles=args.dipoles,
        depth_range=tuple(args.depth_range), anomaly_range=tuple(a / UT for a in args.anomaly_range))
    rotation = np.asarray(args.sensor_rotation, dtype=float)
    norm = float(np.linalg.norm(rotation))
    if not (math.isfinite(norm) and norm > 1e-9):
        raise SimulationError(f"--sensor-rotation must be a non-zero quaternion, got {args.sensor_rotation}")
    sensor = SensorConfig(
        noise_std=args.noise_std / UT, bias=tuple(b / UT for b in args.bias), spike_rate=args.spike_rate,
        dropout_rate=args.dropout_rate, translation=translation, rotation=tuple((rotation / norm).tolist()),
        **({"distortion": tuple(float(v) for v in soft_iron)} if (soft_iron := getattr(args, "soft_iron", None))
           is not None else {}))
    return world, trajectory, sensor


def command_line(args: argparse.Namespace) -> str:
    """The full `gp-mapping demo-bag` command that reproduces ``args`` (every option spelled out); it is
    stored in the bag's metadata (custom_data ``gp_mapping.command``)."""
    def fmt(v) -> str:
        if isinstance(v, (list, tuple)):
            return " ".join(fmt(x) for x in v)
        return repr(v) if isinstance(v, float) else shlex.quote(str(v))

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    parts = ["gp-mapping", "demo-bag", shlex.quote(str(args.out))]
    for action in parser._actions:  # the options in the order add_arguments declares them
        if not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a flag
            if value:
                parts.append(action.option_strings[0])
        elif value is not None:
            parts += [action.option_strings[0], fmt(value)]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Simulate and write the bag; 0 on success, 2 with a message on bad arguments."""
    try:
        if args.out.exists():
            raise DemoBagError(f"output {args.out} exists already; choose a new directory")
        if args.seed < 0:
            raise DemoBagError(f"--seed must be >= 0, got {args.seed}")
        world, trajectory, sensor = configs_from_args(args)
        pose_every = _divisor(args.rate, args.pose_rate if args.pose_rate is not None else args.rate, "--pose-rate")
        odom_every = _divisor(args.rate, args.odom_rate, "--odom-rate")
        if not (math.isfinite(args.grid_resolution) and args.grid_resolution > 0.0):
            raise DemoBagError(f"--grid-resolution must be > 0, got {args.grid_resolution}")
        drive_seed = getattr(args, "drive_seed", None)
        drift = getattr(args, "odometry_drift", None)
        if drive_seed is None:
            recording = simulate(world, trajectory, sensor, seed=args.seed)
        else:
            if drive_seed < 0:
                raise DemoBagError(f"--drive-seed must be >= 0, got {drive_seed}")
            # the world of --seed (simulate draws it from the first of the seed's three streams)
            world_rng = np.random.default_rng(np.random.SeedSequence(int(args.seed)).spawn(3)[0])
            recording = simulate(World.from_config(world, world_rng), trajectory, sensor, seed=drive_seed)
        odometry = None
        if drift is not None:
            if not all(math.isfinite(v) for v in drift) or abs(drift[0]) >= 0.5:
                raise DemoBagError(f"--odometry-drift needs a finite scale error below 0.5 and a finite drift, got "
                                   f"{drift}")
            odometry = drifting_odometry(recording.t, recording.position, recording.orientation_xyzw, drift[0],
                                         drift[1], seed=recording.seed)
        summary = write_demo_bag(args.out, recording, start_time=args.start_time, pose_every=pose_every,
                                 odom_every=odom_every, tf_every=pose_every, storage=args.storage,
                                 compress=not args.no_compression, grid_resolution=args.grid_resolution,
                                 custom_data={"gp_mapping.command": command_line(args)}, odometry=odometry)
    except (DemoBagError, SimulationError) as exc:
        print(f"gp-mapping demo-bag: error: {exc}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{topic} {n}" for topic, n in summary.counts.items())
    print(f"wrote {summary.path} ({summary.size_bytes / 1e6:.2f} MB with ground truth): {counts}")
    return 0


__all__ = [
    "TOPICS", "MSGTYPES", "GROUND_TRUTH_FILE", "DemoBagError", "BagSummary", "GroundTruth", "write_demo_bag",
    "load_ground_truth", "ground_truth_path", "body_twist", "configs_from_args", "command_line", "add_arguments",
    "run", "drifting_odometry",
]
