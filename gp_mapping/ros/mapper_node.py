"""The ROS 2 mapping node: magnetometer + pose in, Gaussian-process map of the magnetic field out.

Run it with ``ros2 run gp_mapping mapper --ros-args --params-file config/mapper.yaml`` or
``gp-mapping node --config config/mapper.yaml`` (any ``--ros-args ...`` after it are passed to ROS): the plain
node, mapping from the start. ``ros2 run gp_mapping lifecycle_mapper`` runs the same node as an rclpy lifecycle
(managed) node: configure (parameters, model, publishers), activate (subscriptions, timers, services),
deactivate (keeps the map), cleanup (drops it); ``--autostart`` configures and activates it without a manager.
The node is thin: it converts messages to arrays, feeds a :class:`gp_mapping.mapping.mapper.Mapper`, and
converts the Mapper's grids back to messages. The offline replay drives the same Mapper the same way.

This module holds the node's life (configure, activate, deactivate, cleanup, stop) and its commands; each job of
the node has its own module, where its topics, services and rules are documented:

- :mod:`gp_mapping.ros.parameters`: every key of ``config/mapper.yaml`` as a declared, validated parameter; the
  live ones (:data:`~gp_mapping.ros.parameters.LIVE_PARAMETERS`);
- :mod:`gp_mapping.ros.inputs`: the subscriptions ``mag`` and ``pose`` (or ``/tf``, ``/tf_static``), the bounded
  queues and the refusals counted there;
- :mod:`gp_mapping.ros.update_worker`: the inbox and the update thread that feeds the Mapper and runs the jobs;
- :mod:`gp_mapping.ros.publishers`: ``~/mean``, ``~/variance``, ``~/cloud``, ``~/scale`` (latched) and how to
  decode them;
- :mod:`gp_mapping.ros.model_summaries`: ``~/model``, what a merger node merges;
- :mod:`gp_mapping.ros.services`: ``~/save_map``, ``~/load_map``, ``~/reset``;
- :mod:`gp_mapping.ros.persistence`: the start from a checkpoint or ``node.initial_map``, the checkpoints;
- :mod:`gp_mapping.ros.diagnostics`: ``/diagnostics`` with levels and reasons;
- :mod:`gp_mapping.ros.process`: the process around the node and its exit status.

``use_sim_time`` works: stamps come from the messages, the publishing and diagnostics timers from the node's
clock.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from rclpy.lifecycle import LifecycleNode
from rclpy.node import Node

from gp_mapping.gp import warm_up as warm_up_engines
from gp_mapping.mapping.publication import NODE_NAME
from gp_mapping.ros.diagnostics import DIAGNOSTICS_PERIOD, MapperDiagnostics
from gp_mapping.ros.inputs import MapperInputs
from gp_mapping.ros.lifecycle import LifecycleCallbacks, init_node
from gp_mapping.ros.model_summaries import ModelSummaries
from gp_mapping.ros.parameters import ConfigParameters
from gp_mapping.ros.persistence import Persistence
from gp_mapping.ros.process import NodeStartError  # noqa: F401  (where the tests and callers import it from)
from gp_mapping.ros.process import EXIT_BAD_CONFIG, add_config_argument, bring_up, node_command, spin_node, with_config
from gp_mapping.ros.publishers import MapPublishing
from gp_mapping.ros.services import MapServices
from gp_mapping.ros.update_worker import UpdateWorker


class _MapperCore(ConfigParameters, UpdateWorker, MapperInputs, MapPublishing, ModelSummaries, Persistence,
                  MapperDiagnostics, MapServices):
    """The mapping node's work, shared by the plain node (:class:`MapperNode`, running from construction) and
    the lifecycle node (:class:`LifecycleMapperNode`). Its stages follow the lifecycle:

    - :meth:`_configure`: parameters read and validated, the Mapper built (from a checkpoint or
      ``node.initial_map`` when set), publishers made;
    - :meth:`_activate`: subscriptions, timers, services and the update thread: mapping and publishing;
    - :meth:`_deactivate`: all of those stopped; the map, the publishers (latched maps) and the parameters stay;
    - :meth:`_cleanup`: the map and the publishers dropped.

    It feeds the Mapper from a worker thread and publishes on a timer."""

    _active = False
    _configured_once = False

    def _init_core(self) -> None:
        """Declare and validate the parameters (a bad one raises NodeStartError) and the live-change hooks."""
        self._setup_parameters()
        self.mapper = None
        self._map_pubs: dict = {}

    def _configure(self) -> None:
        """Parameters (their current values) and the model; publishers. NodeStartError when either is bad."""
        if self.mapper is None and self._configured_once:  # after a cleanup: re-read
            self.config = self._read_parameters()
        self._configured_once = True
        self.mapper = self._build_mapper()
        # The update thread is the only user of the mapper: the executor's callbacks never wait for an update.
        self._setup_worker()
        self._mapper_diagnostics: dict[str, Any] = self.mapper.diagnostics()  # the update thread refreshes it
        self._latency = {"last": math.nan, "max": 0.0, "sum": 0.0, "count": 0}
        self._setup_inputs()
        self._setup_persistence()
        self._setup_publishing()
        self._setup_model_summaries()
        self._setup_diagnostics()

    def _activate(self) -> None:
        """Subscriptions, timers, services and the update thread: the node maps and publishes."""
        self._start_health()
        self._input_subscriptions: list = self._subscribe_inputs()
        self._publish_timer = self.create_timer(self.config.node.publish_period, self._on_publish_timer)
        self._active_timers: list = [self._publish_timer,
                                     self.create_timer(DIAGNOSTICS_PERIOD, self._publish_diagnostics)]
        if self.config.node.checkpoint_interval_s > 0:
            self._active_timers.append(self.create_timer(self.config.node.checkpoint_interval_s,
                                                         self._on_checkpoint_timer))
        if self._sends_model_summaries():
            self._active_timers.append(self.create_timer(self.config.node.model_period,
                                                         lambda: self._submit("model", self.publish_model)))
        # The services wait for the update thread (a save first runs the backlog), so they live on a hidden
        # helper node with its own executor thread: while one runs, this node keeps taking messages.
        self._service_host = self._create_services()
        self._start_worker()
        self._service_host.start()
        self._active = True
        self.get_logger().info(self.describe())

    def _deactivate(self) -> None:
        """Stop taking messages, publishing and serving; the update thread finishes its step and stops. The map
        (with the messages already received, fed to it) and the latched maps stay."""
        self._active = False
        self._request_stop()
        # The other threads that use rclpy (the update thread publishes, the service host spins its own
        # executor) stop before this one destroys anything: rcl's teardown is not safe against them, and a
        # clean-clone CI run once died (SIGSEGV in Subscription.destroy) at a Ctrl-C while they still ran. No
        # message is taken meanwhile: this runs on the node's executor thread, or after it stopped spinning.
        self._worker.join(timeout=30.0)
        self._fail_queued_jobs()  # a service waiting on a job that will never run answers now, so its thread stops
        self._service_host.stop(self.get_logger())
        for subscription in self._input_subscriptions:
            self.destroy_subscription(subscription)
        for timer in self._active_timers:
            self.destroy_timer(timer)
        self._input_subscriptions, self._active_timers = [], []
        with self._lock:
            try:
                self._feed_inbox()  # what was received is kept (no update runs: batches stay as cut)
            except Exception as err:
                self._report(f"feeding the mapper failed: {type(err).__name__}: {err}")

    def _cleanup(self) -> None:
        """Drop the map and the publishers (back to unconfigured)."""
        self._destroy_map_publishers()
        self.destroy_publisher(self._diag_pub)
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
        return (f"mapping {c.sync.target} of the field in {c.sync.field_unit}: magnetometer on {resolve('mag')}, "
                f"{pose}; map frame '{c.grid.frame_id}'; {c.model.engine} (M={c.model.num_inducing}) on "
                f"{self.mapper.model.device}; publishing under {self.get_fully_qualified_name()}/ every "
                f"{c.node.publish_period} s")

    def _apply_live_parameter(self, name: str, value: Any) -> None:
        section, key = name.split(".")
        # The Mapper holds this same config object and reads it when predicting, on the update thread.
        if self._active:
            self._submit(f"set {name}", lambda: self._set_config(section, key, value), periodic=False)
        else:  # no update thread (a lifecycle node not active): the config takes it now
            setattr(getattr(self.config, section), key, value)
            if self.mapper is not None:
                self.mapper.mark_changed()
        if name == "node.publish_period" and self._active:
            self._publish_timer.timer_period_ns = int(round(value * 1e9))
            self._publish_timer.reset()

    def _set_config(self, section: str, key: str, value: Any) -> None:
        with self._lock:
            setattr(getattr(self.config, section), key, value)
            self.mapper.mark_changed()

    # ---------------------------------------------------------------------------------- the update thread

    def _update_step(self) -> bool:
        """Feed the inbox to the mapper and run one update; True when it ran one (more may be ready)."""
        try:
            self._feed_inbox()
        except Exception as err:  # the thread must survive whatever one message does
            self._report(f"feeding the mapper failed: {type(err).__name__}: {err}")
        waiting = self._run_updates(max_updates=1) > 0
        self._mapper_diagnostics = self.mapper.diagnostics()
        return waiting

    def _after_update_step(self) -> None:
        # A timer tick that came during the update is served right after it: a job queued by the tick would wait
        # for the next update, seconds when updates are slow (a flood, a small CPU).
        self._publish_if_due()

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
        init_node(self, Node, NODE_NAME, node_kwargs, plain=True)


class LifecycleMapperNode(LifecycleCallbacks, _MapperCore, LifecycleNode):
    """The managed node (``ros2 run gp_mapping lifecycle_mapper``), brought up as nav2's lifecycle manager does:
    ``configure`` reads the parameters and builds the model (a bad parameter or an unreadable initial map fails
    the transition with the reason), ``activate`` subscribes and publishes, ``deactivate`` stops both and keeps
    the map, ``cleanup`` drops it, ``shutdown`` writes the last checkpoint (when they are on)."""

    deactivated_line = "deactivated: not mapping; the map is kept"
    cleaned_up_line = "cleaned up: the map is dropped"

    def __init__(self, **node_kwargs: Any) -> None:
        init_node(self, LifecycleNode, NODE_NAME, node_kwargs, plain=False)

    def _configure_failed(self) -> None:
        self.mapper = None

    def _reactivated(self) -> None:
        if self.mapper.diagnostics()["num_seen"]:
            self.mapper.mark_changed()  # the map kept through a deactivate is published again at once


# ------------------------------------------------------------------------------------------------ commands


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gp-mapping node``; everything after ``--ros-args`` goes to ROS."""
    add_config_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``gp-mapping node``: ``args.ros_args`` holds the ROS arguments (``--ros-args ...``)."""
    from rclpy.utilities import remove_ros_args

    ros_args = list(getattr(args, "ros_args", []) or [])
    stray = remove_ros_args(["gp-mapping node"] + ros_args)[1:]
    if stray:
        print(f"gp-mapping node: unrecognised arguments: {' '.join(stray)} (ROS arguments go after --ros-args)",
              file=sys.stderr)
        return EXIT_BAD_CONFIG
    return spin(with_config(["gp-mapping node"], args.config, ros_args))


def spin(argv: list[str], lifecycle: bool = False, autostart: bool = False) -> int:
    """Start ROS with ``argv``, run the mapper until shutdown, and return the exit status. ``lifecycle``: the
    managed node, waiting for configure and activate (``autostart``: it does both itself)."""

    def prepare(node) -> bool:
        # Before the executor takes any message (or /clock): the first update must not stall on the imports
        # torch makes on first use.
        warm_up_engines()
        return bring_up(node) if lifecycle and autostart else True

    return spin_node(argv, "mapper", NODE_NAME, LifecycleMapperNode if lifecycle else MapperNode, prepare)


def main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping mapper [--config FILE] [--ros-args ...]``."""
    ros_argv, _ = node_command(argv, "mapper", "Gaussian-process magnetic-field mapping node.")
    return spin(ros_argv)


def lifecycle_main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping lifecycle_mapper [--config FILE] [--autostart] [--ros-args ...]``: the managed
    node; a lifecycle manager (the launch files, nav2's lifecycle_manager) configures and activates it."""
    ros_argv, autostart = node_command(argv, "lifecycle_mapper", "Gaussian-process magnetic-field mapping node "
                                       "(managed, rclpy lifecycle).", lifecycle=True)
    return spin(ros_argv, lifecycle=True, autostart=autostart)


if __name__ == "__main__":
    sys.exit(main())
