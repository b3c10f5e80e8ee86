"""The mapping node's services, served beside the node so that it keeps taking messages while one runs.

Services (std_srvs/Trigger; the paths are parameters)
    ``~/save_map``   feeds every message received so far, runs the pending updates and the last partial batch
                     (samples still waiting for a following pose keep waiting), then writes the map state to a new
                     file ``<node.map_directory>/<node name>_<UTC time>.safetensors`` (``node.map_directory``
                     empty: ``$ROS_HOME/gp_mapping``, ``ROS_HOME`` defaulting to ``~/.ros``); never overwrites. The
                     response message is the absolute path. Start from it with the parameter ``node.initial_map``.
    ``~/load_map``   replaces the map by the state file named by ``node.initial_map`` (settable while running),
                     with the start-up checks: an unreadable or incompatible file is refused with the reason and
                     the current map stays. Buffered messages are dropped; the loaded map is published at once.
    ``~/reset``      forgets the map and the buffered messages; publishes all-unknown grids of the last geometry.
    ``~/start_session``  the readings from now on are a new session (the sensor was swapped, re-mounted or
                     recalibrated): what was received is conditioned first, then the new session's constant offset
                     to the map so far is learned and removed (docs/calibration.md). ``node.initial_map`` and
                     ``~/load_map`` start one by themselves (``node.new_session_on_load``). The response message
                     names the session.

nav2's services (``nav2_msgs/srv/SaveMap``, ``nav2_msgs/srv/LoadMap``, the types of nav2's map_saver and
map_server), served only where ``nav2_msgs`` is importable (a robot with nav2 has it; without it the node logs
that they are off and serves the rest). They take the path in the request; their names, beside the Trigger
services that keep theirs:
    ``~/nav2/save_map``  as ``~/save_map`` (the backlog first), then, by ``image_format``: empty or ``safetensors``,
                     the state file ``<map_url>.safetensors``; ``pgm`` or ``png``, the nav2 export of
                     ``gp-mapping export`` into the folder ``map_url`` (per layer and statistic an image and its
                     map_server YAML, ``mode: raw``, with the request's ``free_thresh`` / ``occupied_thresh``,
                     0 meaning map_saver's defaults; and map.npz, map.png). ``map_url``: a path or ``file://`` URL,
                     relative to the saved maps' folder; empty, ``~/save_map``'s timestamped name. An explicit
                     ``map_url`` is overwritten, as map_saver overwrites. ``map_mode`` must be empty or ``raw``
                     (the pixels are field values, not occupancy); ``map_topic`` is not used (every layer is
                     written). ``result``: whether the files were written.
    ``~/nav2/load_map``  as ``~/load_map``, the state file named by ``map_url`` (a path or ``file://`` URL,
                     relative to the saved maps' folder; ``.safetensors`` may be left off). ``map``: the loaded
                     map's mean layer (``magnitude``; a vector map's ``norm``) as the nav2 export encodes it
                     (0..100, -1 unknown, ``grid.mean_range``), empty when the map holds no data yet. ``result``:
                     ``RESULT_SUCCESS``; ``RESULT_MAP_DOES_NOT_EXIST`` (no such file, an empty ``map_url``);
                     ``RESULT_INVALID_MAP_DATA`` (not a map state file: truncated, corrupt, a nav2 image map);
                     ``RESULT_INVALID_MAP_METADATA`` (a state file of another schema or an incompatible config:
                     frame, unit, engine ...); ``RESULT_UNDEFINED_FAILURE`` (a URL other than ``file://``, the
                     node stopping, a timeout). The current map stays on any failure.

They run on the update thread between two updates (:mod:`gp_mapping.ros.update_worker`); they are served by a
hidden helper node (``_<node name>_services``, :class:`ServiceHost`) with its own executor thread, so the node
keeps taking messages meanwhile. Each keeps :data:`SERVICE_QUEUE_DEPTH` requests, answered in order.
"""
from __future__ import annotations

import re
import threading
import urllib.parse
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from nav_msgs.msg import OccupancyGrid
from std_srvs.srv import Trigger

from gp_mapping.config import shorten
from gp_mapping.export import export_map
from gp_mapping.mapping.map_files import NAV2_IMAGE_FORMATS, NAV2_THRESHOLDS, nav2_cells
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import MapStateError
from gp_mapping.ros.conversions import occupancy_msg, seconds_to_stamp
from gp_mapping.ros.persistence import saved_map_path, saved_maps_folder

SERVICE_TIMEOUT_S = 300.0  # a service waits this long for its job on the update thread (a save flushes the backlog)
# Requests the services keep while earlier ones run (rclpy's default keeps 10: of 50 concurrent ~/reset calls 39
# were never answered). Each request waits its turn on the update thread, so a burst is answered in order.
SERVICE_QUEUE_DEPTH = 1000
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=SERVICE_QUEUE_DEPTH,
                         reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)

# nav2's map services, under the node beside the Trigger services of the same verbs (docs/node.md).
NAV2_SAVE_MAP = "nav2/save_map"
NAV2_LOAD_MAP = "nav2/load_map"
STATE_SUFFIX = ".safetensors"
STATE_FORMATS = ("", "safetensors")  # SaveMap image_format values that write the state file
NAV2_MAP_MODES = ("", "raw")  # the export's pixels are field values: map_saver's trinary / scale would misread them
NAV2_MAP_LAYERS = ("magnitude", "norm")  # LoadMap's map: the first of these the map has (else its first layer)
IMAGE_MAP_SUFFIXES = (".yaml", ".yml", ".pgm", ".png")
# A state file refused for what it says about itself (not for its bytes): LoadMap's RESULT_INVALID_MAP_METADATA.
METADATA_REASONS = frozenset({"schema", "metadata", "frame_mismatch", "unit_mismatch", "config_mismatch"})
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def nav2_service_types() -> tuple[Any, Any] | None:
    """(SaveMap, LoadMap) of ``nav2_msgs``, or None where nav2_msgs is not importable (a robot without nav2)."""
    try:
        from nav2_msgs.srv import LoadMap, SaveMap
    except ImportError:
        return None
    return SaveMap, LoadMap


def map_url_path(url: str, folder: Path) -> Path:
    """A nav2 ``map_url`` as an absolute path: a path (``~`` expanded; relative: under ``folder``) or a
    ``file://`` URL (percent-escapes decoded). ValueError for any other URL."""
    match = _URL_SCHEME.match(url)
    if match:
        parsed = urllib.parse.urlparse(url)
        if match.group(1).lower() != "file" or parsed.netloc not in ("", "localhost"):
            raise ValueError(f"map_url {shorten(repr(url), 200)}: only paths and file:// URLs on this machine are "
                             "read and written")
        path = Path(urllib.parse.unquote(parsed.path))
    else:
        path = Path(url).expanduser()
    return path if path.is_absolute() else folder / path


class ServiceHost:
    """Services with ``node``'s names (``<node>/<name>``) on a hidden helper node with its own executor thread:
    while a service waits for the node's update thread, the node's own executor keeps taking messages."""

    def __init__(self, node: Node, callbacks: dict[str, Callable | tuple[Any, Callable]], srv_type: Any = Trigger
                 ) -> None:
        """``callbacks``: service name under the node -> its callback (of type ``srv_type``) or a pair
        (service type, callback)."""
        # Global ROS arguments stay off it: `-r __node:=name` would give it the node's name.
        self.node = rclpy.create_node(f"_{node.get_name()}_services", namespace=node.get_namespace(),
                                      context=node.context, use_global_arguments=False,
                                      start_parameter_services=False)
        own_name = node.get_fully_qualified_name()
        for name, entry in callbacks.items():
            service_type, callback = entry if isinstance(entry, tuple) else (srv_type, entry)
            self.node.create_service(service_type, f"{own_name}/{name}", callback, qos_profile=SERVICE_QOS)
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
    """Mixin of the mapping node: ``~/save_map``, ``~/load_map``, ``~/reset`` and ``~/start_session`` (Trigger), and
    where nav2_msgs is importable ``~/nav2/save_map`` and ``~/nav2/load_map``; each a job on the update thread
    (``_submit``) answered with its result or with why it failed."""

    def _create_services(self) -> ServiceHost:
        callbacks: dict[str, Any] = {"save_map": self.on_save_map, "reset": self.on_reset,
                                     "load_map": self.on_load_map, "start_session": self.on_start_session}
        nav2 = nav2_service_types()
        if nav2 is None:
            self.get_logger().info(f"nav2_msgs is not installed: ~/{NAV2_SAVE_MAP} and ~/{NAV2_LOAD_MAP} are not "
                                   "served (the Trigger services are)")
        else:
            save_type, load_type = nav2
            callbacks[NAV2_SAVE_MAP] = (save_type, self.on_nav2_save_map)
            callbacks[NAV2_LOAD_MAP] = (load_type, self.on_nav2_load_map)
        return ServiceHost(self, callbacks)

    def _run_on_update_thread(self, name: str, job: Callable[[], Any]) -> tuple[Any, Exception | None, str]:
        """Run a service's ``job`` on the update thread: (its value, None, "") or (None, the error, why it
        failed, for the log and the caller)."""
        future = self._submit(name, job, periodic=False)
        try:
            if future is None:
                raise RuntimeError("the node is stopping")
            return future.result(timeout=SERVICE_TIMEOUT_S), None, ""
        except FutureTimeout as err:  # the job still runs; the caller learns it has not finished
            return None, err, f"{name}: not finished after {SERVICE_TIMEOUT_S:.0f} s; it goes on in the node"
        except Exception as err:  # a failed save or reset is the caller's answer, not the node's end
            reason = err.reason if isinstance(err, MapStateError) else ""  # a state file's refusal is named
            return None, err, shorten(f"{name} failed: {type(err).__name__}{f' ({reason})' if reason else ''}: "
                                      f"{err}", 1000)

    def _call_on_update_thread(self, name: str, job: Callable[[], str], response: Trigger.Response
                               ) -> Trigger.Response:
        """Run a service's ``job`` on the update thread and answer with its message, or with why it failed."""
        message, error, why = self._run_on_update_thread(name, job)
        response.success = error is None
        response.message = message if error is None else why
        if response.success:
            self.get_logger().info(f"{name}: {response.message}")
        else:
            self.get_logger().error(response.message)
        return response

    # ------------------------------------------------------------------------------ jobs (update thread)

    def _save_state(self, path: Path) -> str:
        """Feed the backlog, run the updates and the last partial batch, write the state to ``path``."""
        with self._lock:
            self._feed_inbox()
            self._run_updates(flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.mapper.save(path)
            self._mapper_diagnostics = self.mapper.diagnostics()
        return str(path.resolve())

    def _load_state(self, path: str | Path, mapper: Mapper | None = None) -> str:
        """Replace the map by the state file ``path`` (``mapper``: the one already read from it), with the checks
        of a start (raises before anything changes); buffered messages are dropped and the loaded map goes out at
        once."""
        if mapper is None:
            mapper = self._load_mapper(path)  # raises before anything changes
        with self._lock:
            dropped = self._drop_inbox()
            self.mapper = mapper
            self._mapper_diagnostics = self.mapper.diagnostics()
            self._publish_due = True  # the loaded map (changed, for the Mapper) goes out at once
            self._last_error = ""
        return (f"loaded {Path(path).resolve()} ({self._mapper_diagnostics.get('num_seen', 0)} samples in the "
                f"model; {dropped} buffered messages dropped){self._session_note(mapper)}")

    # ---------------------------------------------------------------------------------- Trigger services

    def on_save_map(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        def save() -> str:
            return self._save_state(saved_map_path(self.config.node.map_directory, self.get_name()))

        return self._call_on_update_thread("save_map", save, response)

    def on_load_map(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        """Replace the map by the state file ``node.initial_map`` (set it first, e.g. with ``ros2 param set``),
        with the start-up checks: a file that cannot be read, or that was made with an incompatible config,
        is refused with the reason and the current map stays."""
        def load() -> str:
            path = self.config.node.initial_map
            if not path:
                raise ValueError("node.initial_map is empty; set it to the state file to load")
            return self._load_state(path)

        return self._call_on_update_thread("load_map", load, response)

    def on_start_session(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        """The readings from now on are a new session (the sensor was swapped, re-mounted or recalibrated): the
        messages received so far are conditioned in the old one, then the new one's constant offset is learned."""
        def start() -> str:
            with self._lock:
                self._feed_inbox()
                self._run_updates(flush=True)
                session = self.mapper.start_session()
                self._mapper_diagnostics = self.mapper.diagnostics()
            return f"session {session} started; its constant offset to the map so far is learned as it comes"

        return self._call_on_update_thread("start_session", start, response)

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

    # ------------------------------------------------------------------------------------- nav2 services

    def _saved_maps_folder(self) -> Path:
        return saved_maps_folder(self.config.node.map_directory, self.get_name())

    def on_nav2_save_map(self, request: Any, response: Any) -> Any:
        """nav2_msgs/SaveMap: the state file (``image_format`` empty or ``safetensors``) or the nav2 export
        (``pgm``, ``png``) at ``map_url``; ``result`` says whether the files were written."""
        def save() -> str:
            image_format = request.image_format.strip().lower()
            map_mode = request.map_mode.strip().lower()
            if image_format not in STATE_FORMATS + NAV2_IMAGE_FORMATS:
                raise ValueError(f"image_format {shorten(repr(request.image_format), 100)} is none of "
                                 f"{', '.join(repr(f) for f in STATE_FORMATS + NAV2_IMAGE_FORMATS)} (empty or "
                                 "'safetensors': the state file)")
            if map_mode not in NAV2_MAP_MODES:
                raise ValueError(f"map_mode {shorten(repr(request.map_mode), 100)}: only 'raw' (or empty) keeps a "
                                 "field map's values; trinary and scale would read them as occupancy")
            # float32 on the wire: 0.25 arrives as 0.2500000037, written back as 0.25
            thresholds = tuple(round(float(value), 6) or default for value, default in
                               zip((request.free_thresh, request.occupied_thresh), NAV2_THRESHOLDS))
            if not 0.0 <= thresholds[0] < thresholds[1] <= 1.0:
                raise ValueError(f"free_thresh {thresholds[0]:g} and occupied_thresh {thresholds[1]:g} must satisfy "
                                 "0 <= free_thresh < occupied_thresh <= 1 (0 means map_saver's default)")
            if request.map_url:
                target = map_url_path(request.map_url, self._saved_maps_folder())
            else:
                target = saved_map_path(self.config.node.map_directory, self.get_name()).with_suffix("")
            if image_format in STATE_FORMATS:
                if target.suffix != STATE_SUFFIX:
                    target = target.with_name(target.name + STATE_SUFFIX)
                return f"wrote the map state {self._save_state(target)}"
            with self._lock:
                self._feed_inbox()
                self._run_updates(flush=True)
                grid = self.mapper.export_grid()
                if grid is None:
                    raise ValueError("the map holds no data yet (no update ran), so there is no image to write")
                grid_config = self.mapper.config.grid
                files = export_map(grid, target, self.mapper.trajectory, grid_config.mean_range,
                                   grid_config.variance_range, title=target.name, image_format=image_format,
                                   thresholds=thresholds)
                self._mapper_diagnostics = self.mapper.diagnostics()
            return f"wrote the nav2 map files {', '.join(sorted(files))} into {target.resolve()}"

        message, error, why = self._run_on_update_thread(NAV2_SAVE_MAP, save)
        response.result = error is None
        if error is None:
            self.get_logger().info(f"{NAV2_SAVE_MAP}: {message}")
        else:
            self.get_logger().error(why)
        return response

    def on_nav2_load_map(self, request: Any, response: Any) -> Any:
        """nav2_msgs/LoadMap: replace the map by the state file at ``map_url`` and answer its mean layer as an
        OccupancyGrid; ``result`` is one of LoadMap's codes, and on any failure the current map stays."""
        def fail(code: int, why: str) -> Any:
            response.result = code
            self.get_logger().error(shorten(f"{NAV2_LOAD_MAP} failed: {why}", 1000))
            return response

        if not request.map_url:
            return fail(response.RESULT_MAP_DOES_NOT_EXIST, "map_url is empty; name the state file to load")
        try:
            path = map_url_path(request.map_url, self._saved_maps_folder())
        except ValueError as err:
            return fail(response.RESULT_UNDEFINED_FAILURE, str(err))
        if not path.exists() and path.suffix != STATE_SUFFIX and path.with_name(path.name + STATE_SUFFIX).exists():
            path = path.with_name(path.name + STATE_SUFFIX)  # the name SaveMap was given
        if not path.exists():
            return fail(response.RESULT_MAP_DOES_NOT_EXIST, f"{path} does not exist")
        if path.suffix.lower() in IMAGE_MAP_SUFFIXES:
            return fail(response.RESULT_INVALID_MAP_DATA, f"{path} is a nav2 image map, which holds no model; load "
                        f"the map's state file ({STATE_SUFFIX}, from ~/{NAV2_SAVE_MAP} with an empty image_format "
                        "or from ~/save_map)")

        def load() -> tuple[str, Any]:
            mapper = self._load_mapper(path)
            grid_msg = self._nav2_map(mapper)  # before the swap: a map that cannot be answered changes nothing
            return self._load_state(path, mapper), grid_msg

        value, error, why = self._run_on_update_thread(NAV2_LOAD_MAP, load)
        if error is None:
            message, response.map = value
            response.result = response.RESULT_SUCCESS
            self.get_logger().info(f"{NAV2_LOAD_MAP}: {message}")
            return response
        if isinstance(error, MapStateError):
            code = (response.RESULT_INVALID_MAP_METADATA if error.reason in METADATA_REASONS
                    else response.RESULT_INVALID_MAP_DATA)
        else:
            code = response.RESULT_UNDEFINED_FAILURE
        response.result = code
        self.get_logger().error(why)
        return response

    def _nav2_map(self, mapper: Mapper) -> OccupancyGrid:
        """The mean layer of ``mapper``'s map (``magnitude``, a vector map's ``norm``) as the nav2 export encodes
        it (the whole map, :meth:`Mapper.export_grid`); an empty grid in the map frame when there is no map yet."""
        grid = mapper.export_grid()
        if grid is None:
            msg = OccupancyGrid()
            msg.header.frame_id = self.config.grid.frame_id
            return msg
        layer = next((name for name in NAV2_MAP_LAYERS if name in grid.layers), next(iter(grid.layers)))
        cells, _, _ = nav2_cells(grid, grid.layers[layer][0], mapper.config.grid.mean_range)
        return occupancy_msg(grid, cells.ravel(), seconds_to_stamp(grid.stamp))
