"""The merger node: merges the maps of several mapping nodes from their model summaries (no data) and publishes
the merged map exactly as a mapping node publishes its own.

``ros2 run gp_mapping merger --ros-args -p sources:="['/robot1/mapper/model', '/robot2/mapper/model']"``
(or ``gp-mapping merge-node --ros-args ...``; ``launch/multi_robot.launch.py`` starts two mappers and one merger).

Parameters (validated at start; a bad one stops the node with exit status 2, naming it):

| name | type | meaning |
|---|---|---|
| ``sources`` | string array | model summary topics (``<mapper>/model``, std_msgs/UInt8MultiArray); at least one |
| ``transforms`` | string array | empty, or one per source: ``""`` (same frame) or ``"x,y,yaw_deg"`` into the merged frame |
| ``merge_period`` | double | seconds between merges (a merge runs only when a source changed) |
| ``steps`` | int | Adam steps on the global inducing inputs and hyperparameters per merge (0: none, the closed form; -1, the default: as ``gp-mapping merge``, none while the merged inducing points explain all the sources', else 100) |
| ``tiled_steps`` | int | the same per tile, when the sources are tiled maps (0, the default: the closed form) |
| ``num_inducing`` | int | global inducing points (0: the sum of the sources', up to 1024; tiled maps: per tile, 0: the largest source tile's) |
| ``max_summary_bytes`` | int | larger summaries are refused unread |
| ``same_level`` | bool | the sources read alike (one sensor): do not measure and remove a constant offset between them (false, the default: each source is a session, levelled as ``gp-mapping merge`` does) |

Subscribes (reliable, transient local, depth 1) to every source topic; publishes ``~/mean``, ``~/variance``
(per layer for a vector target), ``~/cloud``, ``~/scale`` (latched, the mapping node's layout and code) and
``/diagnostics``. A summary that is oversized, malformed, incompatible (another target, unit, frame) or that
shares data with another source (its lineage overlaps another's) is refused, counted under
``rejected/<reason>`` and logged; the merger keeps merging what it has. Tiled maps (the mappers' default) arrive
tile by tile and merge tile by tile into a map tiled alike (gp_mapping/mapping/merge.py); a map too large for one
message arrives in parts, which the merger puts together: it merges that map once it holds every tile (until then
its earlier whole map, if any, stays in the merge), each tile as of its latest part (``parts_received``,
``sources_incomplete`` in the diagnostics). The merge is gp_mapping/mapping/merge.py's, as for ``gp-mapping merge``
(gp_mapping/merge_cli.py) on state files; the map goes out through the mapping node's publishers
(gp_mapping/ros/publishers.py).
"""
from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import ParameterDescriptor, ParameterType
from rclpy.exceptions import ParameterUninitializedException
from rclpy.parameter import Parameter
from rclpy.node import Node
from std_msgs.msg import UInt8MultiArray

from gp_mapping.gp.merging import MergeError
from gp_mapping.mapping import publication
from gp_mapping.mapping.health import OK, WARN
from gp_mapping.mapping.merge import (DuplicateSourceError, MapSource, SummaryError, assemble_tiles, check_compatible,
                                      check_lineage, decode_summary, levels_text, merge_maps, parse_transform)
from gp_mapping.ros.diagnostics import DIAGNOSTICS_PERIOD, diagnostic_array
from gp_mapping.ros.process import NodeStartError, spin_node
from gp_mapping.ros.publishers import MAP_QOS, create_map_publishers, publish_map_layout

MERGER_NAME = "merger"
REJECTION_REASONS = ("oversized", "malformed", "incompatible", "duplicate")

_PARAMETERS = {
    "sources": ([], ParameterType.PARAMETER_STRING_ARRAY, "model summary topics (<mapper>/model), at least one"),
    "transforms": ([], ParameterType.PARAMETER_STRING_ARRAY,
                   "empty, or one per source: '' or 'x,y,yaw_deg' (that source's frame into the merged frame)"),
    "merge_period": (2.0, ParameterType.PARAMETER_DOUBLE, "seconds between merges (only when a source changed); > 0"),
    "steps": (-1, ParameterType.PARAMETER_INTEGER, "Adam steps on the global Z and hyperparameters per merge; >= 0, "
              "or -1: none while the merged Z explains all the sources', else 100"),
    "tiled_steps": (0, ParameterType.PARAMETER_INTEGER, "the same per tile, for tiled maps (0: closed form); >= 0"),
    "num_inducing": (0, ParameterType.PARAMETER_INTEGER, "global inducing points (0: sum of the sources', <= 1024)"),
    "max_summary_bytes": (16_000_000, ParameterType.PARAMETER_INTEGER, "larger summaries are refused; >= 1024"),
    "same_level": (False, ParameterType.PARAMETER_BOOL, "the sources read alike: merge them without measuring and "
                   "removing a constant offset between them (false: each source is a session, its offset to the "
                   "first measured where they overlap and removed)"),
}


class MergerNode(Node):
    """See the module docstring."""

    def __init__(self, **node_kwargs: Any) -> None:
        super().__init__(MERGER_NAME, **node_kwargs)
        try:
            self._read_parameters()
        except BaseException:
            self.destroy_node()
            raise
        self._sources: dict[str, MapSource] = {}  # topic -> latest accepted summary
        self._parts: dict[str, MapSource] = {}  # topic -> the parts of a large tiled map received so far, together
        self._tile_cache: dict = {}  # merged tiles of the last merge, by their inputs: a merge redoes changed tiles
        self._changed = False
        self._rejected = {reason: 0 for reason in REJECTION_REASONS}
        self._counts = {"received": 0, "parts_received": 0, "accepted": 0, "merges": 0, "failed_merges": 0,
                        "maps_published": 0}
        self._last_error = ""
        self._merge_seconds = math.nan
        self._tiles_reused = 0  # tiles the last merge took unchanged from the one before
        self._levels = "no merge yet"  # the sources' offsets the last merge removed (mapping/merge.py levels_text)
        self._pubs = None  # created at the first merge, for the sources' target (layers)
        self.mapper = None  # the merged Mapper
        self._worker: threading.Thread | None = None  # the merge in progress (callbacks never wait for it)
        for topic in self.source_topics:
            self.create_subscription(UInt8MultiArray, topic, lambda msg, t=topic: self.on_summary(t, msg), MAP_QOS)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_timer(self.merge_period, self._on_merge_timer)
        self.create_timer(DIAGNOSTICS_PERIOD, self._publish_diagnostics)

    def _read_parameters(self) -> None:
        values = {}
        for name, (default, kind, doc) in _PARAMETERS.items():
            descriptor = ParameterDescriptor(name=name, type=kind, description=doc, read_only=True)
            if kind == ParameterType.PARAMETER_STRING_ARRAY:  # an empty default would be typed as bytes
                self.declare_parameter(name, Parameter.Type.STRING_ARRAY, descriptor)
                try:
                    values[name] = list(self.get_parameter(name).value or [])
                except ParameterUninitializedException:
                    values[name] = list(default)
            else:
                self.declare_parameter(name, default, descriptor)
                values[name] = self.get_parameter(name).value
        topics = [str(t) for t in (values["sources"] or [])]
        if not topics or any(not t for t in topics) or len(set(topics)) != len(topics):
            raise NodeStartError(f"bad parameter: sources = {topics!r}: give one or more distinct topic names")
        transforms = [str(t) for t in (values["transforms"] or [])]
        if transforms and len(transforms) != len(topics):
            raise NodeStartError(f"bad parameter: transforms has {len(transforms)} entries for {len(topics)} sources "
                                 "(give none, or one per source)")
        try:
            self.transforms = {topic: (parse_transform(tf) if tf else None)
                               for topic, tf in zip(topics, transforms or [""] * len(topics))}
        except MergeError as err:
            raise NodeStartError(f"bad parameter: transforms: {err}") from None
        checks = {"merge_period": values["merge_period"] > 0, "steps": -1 <= values["steps"] <= 100_000,
                  "tiled_steps": 0 <= values["tiled_steps"] <= 100_000,
                  "num_inducing": 0 <= values["num_inducing"] <= 8192,
                  "max_summary_bytes": values["max_summary_bytes"] >= 1024}
        for name, ok in checks.items():
            if not ok:
                raise NodeStartError(f"bad parameter: {name} = {values[name]!r}: {_PARAMETERS[name][2]}")
        self.source_topics = topics
        self.merge_period = float(values["merge_period"])
        self.steps = int(values["steps"]) if values["steps"] >= 0 else None
        self.tiled_steps = int(values["tiled_steps"])
        self.num_inducing = int(values["num_inducing"]) or None
        self.max_summary_bytes = int(values["max_summary_bytes"])
        self.same_level = bool(values["same_level"])

    # ------------------------------------------------------------------------------------------- input

    def _refuse(self, reason: str, message: str) -> None:
        self._rejected[reason] += 1
        self._last_error = message
        self.get_logger().warning(f"summary refused ({reason}): {message}", throttle_duration_sec=5.0)

    def on_summary(self, topic: str, msg: UInt8MultiArray) -> None:
        """Check a summary and keep it as the topic's latest source; never raises."""
        self._counts["received"] += 1
        try:
            if len(msg.data) > self.max_summary_bytes:
                self._refuse("oversized", f"{topic}: {len(msg.data)} bytes, more than max_summary_bytes = "
                                          f"{self.max_summary_bytes}")
                return
            try:
                source = decode_summary(bytes(msg.data), self.max_summary_bytes, name=topic)
            except SummaryError as err:
                self._refuse("malformed", str(err))
                return
            if source.tile_index is not None or topic in self._parts:
                self._counts["parts_received"] += source.tile_index is not None
                source = assemble_tiles(self._parts.get(topic), source)
                self._parts[topic] = source
                if source.missing_tiles:  # not mergeable yet: the map's earlier whole summary stays
                    return
            source.transform = self.transforms[topic]
            others = [s for t, s in self._sources.items() if t != topic]
            try:
                check_compatible(others + [source])
            except MergeError as err:
                self._refuse("incompatible", str(err))
                return
            try:
                check_lineage(others + [source])
            except DuplicateSourceError as err:
                self._refuse("duplicate", str(err))
                return
            # a part that went round again on a map standing still changes nothing: no merge for it
            self._changed = self._changed or not _same_tiles(self._sources.get(topic), source)
            self._sources[topic] = source
            self._counts["accepted"] += 1
        except Exception as err:  # whatever one message holds, the merger goes on
            self._refuse("malformed", f"{topic}: {type(err).__name__}: {err}")

    # ------------------------------------------------------------------------------------------- merging

    def _on_merge_timer(self) -> None:
        """Start a merge on a worker thread when a source changed and no merge is running: the subscriptions
        and diagnostics go on during a merge of many or large maps."""
        if self._worker is not None and self._worker.is_alive():
            return
        if not self._changed or not self._sources:
            return
        sources = [self._sources[t] for t in self.source_topics if t in self._sources]
        self._changed = False
        self._worker = threading.Thread(target=self.merge, args=(sources,), name="gp_mapping_merge", daemon=True)
        self._worker.start()

    def merge_if_changed(self) -> bool:
        """Merge the latest sources and publish the map now, if any source changed since the last merge."""
        if not self._changed or not self._sources:
            return False
        self._changed = False
        return self.merge([self._sources[t] for t in self.source_topics if t in self._sources])

    def merge(self, sources: list[MapSource]) -> bool:
        """Merge ``sources`` and publish the merged map; a failure is counted and the last map stays."""
        start = time.perf_counter()
        try:
            mapper, result = merge_maps(sources, steps=self.steps, tiled_steps=self.tiled_steps,
                                        num_inducing=self.num_inducing, tile_cache=self._tile_cache,
                                        levels=not self.same_level)
            self._tiles_reused = result.reused
            self._levels = (levels_text([s.name for s in sources], result.levels, mapper.config.sync.field_unit)
                            if result.levels is not None else "none removed (same_level)" if self.same_level
                            else "none removed (one source)")
            grid = mapper.grid(predict_unknown=False)
        except Exception as err:  # a merge that fails leaves the last map published
            self._counts["failed_merges"] += 1
            self._last_error = f"merge failed: {type(err).__name__}: {err}"
            self.get_logger().error(self._last_error, throttle_duration_sec=5.0)
            return False
        self.mapper = mapper
        self._merge_seconds = time.perf_counter() - start
        self._counts["merges"] += 1
        if grid is None:
            return False
        config = mapper.config
        try:
            if self._pubs is None:
                self._pubs = create_map_publishers(self, config)
            layout = publication.publication(grid, config.sync.field_unit, config.grid.mean_range,
                                             config.grid.variance_range)
            publish_map_layout(*self._pubs, grid, layout, config.sync.field_unit, self.get_clock().now().to_msg())
        except Exception as err:  # shutting down, or a map that cannot be encoded: counted, the node goes on
            self._counts["failed_merges"] += 1
            self._last_error = f"publishing the merged map failed: {type(err).__name__}: {err}"
            return False
        self._counts["maps_published"] += 1
        self._last_error = ""
        return True

    def _publish_diagnostics(self) -> None:
        values: dict[str, Any] = dict(self._counts)
        values.update({f"rejected/{k}": v for k, v in self._rejected.items()})
        values["sources"] = len(self._sources)
        values["sources_incomplete"] = sum(bool(s.missing_tiles) for s in self._parts.values())
        values["merge_seconds_last"] = self._merge_seconds
        values["merge_tiles_reused_last"] = self._tiles_reused
        values["source_offsets_last"] = self._levels
        if self._last_error:
            level, message = WARN, self._last_error
        elif not self._sources:
            level, message = WARN, "waiting for model summaries"
        else:
            level, message = OK, f"merging {len(self._sources)} maps"
        self._diag_pub.publish(diagnostic_array(self.get_clock().now().to_msg(),
                                                f"{self.get_name()}: gp_mapping merger", level, message, values))

    def close(self) -> None:
        """Nothing to stop or write: the merged map is rebuilt from the sources' summaries."""
        self.destroy_node()


def _same_tiles(held: MapSource | None, source: MapSource) -> bool:
    """Whether ``source`` is a tiled map holding the very tiles ``held`` holds (same map, every tile with the same
    samples): what the parts of a map that stands still put together again and again."""
    if held is None or held.tiles is None or source.tiles is None or held.source_id != source.source_id \
            or held.num_seen != source.num_seen:
        return False
    return ({i: s.get("num_seen") for i, s in held.tiles.tiles.items()}
            == {i: s.get("num_seen") for i, s in source.tiles.tiles.items()})


def spin(argv: list[str]) -> int:
    """Start ROS with ``argv`` and run the merger until shutdown; returns the exit status."""
    return spin_node(argv, "merger", MERGER_NAME, MergerNode)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gp-mapping merge-node [--ros-args ...]``: parameters as ROS arguments (see the module docstring)."""


def run(args: argparse.Namespace) -> int:
    return spin(["gp-mapping merge-node"] + list(getattr(args, "ros_args", []) or []))


def main(argv: list[str] | None = None) -> int:
    """``ros2 run gp_mapping merger [--ros-args ...]``."""
    return spin(list(sys.argv if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
