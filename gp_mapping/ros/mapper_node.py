"""The ROS 2 mapping node: magnetometer + pose in, Gaussian-process map of the magnetic field out.

Run it with ``ros2 run gp_mapping mapper --ros-args --params-file config/mapper.yaml`` or
``gp-mapping node --config config/mapper.yaml`` (any ``--ros-args ...`` after it are passed to ROS).
The node is thin: it converts messages to arrays, feeds a :class:`gp_mapping.mapping.mapper.Mapper`, and
converts the Mapper's grids back to messages. The offline replay drives the same Mapper the same way.

Subscriptions (sensor-data QoS: best effort, keep last ``node.queue_depth``)
    ``mag``   sensor_msgs/MagneticField, tesla, in the magnetometer frame (placed on the body by
              ``sync.sensor_translation`` / ``sync.sensor_rotation``).
    ``pose``  geometry_msgs/PoseStamped, nav_msgs/Odometry or geometry_msgs/PoseWithCovarianceStamped as
              ``node.pose_type`` says; the body pose in ``grid.frame_id`` (a pose in another frame is
              rejected and counted as ``pose_frame_mismatch``; there is no tf lookup).
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
                                 accepted, rejected by reason, update latency, map size, errors.

The scale message (latched, republished with every map). A row-major L x 4 matrix, one row per layer::

    layout.dim[0]: label "layer:<names>" (e.g. "layer:magnitude" or "layer:x,y,z,norm"), size L, stride 4L
    layout.dim[1]: label "mean_offset,mean_scale,variance_offset,variance_scale;unit:<sync.field_unit>",
                   size 4, stride 4
    data[4i:4i+4] = mean_offset, mean_scale, variance_offset, variance_scale of layer i

A published cell value ``c`` in 0..100 decodes to ``mean = mean_offset + mean_scale * c`` (in the unit) and
``variance = variance_offset + variance_scale * c`` (unit squared), exact within half a step; -1 is unknown.
``gp_mapping.ros.conversions.scale_from_msg`` parses it.

Services (std_srvs/Trigger)
    ``~/save_map``   feeds every message received so far, runs the pending updates and the last partial batch
                     (samples still waiting for a following pose keep waiting), then writes the map state to
                     ``$ROS_HOME/gp_mapping/<node name>_map.safetensors``
                     (``ROS_HOME`` defaults to ``~/.ros``); the response message is the absolute path. Start from
                     it again with the parameter ``node.initial_map``.
    ``~/reset``      forgets the map and the buffered messages; publishes all-unknown grids of the last geometry.
    Both run on the update thread between two updates; they are served by a hidden helper node
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
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import MagneticField, PointCloud2
from std_msgs.msg import Float64MultiArray
from std_srvs.srv import Trigger

from gp_mapping.config import (ROS_RESERVED_KEYS, ConfigError, MapperConfig, describe_allowed, config_from_dict,
                               field_specs, to_flat_parameters, validate_value)
from gp_mapping.gp import warm_up as warm_up_engines
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.ros import conversions

NODE_NAME = "mapper"
DIAGNOSTICS_PERIOD = 1.0  # seconds (node clock), the usual rate of /diagnostics
VECTOR_LAYERS = ("x", "y", "z", "norm")
# Parameters the running node applies when they change (the Mapper reads them at every prediction); every
# other one is declared read-only because the model, the sync, the grid lattice or the subscriptions are built
# from it at start.
LIVE_PARAMETERS = frozenset({"node.publish_period", "grid.unknown_distance", "grid.tile_size", "grid.margin",
                             "grid.mean_range", "grid.variance_range"})
EXIT_OK, EXIT_FAILURE, EXIT_BAD_CONFIG = 0, 1, 2
LOG_THROTTLE_S = 5.0  # seconds between two log lines about refused input, failed updates or dropped backlog
MAX_TRACKED_PUBLISHERS = 64  # per input topic, for counting messages lost in transport
SERVICE_TIMEOUT_S = 300.0  # a service waits this long for its job on the update thread (a save flushes the backlog)

_PARAMETER_TYPES = {"bool": ParameterType.PARAMETER_BOOL, "int": ParameterType.PARAMETER_INTEGER,
                    "float": ParameterType.PARAMETER_DOUBLE, "str": ParameterType.PARAMETER_STRING,
                    "list": ParameterType.PARAMETER_DOUBLE_ARRAY}

MAP_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)


class NodeStartError(RuntimeError):
    """The node cannot start (a bad parameter, an unreadable initial map, a mapper that cannot be built)."""


# --------------------------------------------------------------------------------------- static description


def layer_names(config: MapperConfig) -> tuple[str, ...]:
    """Layers of the published map for the configured ``sync.target``."""
    return ("magnitude",) if config.sync.target == "magnitude" else VECTOR_LAYERS


def map_topics(config: MapperConfig) -> dict[str, tuple[str, str]]:
    """Layer -> (mean topic, variance topic), relative to the node (``~/...``)."""
    if config.sync.target == "magnitude":
        return {"magnitude": ("~/mean", "~/variance")}
    return {name: (f"~/mean/{name}", f"~/variance/{name}") for name in VECTOR_LAYERS}


def published_topics(config: MapperConfig) -> dict[str, str]:
    """Every topic the node publishes (node-relative or absolute) -> its message type."""
    topics = {t: "nav_msgs/msg/OccupancyGrid" for pair in map_topics(config).values() for t in pair}
    topics["~/cloud"] = "sensor_msgs/msg/PointCloud2"
    topics["~/scale"] = "std_msgs/msg/Float64MultiArray"
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
    """Where ``~/save_map`` writes: ``$ROS_HOME/gp_mapping/<node name>_map.safetensors`` (ROS_HOME: ~/.ros);
    ``kind="checkpoint"``: the default checkpoint file ``<node name>_checkpoint.safetensors`` beside it."""
    ros_home = os.environ.get("ROS_HOME") or os.path.join(os.path.expanduser("~"), ".ros")
    return Path(ros_home) / "gp_mapping" / f"{node_name}_{kind}.safetensors"


def _plain(value: Any) -> Any:
    """A parameter value as plain Python (rclpy hands arrays as array.array)."""
    if isinstance(value, (array.array, tuple)):
        return list(value)
    return value


# -------------------------------------------------------------------------------------------------- the node


class MapperNode(Node):
    """Declares and validates the parameters, feeds the Mapper from a worker thread, publishes on a timer."""

    def __init__(self, **node_kwargs: Any) -> None:
        super().__init__(NODE_NAME, **node_kwargs)
        try:
            self.config = self._declare_parameters()
            self.mapper = self._build_mapper()
        except BaseException:
            self.destroy_node()
            raise
        self._specs = field_specs()
        # The update thread is the only user of the mapper: the executor's callbacks never wait for an update.
        # They queue messages (inbox) and jobs (publish, checkpoint, services, parameter changes) that the thread
        # runs between two updates, so the subscriptions keep up with a flood while a long update runs. The lock
        # only makes it safe for tests to look inside while the thread runs.
        self._lock = threading.Lock()
        self._inbox_cond = threading.Condition()  # guards _inbox, _jobs, _queued and _stopping
        # (kind, stamp, values, orientation or frame_id, receive time or None)
        self._inbox: deque[tuple[str, float, Any, Any, float | None]] = deque()
        self._jobs: deque[tuple[str, Callable[[], Any], Future]] = deque()
        self._queued: set[str] = set()  # names of the periodic jobs waiting in _jobs (one of each at most)
        self._updates_waiting = False  # the last update step ran an update: more full batches may be ready
        self._stopping = False
        self._mapper_diagnostics: dict[str, Any] = self.mapper.diagnostics()  # the update thread refreshes it
        self._dirty = True  # a map loaded from node.initial_map is published on the first tick
        self._counts: dict[str, int] = {"mag_messages": 0, "pose_messages": 0, "updates": 0, "maps_published": 0,
                                        "errors": 0, "stamps_from_clock": 0}
        self._node_rejected: dict[str, int] = {"pose_frame_mismatch": 0, "inbox_overflow": 0,
                                               "transport_lost_mag": 0, "transport_lost_pose": 0}
        self._latency = {"last": math.nan, "max": 0.0, "sum": 0.0, "count": 0}
        self._publish_seconds = math.nan
        self._publish_due = False  # the publish timer ticked since the last map
        self._updating = False  # the update thread is feeding the mapper or updating the model
        self._logged_counts: dict[str, int] = {}  # refusal counts at the last log line about them
        self._checkpoint = {"written": 0, "failed": 0, "seconds": math.nan, "error": ""}
        self._last_error = ""
        self._last_grid = None  # the last published MapGrid (geometry for the cleared map after a reset)

        depth = self.config.node.queue_depth
        sensor_qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth,
                                reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE)
        # The two-argument callbacks get the message info: its sequence numbers reveal messages that the
        # transport dropped before the node could take them (a full subscription queue under load).
        self._last_sequence: dict[str, dict[bytes, int]] = {"mag": {}, "pose": {}}
        self.create_subscription(MagneticField, "mag", lambda msg, info: self._receive("mag", msg, info),
                                 sensor_qos)
        self.create_subscription(conversions.POSE_TYPES[self.config.node.pose_type], "pose",
                                 lambda msg, info: self._receive("pose", msg, info), sensor_qos)

        self._map_pubs = {layer: (self.create_publisher(OccupancyGrid, mean, MAP_QOS),
                                  self.create_publisher(OccupancyGrid, var, MAP_QOS))
                          for layer, (mean, var) in map_topics(self.config).items()}
        self._cloud_pub = self.create_publisher(PointCloud2, "~/cloud", MAP_QOS)
        self._scale_pub = self.create_publisher(Float64MultiArray, "~/scale", MAP_QOS)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)

        self._publish_timer = self.create_timer(self.config.node.publish_period, self._on_publish_timer)
        self.create_timer(DIAGNOSTICS_PERIOD, self._publish_diagnostics)
        if self.config.node.checkpoint_interval_s > 0:
            self.create_timer(self.config.node.checkpoint_interval_s, self._on_checkpoint_timer)
        self.add_on_set_parameters_callback(self._validate_parameter_change)
        self.add_post_set_parameters_callback(self._apply_parameter_change)

        # The services wait for the update thread (a save first runs the backlog), so they live on a hidden
        # helper node with its own executor thread: while one runs, this node keeps taking messages. Their
        # names are this node's (~/save_map, ~/reset).
        # Global ROS arguments stay off it: `-r __node:=name` would give it this node's name.
        self._service_node = rclpy.create_node(f"_{self.get_name()}_services", namespace=self.get_namespace(),
                                               context=self.context, use_global_arguments=False,
                                               start_parameter_services=False)
        own_name = self.get_fully_qualified_name()
        self._service_node.create_service(Trigger, f"{own_name}/save_map", self.on_save_map)
        self._service_node.create_service(Trigger, f"{own_name}/reset", self.on_reset)
        self._service_executor = SingleThreadedExecutor(context=self.context)
        self._service_executor.add_node(self._service_node)
        self._service_thread = threading.Thread(target=self._spin_services, name="gp_mapping_services",
                                                daemon=True)

        self._worker = threading.Thread(target=self._worker_loop, name="gp_mapping_updates", daemon=True)
        self._worker.start()
        self._service_thread.start()
        self.get_logger().info(
            f"mapping {self.config.sync.target} of the field in {self.config.sync.field_unit} on frame "
            f"'{self.config.grid.frame_id}' with {self.config.model.engine} (M={self.config.model.num_inducing}); "
            f"pose type {self.config.node.pose_type}; publishing every {self.config.node.publish_period} s")

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
                raise NodeStartError(f"bad parameter: node.initial_map = {path!r}: {err}") from err
            self.get_logger().info(f"started from the map in {path}")
            return mapper
        try:
            return Mapper(self.config)
        except Exception as err:
            raise NodeStartError(f"cannot build the mapper from the parameters: {err}") from err

    def _validate_parameter_change(self, params: list) -> SetParametersResult:
        for param in params:
            spec = self._specs.get(param.name)
            if spec is None:
                continue
            try:
                validate_value(param.name, _plain(param.value), spec)
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
            self._submit(f"set {param.name}", lambda s=section, k=key, v=value: self._set_config(s, k, v),
                         periodic=False)
            if param.name == "node.publish_period":
                self._publish_timer.timer_period_ns = int(round(value * 1e9))
                self._publish_timer.reset()
            self.get_logger().info(f"parameter {param.name} = {value!r} applied")

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
        self._push(("field", self._receive_stamp(stamp, now), field_tesla, frame, now))

    def on_pose(self, msg: Any) -> None:
        """Subscription callback of ``pose``."""
        stamp, position, orientation, frame = conversions.pose_from_msg(msg)
        now = self._now()
        stamp = self._receive_stamp(stamp, now)
        self._counts["pose_messages"] += 1
        if frame != self.config.grid.frame_id:
            self._node_rejected["pose_frame_mismatch"] += 1
            self.get_logger().warning(f"pose in frame '{frame}', expected grid.frame_id '{self.config.grid.frame_id}'"
                                      f"; rejected (no tf lookup in this node)", throttle_duration_sec=5.0)
            return
        self._push(("pose", stamp, position, orientation, now))

    def _feed_inbox(self) -> None:
        """Hand every buffered message to the mapper in arrival order (caller holds ``_lock``)."""
        with self._inbox_cond:
            items, self._inbox = self._inbox, deque()
        for kind, stamp, a, b, now in items:
            if kind == "pose":
                self.mapper.add_pose(stamp, a, b, receive_time=now)
            else:
                self.mapper.add_magnetic_field(stamp, a, frame_id=b, receive_time=now)

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
            self._dirty = True
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
            self._dirty = True

    def _report(self, message: str) -> None:
        """An error that the node survives: logged (throttled) and shown as ERROR in the diagnostics."""
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
        # At most one map per tick (node clock, so sim time too). A tick during an update is served right after
        # it (the map is dirty by then); otherwise a dirty map goes out through a job at once.
        if self._dirty or self._updating:
            self._publish_due = True
        if self._dirty:
            self._submit("publish", self._publish_if_due)

    def _publish_if_due(self) -> None:
        if self._publish_due and self._dirty:
            self.publish_map()

    def publish_map(self) -> None:
        """Predict the grid and publish it (on the update thread; tests call it directly)."""
        start = time.perf_counter()
        self._publish_due = False
        with self._lock:
            self._dirty = False
            try:
                grid = self.mapper.grid()
            except Exception as err:
                self._report(f"map prediction failed: {type(err).__name__}: {err}")
                return
        if grid is None:
            return
        self._publish_grid(grid)
        self._publish_seconds = time.perf_counter() - start

    def _publish_grid(self, grid: Any) -> None:
        stamp = self._stamp_of(grid)
        try:
            layers = conversions.encode_layers(grid, self.config.grid.mean_range, self.config.grid.variance_range)
        except Exception as err:
            self._report(f"map encoding failed: {type(err).__name__}: {err}")
            return
        # The scale first, so a subscriber that decodes a grid already has the scale that matches it.
        self._scale_pub.publish(conversions.scale_to_msg(layers, self.config.sync.field_unit))
        for layer in layers:
            mean_pub, var_pub = self._map_pubs[layer.name]
            mean_pub.publish(conversions.occupancy_msg(grid, layer.mean_data, stamp))
            var_pub.publish(conversions.occupancy_msg(grid, layer.variance_data, stamp))
        self._cloud_pub.publish(conversions.cloud_msg(grid, stamp, z=grid.height))
        self._last_grid = grid
        self._counts["maps_published"] += 1
        self._last_error = ""  # the diagnostics show ERROR until the next good map

    def _publish_cleared(self) -> None:
        """After a reset: every map topic gets the last geometry with all cells unknown, the cloud no points."""
        grid = self._last_grid
        if grid is None:
            return
        stamp = self.get_clock().now().to_msg()
        unknown = np.full(grid.spec.width * grid.spec.height, -1, dtype=np.int8)
        for mean_pub, var_pub in self._map_pubs.values():
            for pub in (mean_pub, var_pub):
                msg = conversions.occupancy_msg(grid, unknown, stamp)
                pub.publish(msg)
        self._cloud_pub.publish(conversions.cloud_msg(grid, stamp, z=grid.height, empty=True))

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
        keys += ["dropped_overflow", "failed_updates", "reanchors", "teleports"]
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

    def _publish_diagnostics(self) -> None:
        mapper_diag = self._mapper_diagnostics  # as of the update thread's last step: never waits for an update
        with self._inbox_cond:
            inbox = len(self._inbox)
        values: dict[str, Any] = {}
        _flatten("", mapper_diag, values)
        values.update({f"node/{k}": v for k, v in self._counts.items()})
        values.update({f"node/rejected/{k}": v for k, v in self._node_rejected.items()})
        values["node/inbox"] = inbox
        lat = self._latency
        values["node/update_latency_last_s"] = lat["last"]
        values["node/update_latency_mean_s"] = lat["sum"] / lat["count"] if lat["count"] else math.nan
        values["node/update_latency_max_s"] = lat["max"]
        values["node/publish_latency_last_s"] = self._publish_seconds
        if self.config.node.checkpoint_interval_s > 0:
            values["node/checkpoint_path"] = str(self.checkpoint_path)
            values["node/checkpoints_written"] = self._checkpoint["written"]
            values["node/checkpoints_failed"] = self._checkpoint["failed"]
            values["node/checkpoint_seconds_last"] = self._checkpoint["seconds"]
        self._log_refusals(values)
        status = DiagnosticStatus(name=f"{self.get_name()}: gp_mapping", hardware_id="gp_mapping")
        if self._last_error:
            status.level, status.message = DiagnosticStatus.ERROR, self._last_error
        elif self._counts["mag_messages"] and not self._counts["updates"]:
            status.level, status.message = DiagnosticStatus.WARN, "receiving data, no map update yet"
        else:
            status.level, status.message = DiagnosticStatus.OK, "mapping"
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
            response.success, response.message = False, f"{name} failed: {type(err).__name__}: {err}"
        if response.success:
            self.get_logger().info(f"{name}: {response.message}")
        else:
            self.get_logger().error(response.message)
        return response

    def on_save_map(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        path = default_map_path(self.get_name())

        def save() -> str:
            with self._lock:
                self._feed_inbox()
                self._run_updates(flush=True)
                self.mapper.save(path)
                self._mapper_diagnostics = self.mapper.diagnostics()
            return str(path.resolve())

        return self._call_on_update_thread("save_map", save, response)

    def on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        def reset() -> str:
            with self._lock:
                with self._inbox_cond:
                    dropped = len(self._inbox)
                    self._inbox.clear()
                self.mapper.reset()
                self._mapper_diagnostics = self.mapper.diagnostics()
                self._dirty = False
                self._last_error = ""
                self._publish_cleared()
            return f"map reset ({dropped} buffered messages dropped)"

        return self._call_on_update_thread("reset", reset, response)

    # ---------------------------------------------------------------------------------------------- stop

    def close(self) -> None:
        """Stop the update thread, write a last checkpoint (when they are on) and destroy the node."""
        with self._inbox_cond:
            self._stopping = True
            self._inbox_cond.notify_all()
        self._worker.join(timeout=30.0)
        self._service_executor.shutdown()
        self._service_thread.join(timeout=10.0)
        self._service_node.destroy_node()
        with self._inbox_cond:  # jobs that will never run: their callers get an answer now
            for name, _, future in self._jobs:
                future.set_exception(RuntimeError(f"{name}: the node stopped before it ran"))
            self._jobs.clear()
        if self.config.node.checkpoint_interval_s > 0:
            with self._lock:
                try:
                    self._feed_inbox()  # what was received is kept (no update runs: batches stay as cut)
                except Exception as err:
                    self._report(f"feeding the mapper failed: {type(err).__name__}: {err}")
            self.write_checkpoint()
        self.destroy_node()


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


def spin(argv: list[str]) -> int:
    """Start ROS with ``argv``, run the node until shutdown, and return the exit status."""
    try:
        rclpy.init(args=argv)
    except Exception as err:  # rcl refuses malformed --ros-args or an unparsable params file
        print(f"gp_mapping mapper: cannot start ROS: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    # Before the node exists (so before any message or /clock arrives): the first update must not stall on
    # the imports torch makes on first use.
    warm_up_engines()
    try:
        try:
            node = MapperNode()
        except NodeStartError as err:
            rclpy.logging.get_logger(NODE_NAME).fatal(str(err))
            return EXIT_BAD_CONFIG
        # Single-threaded: every callback is short (the updates run on the node's own thread). rclpy's
        # MultiThreadedExecutor took about 400 of 30 000 messages under a 1 kHz flood on two cores.
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        try:
            executor.spin()
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        finally:
            executor.shutdown()
            node.close()
        return EXIT_OK
    finally:
        rclpy.try_shutdown()


def main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping mapper [--config FILE] [--ros-args ...]``."""
    from rclpy.utilities import remove_ros_args

    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mapper", description="Gaussian-process magnetic-field mapping node.")
    add_arguments(parser)
    args = parser.parse_args(remove_ros_args(argv)[1:])
    return spin(_with_config(argv[:1], args.config, argv[1:]))


def _with_config(program: list[str], config: str | None, rest: list[str]) -> list[str]:
    """ROS argv with ``config`` as a params file placed first, so later ``--ros-args`` override its values."""
    if not config:
        return program + rest
    return program + ["--ros-args", "--params-file", str(config), "--"] + rest


if __name__ == "__main__":
    sys.exit(main())
