"""The localizer's settings (the ``localizer`` section of a YAML) and the errors of localization.

:class:`LocalizerConfig` is one small dataclass whose every field carries its allowed range or choices (the
``option`` rules of :mod:`gp_mapping.gp.config`, so a bad value reads like the mapper's: ``config key
'localizer.num_particles': 0 is too small; allowed: an integer in [10, 1000000]``). It validates itself on
construction, so ``LocalizerConfig(inflation=-1)`` is refused as a YAML holding it is.

:class:`LocalizerNodeConfig` holds the localizer *node*'s own settings (the map file, frames, where odometry comes
from, what it publishes, its diagnostics' thresholds): ROS parameters ``localizer.<key>`` beside the filter's, in
the same YAML section. ``gp-mapping localize`` takes its map and odometry from its arguments and skips them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from gp_mapping.config import read_parameter_file
from gp_mapping.gp.config import option, section_from_dict, validate_value
from gp_mapping.gp.errors import ConfigError

SECTION = "localizer"


class LocalizationError(ValueError):
    """Localization cannot run with the given inputs (a map that does not fit, a bad initial pose ...)."""


class MapLoadError(LocalizationError):
    """The map state file is missing, unreadable, empty, or of another frame or target than asked for."""


@dataclass
class LocalizerConfig:
    """Particle-filter settings (section ``localizer``). Units: metres, radians, seconds, and the map's field
    unit (microtesla for the shipped config)."""

    num_particles: int = option(1000, doc="particles in the filter after a start from a pose, and the fewest the "
                                "adaptive count (kld_err) goes down to", low=10, high=1_000_000)
    max_particles: int = option(10000, doc="particles after a global start (spread over the whole map), and the most "
                                "the adaptive count goes up to", low=10, high=10_000_000)
    kld_err: float = option(0.05, doc="KLD-sampling (Fox 2003, AMCL's pf_err): at each resampling the count is the "
                            "number that bounds the error of the particle histogram (bins of 0.5 m, 0.5 m, 10 deg) "
                            "by this with probability 0.99, between num_particles and max_particles; 0: a fixed "
                            "count", low=0.0, high=1.0)
    # --- motion model (nav2 AMCL's differential model: the odometry increment between two filter updates as
    # rotation 1, translation, rotation 2, each perturbed with a variance from the four alphas)
    alpha1: float = option(0.05, doc="rotation noise from rotation (variance of a turn per rad^2 turned)",
                           low=0.0, high=10.0)
    alpha2: float = option(0.02, doc="rotation noise from translation [rad^2 per m^2 driven]", low=0.0, high=10.0)
    alpha3: float = option(0.02, doc="translation noise from translation (variance per m^2 driven)", low=0.0,
                           high=10.0)
    alpha4: float = option(0.005, doc="translation noise from rotation [m^2 per rad^2 turned]", low=0.0, high=10.0)
    # --- when the filter updates (AMCL's update_min_d / update_min_a): readings between updates are skipped
    update_min_d: float = option(0.2, doc="a filter update needs this much translation since the last one [m] "
                                 "(consecutive readings closer than this carry the same map error)", low=0.0,
                                 high=100.0)
    update_min_a: float = option(0.1, doc="... or this much rotation [rad]", low=0.0, high=10.0)
    max_update_rate: float = option(50.0, doc="at most this many filter updates per second of stamps (a 200 Hz "
                                    "magnetometer is subsampled); 0: no limit", low=0.0, high=10_000.0)
    # --- measurement model
    inflation: float = option(1.0, doc="multiplies the map's predictive variance of a reading (both its parts: the "
                              "map's error and the sensor's noise); 1: the map's calibrated variance as it is",
                              low=0.0, low_open=True, high=1e6)
    correlated_map_error: bool = option(True, doc="treat the map's error (a reading's variance less the sensor's "
                                        "noise) as shared by successive readings along the path: a per-particle error "
                                        "state that decorrelates over error_correlation_length of travel, estimated "
                                        "with the offset (Kalman), so readings in a row count as the evidence they "
                                        "are; false: every update's error independent of the others")
    error_correlation_length: float = option(0.0, doc="distance over which the map's errors along a path "
                                             "decorrelate (e-folding of an exponential correlation) [m]; 0: measured "
                                             "on the map (the e-folding distance of its mean's autocorrelation)",
                                             low=0.0, high=1e4)
    position_std: float = option(0.0, doc="position uncertainty the map lookup allows for [m]: adds |grad m|^2 "
                                 "position_std^2 to the reading variance (a noisy-input GP, McHutchon and Rasmussen "
                                 "2011), so steep parts of the field, where a few centimetres change a reading by "
                                 "microtesla, weigh less", low=0.0, high=10.0)
    keep_noise_floor: bool = option(True, doc="weigh readings with the noise floor's part of their noise at its "
                                    "full width (the map's model.noise_floor), where the map's calibration narrowed "
                                    "it for a sensor quieter than the floor: a robot localizing reads with its own "
                                    "pose and heading errors, and from a global start the filter lost the robot "
                                    "more often with the narrower noise (docs/localization.md, Measurement model)")
    variance_floor: float = option(0.0, doc="added to every reading variance [unit^2]", low=0.0, high=1e6)
    use_map_variance: bool = option(True, doc="use the map's predictive variance of a reading; false: a fixed "
                                    "variance (fixed_variance) everywhere (a baseline, the map's variance ignored)")
    fixed_variance: float = option(1.0, doc="the reading variance when use_map_variance is false [unit^2]",
                                   low=0.0, low_open=True, high=1e6)
    outlier_probability: float = option(0.2, doc="weight of a uniform density over the map's range mixed into the "
                                        "likelihood (AMCL's z_rand): a reading the map explains badly (a map error, "
                                        "a disturbance) costs a particle at most this floor, so the true pose "
                                        "survives a few bad readings", low=0.0, high=0.99)
    off_map: str = option("prior", doc="the likelihood of a particle on an unknown cell (farther than the map's "
                          "grid.unknown_distance from its data) or off the grid: the map's marginal distribution of "
                          "readings (prior) or a uniform density over the map's range (uniform)",
                          choices=("prior", "uniform"))
    grid_resolution: float = option(0.0, doc="cell size of the lookup grid predicted from the map [m]; 0: the "
                                    "map's grid.resolution", low=0.0, high=100.0)
    orientation: str = option("level", doc="vector maps: the reading is rotated into the map frame by the "
                              "particle's yaw and roll and pitch from the orientation given with it (orientation), or "
                              "assumed level (level)", choices=("level", "orientation"))
    # --- magnetometer bias: a constant offset per map output, Rao-Blackwellised (a Kalman filter per particle)
    bias_prior_std: float = option(5.0, doc="prior standard deviation of the offset per output [unit]; 0: no "
                                   "bias state", low=0.0, high=1e6)
    bias_prior_mean: list = option([], doc="prior mean of the offset [unit]: empty (0), one value (every "
                                   "output) or one per output", length=(0, 1, 3))
    bias_random_walk: float = option(0.0, doc="random walk of the offset [unit per sqrt(s)]; 0: constant",
                                     low=0.0, high=1e6)
    # --- resampling and initialisation
    ess_threshold: float = option(0.5, doc="resample (systematic) when the effective sample size falls below this "
                                  "fraction of the particles", low=0.0, high=1.0)
    initial_std: list = option([0.1, 0.1, 0.05], doc="standard deviation of a Gaussian initial pose: x [m], y [m], "
                               "yaw [rad]", length=3, low=0.0, high=1e4)
    # --- bad input
    max_speed: float = option(5.0, doc="odometry moving faster than this between two messages is a jump: refused "
                              "and counted, the filter bridges it without motion [m/s]", low=0.0, low_open=True,
                              high=1e4)
    max_yaw_rate: float = option(10.0, doc="as max_speed for rotation [rad/s]", low=0.0, low_open=True, high=1e4)
    max_odometry_gap: float = option(0.5, doc="a reading needs odometry within this many seconds before and after "
                                     "it [s]", low=0.0, low_open=True, high=3600.0)
    converged_std: float = option(0.3, doc="the filter counts as converged while the position standard deviation "
                                  "(larger axis) is below this [m]", low=0.0, low_open=True, high=1e4)
    seed: int = option(0, doc="random seed", low=0, high=2**31 - 1)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, validate_value(f"{SECTION}.{f.name}", getattr(self, f.name), f))
        if self.max_particles < self.num_particles:
            raise ConfigError(f"{self.max_particles} is below num_particles = {self.num_particles}",
                              f"{SECTION}.max_particles")
        if self.update_min_d == 0.0 and self.update_min_a == 0.0 and self.max_update_rate == 0.0:
            raise ConfigError("update_min_d, update_min_a and max_update_rate are all 0: every reading would be an "
                              "update, at any rate; set max_update_rate", f"{SECTION}.max_update_rate")

    def bias_mean(self, outputs: int) -> list[float]:
        """The prior mean of the offset for a map of ``outputs`` outputs."""
        values = list(self.bias_prior_mean)
        if not values:
            return [0.0] * outputs
        if len(values) == 1:
            return values * outputs
        if len(values) != outputs:
            raise ConfigError(f"{values} has {len(values)} entries but the map has {outputs} output(s)",
                              f"{SECTION}.bias_prior_mean")
        return values


#: Longest frame name the node accepts in its frame settings.
FRAME_MAX_LENGTH = 256


@dataclass
class LocalizerNodeConfig:
    """The localizer node's own settings (ROS parameters ``localizer.<key>``; docs/localization.md "The node")."""

    map: str = option("", doc="the map state file (.safetensors: the mapper's ~/save_map, a checkpoint, gp-mapping "
                      "replay --save-state); required: a missing file or a map of another frame stops the node at "
                      "start (exit status 2). Live: a new file is loaded and the filter restarts around the last "
                      "estimate; a file that cannot be used is refused with the reason and the old map stays")
    global_frame: str = option("map", doc="the map frame (AMCL's global_frame_id): the map file must be of this "
                               "frame; ~/pose, ~/particles and /initialpose are in it", max_length=FRAME_MAX_LENGTH)
    odom_frame: str = option("odom", doc="the odometry frame (AMCL's odom_frame_id): odometry messages must be in it; "
                             "the published transform is global_frame -> odom_frame", max_length=FRAME_MAX_LENGTH)
    base_frame: str = option("base_link", doc="the robot's body frame (AMCL's base_frame_id): odom_source tf looks "
                             "up odom_frame -> base_frame", max_length=FRAME_MAX_LENGTH)
    odom_source: str = option("topic", doc="where odometry comes from: the odom topic (nav_msgs/Odometry in "
                              "odom_frame) or /tf and /tf_static (odom_frame -> base_frame)", choices=("topic", "tf"))
    tf_broadcast: bool = option(True, doc="publish global_frame -> odom_frame on /tf (AMCL's tf_broadcast); false "
                                "where another node publishes it")
    transform_tolerance: float = option(0.1, doc="the map -> odom transform is stamped this long after the reading "
                                        "it comes from, so that tf users can look up the present with it (AMCL's "
                                        "transform_tolerance) [s]", low=0.0, high=60.0)
    initial_pose: list = option([], doc="x [m], y [m], yaw [rad] in global_frame to start from (a Gaussian of "
                                "initial_std around it); empty: global_start, else wait for /initialpose",
                                length=(0, 3))
    global_start: bool = option(False, doc="without initial_pose: start by global localization (max_particles "
                                "spread over the map's known cells) instead of waiting for /initialpose")
    particles_period: float = option(0.5, doc="~/particles at most this often (node clock) [s]; 0: after every "
                                     "filter update", low=0.0, high=3600.0)
    queue_depth: int = option(200, doc="subscription queue depth (sensor-data QoS) of mag and odom", low=1,
                              high=100_000)
    stale_after: float = option(5.0, doc="diagnostics: WARN when no magnetometer or no odometry message has come for "
                                "this long, also before the first one [s]; 0: no check", low=0.0, high=1e6)
    stale_level_after: float = option(30.0, doc="diagnostics: STALE when a stream has been silent this long (taken as "
                                      "at least stale_after) [s]", low=0.0, high=1e6)
    max_refused_share: float = option(0.5, doc="diagnostics: WARN when more than this share of the readings of the "
                                      "last diagnostics_window were refused (judged from 10 readings on); 1: no check",
                                      low=0.0, high=1.0)
    diagnostics_window: float = option(10.0, doc="diagnostics: the window of the refused-share check [s]", low=0.0,
                                       low_open=True, high=3600.0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, validate_value(f"{SECTION}.{f.name}", getattr(self, f.name), f))
        for key in ("global_frame", "odom_frame", "base_frame"):
            name = getattr(self, key)
            if not name.strip("/") or name != name.strip():
                raise ConfigError(f"{name!r} is not a frame name", f"{SECTION}.{key}")
        if self.global_frame.lstrip("/") == self.odom_frame.lstrip("/"):
            raise ConfigError(f"'{self.odom_frame}' is global_frame too; the transform is global_frame -> odom_frame",
                              f"{SECTION}.odom_frame")


#: The node's keys, which ``gp-mapping localize`` skips in a config file.
NODE_KEYS = frozenset(f.name for f in dataclasses.fields(LocalizerNodeConfig))


def config_from_dict(values: Mapping[str, Any] | None) -> LocalizerConfig:
    """A LocalizerConfig from a mapping of its keys (unknown keys and bad values refused, named
    ``localizer.<key>``)."""
    return section_from_dict(LocalizerConfig, dict(values or {}), SECTION + ".")


def load_localizer_config(path: str | Path) -> LocalizerConfig:
    """Read a YAML: a mapping of the keys, or one with a ``localizer`` section, either at the top level or under
    a ROS ``/**: ros__parameters:`` entry (so the node's parameter file serves the CLI too). The node's own keys
    (:data:`NODE_KEYS`: the map file, frames ...) are skipped: the command takes those from its arguments."""
    document = read_parameter_file(path)
    if SECTION in document:
        section = document[SECTION]
        if section is None:
            return LocalizerConfig()
        if not isinstance(section, Mapping):
            raise ConfigError(f"must be a mapping of keys, got {section!r}", SECTION)
        return config_from_dict({k: v for k, v in section.items() if k not in NODE_KEYS})
    # dotted ROS names (localizer.num_particles) or bare keys
    flat = {(k[len(SECTION) + 1:] if isinstance(k, str) and k.startswith(SECTION + ".") else k): v
            for k, v in document.items() if k not in ("use_sim_time",)}
    return config_from_dict({k: v for k, v in flat.items() if k not in NODE_KEYS})


def field_specs() -> dict[str, dataclasses.Field]:
    """Every setting's dataclass field by its ROS parameter name (``localizer.<key>``): type, default, doc and
    range, for a node's parameter descriptors."""
    return {f"{SECTION}.{f.name}": f for f in dataclasses.fields(LocalizerConfig)}


def node_field_specs() -> dict[str, dataclasses.Field]:
    """The node's own settings (:class:`LocalizerNodeConfig`) the same way."""
    return {f"{SECTION}.{f.name}": f for f in dataclasses.fields(LocalizerNodeConfig)}


@dataclass
class LocalizerSettings:
    """What the localizer node is configured with: the filter's settings and the node's own."""

    filter: LocalizerConfig = dataclasses.field(default_factory=LocalizerConfig)
    node: LocalizerNodeConfig = dataclasses.field(default_factory=LocalizerNodeConfig)


def settings_from_parameters(values: Mapping[str, Any]) -> LocalizerSettings:
    """The node's settings from ROS parameter names (``localizer.<key>``) and values; a name outside the section or
    a key neither the filter nor the node knows is refused naming it, as a bad value is."""
    ours: dict[str, dict[str, Any]] = {"filter": {}, "node": {}}
    for name, value in values.items():
        section, dot, key = str(name).partition(".")
        if section != SECTION or not dot:
            raise ConfigError(f"the localizer's parameters are {SECTION}.<key>", str(name)[:100], unknown=True)
        known = NODE_KEYS | {f.name for f in dataclasses.fields(LocalizerConfig)}
        if key not in known:
            raise ConfigError(f"known keys in '{SECTION}': {', '.join(sorted(known))}", str(name)[:100], unknown=True)
        ours["node" if key in NODE_KEYS else "filter"][key] = value
    return LocalizerSettings(filter=config_from_dict(ours["filter"]),
                             node=section_from_dict(LocalizerNodeConfig, ours["node"], SECTION + "."))


def settings_to_parameters(settings: LocalizerSettings) -> dict[str, Any]:
    """ROS parameter name -> value of the node's settings (the filter's keys, then the node's)."""
    return {f"{SECTION}.{key}": value for part in (settings.filter, settings.node)
            for key, value in dataclasses.asdict(part).items()}


__all__ = ["ConfigError", "LocalizationError", "LocalizerConfig", "LocalizerNodeConfig", "LocalizerSettings",
           "MapLoadError", "NODE_KEYS", "config_from_dict", "field_specs", "load_localizer_config", "node_field_specs",
           "settings_from_parameters", "settings_to_parameters"]
