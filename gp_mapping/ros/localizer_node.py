"""The localizer node: a particle filter on a saved magnetic map (:mod:`gp_mapping.localization`), in the style of
nav2's AMCL, with the GP map's mean and reading variance as its measurement model and odometry as its motion model.

    ros2 run gp_mapping localizer --ros-args -p localizer.map:=survey/map.safetensors \\
        -p "localizer.initial_pose:=[0.0, 0.0, 0.0]"
    ros2 launch gp_mapping localizer.launch.py map:=survey/map.safetensors

``ros2 run gp_mapping lifecycle_localizer`` is the managed node (configure loads the map and builds the filter,
activate subscribes and publishes, deactivate stops both and keeps the filter, cleanup drops it; ``--autostart``
brings it up without a manager). Parameters: ``localizer.<key>``, the filter's (:class:`LocalizerConfig`) and the
node's own (:class:`LocalizerNodeConfig`), declared with descriptors and validated as the mapper's
(:mod:`gp_mapping.ros.parameters`); a bad value, an unknown key, a missing map file or a map of another frame than
``localizer.global_frame`` stops the node at start with the reason and exit status 2. Live: :data:`LIVE_PARAMETERS`.

Subscriptions
    ``mag``          sensor_msgs/MagneticField, tesla, in the magnetometer frame (placed on the robot as the map's
                     ``sync.sensor_translation`` / ``sync.sensor_rotation``); sensor-data QoS.
    ``odom``         nav_msgs/Odometry in ``localizer.odom_frame`` (``localizer.odom_source: topic``); sensor-data QoS.
    ``/tf``, ``/tf_static``  instead of ``odom`` with ``odom_source: tf``: ``odom_frame -> base_frame``, looked up
                     at the stamps of each /tf message.
    ``/initialpose`` geometry_msgs/PoseWithCovarianceStamped in ``localizer.global_frame`` (RViz's "2D Pose
                     Estimate"): the filter restarts from a Gaussian around it (standard deviations from the
                     covariance's x, y and yaw, ``initial_std`` where those are zero).
Publications
    ``~/pose``       PoseWithCovarianceStamped after every filter update (reliable, transient local, depth 1, as
                     AMCL's ``amcl_pose``), in ``global_frame``, stamped with the reading.
    ``~/particles``  geometry_msgs/PoseArray, at most every ``particles_period`` (reliable, depth 1).
    ``/tf``          ``global_frame -> odom_frame`` after every update and, between updates, with the readings at
                     most every 0.1 s of their stamps (:data:`~gp_mapping.ros.localizer_inputs.TF_REPUBLISH_PERIOD`),
                     stamped ``transform_tolerance`` after the reading (``localizer.tf_broadcast``).
    ``~/mean``, ``~/variance``, ``~/cloud``, ``~/scale``  the map the filter looks up (latched, the mapper's layout,
                     :mod:`gp_mapping.ros.publishers`), its variance a reading's (latent + noise), for RViz.
    ``/diagnostics`` every second: the filter's counters (readings, updates, skipped, ``rejected/<reason>``), ESS,
                     the innovations' mean NIS, converged, the offset (``bias``, ``bias_std``), the pose and its
                     standard deviations, and the node's refusals ``node/rejected/<reason>``
                     (:data:`NODE_REJECTION_REASONS`). Levels with reasons: WARN without an initial pose, while not
                     converged, with most of the particles' weight off the map, a stream silent ``stale_after``
                     (STALE after ``stale_level_after``), more than ``max_refused_share`` of the readings refused;
                     ERROR for an error the node survived.

Bad input never stops the node: the filter refuses and counts non-finite or zero readings, stamps that go back,
readings without odometry around them and odometry jumps (:data:`gp_mapping.localization.REJECTION_REASONS`); the
node counts odometry of another frame, unusable /initialpose messages and map files that cannot be loaded.
"""
from __future__ import annotations

import math
import sys
from typing import Any

from geometry_msgs.msg import PoseArray, PoseWithCovarianceStamped
from rclpy.lifecycle import LifecycleNode
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from gp_mapping.config import shorten
from gp_mapping.localization.config import (ConfigError, LocalizationError, LocalizerSettings, MapLoadError,
                                            field_specs, node_field_specs, settings_from_parameters,
                                            settings_to_parameters)
from gp_mapping.localization.field_map import MagneticMap
from gp_mapping.localization.localizer import Localizer
from gp_mapping.mapping import publication
from gp_mapping.ros import conversions
from gp_mapping.ros.diagnostics import DIAGNOSTICS_PERIOD, LocalizerDiagnostics
from gp_mapping.ros.lifecycle import LifecycleCallbacks, init_node
from gp_mapping.ros.localizer_inputs import TF_QOS, LocalizerInputs
from gp_mapping.ros.parameters import ConfigParameters, ParameterSchema
from gp_mapping.ros.process import NodeStartError, bring_up, node_command, spin_node
from gp_mapping.ros.publishers import create_map_publishers, publish_map_layout

LOCALIZER_NAME = "localizer"
LIVE_PARAMETERS = frozenset({"localizer.map", "localizer.tf_broadcast", "localizer.transform_tolerance",
                             "localizer.particles_period", "localizer.stale_after", "localizer.stale_level_after",
                             "localizer.max_refused_share", "localizer.diagnostics_window"})
POSE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL)
RELIABLE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.VOLATILE)


def published_topics(target: str = "magnitude") -> dict[str, str]:
    """Every topic the localizer node publishes (node-relative or absolute) -> its message type, for a map of
    ``target`` (``magnitude`` or ``vector``: the map topics' layers)."""
    return {"~/pose": "geometry_msgs/msg/PoseWithCovarianceStamped", "~/particles": "geometry_msgs/msg/PoseArray",
            "/tf": "tf2_msgs/msg/TFMessage", "/diagnostics": "diagnostic_msgs/msg/DiagnosticArray",
            **publication.map_topic_types(publication.layer_names(target))}


def _check_live_change(node: Any, changes: dict[str, Any]) -> None:
    if "localizer.map" in changes:  # loaded now, so that a file that cannot be used is refused with the reason
        node._prepare_map(changes["localizer.map"])


LOCALIZER_SCHEMA = ParameterSchema(lambda: {**field_specs(), **node_field_specs()}, settings_from_parameters,
                                   settings_to_parameters, LIVE_PARAMETERS, _check_live_change)


class _LocalizerCore(ConfigParameters, LocalizerInputs, LocalizerDiagnostics):
    """The localizer's work, shared by the plain node and the lifecycle node (stages as the mapper's)."""

    parameter_schema = LOCALIZER_SCHEMA
    config: LocalizerSettings
    _active = False
    _configured_once = False

    def _init_core(self) -> None:
        self._setup_parameters()
        self.localizer: Localizer | None = None
        self._pending_map: tuple[str, MagneticMap] | None = None

    # ------------------------------------------------------------------------------------------ life

    def _configure(self) -> None:
        """Parameters, the map and the filter, the publishers; NodeStartError when the map cannot be used."""
        if self.localizer is None and self._configured_once:  # after a cleanup: re-read
            self.config = self._read_parameters()
        self._configured_once = True
        node = self.config.node
        if not node.map:
            raise NodeStartError("bad parameter: config key 'localizer.map': no map file given (a map state "
                                 ".safetensors: the mapper's ~/save_map or gp-mapping replay --save-state)")
        try:
            self.map = self._load_map(node.map)
            self.localizer = self._new_localizer(self.map)
        except (MapLoadError, LocalizationError) as err:
            raise NodeStartError(f"bad parameter: config key 'localizer.map': {err}") from err
        self._start_filter(None)
        self._counts = {"mag_messages": 0, "odom_messages": 0, "tf_messages": 0, "initial_poses": 0,
                        "poses_published": 0, "particles_published": 0, "transforms_published": 0,
                        "maps_loaded": 1, "errors": 0, "stamps_from_clock": 0}
        self._setup_inputs()
        self._last_error = ""
        self._last_particles = -math.inf
        self._pose_pub = self.create_publisher(PoseWithCovarianceStamped, "~/pose", POSE_QOS)
        self._particles_pub = self.create_publisher(PoseArray, "~/particles", RELIABLE_QOS)
        self._tf_pub = self._tf_publisher()
        self._setup_status()
        self._publish_map()

    def _activate(self) -> None:
        self._start_health()
        self._subscriptions = self._subscribe_inputs()
        self._timers = [self.create_timer(DIAGNOSTICS_PERIOD, self._publish_diagnostics)]
        self._active = True
        self.get_logger().info(self.describe())

    def _deactivate(self) -> None:
        self._active = False
        for subscription in self._subscriptions:
            self.destroy_subscription(subscription)
        for timer in self._timers:
            self.destroy_timer(timer)
        self._subscriptions, self._timers = [], []

    def _cleanup(self) -> None:
        for pub in [self._pose_pub, self._particles_pub, self._tf_pub, self._diag_pub, self._cloud_pub,
                    self._scale_pub, *[p for pair in self._map_pubs.values() for p in pair]]:
            if pub is not None:
                self.destroy_publisher(pub)
        self.localizer, self._map_layers = None, None

    def _stop(self) -> None:
        if self._active:
            self._deactivate()

    def close(self) -> None:
        """Shut down from whatever state the node is in, then destroy it."""
        self._stop()
        self.destroy_node()

    def describe(self) -> str:
        c, m, resolve = self.config.node, self.map, self.resolve_topic_name
        odom = (f"odometry from /tf ({c.odom_frame} -> {c.base_frame})" if c.odom_source == "tf"
                else f"odometry on {resolve('odom')} in '{c.odom_frame}'")
        start = ("at " + str(c.initial_pose) if c.initial_pose else "globally" if c.global_start
                 else "when /initialpose comes")
        return (f"localizing on {m.source} ({m.target} map of {int(m.known.sum())} known cells in '{m.frame_id}', "
                f"{m.field_unit}): magnetometer on {resolve('mag')}, {odom}; starts {start}; "
                f"{self.localizer.filter.num_particles} particles; "
                f"{'publishing' if c.tf_broadcast else 'not publishing'} {c.global_frame} -> {c.odom_frame} on /tf")

    # ------------------------------------------------------------------------------------------ the map

    def _load_map(self, path: str) -> MagneticMap:
        return MagneticMap.load(path, self.config.filter.grid_resolution, frame_id=self.config.node.global_frame)

    def _new_localizer(self, fmap: MagneticMap) -> Localizer:
        return Localizer(fmap, self.config.filter, fmap.sensor_translation, fmap.sensor_rotation)

    def _start_filter(self, around: Any) -> None:
        """Initialise the filter: around an estimate of the map before (a new map), else as the parameters say
        (``initial_pose``, ``global_start``), else leave it waiting for /initialpose."""
        node = self.config.node
        if around is not None:
            self.localizer.initialise(around.pose)
        elif node.initial_pose:
            self.localizer.initialise(node.initial_pose)
        elif node.global_start:
            self.localizer.initialise_global()

    def _prepare_map(self, path: str) -> None:
        """A live ``localizer.map``: load it now (ConfigError with the reason, counted, when it cannot be used)."""
        try:
            fmap = self._load_map(path)
            self._new_localizer(fmap)
        except (MapLoadError, LocalizationError) as err:
            if hasattr(self, "_node_rejected"):
                self._node_rejected["map_refused"] += 1
            self.get_logger().warning(f"localizer.map {shorten(path)} refused: {err}")
            raise ConfigError(str(err), "localizer.map") from None
        self._pending_map = (path, fmap)

    def _apply_live_parameter(self, name: str, value: Any) -> None:
        setattr(self.config.node, name.split(".", 1)[1], value)
        pending, self._pending_map = self._pending_map, None
        if name != "localizer.map" or self.localizer is None or pending is None:
            return  # (a lifecycle node not configured loads the map at configure)
        path, self.map = pending
        before = self.localizer.last_estimate
        self.localizer = self._new_localizer(self.map)
        self._start_filter(before)
        self._counts["maps_loaded"] += 1
        self._tf_from = -math.inf
        self._publish_map()
        self.get_logger().info(f"map {path} loaded; the filter restarts "
                               + ("around the last estimate" if before is not None else "as at start"))

    def _publish_map(self) -> None:
        grid = self.map.map_grid()
        layers = tuple(grid.layers)
        if getattr(self, "_map_layers", None) != layers:  # first map, or one with other layers
            for pub in [*[p for pair in getattr(self, "_map_pubs", {}).values() for p in pair],
                        getattr(self, "_cloud_pub", None), getattr(self, "_scale_pub", None)]:
                if pub is not None:
                    self.destroy_publisher(pub)
            self._map_pubs, self._cloud_pub, self._scale_pub = create_map_publishers(self, None, layers)
            self._map_layers = layers
        publish_map_layout(self._map_pubs, self._cloud_pub, self._scale_pub, grid,
                           publication.publication(grid, self.map.field_unit), self.map.field_unit,
                           self.get_clock().now().to_msg())

    # ------------------------------------------------------------------------------------------ outputs

    def _tf_publisher(self) -> Any:
        from tf2_msgs.msg import TFMessage

        return self.create_publisher(TFMessage, "/tf", TF_QOS)

    def _publish_estimates(self, estimates: list) -> None:
        if not estimates:
            return
        node = self.config.node
        for est in estimates:
            self._pose_pub.publish(conversions.pose_with_covariance_msg(
                conversions.seconds_to_stamp(est.stamp), node.global_frame, est.pose, est.covariance))
            self._counts["poses_published"] += 1
        self._last_error = ""  # the diagnostics show ERROR until the next good update
        now = self._now() or 0.0
        if now - self._last_particles >= node.particles_period:
            self._last_particles = now
            self._particles_pub.publish(conversions.pose_array_msg(conversions.seconds_to_stamp(est.stamp),
                                                                   node.global_frame, self.localizer.filter.poses))
            self._counts["particles_published"] += 1
        self._publish_transform(est.stamp)

    def _publish_transform(self, stamp: float) -> None:
        node = self.config.node
        transform = self.localizer.map_to_odom()
        if not node.tf_broadcast or transform is None:
            return
        self._tf_from = stamp
        self._tf_pub.publish(conversions.transform_msg(conversions.seconds_to_stamp(stamp + node.transform_tolerance),
                                                       node.global_frame, node.odom_frame, transform))
        self._counts["transforms_published"] += 1

class LocalizerNode(_LocalizerCore, Node):
    """The plain node: configured and active from construction (``ros2 run gp_mapping localizer``)."""

    def __init__(self, **node_kwargs: Any) -> None:
        init_node(self, Node, LOCALIZER_NAME, node_kwargs, plain=True)


class LifecycleLocalizerNode(LifecycleCallbacks, _LocalizerCore, LifecycleNode):
    """The managed node (``ros2 run gp_mapping lifecycle_localizer``): configure loads the map (a missing one
    fails the transition with the reason), activate subscribes and publishes, deactivate stops both and keeps the
    filter, cleanup drops it."""

    deactivated_line = "deactivated: not localizing; the filter is kept"
    cleaned_up_line = "cleaned up: the map and the filter are dropped"

    def __init__(self, **node_kwargs: Any) -> None:
        init_node(self, LifecycleNode, LOCALIZER_NAME, node_kwargs, plain=False)

    def _configure_failed(self) -> None:
        self.localizer = None


def main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping localizer [--config FILE] [--ros-args ...]``."""
    ros_argv, _ = node_command(argv, "localizer", "Particle-filter localizer on a saved magnetic-field map.")
    return spin_node(ros_argv, "localizer", LOCALIZER_NAME, LocalizerNode)


def lifecycle_main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping lifecycle_localizer [--config FILE] [--autostart] [--ros-args ...]``."""
    ros_argv, autostart = node_command(argv, "lifecycle_localizer", "Particle-filter localizer on a saved "
                                       "magnetic-field map (managed, rclpy lifecycle).", lifecycle=True)
    return spin_node(ros_argv, "localizer", LOCALIZER_NAME, LifecycleLocalizerNode,
                     bring_up if autostart else None)


if __name__ == "__main__":
    sys.exit(main())
