"""Typed configuration shared by the node, the offline replay and the benchmarks.

One YAML file in the ROS 2 parameter form (``/**: ros__parameters: ...``) fills a tree of dataclasses.
Nested YAML mappings are the sections (``model.kernel`` in ROS parameter names). Every field carries its
allowed range or choices in its metadata; :func:`load_config` and :func:`config_from_dict` refuse unknown
keys and out-of-range values with a :class:`ConfigError` that names the key and what is allowed.

The ``model`` section (:class:`ModelConfig`), the field rules and :class:`ConfigError` live with the engines in
:mod:`gp_mapping.gp.config`, so ``gp/`` depends on nothing above it; they are re-exported here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from gp_mapping.gp.config import (MIXING_LEARNING_CHOICES, ConfigError, ModelConfig, describe_allowed,  # noqa: F401
                                  section_from_dict, validate_value)
from gp_mapping.gp.config import option as _opt

#: Longest frame_id accepted (in sync.field_frame and in a reading's header).
FRAME_ID_MAX_LENGTH = 256
#: Longest text a log line, a service answer or a CLI error quotes from a value (a path, a parameter, a message).
LOG_VALUE_MAX_CHARS = 300


def shorten(text: Any, limit: int = LOG_VALUE_MAX_CHARS) -> str:
    """``text`` (any value, as str) cut to ``limit`` characters, saying how long it was: a 200 kB parameter value
    or path is quoted by its start, never in full."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters in all)"


@dataclass
class SyncConfig:
    """Time synchronisation of magnetometer samples with the pose, and frames (section ``sync``)."""

    max_pose_gap: float = _opt(0.1, doc="reject a sample with no pose within this many seconds", low=0.0,
                               low_open=True, high=60.0)
    pose_buffer_seconds: float = _opt(10.0, doc="how much pose history is kept for interpolation", low=0.0,
                                      low_open=True, high=3600.0)
    sensor_translation: list = _opt([0.0, 0.0, 0.0], doc="sensor position in the body frame [m]", length=3)
    sensor_rotation: list = _opt([0.0, 0.0, 0.0, 1.0], doc="sensor-to-body rotation quaternion [x, y, z, w]",
                                 length=4)
    hard_iron: list = _opt([0.0, 0.0, 0.0], doc="magnetometer calibration: the hard-iron offset h, the robot's own "
                           "constant field in the sensor frame [field_unit]; every reading (mapper, replay, localizer) "
                           "is corrected to soft_iron @ (raw - h) before anything else (docs/magnetometer.md; "
                           "gp-mapping calibrate fits it)", length=3, low=-1e9, high=1e9)
    soft_iron: list = _opt([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], doc="magnetometer calibration: the "
                           "soft-iron matrix S, 3x3 row-major, in corrected = S @ (raw - hard_iron); identity: none. "
                           "Must be invertible", length=9, low=-1e3, high=1e3)
    target: str = _opt("magnitude", doc="what is mapped: |B| or the map-frame vector",
                       choices=("magnitude", "vector"))
    input_dims: int = _opt(2, doc="map inputs: 2 (x, y) or 3 (x, y, z)", low=2, high=3)
    field_frame: str = _opt("", doc="the magnetometer's frame_id: readings in another frame are refused. Empty: "
                            "learn it (the first frame seen is held; another frame that sends 20 readings in a "
                            "row while the held one is silent takes over)", max_length=FRAME_ID_MAX_LENGTH)
    field_unit: str = _opt("microtesla", doc="unit of the field inside the mapper and in its outputs",
                           choices=("tesla", "millitesla", "microtesla", "nanotesla", "gauss"))
    # Bad-input guards (docs/reliability.md): each refusal is counted under a named reason.
    max_field: float = _opt(0.01, doc="refuse readings with |B| above this, saturated or absurd [T]; 0: no limit",
                            low=0.0, high=1e3)
    max_position: float = _opt(1e7, doc="refuse poses farther than this from the map origin [m]", low=0.0,
                               low_open=True, high=1e12)
    quaternion_tolerance: float = _opt(0.01, doc="refuse orientations whose norm differs from 1 by more than this "
                                       "(others are normalised)", low=0.0, high=1.0)
    max_speed: float = _opt(20.0, doc="a pose farther than max_speed * dt from the previous one is a teleport: "
                            "samples between the two are refused [m/s]; 0: no check", low=0.0, high=1e6)
    max_stamp_jump: float = _opt(60.0, doc="refuse a stamp more than this ahead of the newest accepted stamp, so "
                                 "one bad stamp cannot block later data [s]; 0: no check", low=0.0, high=1e9)
    max_stamp_skew: float = _opt(0.0, doc="refuse stamps farther than this from their receive time (node clock, "
                                 "bag time) [s]; 0: no check", low=0.0, high=1e9)


@dataclass
class BatchConfig:
    """How accepted samples are grouped into model updates (section ``batching``)."""

    mode: str = _opt("count", doc="close a batch by sample count or by elapsed time", choices=("count", "time"))
    size: int = _opt(50, doc="samples per batch in count mode", low=1, high=1_000_000)
    period: float = _opt(1.0, doc="seconds per batch in time mode", low=0.0, low_open=True, high=3600.0)
    max_pending: int = _opt(10_000, doc="bound on samples waiting for an update; the oldest are dropped and "
                            "counted beyond it", low=1, high=10_000_000)
    catch_up_after: int = _opt(4, doc="the node catches up once this many full batches wait for the model: each "
                               "update then takes several full batches at once (a power of two of them, as many as "
                               "the engine's measured cost per sample favours, at most batching.catch_up_max samples), "
                               "so the backlog stays bounded and nothing is dropped while the sensor rate is within "
                               "what the engine can absorb; below it the batches are the replay's (which never falls "
                               "behind). 0: never", low=0, high=1_000_000)
    catch_up_max: int = _opt(2000, doc="most samples one catch-up update takes (its latency and memory)", low=1,
                             high=10_000_000)


@dataclass
class GridConfig:
    """The published grid (section ``grid``)."""

    frame_id: str = _opt("map", doc="frame of the map and of the pose")
    resolution: float = _opt(0.1, doc="cell size [m]", low=0.0, low_open=True, high=1e3)
    mode: str = _opt("grow", doc="fixed extent, or grow to cover the visited area plus a margin",
                     choices=("fixed", "grow"))
    origin: list = _opt([-5.0, -5.0], doc="fixed mode: map coordinates of the corner of cell (0, 0) [m]", length=2)
    size: list = _opt([10.0, 10.0], doc="fixed mode: width and height [m]", length=2)
    margin: float = _opt(1.0, doc="grow mode: margin around the visited area [m]", low=0.0, high=1e4)
    window: list = _opt([40.0, 40.0], doc="grow mode: width and height of the published window [m], centred on the "
                        "newest accepted position (a rolling window, as costmaps and elevation maps have): each map is "
                        "the visited area plus margin cut to it, so publishing costs the same however far the robot "
                        "goes; the whole map stays in the model (save, export). At most grid.max_cells cells",
                        length=2, low=0.0, low_open=True, high=1e6)
    max_cells: int = _opt(1_000_000, doc="refuse grids with more cells than this", low=1, high=100_000_000)
    unknown_distance: float = _opt(1.0, doc="cells farther than this from every sample are unknown (-1) [m]; at most "
                                   "the smaller side of grid.window (grow) or grid.size (fixed), so the known-cell "
                                   "mask stays bounded by the published grid", low=0.0, low_open=True, high=1e4)
    tile_size: int = _opt(0, doc="cells predicted per call of the engine; 0: by the model's device, 2048 on a CPU (a "
                          "tile's (cells, M) kernel matrix then fits the cache: 4 MiB at M = 256) and on a GPU as "
                          "many as keep a (cells, M) matrix at 64 MiB, 32768 at M = 256 (fewer, larger kernel "
                          "launches)", low=0, high=10_000_000)
    height: float = _opt(0.0, doc="z of the grid cells when input_dims is 3 [m]", low=-1e4, high=1e4)
    mean_range: list = _opt([], doc="field values [unit] published as 0 and 100 in every mean grid, so a colour "
                            "means the same value all run (values outside are clipped); empty: each map's own "
                            "min..max", length=(0, 2), increasing=True)
    variance_range: list = _opt([], doc="as mean_range for the variance grids [unit squared]", length=(0, 2),
                                increasing=True)


@dataclass
class NodeConfig:
    """ROS-facing settings of the mapping node (section ``node``)."""

    pose_source: str = _opt("topic", doc="where the pose comes from: the pose topic (in grid.frame_id), or /tf and "
                            "/tf_static (grid.frame_id to the magnetometer frame, else to node.base_frame)",
                            choices=("topic", "tf"))
    base_frame: str = _opt("base_link", doc="pose_source tf: the body frame, used with sync.sensor_translation / "
                           "sync.sensor_rotation when tf does not hold the magnetometer frame")
    tf_timeout: float = _opt(1.0, doc="pose_source tf: a reading is refused (tf_missing) when a reading this many "
                             "seconds newer has come and its transforms still have not [s]", low=0.0, low_open=True,
                             high=60.0)
    pose_type: str = _opt("pose_stamped", doc="message type on the pose topic",
                          choices=("pose_stamped", "odometry", "pose_with_covariance"))
    publish_period: float = _opt(1.0, doc="seconds between map publications (at most 20 a second: each one "
                                  "predicts the whole window)", low=0.05, high=3600.0)
    initial_map: str = _opt("", doc="map state file to start from (empty: start empty); ~/load_map loads it "
                            "while running")
    new_session_on_load: bool = _opt(True, doc="the readings after a map is started from node.initial_map, loaded "
                                     "by ~/load_map or given to `gp-mapping replay --initial-map` are a new session: "
                                     "their constant offset to the loaded map is learned and removed (another day or "
                                     "sensor; docs/calibration.md); false: they continue the loaded map's session. A "
                                     "resume from the checkpoint always continues")
    map_directory: str = _opt("", doc="where ~/save_map writes <node name>_<UTC time>.safetensors (empty: "
                              "$ROS_HOME/gp_mapping)")
    queue_depth: int = _opt(50, doc="subscription queue depth (sensor-data QoS)", low=1, high=100_000)
    checkpoint_interval_s: float = _opt(0.0, doc="seconds (node clock) between atomic checkpoints of the whole "
                                        "mapper state; 0: no checkpoints", low=0.0, high=1e6)
    checkpoint_path: str = _opt("", doc="checkpoint file (empty: $ROS_HOME/gp_mapping/<node name>_checkpoint"
                                ".safetensors)")
    resume: bool = _opt(True, doc="with checkpoints on, start from the checkpoint file when it exists (an "
                        "unreadable or incompatible one stops the node)")
    model_period: float = _opt(5.0, doc="seconds between model summaries on ~/model (what a merger node merges; "
                               "sent only when the map changed, except the parts of a large tiled map, which go "
                               "round); 0: none", low=0.0, high=1e6)
    model_max_bytes: int = _opt(16_000_000, doc="largest model summary sent on ~/model; a larger one is sent "
                                "reduced: a tiled map's in parts of as many tiles as fit (changed tiles first), then "
                                "in float32; one engine's in float32; then with its visited cells coarser and fewer "
                                "trajectory points. One that fits no form is counted, logged and tried again at the "
                                "next period [bytes]", low=1024, high=1_000_000_000)
    # Diagnostics levels (gp_mapping.mapping.health): each check names its reason in the status message.
    stale_after: float = _opt(5.0, doc="diagnostics: WARN when no magnetometer message, or no pose message (/tf "
                              "with node.pose_source tf), has come for this long, also before the first one (a dead "
                              "or stalled sensor) [s]; 0: no check", low=0.0, high=1e6)
    stale_level_after: float = _opt(30.0, doc="diagnostics: STALE when a stream has been silent this long (taken as "
                                    "at least node.stale_after) [s]", low=0.0, high=1e6)
    expected_mag_rate: float = _opt(0.0, doc="diagnostics: WARN when the magnetometer's message rate over "
                                    "node.diagnostics_window falls below this [Hz]; 0: no check", low=0.0, high=1e6)
    expected_pose_rate: float = _opt(0.0, doc="diagnostics: WARN when the pose topic's (or /tf's) message rate over "
                                     "node.diagnostics_window falls below this [Hz]; 0: no check", low=0.0, high=1e6)
    max_refused_share: float = _opt(0.5, doc="diagnostics: WARN when more than this share of the readings of the "
                                    "last node.diagnostics_window were refused (judged from 10 readings on); 1: no "
                                    "check", low=0.0, high=1.0)
    diagnostics_window: float = _opt(10.0, doc="diagnostics: the window of the rate, refused-share, falling-behind "
                                     "(samples pending grew at every tick, by more than a batch: WARN) and "
                                     "failed-update (ERROR) checks [s]", low=0.0, low_open=True, high=3600.0)


@dataclass
class MapperConfig:
    """Everything the mapper needs; the root of the YAML's ``ros__parameters``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    batching: BatchConfig = field(default_factory=BatchConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    node: NodeConfig = field(default_factory=NodeConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(MapperConfig)}
_SECTION_CLASSES = {"model": ModelConfig, "sync": SyncConfig, "batching": BatchConfig, "grid": GridConfig,
                    "node": NodeConfig}


# Keys that ROS puts in every node's parameters; accepted and ignored by the mapper configuration.
ROS_RESERVED_KEYS = frozenset({"use_sim_time", "start_type_description_service", "qos_overrides"})


def config_from_dict(values: Mapping[str, Any] | None) -> MapperConfig:
    """Build a MapperConfig from nested mappings (``{"model": {...}, ...}``) or dotted keys (``model.kernel``)."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in (values or {}).items():
        if key in ROS_RESERVED_KEYS:
            continue
        section, dot, sub = key.partition(".")
        if section not in _SECTION_CLASSES:
            raise ConfigError(f"unknown config key '{shorten(key, 100)}'; known sections: "
                              f"{', '.join(_SECTION_CLASSES)}")
        if dot:
            nested.setdefault(section, {})[sub] = value
        elif isinstance(value, Mapping):
            nested.setdefault(section, {}).update(value)
        else:
            raise ConfigError(f"config key '{shorten(key, 100)}' must be a section (a mapping of keys), got "
                              f"{shorten(repr(value), 100)}")
    config = MapperConfig(**{name: section_from_dict(cls, nested.get(name, {}), name + ".")
                             for name, cls in _SECTION_CLASSES.items()})
    check_iron_calibration(config.sync)
    return config


#: Largest condition number of sync.soft_iron: beyond it the matrix is taken as singular (it would flatten the
#: readings onto a plane or a line, and its inverse, the sensor's distortion, would be absurd).
SOFT_IRON_MAX_CONDITION = 1e6


def check_iron_calibration(sync: SyncConfig) -> None:
    """Refuse a ``sync.soft_iron`` that is singular or nearly so (ConfigError naming the key); the entries' own
    rules (9 finite numbers, 3 finite numbers for ``sync.hard_iron``) are checked with the other keys."""
    import numpy as np

    matrix = np.asarray(sync.soft_iron, dtype=np.float64)
    if matrix.shape != (9,) or not np.all(np.isfinite(matrix)):
        raise ConfigError(f"{shorten(sync.soft_iron, 200)} is not 9 finite numbers (a 3x3 matrix, row-major)",
                          "sync.soft_iron")
    condition = float(np.linalg.cond(matrix.reshape(3, 3)))
    if not condition <= SOFT_IRON_MAX_CONDITION:
        raise ConfigError(f"{sync.soft_iron} is a singular matrix (condition number {condition:.3g}, at most "
                          f"{SOFT_IRON_MAX_CONDITION:g} allowed): corrected = soft_iron @ (raw - hard_iron) would "
                          "flatten the readings; identity [1, 0, 0, 0, 1, 0, 0, 0, 1] means no soft-iron correction",
                          "sync.soft_iron")


def load_config(path: str | Path | None = None) -> MapperConfig:
    """Read a ``/**: ros__parameters:`` YAML (or a plain mapping of sections); None gives the defaults."""
    if path is None:
        return MapperConfig()
    return config_from_dict(read_parameter_file(path))


def read_parameter_file(path: str | Path) -> Mapping[str, Any]:
    """The parameters a YAML file holds: the ``ros__parameters`` of its one node entry (``/**`` or a node
    name), else the file's own top-level mapping; {} for an empty file. ConfigError with the reason for a file
    that cannot be read, is not YAML, is hostile or holds no mapping (every command's and node's files)."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not text (UTF-8): {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {shorten(err)}") from err
    except RecursionError:  # a hostile file of nested brackets
        raise ConfigError(f"config file {path} is nested deeper than any parameter file; refused") from None
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    params = _ros_parameters(document) if any(isinstance(v, Mapping) and "ros__parameters" in v
                                              for v in document.values()) else document
    if not isinstance(params, Mapping):
        raise ConfigError(f"config file {path}: the ros__parameters entry must be a mapping")
    return params


def _ros_parameters(document: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``ros__parameters`` of the node entry (``/**`` or any single node name)."""
    entries = [v["ros__parameters"] for v in document.values() if isinstance(v, Mapping) and "ros__parameters" in v]
    if len(entries) != 1:
        raise ConfigError("a ROS parameter file for gp_mapping must hold exactly one node entry "
                          "(use '/**: ros__parameters:')")
    return entries[0] or {}


def to_flat_parameters(config: MapperConfig) -> dict[str, Any]:
    """``{"model.kernel": "matern52", ...}``: the ROS parameter names and values of a config."""
    out = {}
    for name in _SECTION_CLASSES:
        for key, value in dataclasses.asdict(getattr(config, name)).items():
            out[f"{name}.{key}"] = value
    return out


def field_specs() -> dict[str, dataclasses.Field]:
    """Every parameter's dataclass field by ROS name (type, default, doc, range), for the node's descriptors."""
    return {f"{name}.{f.name}": f for name, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)}


def to_dict(config: MapperConfig) -> dict[str, dict[str, Any]]:
    """Nested plain-Python form (for saving with a map)."""
    return dataclasses.asdict(config)
