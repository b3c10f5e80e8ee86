"""Typed configuration shared by the node, the offline replay and the benchmarks.

One YAML file in the ROS 2 parameter form (``/**: ros__parameters: ...``) fills a tree of dataclasses.
Nested YAML mappings are the sections (``model.kernel`` in ROS parameter names). Every field carries its
allowed range or choices in its metadata; :func:`load_config` and :func:`config_from_dict` refuse unknown
keys and out-of-range values with a :class:`ConfigError` that names the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


#: model.mixing_learning choices (the continual_mogp engine reads them from here).
MIXING_LEARNING_CHOICES = ("first", "always", "never")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is outside what is allowed."""


def _opt(default, *, doc: str, low=None, high=None, low_open=False, choices=None, length=None):
    """A dataclass field with its validation rule and its one-line documentation."""
    meta = {"doc": doc, "low": low, "high": high, "low_open": low_open, "choices": choices, "length": length}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The GP engine (section ``model``)."""

    engine: str = _opt("dual_svgp", doc="GP engine: dual_svgp (memory-based dual SVGP, seed 004; a vector target "
                       "gets independent latents sharing Z) or continual_mogp (continual multi-output GP with a "
                       "linear model of coregionalisation, seed 000)", choices=("dual_svgp", "continual_mogp"))
    kernel: str = _opt("matern52", doc="stationary kernel", choices=("matern12", "matern32", "matern52", "rbf"))
    ard: bool = _opt(True, doc="one lengthscale per input dimension")
    constant_kernel: bool = _opt(True, doc="add a learned constant (bias) kernel")
    lengthscale: float = _opt(1.0, doc="initial lengthscale [m]", low=0.0, low_open=True, high=1e4)
    signal_variance: float = _opt(1.0, doc="initial kernel variance (standardised targets)", low=0.0,
                                  low_open=True, high=1e4)
    constant_variance: float = _opt(1.0, doc="initial constant-kernel variance (standardised)", low=0.0,
                                    low_open=True, high=1e4)
    likelihood: str = _opt("gaussian", doc="observation model", choices=("gaussian", "student_t", "bernoulli"))
    noise_variance: float = _opt(0.01, doc="initial noise variance (standardised)", low=0.0, low_open=True,
                                 high=1e2)
    student_t_dof: float = _opt(4.0, doc="Student-t degrees of freedom", low=0.0, low_open=True, high=1e3)
    num_inducing: int = _opt(128, doc="number of inducing points M", low=1, high=8192)
    inducing: str = _opt("pivoted_cholesky", doc="inducing-point policy: re-selected by pivoted Cholesky "
                         "over [Z; X_new], or a fixed grid over inducing_bounds",
                         choices=("pivoted_cholesky", "grid"))
    inducing_bounds: list = _opt([-5.0, -5.0, 5.0, 5.0], doc="grid policy: [xmin, ymin, xmax, ymax] of the fixed "
                                 "inducing grid [m]", length=4)
    memory_size: int = _opt(500, doc="maximum number of past samples kept in memory", low=0, high=1_000_000)
    memory_per_batch: int = _opt(10, doc="samples drawn into memory from each batch", low=0, high=100_000)
    memory_selection: str = _opt("leverage", doc="how memory samples are drawn from a batch",
                                 choices=("leverage", "random"))
    rho: float = _opt(0.9, doc="natural-gradient damping step", low=0.0, low_open=True, high=1.0)
    n_steps: int = _opt(2, doc="natural-gradient steps per update", low=1, high=1000)
    learn_hyperparameters: bool = _opt(True, doc="learn kernel and noise hyperparameters online (full mode)")
    hyper_steps: int = _opt(20, doc="most Adam steps on the hyperparameters per full update (dual_svgp stops "
                                    "earlier once a step gains less than hyper_tol per datum; Adam's moments carry "
                                    "over between updates)", low=0, high=100_000)
    hyper_tol: float = _opt(1e-4, doc="dual_svgp: stop a full update's hyperparameter steps when the objective per "
                                      "datum rose by less than this in the last step; 0: always hyper_steps",
                            low=0.0, high=1.0)
    hyper_lr: float = _opt(0.01, doc="Adam learning rate for the hyperparameters", low=0.0, low_open=True,
                           high=10.0)
    learn_inducing: bool = _opt(False, doc="move the inducing inputs by gradient steps on an ELBO that keeps the old "
                                "data's information (full mode; not for the grid policy). Opt-in: it helps on the Solin "
                                "recording and hurts on the demo bag (see the engine docstring)")
    inducing_lr: float = _opt(0.01, doc="Adam learning rate for the inducing inputs [m per step]", low=0.0,
                              low_open=True, high=100.0)
    full_update_every: int = _opt(1, doc="every n-th update is a full update (memory, hyperparameters, "
                                  "inducing re-selection); the others are fast conditioning", low=1, high=1_000_000)
    jitter: float = _opt(1e-6, doc="initial diagonal jitter added to K before Cholesky", low=0.0, high=1.0)
    device: str = _opt("auto", doc="torch device for the model", choices=("auto", "cpu", "cuda"))
    seed: int = _opt(0, doc="random seed (memory sampling, initial mixing weights)", low=0, high=2**31 - 1)
    num_latents: int = _opt(3, doc="continual_mogp: number Q of latent GPs mixed into the output channels",
                            low=1, high=64)
    latent_lengthscale_ratio: float = _opt(2.0, doc="continual_mogp: latent q starts at lengthscale * ratio ** "
                                           "(q - (Q - 1) / 2), so the latents cover several scales (1: all equal)",
                                           low=1.0, high=100.0)
    vem_iterations: int = _opt(4, doc="continual_mogp: variational EM iterations (M-step of hyper_steps Adam "
                               "steps, inducing inputs re-placed, E-step) per full update", low=1, high=1000)
    mixing_learning: str = _opt("first", doc="continual_mogp: when the mixing weights are learned: only while a "
                                "channel is first seen (no forgetting through them), in every full update (as "
                                "the paper), or never", choices=MIXING_LEARNING_CHOICES)
    variational_steps: int = _opt(100, doc="continual_mogp, non-Gaussian likelihoods: Adam steps on q(u) per "
                                  "E-step (a Gaussian likelihood has a closed-form E-step)", low=1, high=100_000)
    variational_lr: float = _opt(0.02, doc="continual_mogp, non-Gaussian likelihoods: Adam learning rate on q(u)",
                                 low=0.0, low_open=True, high=10.0)


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
    target: str = _opt("magnitude", doc="what is mapped: |B| or the map-frame vector",
                       choices=("magnitude", "vector"))
    input_dims: int = _opt(2, doc="map inputs: 2 (x, y) or 3 (x, y, z)", low=2, high=3)
    field_unit: str = _opt("microtesla", doc="unit of the field inside the mapper and in its outputs",
                           choices=("tesla", "millitesla", "microtesla", "nanotesla", "gauss"))
    # Bad-input guards (README "Bad input and reliability"): each refusal is counted under a named reason.
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
    max_cells: int = _opt(1_000_000, doc="refuse grids with more cells than this", low=1, high=100_000_000)
    unknown_distance: float = _opt(1.0, doc="cells farther than this from every sample are unknown (-1) [m]",
                                   low=0.0, low_open=True, high=1e4)
    tile_size: int = _opt(16384, doc="cells predicted per tile on the device", low=1, high=10_000_000)
    height: float = _opt(0.0, doc="z of the grid cells when input_dims is 3 [m]", low=-1e4, high=1e4)


@dataclass
class NodeConfig:
    """ROS-facing settings of the mapping node (section ``node``)."""

    pose_type: str = _opt("pose_stamped", doc="message type on the pose topic",
                          choices=("pose_stamped", "odometry", "pose_with_covariance"))
    publish_period: float = _opt(1.0, doc="seconds between map publications", low=0.0, low_open=True, high=3600.0)
    initial_map: str = _opt("", doc="map state file to start from (empty: start empty)")
    queue_depth: int = _opt(50, doc="subscription queue depth (sensor-data QoS)", low=1, high=100_000)
    checkpoint_interval_s: float = _opt(0.0, doc="seconds (node clock) between atomic checkpoints of the whole "
                                        "mapper state; 0: no checkpoints", low=0.0, high=1e6)
    checkpoint_path: str = _opt("", doc="checkpoint file (empty: $ROS_HOME/gp_mapping/<node name>_checkpoint"
                                ".safetensors)")
    resume: bool = _opt(True, doc="with checkpoints on, start from the checkpoint file when it exists (an "
                        "unreadable or incompatible one stops the node)")


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


def describe_allowed(meta: Mapping[str, Any], ftype: str) -> str:
    """Human-readable allowed values of a field (used in error messages and ROS parameter descriptors)."""
    if meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    if meta.get("length"):
        return f"a list of {meta['length']} finite numbers"
    low, high = meta.get("low"), meta.get("high")
    if low is not None or high is not None:
        left = "(" if meta.get("low_open") else "["
        return f"{'an integer' if ftype == 'int' else 'a number'} in {left}{low}, {high}]"
    return f"a {ftype}"


def validate_value(key: str, value: Any, f: dataclasses.Field) -> Any:
    """Return ``value`` converted to the field's type, or raise ConfigError naming ``key``."""
    meta, ftype = f.metadata, f.type if isinstance(f.type, str) else f.type.__name__
    allowed = describe_allowed(meta, ftype)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"config key '{key}': {why}; allowed: {allowed}")

    if ftype == "bool":
        if not isinstance(value, bool):
            raise refuse(f"{value!r} is not a boolean")
        return value
    if ftype == "str":
        if not isinstance(value, str):
            raise refuse(f"{value!r} is not a string")
        if meta.get("choices") and value not in meta["choices"]:
            raise refuse(f"{value!r} is not allowed")
        return value
    if ftype == "list":
        if not isinstance(value, (list, tuple)) or len(value) != meta["length"]:
            raise refuse(f"{value!r} is not a list of length {meta['length']}")
        out = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise refuse(f"{value!r} holds a non-finite or non-numeric entry")
            out.append(float(v))
        return out
    if ftype == "int":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise refuse(f"{value!r} is not an integer")
        value = int(value)
    elif ftype == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(f"{value!r} is not a number")
        value = float(value)
        if not math.isfinite(value):
            raise refuse(f"{value!r} is not finite")
    low, high = meta.get("low"), meta.get("high")
    if low is not None and (value < low or (meta.get("low_open") and value == low)):
        raise refuse(f"{value!r} is too small")
    if high is not None and value > high:
        raise refuse(f"{value!r} is too large")
    return value


def section_from_dict(cls, values: Mapping[str, Any], prefix: str):
    """Build one section dataclass from a mapping, refusing unknown keys and bad values."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown config key '{prefix}{key}'; known keys in '{prefix.rstrip('.') or 'root'}':"
                              f" {', '.join(sorted(fields))}")
        kwargs[key] = validate_value(prefix + key, value, fields[key])
    return cls(**kwargs)


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
            raise ConfigError(f"unknown config key '{key}'; known sections: {', '.join(_SECTION_CLASSES)}")
        if dot:
            nested.setdefault(section, {})[sub] = value
        elif isinstance(value, Mapping):
            nested.setdefault(section, {}).update(value)
        else:
            raise ConfigError(f"config key '{key}' must be a section (a mapping of keys), got {value!r}")
    return MapperConfig(**{name: section_from_dict(cls, nested.get(name, {}), name + ".")
                           for name, cls in _SECTION_CLASSES.items()})


def load_config(path: str | Path | None = None) -> MapperConfig:
    """Read a ``/**: ros__parameters:`` YAML (or a plain mapping of sections); None gives the defaults."""
    if path is None:
        return MapperConfig()
    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if document is None:
        return MapperConfig()
    if not isinstance(document, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    params = _ros_parameters(document) if any(isinstance(v, Mapping) and "ros__parameters" in v
                                              for v in document.values()) else document
    return config_from_dict(params)


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
