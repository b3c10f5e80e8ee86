"""The ROS 2 mapping node: magnetometer + pose in, Gaussian-process map of the magnetic field out.

Run it with ``ros2 run gp_mapping mapper --ros-args --params-file config/mapper.yaml`` or
``gp-mapping node --config config/mapper.yaml`` (any ``--ros-args ...`` after it are passed to ROS): the plain
node, mapping from the start. ``ros2 run gp_mapping lifecycle_mapper`` runs the same node as an rclpy lifecycle
(managed) node: configure (parameters, model, publishers), activate (subscriptions, timers, services),
deactivate (keeps the map), cleanup (drops it); ``--autostart`` configures and activates it without a manager.
The node is thin: it converts messages to arrays, feeds a :class:`gp_mapping.mapping.mapper.Mapper`, and
converts the Mapper's grids back to messages. The offline replay drives the same Mapper the same way.

Subscriptions (sensor-data QoS: best effort, keep last ``node.queue_depth``)
    ``mag``   sensor_msgs/MagneticField, tesla, in the magnetometer frame (placed on the body by
              ``sync.sensor_translation`` / ``sync.sensor_rotation``).
    ``pose``  geometry_msgs/PoseStamped, nav_msgs/Odometry or geometry_msgs/PoseWithCovarianceStamped as
              ``node.pose_type`` says; the body pose in ``grid.frame_id`` (a pose in another frame is
              rejected and counted as ``pose_frame_mismatch``).
    ``/tf``, ``/tf_static``  tf2_msgs/TFMessage, instead of ``pose`` when ``node.pose_source`` is ``tf``: each
              reading gets the pose of ``grid.frame_id`` -> its frame (mount from /tf_static), or ->
              ``node.base_frame`` with the configured extrinsic (:class:`gp_mapping.mapping.transforms.TfPoseMatcher`;
              refusals ``tf_missing``, ``tf_stale``).
    Stamps come from the message headers; a header left at zero gets the receive time on the node's clock
    (the offline replay uses the bag's receive time for such messages).

Publications (reliable + transient local, depth 1, so a late subscriber such as RViz still gets the map)
    ``~/mean``, ``~/variance``   nav_msgs/OccupancyGrid, 0..100 and -1 where unknown (``sync.target``
                                 ``magnitude``); for ``vector`` one pair per layer instead:
                                 ``~/mean/x``, ``~/mean/y``, ``~/mean/z``, ``~/mean/norm`` and
                                 ``~/variance/x`` ... ``~/variance/norm``.
    ``~/cloud``                  sensor_msgs/PointCloud2, one point per known cell at its centre
                                 (z = ``grid.height`` for 3-D inputs, else 0), float32 fields
                                 ``x, y, z, mean, variance``
                                 (vector: ``mean_x .. mean_norm, variance_x .. variance_norm``), in the field
                                 unit (variance: unit squared). Lossless up to float32.
    ``~/scale``                  std_msgs/Float64MultiArray, how to decode the grids (below).
    ``/diagnostics``             diagnostic_msgs/DiagnosticArray every second: messages received, samples
                                 accepted, rejected by reason, update latency, map size, errors. Its level
                                 (:mod:`gp_mapping.mapping.health`): WARN for a magnetometer or pose stream silent
                                 ``node.stale_after`` s (STALE after ``node.stale_level_after``) or slower than
                                 ``node.expected_mag_rate`` / ``node.expected_pose_rate``, for more than
                                 ``node.max_refused_share`` of the readings refused or the model falling behind
                                 over ``node.diagnostics_window``; ERROR when updates fail or the map cannot be
                                 predicted or published; the message names each reason. A change of level is
                                 logged once.

The scale message (latched, republished with every map). A row-major L x 4 matrix, one row per layer::

    layout.dim[0]: label "layer:<names>" (e.g. "layer:magnitude" or "layer:x,y,z,norm"), size L, stride 4L
    layout.dim[1]: label "mean_offset,mean_scale,variance_offset,variance_scale;unit:<sync.field_unit>",
                   size 4, stride 4
    data[4i:4i+4] = mean_offset, mean_scale, variance_offset, variance_scale of layer i

A published cell value ``c`` in 0..100 decodes to ``mean = mean_offset + mean_scale * c`` (in the unit) and
``variance = variance_offset + variance_scale * c`` (unit squared), exact within half a step; -1 is unknown.
``gp_mapping.ros.conversions.scale_from_msg`` parses it.

Services (std_srvs/Trigger; a service type taking a file path, as nav2's and slam_toolbox's, needs a generated
interface package, which cannot be built from this package's wheels: the paths are parameters instead)
    ``~/save_map``   feeds every message received so far, runs the pending updates and the last partial batch
                     (samples still waiting for a following pose keep waiting), then writes the map state to a new
                     file ``<node.map_directory>/<node name>_<UTC time>.safetensors`` (``node.map_directory``
                     empty: ``$ROS_HOME/gp_mapping``, ``ROS_HOME`` defaulting to ``~/.ros``); never overwrites. The
                     response message is the absolute path. Start from it with the parameter ``node.initial_map``.
    ``~/load_map``   replaces the map by the state file named by ``node.initial_map`` (settable while running),
                     with the start-up checks: an unreadable or incompatible file is refused with the reason and
                     the current map stays. Buffered messages are dropped; the loaded map is published at once.
    ``~/reset``      forgets the map and the buffered messages; publishes all-unknown grids of the last geometry.
    They run on the update thread between two updates; they are served by a hidden helper node
    (``_<node name>_services``) with its own executor thread, so the node keeps taking messages meanwhile.

Checkpoints and resume. With ``node.checkpoint_interval_s`` > 0 a timer (node clock) has the Mapper write its
whole state atomically (temporary file, fsync, rename; safetensors, nothing executable) to
``node.checkpoint_path`` (default ``$ROS_HOME/gp_mapping/<node name>_checkpoint.safetensors``), and once more
on a clean shutdown. With ``node.resume`` (default) a node that finds that file starts from it, so a crash (even
SIGKILL) loses at most one interval. A checkpoint that cannot be read, or that was made with an incompatible
config (another kernel, target, engine ...), stops the node at start with the reason (exit status 2): the file
is left untouched, never overwritten by an empty map.

Bad input. Every refused message is counted by reason (``rejected/<reason>`` and ``node/rejected/<reason>`` in
the diagnostics; the table is in README "Bad input and reliability"), and a summary of new refusals is logged
at most every LOG_THROTTLE_S seconds. The queues are bounded: the subscriptions keep ``node.queue_depth``
messages (what the transport drops beyond them shows as ``transport_lost_mag`` / ``transport_lost_pose``, from
gaps in each publisher's sequence numbers), the inbox of the update thread 2 x ``batching.max_pending`` (oldest
dropped, ``inbox_overflow``),
the Mapper ``batching.max_pending`` samples (oldest dropped, ``dropped_overflow``).

Parameters: every key of ``config/mapper.yaml`` (``model.*``, ``sync.*``, ``batching.*``, ``grid.*``,
``node.*``), declared with type, description and range, validated by :mod:`gp_mapping.config` at start (a bad
value or an unknown key stops the node with a message naming it, exit status 2) and on every live change
(refused with the reason, the old value stays). Only :data:`LIVE_PARAMETERS` can change while the node runs;
the others are read-only because the model or the subscriptions are built from them. ``use_sim_time`` works:
stamps come from the messages, the publishing and diagnostics timers from the node's clock.
"""
from __future__ import annotations

import argparse
import array
import dataclasses
import faulthandler
import math
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from nav_msgs.msg import OccupancyGrid
from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType,
                                SetParametersResult)
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import MagneticField, PointCloud2
from std_msgs.msg import Float64MultiArray, UInt8MultiArray
from std_srvs.srv import Trigger

from gp_mapping.config import (ROS_RESERVED_KEYS, ConfigError, MapperConfig, describe_allowed, config_from_dict,
                               field_specs, shorten, to_flat_parameters, validate_value)
from gp_mapping.gp import warm_up as warm_up_engines
from gp_mapping.mapping import publication
from gp_mapping.mapping.grid import check_grid_config
from gp_mapping.mapping.health import OK, WARN, Health, HealthMonitor, Tick
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.merge import (MapSource, TileRotation, encode_summary, summary_overhead_bytes,
                                      tile_summary_bytes)
from gp_mapping.mapping.publication import NODE_NAME
from gp_mapping.mapping.sync import SAMPLE_REJECTION_REASONS
from gp_mapping.mapping.transforms import TfPoseMatcher
from gp_mapping.ros import conversions
from gp_mapping.runtime import keep_freed_memory

DIAGNOSTICS_PERIOD = 1.0  # seconds (node clock), the usual rate of /diagnostics
# Parameters the running node applies when they change (the Mapper reads them at every prediction); every
# other one is declared read-only because the model, the sync, the grid lattice or the subscriptions are built
# from it at start.
LIVE_PARAMETERS = frozenset({"node.publish_period", "grid.unknown_distance", "grid.tile_size", "grid.margin",
                             "grid.window", "grid.height",
                             "grid.mean_range", "grid.variance_range", "node.initial_map", "node.map_directory",
                             "node.stale_after", "node.stale_level_after", "node.expected_mag_rate",
                             "node.expected_pose_rate", "node.max_refused_share", "node.diagnostics_window"})
EXIT_OK, EXIT_FAILURE, EXIT_BAD_CONFIG = 0, 1, 2
LOG_THROTTLE_S = 5.0  # seconds between two log lines about refused input, failed updates or dropped backlog
MAX_TRACKED_PUBLISHERS = 64  # per input topic, for counting messages lost in transport
SERVICE_TIMEOUT_S = 300.0  # a service waits this long for its job on the update thread (a save flushes the backlog)

_PARAMETER_TYPES = {"bool": ParameterType.PARAMETER_BOOL, "int": ParameterType.PARAMETER_INTEGER,
                    "float": ParameterType.PARAMETER_DOUBLE, "str": ParameterType.PARAMETER_STRING,
                    "list": ParameterType.PARAMETER_DOUBLE_ARRAY}

MAP_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)
# Requests the services keep while earlier ones run (rclpy's default keeps 10: of 50 concurrent ~/reset calls 39
# were never answered). Each request waits its turn on the update thread, so a burst is answered in order.
SERVICE_QUEUE_DEPTH = 1000
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=SERVICE_QUEUE_DEPTH,
                         reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)


MODEL_TOPIC = "~/model"  # the model summary a merger node merges (std_msgs/UInt8MultiArray: safetensors bytes)


def create_map_publishers(node: Node, config: MapperConfig) -> tuple[dict[str, tuple[Any, Any]], Any, Any]:
    """The map topics of ``node`` (latched): layer -> (~/mean..., ~/variance...) publishers, ~/cloud, ~/scale.
    The mapping node and the merger node publish through these and :func:`publish_map_layout`."""
    map_pubs = {layer: (node.create_publisher(OccupancyGrid, mean, MAP_QOS),
                        node.create_publisher(OccupancyGrid, var, MAP_QOS))
                for layer, (mean, var) in map_topics(config).items()}
    return (map_pubs, node.create_publisher(PointCloud2, publication.cloud_topic(), MAP_QOS),
            node.create_publisher(Float64MultiArray, publication.scale_topic(), MAP_QOS))


def publish_map_layout(map_pubs, cloud_pub, scale_pub, grid: Any, layout: Any, field_unit: str, stamp: Any) -> None:
    """Publish an encoded map (:func:`gp_mapping.mapping.publication.publication`): the scale first, so a
    subscriber that decodes a grid already has the scale that matches it; then each layer's grids; the cloud."""
    scale_pub.publish(conversions.scale_to_msg(layout.layers, field_unit))
    for layer in layout.layers:
        mean_pub, var_pub = map_pubs[layer.name]
        mean_pub.publish(conversions.occupancy_msg(grid, layer.mean_data, stamp))
        var_pub.publish(conversions.occupancy_msg(grid, layer.variance_data, stamp))
    cloud_pub.publish(conversions.cloud_msg(grid, stamp, points=layout.cloud))


class NodeStartError(RuntimeError):
    """The node cannot start (a bad parameter, an unreadable initial map, a mapper that cannot be built)."""


# --------------------------------------------------------------------------------------- static description


def layer_names(config: MapperConfig) -> tuple[str, ...]:
    """Layers of the published map for the configured ``sync.target``."""
    return publication.layer_names(config.sync.target)


def map_topics(config: MapperConfig) -> dict[str, tuple[str, str]]:
    """Layer -> (mean topic, variance topic), relative to the node (``~/...``)."""
    return publication.map_topics(layer_names(config))


def published_topics(config: MapperConfig) -> dict[str, str]:
    """Every topic the node publishes (node-relative or absolute) -> its message type."""
    topics = publication.map_topic_types(layer_names(config))
    topics["/diagnostics"] = "diagnostic_msgs/msg/DiagnosticArray"
    return topics


def parameter_descriptor(name: str, spec: dataclasses.Field) -> ParameterDescriptor:
    """The ROS descriptor of one config field: type, description, allowed values, range, read-only."""
    ftype = spec.type if isinstance(spec.type, str) else spec.type.__name__
    meta = spec.metadata
    allowed = describe_allowed(meta, ftype)
    descriptor = ParameterDescriptor(name=name, type=_PARAMETER_TYPES[ftype], description=meta["doc"],
                                     additional_constraints=allowed, read_only=name not in LIVE_PARAMETERS)
    if ftype == "list" and isinstance(meta.get("length"), tuple) and 0 in meta["length"]:
        # rclpy types an empty list as a byte array and would then refuse numbers; the config validation
        # checks the values instead.
        descriptor.dynamic_typing = True
    low, high = meta.get("low"), meta.get("high")
    if ftype == "float" and low is not None and high is not None:
        # ROS ranges are closed; an open lower bound (low_open) is enforced by the config validation.
        descriptor.floating_point_range = [FloatingPointRange(from_value=float(low), to_value=float(high), step=0.0)]
    elif ftype == "int" and low is not None and high is not None:
        descriptor.integer_range = [IntegerRange(from_value=int(low), to_value=int(high), step=1)]
    return descriptor


def default_map_path(node_name: str = NODE_NAME, kind: str = "map") -> Path:
    """``$ROS_HOME/gp_mapping/<node name>_<kind>.safetensors`` (ROS_HOME: ~/.ros); ``kind="checkpoint"``: the
    default checkpoint file."""
    ros_home = os.environ.get("ROS_HOME") or os.path.join(os.path.expanduser("~"), ".ros")
    return Path(ros_home) / "gp_mapping" / f"{node_name}_{kind}.safetensors"


def saved_map_path(directory: str, node_name: str, now: float | None = None) -> Path:
    """Where ``~/save_map`` writes: ``<directory>/<node name>_<UTC time>.safetensors`` (``directory`` empty:
    ``$ROS_HOME/gp_mapping``); the time has milliseconds, and a name already taken gets a counter, so a save
    never overwrites an earlier one."""
    folder = Path(directory).expanduser() if directory else default_map_path(node_name).parent
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    path = folder / f"{node_name}_{stamp}.safetensors"
    counter = 1
    while path.exists():
        path = folder / f"{node_name}_{stamp}_{counter}.safetensors"
        counter += 1
    return path


def _plain(value: Any) -> Any:
    """A parameter value as plain Python (rclpy hands arrays as array.array)."""
    if isinstance(value, (array.array, tuple)):
        return list(value)
    return value


# -------------------------------------------------------------------------------------------------- the node


class _MapperCore:
    """The mapping node's work, shared by the plain node (:class:`MapperNode`, running from construction) and
    the lifecycle node (:class:`LifecycleMapperNode`). Its stages follow the lifecycle:

    - :meth:`_configure`: parameters read and validated, the Mapper built (from a checkpoint or
      ``node.initial_map`` when set), publishers made;
    - :meth:`_activate`: subscriptions, timers, services and the update thread: mapping and publishing;
    - :meth:`_deactivate`: all of those stopped; the map, the publishers (latched maps) and the parameters stay;
    - :meth:`_cleanup`: the map and the publishers dropped.

    It feeds the Mapper from a worker thread and publishes on a timer."""

    _active = False

    def _init_core(self) -> None:
        """Declare and validate the parameters (a bad one raises NodeStartError) and the live-change hooks."""
        self.config = self._declare_parameters()
        self._specs = field_specs()
        self.mapper: Mapper | None = None
        self._map_pubs: dict = {}
        self.add_pre_set_parameters_callback(self._coerce_parameter_types)
        self.add_on_set_parameters_callback(self._validate_parameter_change)
        self.add_post_set_parameters_callback(self._apply_parameter_change)

    def _configure(self) -> None:
        """Parameters (their current values) and the model; publishers. NodeStartError when either is bad."""
        if self.mapper is None and getattr(self, "_configured_once", False):  # after a cleanup: re-read
            values = {name: _plain(self.get_parameter(name).value) for name in field_specs()}
            try:
                self.config = config_from_dict(values)
            except ConfigError as err:
                raise NodeStartError(f"bad parameter: {err}") from err
        self._configured_once = True
        self.mapper = self._build_mapper()
        # The update thread is the only user of the mapper: the executor's callbacks never wait for an update.
        # They queue messages (inbox) and jobs (publish, checkpoint, services, parameter changes) that the thread
        # runs between two updates, so the subscriptions keep up with a flood while a long update runs. The lock
        # only makes it safe for tests to look inside while the thread runs.
        self._lock = threading.Lock()
        self._inbox_cond = threading.Condition()  # guards _inbox, _jobs, _queued and _stopping
        # (kind, stamp, values, (orientation, frame_id) or frame_id, receive time or None)
        self._inbox: deque[tuple[str, float, Any, Any, float | None]] = deque()
        self._jobs: deque[tuple[str, Callable[[], Any], Future]] = deque()
        self._queued: set[str] = set()  # names of the periodic jobs waiting in _jobs (one of each at most)
        self._updates_waiting = False  # the last update step ran an update: more full batches may be ready
        self._stopping = False
        self._mapper_diagnostics: dict[str, Any] = self.mapper.diagnostics()  # the update thread refreshes it
        self._counts: dict[str, int] = {"mag_messages": 0, "pose_messages": 0, "tf_messages": 0, "updates": 0,
                                        "maps_published": 0, "errors": 0, "stamps_from_clock": 0}
        self._node_rejected: dict[str, int] = {"pose_frame_mismatch": 0, "inbox_overflow": 0,
                                               "transport_lost_mag": 0, "transport_lost_pose": 0}
        self._latency = {"last": math.nan, "max": 0.0, "sum": 0.0, "count": 0}
        self._publish_seconds = math.nan
        self._publish_due = False  # the publish timer ticked since the last map
        self._updating = False  # the update thread is feeding the mapper or updating the model
        self._logged_counts: dict[str, int] = {}  # refusal counts at the last log line about them
        self._logged_field_frame = ""
        self._checkpoint = {"written": 0, "failed": 0, "seconds": math.nan, "error": ""}
        self._last_error = ""
        self._last_grid = None  # the last published MapGrid (geometry for the cleared map after a reset)
        self._last_sequence: dict[str, dict[bytes, int]] = {"mag": {}, "pose": {}}
        self._tf: TfPoseMatcher | None = None
        self._map_pubs, self._cloud_pub, self._scale_pub = create_map_publishers(self, self.config)
        self._model_pub = self.create_publisher(UInt8MultiArray, MODEL_TOPIC, MAP_QOS)
        self._model = {"sent": 0, "parts": 0, "too_large": 0, "failed": 0, "bytes": 0, "num_seen": -1}
        self._tile_rotation = TileRotation()  # which tiles the next part of a large tiled map's summary carries
        self._last_seen: dict[str, float | None] = {"magnetometer": None, "pose": None}  # node clock [s]
        self._tf_dynamic_messages = 0
        self._health: HealthMonitor | None = None
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)

    def _activate(self) -> None:
        """Subscriptions, timers, services and the update thread: the node maps and publishes."""
        depth = self.config.node.queue_depth
        self._health = HealthMonitor(self.config.node, self._now() or 0.0)  # silence counts from activation
        sensor_qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth,
                                reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE)
        # The two-argument callbacks get the message info: its sequence numbers reveal messages that the
        # transport dropped before the node could take them (a full subscription queue under load).
        self._active_entities: list = [
            self.create_subscription(MagneticField, "mag", lambda msg, info: self._receive("mag", msg, info),
                                     sensor_qos)]
        if self.config.node.pose_source == "tf":
            self._subscribe_tf()
        else:
            self._active_entities.append(
                self.create_subscription(conversions.POSE_TYPES[self.config.node.pose_type], "pose",
                                         lambda msg, info: self._receive("pose", msg, info), sensor_qos))
        self._publish_timer = self.create_timer(self.config.node.publish_period, self._on_publish_timer)
        self._active_entities += [self._publish_timer,
                                  self.create_timer(DIAGNOSTICS_PERIOD, self._publish_diagnostics)]
        if self.config.node.checkpoint_interval_s > 0:
            self._active_entities.append(self.create_timer(self.config.node.checkpoint_interval_s,
                                                           self._on_checkpoint_timer))
        if self.config.node.model_period > 0 and hasattr(self.mapper.model, "recyclable_summary"):
            self._active_entities.append(self.create_timer(self.config.node.model_period,
                                                           lambda: self._submit("model", self.publish_model)))

        # The services wait for the update thread (a save first runs the backlog), so they live on a hidden
        # helper node with its own executor thread: while one runs, this node keeps taking messages. Their
        # names are this node's (~/save_map, ~/load_map, ~/reset).
        # Global ROS arguments stay off it: `-r __node:=name` would give it this node's name.
        self._service_node = rclpy.create_node(f"_{self.get_name()}_services", namespace=self.get_namespace(),
                                               context=self.context, use_global_arguments=False,
                                               start_parameter_services=False)
        own_name = self.get_fully_qualified_name()
        for name, callback in (("save_map", self.on_save_map), ("reset", self.on_reset),
                               ("load_map", self.on_load_map)):
            self._service_node.create_service(Trigger, f"{own_name}/{name}", callback, qos_profile=SERVICE_QOS)
        self._service_executor = SingleThreadedExecutor(context=self.context)
        self._service_executor.add_node(self._service_node)
        self._service_thread = threading.Thread(target=self._spin_services, name="gp_mapping_services",
                                                daemon=True)
        with self._inbox_cond:
            self._stopping = False
        self._worker = threading.Thread(target=self._worker_loop, name="gp_mapping_updates", daemon=True)
        self._worker.start()
        self._service_thread.start()
        self._active = True
        self.get_logger().info(self.describe())

    def _deactivate(self) -> None:
        """Stop taking messages, publishing and serving; the update thread finishes its step and stops. The map
        (with the messages already received, fed to it) and the latched maps stay."""
        self._active = False
        with self._inbox_cond:
            self._stopping = True
            self._inbox_cond.notify_all()
        for entity in self._active_entities:
            if hasattr(entity, "cancel"):  # a timer
                self.destroy_timer(entity)
            else:
                self.destroy_subscription(entity)
        self._active_entities = []
        self._worker.join(timeout=30.0)
        self._service_executor.shutdown()
        self._service_thread.join(timeout=10.0)
        if self._service_thread.is_alive():
            # rclpy crashes (SIGSEGV) when a node is destroyed under an executor still waiting on it: leave the
            # helper node to the process's exit rather than take the process down
            self.get_logger().error("the service thread did not stop within 10 s; its node is left undestroyed")
        else:
            self._service_node.destroy_node()
        with self._inbox_cond:  # jobs that will never run: their callers get an answer now
            for name, _, future in self._jobs:
                future.set_exception(RuntimeError(f"{name}: the node stopped before it ran"))
            self._jobs.clear()
            self._queued.clear()
        with self._lock:
            try:
                self._feed_inbox()  # what was received is kept (no update runs: batches stay as cut)
            except Exception as err:
                self._report(f"feeding the mapper failed: {type(err).__name__}: {err}")

    def _cleanup(self) -> None:
        """Drop the map and the publishers (back to unconfigured)."""
        for pub in [p for pair in self._map_pubs.values() for p in pair] + [self._cloud_pub, self._scale_pub,
                                                                              self._diag_pub]:
            self.destroy_publisher(pub)
        self._map_pubs = {}
        self.mapper = None

    def describe(self) -> str:
        """The start-up line: what is mapped, from which topics and frames, with which engine on which device."""
        c = self.config
        resolve = self.resolve_topic_name
        if self._tf is not None:
            pose = (f"pose from tf ({resolve('/tf')}, {resolve('/tf_static')}): {c.grid.frame_id} -> the "
                    f"magnetometer frame, or -> {c.node.base_frame} with the configured sensor extrinsic")
        else:
            pose = f"pose {c.node.pose_type} on {resolve('pose')} in frame '{c.grid.frame_id}'"
        device = getattr(getattr(self.mapper, "model", None), "device", c.model.device)
        return (f"mapping {c.sync.target} of the field in {c.sync.field_unit}: magnetometer on {resolve('mag')}, "
                f"{pose}; map frame '{c.grid.frame_id}'; {c.model.engine} (M={c.model.num_inducing}) on {device}; "
                f"publishing under {self.get_fully_qualified_name()}/ every {c.node.publish_period} s")

    def _subscribe_tf(self) -> None:
        """``node.pose_source: tf``: /tf and /tf_static (the QoS of tf2_ros's listener) feed the transform
        buffer that places each reading (mapping/transforms.py, shared with the replay)."""
        try:
            from tf2_msgs.msg import TFMessage
        except ImportError as err:
            raise NodeStartError("node.pose_source is 'tf' but the tf2_msgs Python package is not installed (it "
                                 "comes with ROS; in this repository's venv `make venv` builds it)") from err
        c = self.config
        self._tf = TfPoseMatcher(c.grid.frame_id, c.node.base_frame,
                                 (c.sync.sensor_translation, c.sync.sensor_rotation), c.sync.max_pose_gap,
                                 c.node.tf_timeout, cache_seconds=max(c.sync.pose_buffer_seconds, 10.0))
        dynamic = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.VOLATILE)
        static = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                            durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self._active_entities += [
            self.create_subscription(TFMessage, "/tf", lambda msg: self.on_tf(msg, static=False), dynamic),
            self.create_subscription(TFMessage, "/tf_static", lambda msg: self.on_tf(msg, static=True), static)]

    # ------------------------------------------------------------------------------------------ parameters

    def _declare_parameters(self) -> MapperConfig:
        """Validate the overrides (params file, -p) with the config module, then declare every parameter."""
        # rclpy offers no public accessor for the overrides it parsed; they are needed to refuse unknown keys
        # (rclpy would silently ignore them) before anything is declared.
        overrides = {name: _plain(p.value) for name, p in self._parameter_overrides.items()
                     if name.split(".")[0] not in ROS_RESERVED_KEYS}
        try:
            config = config_from_dict(overrides)
        except ConfigError as err:
            raise NodeStartError(f"bad parameter: {err}") from err
        for name, value in to_flat_parameters(config).items():
            # The validated value (ints written for floats are converted) wins over the raw override.
            self.declare_parameter(name, value, parameter_descriptor(name, field_specs()[name]),
                                   ignore_override=True)
        return config

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint file: ``node.checkpoint_path``, or the default beside the saved maps."""
        configured = self.config.node.checkpoint_path
        return Path(configured).expanduser() if configured else default_map_path(self.get_name(), "checkpoint")

    def _build_mapper(self) -> Mapper:
        node = self.config.node
        checkpoint = self.checkpoint_path
        if node.checkpoint_interval_s > 0 and node.resume and checkpoint.exists():
            try:
                mapper = Mapper.load(checkpoint, config=self.config)
            except Exception as err:  # the file stays: an empty map must never overwrite what was learned
                raise NodeStartError(f"cannot resume from the checkpoint {checkpoint}: {err}; move the file away "
                                     "or set node.resume to false to start empty") from err
            self.get_logger().info(f"resumed from the checkpoint {checkpoint} ({mapper.diagnostics()['num_seen']} "
                                   f"samples in the model, {mapper.num_pending} pending)")
            return mapper
        path = node.initial_map
        if path:
            try:
                mapper = Mapper.load(path, config=self.config)
            except Exception as err:  # any failure to read the file is a bad parameter value
                raise NodeStartError(shorten(f"bad parameter: node.initial_map = {shorten(repr(path), 120)}: {err}",
                                             600)) from err
            self.get_logger().info(f"started from the map in {shorten(path)}")
            return mapper
        try:
            return Mapper(self.config)
        except Exception as err:
            raise NodeStartError(f"cannot build the mapper from the parameters: {err}") from err

    def _coerce_parameter_types(self, params: list) -> list:
        """Before ROS checks the types of a live change: an integer for a float parameter (``3`` for 3.0) becomes
        that float, and a whole float for an integer parameter that integer, as at start (the config
        validation converts them there); anything else is left for the validation to refuse by name."""
        from rclpy.parameter import Parameter

        out = []
        for param in params:
            spec = self._specs.get(param.name) if hasattr(self, "_specs") else None
            ftype = None if spec is None else (spec.type if isinstance(spec.type, str) else spec.type.__name__)
            value = param.value
            if ftype == "float" and param.type_ == Parameter.Type.INTEGER:
                param = Parameter(param.name, Parameter.Type.DOUBLE, float(value))
            elif ftype == "int" and param.type_ == Parameter.Type.DOUBLE and math.isfinite(value) \
                    and float(value).is_integer():
                param = Parameter(param.name, Parameter.Type.INTEGER, int(value))
            elif ftype == "list" and param.type_ == Parameter.Type.INTEGER_ARRAY:
                param = Parameter(param.name, Parameter.Type.DOUBLE_ARRAY, [float(v) for v in value])
            out.append(param)
        return out

    def _validate_parameter_change(self, params: list) -> SetParametersResult:
        grid_changes = {}
        for param in params:
            spec = self._specs.get(param.name)
            if spec is None:
                continue
            try:
                value = validate_value(param.name, _plain(param.value), spec)
            except ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
            section, _, key = param.name.partition(".")
            if section == "grid":
                grid_changes[key] = value
        if grid_changes:  # the rules between grid keys (window cells, unknown_distance within the window)
            # The parameters hold the values accepted so far (the shared config follows on the update thread).
            current = {name.split(".", 1)[1]: validate_value(name, _plain(self.get_parameter(name).value),
                                                             self._specs[name])
                       for name in LIVE_PARAMETERS if name.startswith("grid.")}
            try:
                check_grid_config(dataclasses.replace(self.config.grid, **{**current, **grid_changes}))
            except ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
        return SetParametersResult(successful=True)

    def _apply_parameter_change(self, params: list) -> None:
        for param in params:
            if param.name not in LIVE_PARAMETERS:
                continue
            section, key = param.name.split(".")
            value = validate_value(param.name, _plain(param.value), self._specs[param.name])
            # The Mapper holds this same config object and reads it when predicting, on the update thread.
            if self._active:
                self._submit(f"set {param.name}", lambda s=section, k=key, v=value: self._set_config(s, k, v),
                             periodic=False)
            else:  # no update thread (a lifecycle node not active): the config takes it now
                setattr(getattr(self.config, section), key, value)
                if self.mapper is not None:
                    self.mapper.mark_changed()
            if param.name == "node.publish_period" and self._active:
                self._publish_timer.timer_period_ns = int(round(value * 1e9))
                self._publish_timer.reset()
            self.get_logger().info(f"parameter {param.name} = {shorten(repr(value))} applied")

    # -------------------------------------------------------------------------------------------- inputs

    def _push(self, item: tuple[str, float, Any, Any, float | None]) -> None:
        with self._inbox_cond:
            # Bounded like the mapper's own queue: a reading and a pose per sample.
            if len(self._inbox) >= 2 * self.config.batching.max_pending:
                self._inbox.popleft()  # the mapper cannot keep up: drop the oldest message, counted
                self._node_rejected["inbox_overflow"] += 1
            self._inbox.append(item)
            self._inbox_cond.notify()

    def _now(self) -> float | None:
        """The node clock [s], or None before it runs (sim time before the first /clock)."""
        now = self.get_clock().now().nanoseconds * 1e-9
        return now if now > 0 else None

    @property
    def backlog(self) -> int:
        """Messages received and not yet handed to the mapper (the update thread is busy)."""
        with self._inbox_cond:
            return len(self._inbox)

    def _receive_stamp(self, stamp: float, now: float | None) -> float:
        """A message stamp, or the receive time (node clock) where the publisher left it at zero, as the
        offline replay uses the bag's receive time for such messages."""
        if stamp != 0.0:
            return stamp
        self._counts["stamps_from_clock"] += 1
        return now if now is not None else 0.0

    def _receive(self, topic: str, msg: Any, info: dict[str, Any]) -> None:
        """A subscription callback: count what the transport lost since this publisher's previous message
        (a gap in its sequence numbers), then handle the message."""
        sequence, gid = info.get("publication_sequence_number"), info.get("publisher_gid")
        if sequence and gid is not None:  # None or 0 where the middleware does not number its messages
            key = bytes(gid.get("data", b"")) if isinstance(gid, dict) else bytes(gid)
            seen = self._last_sequence[topic]
            last = seen.pop(key, None)
            if last is not None and sequence > last + 1:
                self._node_rejected[f"transport_lost_{topic}"] += sequence - last - 1
            seen[key] = sequence if last is None else max(sequence, last)
            if len(seen) > MAX_TRACKED_PUBLISHERS:  # publishers that come and go: forget the longest silent
                del seen[next(iter(seen))]
        (self.on_mag if topic == "mag" else self.on_pose)(msg)

    def on_mag(self, msg: MagneticField) -> None:
        """Subscription callback of ``mag`` (public so that tests can drive the node without DDS)."""
        stamp, field_tesla, frame = conversions.field_from_msg(msg)
        now = self._now()
        self._counts["mag_messages"] += 1
        self._last_seen["magnetometer"] = now
        self._push(("field", self._receive_stamp(stamp, now), field_tesla, frame, now))

    def on_pose(self, msg: Any) -> None:
        """Subscription callback of ``pose``."""
        stamp, position, orientation, frame = conversions.pose_from_msg(msg)
        now = self._now()
        stamp = self._receive_stamp(stamp, now)
        self._counts["pose_messages"] += 1
        self._last_seen["pose"] = now
        self._push(("pose", stamp, position, (orientation, frame), now))

    def on_tf(self, msg: Any, static: bool = False) -> None:
        """Subscription callback of ``/tf`` and ``/tf_static`` (``node.pose_source: tf``)."""
        samples = conversions.transforms_from_msg(msg)
        self._counts["tf_messages"] += 1
        now = self._now()
        if not static:  # /tf is the pose stream (the diagnostics' silence and rate checks)
            self._tf_dynamic_messages += 1
            self._last_seen["pose"] = now
        self._push(("tf", 0.0, samples, static, now))

    def _feed_inbox(self) -> None:
        """Hand every buffered message to the mapper in arrival order (caller holds ``_lock``)."""
        with self._inbox_cond:
            items, self._inbox = self._inbox, deque()
        tf = self._tf
        for kind, stamp, a, b, now in items:
            if kind == "pose":
                self.mapper.add_pose(stamp, a, b[0], receive_time=now, frame_id=b[1])
            elif kind == "tf":
                for sample in a:
                    tf.add_transform(sample, static=b)
                for notice in tf.buffer.take_notices():  # each re-parenting or refusal kind once (tf2 warns too)
                    self.get_logger().warning(notice)
            elif tf is not None:
                tf.add_field(stamp, a, b, receive_time=now)
            else:
                self.mapper.add_magnetic_field(stamp, a, frame_id=b, receive_time=now)
        if tf is not None:  # readings whose transforms have come, in arrival order, each with its pose
            for stamp, position, orientation, reading in tf.ready():
                self.mapper.add_pose(stamp, position, orientation, receive_time=reading.receive_time,
                                     frame_id=self.config.grid.frame_id)
                self.mapper.add_magnetic_field(stamp, reading.field, frame_id=reading.frame_id,
                                               receive_time=reading.receive_time)
        refused = self.mapper.pose_frame_mismatch  # the Mapper's rule: a pose must be in grid.frame_id
        if refused != self._node_rejected["pose_frame_mismatch"]:
            if refused > self._node_rejected["pose_frame_mismatch"]:
                frames = ", ".join(repr(f) for f in sorted(self.mapper.refused_pose_frames))
                self.get_logger().warning(f"poses in frame(s) {frames}, expected grid.frame_id "
                                          f"'{self.config.grid.frame_id}'; rejected (node.pose_source topic: the "
                                          "pose topic must be in the map frame; node.pose_source tf looks frames "
                                          "up in /tf)", throttle_duration_sec=5.0)
            self._node_rejected["pose_frame_mismatch"] = refused

    def _run_updates(self, flush: bool = False, max_updates: int | None = None) -> int:
        """Run the model updates the mapper has full batches for (``flush``: and the partial one, keeping samples
        that still wait for a pose); caller holds ``_lock``. Returns how many updates ran."""
        start = time.perf_counter()
        try:
            updates = (self.mapper.flush(end_of_stream=False) if flush
                       else self.mapper.process(max_updates=max_updates))
        except Exception as err:  # a failed update must not take the node down; it is reported
            self._report(f"update failed: {type(err).__name__}: {err}")
            return 0
        seconds = time.perf_counter() - start
        n = len(updates or [])
        if n:
            self._counts["updates"] += n
            self._latency["last"] = seconds
            self._latency["max"] = max(self._latency["max"], seconds)
            self._latency["sum"] += seconds
            self._latency["count"] += 1
        return n

    # ---------------------------------------------------------------------------------- the update thread

    def _submit(self, name: str, job: Callable[[], Any], periodic: bool = True) -> Future | None:
        """Queue ``job`` for the update thread; it runs before the next update. A periodic job (publish,
        checkpoint) is queued once: a tick that finds it still waiting adds nothing. Returns the job's future,
        or None where it was not queued (already waiting, or the node is stopping)."""
        future: Future = Future()
        with self._inbox_cond:
            if self._stopping or (periodic and name in self._queued):
                return None
            if periodic:
                self._queued.add(name)
            self._jobs.append((name, job, future))
            self._inbox_cond.notify()
        return future

    def _worker_loop(self) -> None:
        """Run the queued jobs, feed the mapper and run one update; again while there is work."""
        while True:
            with self._inbox_cond:
                while not (self._inbox or self._jobs or self._updates_waiting or self._stopping):
                    self._inbox_cond.wait()
                if self._stopping:
                    return
                jobs, self._jobs = self._jobs, deque()
                self._queued.clear()
            for name, job, future in jobs:
                try:
                    future.set_result(job())
                except Exception as err:  # the caller (a service) gets the error; the thread goes on
                    future.set_exception(err)
            with self._lock:
                self._updating = True
                try:
                    try:
                        self._feed_inbox()
                    except Exception as err:  # the thread must survive whatever one message does
                        self._report(f"feeding the mapper failed: {type(err).__name__}: {err}")
                    self._updates_waiting = self._run_updates(max_updates=1) > 0
                    self._mapper_diagnostics = self.mapper.diagnostics()
                finally:
                    self._updating = False
            # A timer tick that came during the update is served right after it: a job queued by the tick
            # would wait for the next update, seconds when updates are slow (a flood, a small CPU).
            self._publish_if_due()

    def _set_config(self, section: str, key: str, value: Any) -> None:
        with self._lock:
            setattr(getattr(self.config, section), key, value)
            self.mapper.mark_changed()

    def _report(self, message: str) -> None:
        """An error that the node survives: logged (throttled) and shown as ERROR in the diagnostics."""
        message = shorten(message, 1000)
        self._last_error = message
        self._counts["errors"] += 1
        self.get_logger().error(message, throttle_duration_sec=5.0)

    # ------------------------------------------------------------------------------------------- outputs

    def _stamp_of(self, grid: Any):
        stamp = getattr(grid, "stamp", None)
        if stamp is not None and math.isfinite(stamp) and stamp >= 0:
            return conversions.seconds_to_stamp(stamp)
        return self.get_clock().now().to_msg()

    def _on_publish_timer(self) -> None:
        # At most one map per tick (node clock, so sim time too), and only a map that changed since the last one
        # (the Mapper's rule). A tick during an update is served right after it (the map has changed by then);
        # otherwise a changed map goes out through a job at once.
        changed = self.mapper.map_changed
        if changed or self._updating:
            self._publish_due = True
        if changed:
            self._submit("publish", self._publish_if_due)

    def _publish_if_due(self) -> None:
        if self._publish_due and self.mapper.map_changed:
            self.publish_map()

    def publish_map(self) -> None:
        """Predict the grid and publish it (on the update thread; tests call it directly)."""
        start = time.perf_counter()
        self._publish_due = False
        with self._lock:
            self.mapper.mark_published()
            try:
                grid = self.mapper.grid(predict_unknown=False, incremental=True)  # known cells only
            except Exception as err:
                self._report(f"map prediction failed: {type(err).__name__}: {err}")
                return
        if grid is None:
            return
        try:
            self._publish_grid(grid)
        except Exception as err:
            if not self.context.ok() or self._stopping:  # shut down (SIGTERM, Ctrl-C) during the prediction
                return
            self._report(f"map publication failed: {type(err).__name__}: {err}")
            return
        self._publish_seconds = time.perf_counter() - start

    def _publish_grid(self, grid: Any) -> None:
        stamp = self._stamp_of(grid)
        try:
            layout = publication.publication(grid, self.config.sync.field_unit, self.config.grid.mean_range,
                                             self.config.grid.variance_range)
        except Exception as err:
            self._report(f"map encoding failed: {type(err).__name__}: {err}")
            return
        publish_map_layout(self._map_pubs, self._cloud_pub, self._scale_pub, grid, layout, self.config.sync.field_unit,
                           stamp)
        self._last_grid = grid
        self._counts["maps_published"] += 1
        self._last_error = ""  # the diagnostics show ERROR until the next good map

    def _publish_cleared(self) -> None:
        """After a reset: the last geometry with every cell unknown, published as any map is (the scale that goes
        with it first, the cloud without points), stamped on the maps' clock (the last map's data time)."""
        grid = self._last_grid
        if grid is None:
            return
        self._publish_grid(dataclasses.replace(grid, known=np.zeros(grid.spec.shape, dtype=bool)))

    def publish_model(self) -> bool:
        """Send the model summary on ~/model if the map took data since the last one (on the update thread).
        Returns whether one was sent; a summary over ``node.model_max_bytes`` is counted and logged, not sent. A
        tiled map's summary (every tile's) grows with the map: once it is over the limit it goes in parts, one
        per period, each as many tiles as fit, those that took data first (merge.TileRotation); parts go on while
        the map stands still, so a merger that starts late completes it. Only a tile too large for a message
        alone stops it (counted, warned once: the map merges from its saved state then)."""
        limit = self.config.node.model_max_bytes
        with self._lock:
            model = self.mapper.model
            seen = int(model.num_seen)
            sizes = tile_summary_bytes(model)
            tiled = sizes is not None
            part = None
            budget = limit - summary_overhead_bytes(self.mapper) if tiled else limit
            if tiled and sum(sizes.values()) > budget:
                if max(sizes.values()) > budget:  # a tile that no part can carry: the merger could never finish
                    return self._tiled_summary_too_large(limit - budget + max(sizes.values()), limit)
                samples = model.tile_samples()
                part = self._tile_rotation.choose(samples, sizes, budget)
            if seen == 0 or (part is None and seen == self._model["num_seen"]):
                return False
            try:
                data = encode_summary(MapSource.from_mapper(self.get_fully_qualified_name(), self.mapper,
                                                            tiles=part))
            except Exception as err:
                self._model["failed"] += 1
                self._report(f"model summary failed: {type(err).__name__}: {err}")
                return False
        if len(data) > limit:
            if tiled:
                return self._tiled_summary_too_large(len(data), limit)
            self._model["too_large"] += 1
            self._report(f"model summary of {len(data)} bytes exceeds node.model_max_bytes = {limit}; not sent")
            return False
        msg = UInt8MultiArray()
        msg.data = data
        self._model_pub.publish(msg)
        if part is not None:
            if not self._model["parts"]:
                self.get_logger().info(
                    f"~/model: the tiled map's summary has outgrown node.model_max_bytes = {limit}; it goes in "
                    f"parts from now on ({len(part)} of {len(sizes)} tiles in this one; the merger puts them "
                    "together)")
            self._tile_rotation.sent(part, samples)
            self._model["parts"] += 1
        self._model.update(sent=self._model["sent"] + 1, bytes=len(data), num_seen=seen)
        return True

    def _tiled_summary_too_large(self, size: int, limit: int) -> bool:
        if not self._model["too_large"]:
            self.get_logger().warning(
                f"~/model: the tiled map's summary does not fit node.model_max_bytes = {limit} even in parts (about "
                f"{size} bytes with the map's visited cells and trajectory); not sent from now on (counted in the "
                "diagnostics): merge the saved map with gp-mapping merge, or raise node.model_max_bytes")
        self._model["too_large"] += 1
        return False

    def _on_checkpoint_timer(self) -> None:
        self._submit("checkpoint", self.write_checkpoint)

    def write_checkpoint(self) -> bool:
        """Every ``node.checkpoint_interval_s`` (on the update thread): the Mapper writes its state to the
        checkpoint file. A failure (disk full, say) is reported and counted; the node goes on and tries again
        next time."""
        path = self.checkpoint_path
        start = time.perf_counter()
        try:
            with self._lock:
                self.mapper.checkpoint(path)
        except Exception as err:
            self._checkpoint["failed"] += 1
            self._checkpoint["error"] = f"checkpoint to {path} failed: {type(err).__name__}: {err}"
            self._report(self._checkpoint["error"])
            return False
        self._checkpoint["written"] += 1
        self._checkpoint["seconds"] = time.perf_counter() - start
        self._checkpoint["error"] = ""
        return True

    def _log_refusals(self, values: dict[str, Any]) -> None:
        """One throttled warning naming every refusal / drop / failure counter that grew since the last one."""
        keys = [k for k in values if k.startswith(("rejected/", "node/rejected/"))]
        keys += ["dropped_overflow", "failed_updates", "reanchors", "teleports", "pauses", "field_frame_relatches"]
        grown = {k: int(values[k]) - self._logged_counts.get(k, 0) for k in keys if k in values}
        grown = {k: v for k, v in grown.items() if v > 0}
        if not grown:
            return
        text = ", ".join(f"{k.split('/')[-1]} +{v}" for k, v in grown.items())
        error = values.get("last_error") or ""
        logged = self.get_logger().warning(f"input refused or dropped since the last report: {text}"
                                           + (f"; last update error: {error}" if error else ""),
                                           throttle_duration_sec=LOG_THROTTLE_S)
        if logged:  # rclpy returns whether the line was emitted; counts stay until one is
            self._logged_counts.update({k: int(values[k]) for k in keys if k in values})

    def _log_field_frame(self, frame: str) -> None:
        """Log the magnetometer frame the mapper holds whenever it changes (learned, re-latched, reset)."""
        if frame == self._logged_field_frame:
            return
        self._logged_field_frame = frame
        if frame:
            how = "configured" if self.config.sync.field_frame else "learned; sync.field_frame fixes it"
            self.get_logger().info(f"magnetometer frame '{frame}' held ({how}): readings in another frame are "
                                   "refused as field_frame_mismatch")

    _logged_level = OK

    def _health_now(self, mapper_diag: dict[str, Any], inbox: int) -> Health:
        """The levels of gp_mapping.mapping.health for this tick (node clock)."""
        now = self._now()
        if self._health is None:
            self._health = HealthMonitor(self.config.node, now or 0.0)
        self._health.settings = self.config.node
        rejected = mapper_diag.get("rejected", {})
        refused = {k: int(rejected.get(k, 0)) for k in SAMPLE_REJECTION_REASONS}
        if self._tf is not None:
            refused.update({k: int(v) for k, v in self._tf.rejected.items()})
        tick = Tick(now=now if now is not None else 0.0,
                    messages={"magnetometer": self._counts["mag_messages"],
                              "pose": self._counts["pose_messages"] + self._tf_dynamic_messages},
                    last_seen=dict(self._last_seen), accepted=int(mapper_diag.get("accepted", 0)), refused=refused,
                    pending=int(mapper_diag.get("pending", 0)) + inbox, updates=int(mapper_diag.get("updates", 0)),
                    failed_updates=int(mapper_diag.get("failed_updates", 0)),
                    update_error=shorten(mapper_diag.get("last_error") or "", 300), node_error=self._last_error,
                    batch_size=self.config.batching.size)
        if now is None:  # sim time before the first /clock: only the errors can be judged
            tick.last_seen = {k: tick.now for k in tick.last_seen}
        return self._health.observe(tick)

    def _publish_diagnostics(self) -> None:
        mapper_diag = self._mapper_diagnostics  # as of the update thread's last step: never waits for an update
        with self._inbox_cond:
            inbox = len(self._inbox)
        values: dict[str, Any] = {}
        _flatten("", mapper_diag, values)
        values.update({f"node/{k}": v for k, v in self._counts.items()})
        values.update({f"node/rejected/{k}": v for k, v in self._node_rejected.items()})
        if self._tf is not None:  # read without a lock: counters only grow, a stale value is one second old
            values.update({f"node/rejected/{k}": v for k, v in self._tf.rejected.items()})
            values["node/tf_waiting"] = self._tf.waiting
            values["node/tf_from_sensor_frame"] = self._tf.from_sensor_frame
            values["node/tf_from_base_frame"] = self._tf.from_base_frame
            values["node/tf_rejected_transforms"] = self._tf.buffer.rejected
            values.update({f"node/tf_rejected/{k}": v for k, v in self._tf.buffer.rejected_by_reason.items()})
            values["node/tf_reparents"] = self._tf.buffer.reparents
        values["node/inbox"] = inbox
        lat = self._latency
        values["node/update_latency_last_s"] = lat["last"]
        values["node/update_latency_mean_s"] = lat["sum"] / lat["count"] if lat["count"] else math.nan
        values["node/update_latency_max_s"] = lat["max"]
        values["node/publish_latency_last_s"] = self._publish_seconds
        if self.config.node.model_period > 0:
            for key in ("sent", "parts", "too_large", "failed", "bytes"):
                values[f"node/model_summaries_{key}" if key != "bytes" else "node/model_summary_bytes"] = \
                    self._model[key]
        if self.config.node.checkpoint_interval_s > 0:
            values["node/checkpoint_path"] = str(self.checkpoint_path)
            values["node/checkpoints_written"] = self._checkpoint["written"]
            values["node/checkpoints_failed"] = self._checkpoint["failed"]
            values["node/checkpoint_seconds_last"] = self._checkpoint["seconds"]
        self._log_refusals(values)
        self._log_field_frame(str(mapper_diag.get("field_frame", "")))
        status = DiagnosticStatus(name=f"{self.get_name()}: gp_mapping", hardware_id="gp_mapping")
        health = self._health_now(mapper_diag, inbox)
        if health.level == OK and self._counts["mag_messages"] and not self._counts["updates"]:
            health = Health(WARN, "receiving data, no map update yet", [(WARN, "receiving data, no map update yet")])
        status.level, status.message = bytes([health.level]), health.message
        values["node/health"] = health.level_name
        if health.level != self._logged_level:  # one line per change of level, naming why
            self._logged_level = health.level
            line = f"diagnostics {health.level_name}: {shorten(health.message, 1000)}"
            if health.level == OK:  # (rclpy: one severity per call site)
                self.get_logger().info(line)
            else:
                self.get_logger().warning(line)
        status.values = [KeyValue(key=k, value=_format(v)) for k, v in values.items()]
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)

    # ------------------------------------------------------------------------------------------ services

    def _spin_services(self) -> None:
        try:
            self._service_executor.spin()
        except ExternalShutdownException:  # the context shut down (Ctrl-C): the node is closing
            pass

    def _call_on_update_thread(self, name: str, job: Callable[[], str], response: Trigger.Response
                               ) -> Trigger.Response:
        """Run a service's ``job`` on the update thread and answer with its message, or with why it failed."""
        future = self._submit(name, job, periodic=False)
        try:
            if future is None:
                raise RuntimeError("the node is stopping")
            response.message = future.result(timeout=SERVICE_TIMEOUT_S)
            response.success = True
        except FutureTimeout:  # the job still runs; the caller learns it has not finished
            response.success = False
            response.message = f"{name}: not finished after {SERVICE_TIMEOUT_S:.0f} s; it goes on in the node"
        except Exception as err:  # a failed save or reset is the caller's answer, not the node's end
            reason = getattr(err, "reason", "")  # a state file's refusal is named (MapStateError.reason)
            response.success = False
            response.message = shorten(f"{name} failed: {type(err).__name__}{f' ({reason})' if reason else ''}: "
                                       f"{err}", 1000)
        if response.success:
            self.get_logger().info(f"{name}: {response.message}")
        else:
            self.get_logger().error(response.message)
        return response

    def on_save_map(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        def save() -> str:
            with self._lock:
                self._feed_inbox()
                self._run_updates(flush=True)
                path = saved_map_path(self.config.node.map_directory, self.get_name())
                path.parent.mkdir(parents=True, exist_ok=True)
                self.mapper.save(path)
                self._mapper_diagnostics = self.mapper.diagnostics()
            return str(path.resolve())

        return self._call_on_update_thread("save_map", save, response)

    def on_load_map(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        """Replace the map by the state file ``node.initial_map`` (set it first, e.g. with ``ros2 param set``),
        with the start-up checks: a file that cannot be read, or that was made with an incompatible config,
        is refused with the reason and the current map stays."""
        def load() -> str:
            path = self.config.node.initial_map
            if not path:
                raise ValueError("node.initial_map is empty; set it to the state file to load")
            mapper = Mapper.load(path, config=self.config)  # raises before anything changes
            with self._lock:
                with self._inbox_cond:
                    dropped = len(self._inbox)
                    self._inbox.clear()
                self.mapper = mapper
                self._mapper_diagnostics = self.mapper.diagnostics()
                self._publish_due = True  # the loaded map (changed, for the Mapper) goes out at once
                self._last_error = ""
            return (f"loaded {Path(path).resolve()} ({self._mapper_diagnostics.get('num_seen', 0)} samples in the "
                    f"model; {dropped} buffered messages dropped)")

        return self._call_on_update_thread("load_map", load, response)

    def on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        def reset() -> str:
            with self._lock:
                with self._inbox_cond:
                    dropped = len(self._inbox)
                    self._inbox.clear()
                self.mapper.reset()
                if self._tf is not None:
                    self._tf.clear()
                self._mapper_diagnostics = self.mapper.diagnostics()
                self.mapper.mark_published()  # the cleared map below
                self._last_error = ""
                self._publish_cleared()
            return f"map reset ({dropped} buffered messages dropped)"

        return self._call_on_update_thread("reset", reset, response)

    # ---------------------------------------------------------------------------------------------- stop

    def _stop(self) -> None:
        """Stop the update thread and write a last checkpoint (when they are on)."""
        if self._active:
            self._deactivate()
        if self.mapper is not None and self.config.node.checkpoint_interval_s > 0:
            self.write_checkpoint()

    def close(self) -> None:
        """Shut down from whatever state the node is in (:meth:`_stop`), then destroy it."""
        self._stop()
        self.destroy_node()


class MapperNode(_MapperCore, Node):
    """The plain node: configured and active from construction until :meth:`close` (``ros2 run gp_mapping
    mapper``)."""

    def __init__(self, **node_kwargs: Any) -> None:
        Node.__init__(self, NODE_NAME, **node_kwargs)
        try:
            self._init_core()
            self._configure()
        except BaseException:
            self.destroy_node()
            raise
        self._activate()


class LifecycleMapperNode(_MapperCore, LifecycleNode):
    """The managed node (``ros2 run gp_mapping lifecycle_mapper``), brought up as nav2's lifecycle manager does:
    ``configure`` reads the parameters and builds the model (a bad parameter or an unreadable initial map fails
    the transition with the reason), ``activate`` subscribes and publishes, ``deactivate`` stops both and keeps
    the map, ``cleanup`` drops it, ``shutdown`` writes the last checkpoint (when they are on)."""

    def __init__(self, **node_kwargs: Any) -> None:
        LifecycleNode.__init__(self, NODE_NAME, **node_kwargs)
        try:
            self._init_core()
        except BaseException:
            self.destroy_node()
            raise

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._configure()
        except NodeStartError as err:
            self.get_logger().error(f"configure failed: {err}")
            self.mapper = None
            return TransitionCallbackReturn.FAILURE
        self.get_logger().info("configured")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._activate()
        if self.mapper.diagnostics()["num_seen"]:
            self.mapper.mark_changed()  # the map kept through a deactivate is published again at once
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._deactivate()
        self.get_logger().info("deactivated: not mapping; the map is kept")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._cleanup()
        self.get_logger().info("cleaned up: the map is dropped")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop()
        return TransitionCallbackReturn.SUCCESS


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Nested dicts -> ``{"a/b": value}``."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _format(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)  # floats round-trip (stamps need every digit)


# ------------------------------------------------------------------------------------------------ commands


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gp-mapping node``; everything after ``--ros-args`` goes to ROS."""
    parser.add_argument("--config", metavar="FILE",
                        help="parameter file (same as --ros-args --params-file FILE; later --ros-args win)")


def run(args: argparse.Namespace) -> int:
    """``gp-mapping node``: ``args.ros_args`` holds the ROS arguments (``--ros-args ...``)."""
    from rclpy.utilities import remove_ros_args

    ros_args = list(getattr(args, "ros_args", []) or [])
    stray = remove_ros_args(["gp-mapping node"] + ros_args)[1:]
    if stray:
        print(f"gp-mapping node: unrecognised arguments: {' '.join(stray)} (ROS arguments go after --ros-args)",
              file=sys.stderr)
        return EXIT_BAD_CONFIG
    return spin(_with_config(["gp-mapping node"], args.config, ros_args))


def spin(argv: list[str], lifecycle: bool = False, autostart: bool = False) -> int:
    """Start ROS with ``argv``, run the mapper until shutdown, and return the exit status. ``lifecycle``: the
    managed node, waiting for configure and activate (``autostart``: it does both itself)."""

    def prepare(node) -> bool:
        # Before the executor takes any message (or /clock): the first update must not stall on the imports
        # torch makes on first use.
        warm_up_engines()
        if lifecycle and autostart:
            if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
                return False
            node.trigger_activate()
        return True

    return spin_node(argv, "mapper", NODE_NAME, LifecycleMapperNode if lifecycle else MapperNode, prepare)


def spin_node(argv: list[str], program: str, logger_name: str, make_node: Callable[[], Any],
              prepare: Callable[[Any], bool] | None = None) -> int:
    """The process around a gp_mapping node: start ROS with ``argv``, build the node (a NodeStartError is a bad
    configuration, exit 2), ``prepare`` it (False: exit 2), spin until Ctrl-C or shutdown, ``close()`` it, exit 0."""
    keep_freed_memory()  # the published maps are drawn tile by tile (see gp_mapping.runtime)
    faulthandler.enable()  # a crash in a C extension (rclpy, torch) leaves every thread's Python stack in the log
    try:
        rclpy.init(args=argv)
    except Exception as err:  # rcl refuses malformed --ros-args or an unparsable params file
        print(f"gp_mapping {program}: cannot start ROS: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        try:
            node = make_node()
        except NodeStartError as err:  # at once: a bad parameter does not wait for any warm-up
            rclpy.logging.get_logger(logger_name).fatal(str(err))
            return EXIT_BAD_CONFIG
        if prepare is not None and not prepare(node):
            node.destroy_node()
            return EXIT_BAD_CONFIG
        # Single-threaded: every callback is short (the mapper's updates run on the node's own thread). rclpy's
        # MultiThreadedExecutor took about 400 of 30 000 messages under a 1 kHz flood on two cores.
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        sys.unraisablehook = quiet_interrupts_in_finalizers
        try:
            executor.spin()
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        except RuntimeError:  # rclpy's SIGINT handler can invalidate the context under the executor's wait
            if rclpy.ok():
                raise
        finally:
            executor.shutdown()
            node.close()
        return EXIT_OK
    finally:
        rclpy.try_shutdown()


def quiet_interrupts_in_finalizers(unraisable: Any) -> None:
    """``sys.unraisablehook`` of the node's process: a Ctrl-C that lands while Python runs a finalizer (an rclpy
    Future's ``__del__``) cannot be raised there and was printed as a traceback on a clean stop; the node is
    stopping anyway, so it is dropped. Anything else is reported as usual."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping mapper [--config FILE] [--ros-args ...]``."""
    from rclpy.utilities import remove_ros_args

    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mapper", description="Gaussian-process magnetic-field mapping node.")
    add_arguments(parser)
    args = parser.parse_args(remove_ros_args(argv)[1:])
    return spin(_with_config(argv[:1], args.config, argv[1:]))


def lifecycle_main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping lifecycle_mapper [--config FILE] [--autostart] [--ros-args ...]``: the managed
    node; a lifecycle manager (the launch files, nav2's lifecycle_manager) configures and activates it."""
    from rclpy.utilities import remove_ros_args

    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lifecycle_mapper",
                                     description="Gaussian-process magnetic-field mapping node (managed, "
                                                 "rclpy lifecycle).")
    add_arguments(parser)
    parser.add_argument("--autostart", action="store_true", help="configure and activate without a manager")
    args = parser.parse_args(remove_ros_args(argv)[1:])
    return spin(_with_config(argv[:1], args.config, argv[1:]), lifecycle=True, autostart=args.autostart)


def _with_config(program: list[str], config: str | None, rest: list[str]) -> list[str]:
    """ROS argv with ``config`` as a params file placed first, so later ``--ros-args`` override its values."""
    if not config:
        return program + rest
    return program + ["--ros-args", "--params-file", str(config), "--"] + rest


if __name__ == "__main__":
    sys.exit(main())
