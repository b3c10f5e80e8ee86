"""The map topics: what a gp_mapping node publishes of a map, and when the mapping node publishes it.

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

The scale message (latched, republished with every map). A row-major L x 4 matrix, one row per layer::

    layout.dim[0]: label "layer:<names>" (e.g. "layer:magnitude" or "layer:x,y,z,norm"), size L, stride 4L
    layout.dim[1]: label "mean_offset,mean_scale,variance_offset,variance_scale;unit:<sync.field_unit>",
                   size 4, stride 4
    data[4i:4i+4] = mean_offset, mean_scale, variance_offset, variance_scale of layer i

A published cell value ``c`` in 0..100 decodes to ``mean = mean_offset + mean_scale * c`` (in the unit) and
``variance = variance_offset + variance_scale * c`` (unit squared), exact within half a step; -1 is unknown.
``gp_mapping.ros.conversions.scale_from_msg`` parses it.

The layout is :mod:`gp_mapping.mapping.publication`'s, defined once: :func:`create_map_publishers` and
:func:`publish_map_layout` put it on the topics of any node (the mapper, the merger); :class:`MapPublishing` is the
mapping node's rule of when: at most one map per ``node.publish_period`` tick, and only a map that changed.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
from nav_msgs.msg import OccupancyGrid
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import PointCloud2
from std_msgs.msg import Float64MultiArray

from gp_mapping.config import MapperConfig
from gp_mapping.mapping import publication
from gp_mapping.ros import conversions

MAP_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)


def layer_names(config: MapperConfig) -> tuple[str, ...]:
    """Layers of the published map for the configured ``sync.target``."""
    return publication.layer_names(config.sync.target)


def map_topics(config: MapperConfig) -> dict[str, tuple[str, str]]:
    """Layer -> (mean topic, variance topic), relative to the node (``~/...``)."""
    return publication.map_topics(layer_names(config))


def published_topics(config: MapperConfig) -> dict[str, str]:
    """Every topic the mapping node publishes (node-relative or absolute) -> its message type."""
    topics = publication.map_topic_types(layer_names(config))
    topics["/diagnostics"] = "diagnostic_msgs/msg/DiagnosticArray"
    return topics


def create_map_publishers(node: Node, config: MapperConfig | None,
                          layers: tuple[str, ...] | None = None) -> tuple[dict[str, tuple[Any, Any]], Any, Any]:
    """The map topics of ``node`` (latched): layer -> (~/mean..., ~/variance...) publishers, ~/cloud, ~/scale.
    The mapping node and the merger node publish through these and :func:`publish_map_layout`; the localizer
    node, which has no mapper config, names its map's ``layers``."""
    topics = map_topics(config) if layers is None else publication.map_topics(layers)
    map_pubs = {layer: (node.create_publisher(OccupancyGrid, mean, MAP_QOS),
                        node.create_publisher(OccupancyGrid, var, MAP_QOS))
                for layer, (mean, var) in topics.items()}
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


class MapPublishing:
    """Mixin of the mapping node: its map publishers, the publish timer's rule, and the map's publication (on the
    update thread)."""

    def _setup_publishing(self) -> None:
        self._map_pubs, self._cloud_pub, self._scale_pub = create_map_publishers(self, self.config)
        self._publish_seconds = math.nan
        self._publish_due = False  # the publish timer ticked since the last map
        self._last_grid = None  # the last published MapGrid (geometry for the cleared map after a reset)

    def _destroy_map_publishers(self) -> None:
        for pub in [p for pair in self._map_pubs.values() for p in pair] + [self._cloud_pub, self._scale_pub]:
            self.destroy_publisher(pub)
        self._map_pubs = {}

    def _stamp_of(self, grid: Any):
        """The maps' clock: the grid's data time (its newest sample), or the node clock where it has none."""
        stamp = grid.stamp
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
        publish_map_layout(self._map_pubs, self._cloud_pub, self._scale_pub, grid, layout,
                           self.config.sync.field_unit, stamp)
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
