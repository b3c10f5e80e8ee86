"""The mapping node's services, served beside the node so that it keeps taking messages while one runs.

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

They run on the update thread between two updates (:mod:`gp_mapping.ros.update_worker`); they are served by a
hidden helper node (``_<node name>_services``, :class:`ServiceHost`) with its own executor thread, so the node
keeps taking messages meanwhile. Each keeps :data:`SERVICE_QUEUE_DEPTH` requests, answered in order.
"""
from __future__ import annotations

import threading
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_srvs.srv import Trigger

from gp_mapping.config import shorten
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import MapStateError
from gp_mapping.ros.persistence import saved_map_path

SERVICE_TIMEOUT_S = 300.0  # a service waits this long for its job on the update thread (a save flushes the backlog)
# Requests the services keep while earlier ones run (rclpy's default keeps 10: of 50 concurrent ~/reset calls 39
# were never answered). Each request waits its turn on the update thread, so a burst is answered in order.
SERVICE_QUEUE_DEPTH = 1000
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=SERVICE_QUEUE_DEPTH,
                         reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)


class ServiceHost:
    """Services with ``node``'s names (``<node>/<name>``) on a hidden helper node with its own executor thread:
    while a service waits for the node's update thread, the node's own executor keeps taking messages."""

    def __init__(self, node: Node, callbacks: dict[str, Callable], srv_type: Any = Trigger) -> None:
        # Global ROS arguments stay off it: `-r __node:=name` would give it the node's name.
        self.node = rclpy.create_node(f"_{node.get_name()}_services", namespace=node.get_namespace(),
                                      context=node.context, use_global_arguments=False,
                                      start_parameter_services=False)
        own_name = node.get_fully_qualified_name()
        for name, callback in callbacks.items():
            self.node.create_service(srv_type, f"{own_name}/{name}", callback, qos_profile=SERVICE_QOS)
        self._executor = SingleThreadedExecutor(context=node.context)
        self._executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, name="gp_mapping_services", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, logger: Any) -> None:
        """Stop serving; the helper node is destroyed once its thread has stopped."""
        self._executor.shutdown()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            # rclpy crashes (SIGSEGV) when a node is destroyed under an executor still waiting on it: leave the
            # helper node to the process's exit rather than take the process down
            logger.error("the service thread did not stop within 10 s; its node is left undestroyed")
        else:
            self.node.destroy_node()

    def _spin(self) -> None:
        try:
            self._executor.spin()
        except ExternalShutdownException:  # the context shut down (Ctrl-C): the node is closing
            pass


class MapServices:
    """Mixin of the mapping node: ``~/save_map``, ``~/load_map`` and ``~/reset``, each a job on the update
    thread (``_submit``) answered with its result or with why it failed."""

    def _create_services(self) -> ServiceHost:
        return ServiceHost(self, {"save_map": self.on_save_map, "reset": self.on_reset, "load_map": self.on_load_map})

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
            reason = err.reason if isinstance(err, MapStateError) else ""  # a state file's refusal is named
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
                dropped = self._drop_inbox()
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
                dropped = self._drop_inbox()
                self.mapper.reset()
                if self._tf is not None:
                    self._tf.clear()
                self._mapper_diagnostics = self.mapper.diagnostics()
                self.mapper.mark_published()  # the cleared map below
                self._last_error = ""
                self._publish_cleared()
            return f"map reset ({dropped} buffered messages dropped)"

        return self._call_on_update_thread("reset", reset, response)
