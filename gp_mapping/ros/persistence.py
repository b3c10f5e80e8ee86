"""Where the mapping node keeps its map: the start (from a checkpoint, ``node.initial_map`` or empty), the
checkpoints, and the names of the maps ``~/save_map`` writes.

Checkpoints and resume. With ``node.checkpoint_interval_s`` > 0 a timer (node clock) has the Mapper write its
whole state atomically (temporary file, fsync, rename; safetensors, nothing executable) to
``node.checkpoint_path`` (default ``$ROS_HOME/gp_mapping/<node name>_checkpoint.safetensors``), and once more
on a clean shutdown. With ``node.resume`` (default) a node that finds that file starts from it, so a crash (even
SIGKILL) loses at most one interval. A checkpoint that cannot be read, or that was made with an incompatible
config (another kernel, target, engine ...), stops the node at start with the reason (exit status 2): the file
is left untouched, never overwritten by an empty map.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

from gp_mapping.config import shorten
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.publication import NODE_NAME
from gp_mapping.ros.process import NodeStartError


def default_map_path(node_name: str = NODE_NAME, kind: str = "map") -> Path:
    """``$ROS_HOME/gp_mapping/<node name>_<kind>.safetensors`` (ROS_HOME: ~/.ros); ``kind="checkpoint"``: the
    default checkpoint file."""
    ros_home = os.environ.get("ROS_HOME") or os.path.join(os.path.expanduser("~"), ".ros")
    return Path(ros_home) / "gp_mapping" / f"{node_name}_{kind}.safetensors"


def saved_maps_folder(directory: str, node_name: str) -> Path:
    """The folder of saved maps: ``directory`` (``node.map_directory``), or ``$ROS_HOME/gp_mapping`` when empty."""
    return Path(directory).expanduser() if directory else default_map_path(node_name).parent


def saved_map_path(directory: str, node_name: str, now: float | None = None) -> Path:
    """Where ``~/save_map`` writes: ``<directory>/<node name>_<UTC time>.safetensors`` (``directory`` empty:
    ``$ROS_HOME/gp_mapping``); the time has milliseconds, and a name already taken gets a counter, so a save
    never overwrites an earlier one."""
    folder = saved_maps_folder(directory, node_name)
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    path = folder / f"{node_name}_{stamp}.safetensors"
    counter = 1
    while path.exists():
        path = folder / f"{node_name}_{stamp}_{counter}.safetensors"
        counter += 1
    return path


class Persistence:
    """Mixin of the mapping node: :meth:`_build_mapper` at configure, :meth:`write_checkpoint` (update thread)."""

    def _setup_persistence(self) -> None:
        self._checkpoint = {"written": 0, "failed": 0, "seconds": math.nan, "error": ""}

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint file: ``node.checkpoint_path``, or the default beside the saved maps."""
        configured = self.config.node.checkpoint_path
        return Path(configured).expanduser() if configured else default_map_path(self.get_name(), "checkpoint")

    def _build_mapper(self) -> Mapper:
        """The Mapper to start from: the checkpoint (``node.resume``), else ``node.initial_map``, else empty.
        NodeStartError when the file cannot be used (it is left untouched) or the parameters build no Mapper."""
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
                mapper = self._load_mapper(path)
            except Exception as err:  # any failure to read the file is a bad parameter value
                raise NodeStartError(shorten(f"bad parameter: node.initial_map = {shorten(repr(path), 120)}: {err}",
                                             600)) from err
            self.get_logger().info(f"started from the map in {shorten(path)}{self._session_note(mapper)}")
            return mapper
        try:
            return Mapper(self.config)
        except Exception as err:
            raise NodeStartError(f"cannot build the mapper from the parameters: {err}") from err

    def _load_mapper(self, path: str | Path) -> Mapper:
        """The Mapper of the state file ``path`` that this node run's readings go on (node.initial_map,
        ~/load_map): with ``node.new_session_on_load`` they are a new session, whose constant offset to the
        loaded map is learned (docs/calibration.md); a resume from the checkpoint continues instead."""
        return Mapper.load(path, config=self.config, new_session=self.config.node.new_session_on_load)

    @staticmethod
    def _session_note(mapper: Mapper) -> str:
        session = mapper.session
        return f"; this run's readings are session {session}" if session else ""

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
