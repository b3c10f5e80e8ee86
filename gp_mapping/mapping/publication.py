"""The published map's layout, defined once and free of ROS: the node (``ros/conversions.py``) and the map-bag
writer only turn it into messages, so the live node's maps and the replay's bag cannot drift apart.

A :class:`~gp_mapping.mapping.mapper.MapGrid` is published as, in this order:

- the scale: an L x 4 matrix, one row per layer, columns :data:`SCALE_COLUMNS`, with the dimension labels of
  :func:`scale_labels` (``std_msgs/Float64MultiArray``);
- per layer a mean and a variance grid on the topics of :func:`map_topics`: values 0..100 and -1 where unknown
  (:func:`gp_mapping.mapping.grid.encode_occupancy`), row-major with row ``i`` at
  ``y = origin_y + (i + 0.5) * resolution``, origin = corner of cell (0, 0) (``nav_msgs/OccupancyGrid``); a cell
  value ``c`` decodes as ``offset + scale * c``;
- the cloud: one float32 point per publishable cell at its centre (z = the grid's height), columns
  :func:`cloud_field_names` (``sensor_msgs/PointCloud2``), lossless up to float32.

Layers: ``magnitude`` for a magnitude map, :data:`VECTOR_LAYERS` for a vector map. A cell whose mean or
variance is not finite in any layer is published as unknown and left out of the cloud, so no NaN reaches a map.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gp_mapping.mapping.grid import encode_occupancy

MAGNITUDE_LAYERS = ("magnitude",)
VECTOR_LAYERS = ("x", "y", "z", "norm")
#: Columns of the scale matrix, in order (one row per layer).
SCALE_COLUMNS = ("mean_offset", "mean_scale", "variance_offset", "variance_scale")
#: Message type of each kind of map topic.
OCCUPANCY_GRID = "nav_msgs/msg/OccupancyGrid"
POINT_CLOUD = "sensor_msgs/msg/PointCloud2"
FLOAT64_ARRAY = "std_msgs/msg/Float64MultiArray"
#: The node's default name, hence the namespace of its map topics (and of the replay's map bag).
NODE_NAME = "mapper"
MAP_NAMESPACE = f"/{NODE_NAME}"


class PublicationError(ValueError):
    """A grid cannot be published (inconsistent shapes, or an encoding that is not finite)."""


def layer_names(target: str) -> tuple[str, ...]:
    """The layers of the published map for ``sync.target`` ('magnitude' or 'vector')."""
    return MAGNITUDE_LAYERS if target == "magnitude" else VECTOR_LAYERS


def map_topics(layers: Sequence[str], namespace: str = "~") -> dict[str, tuple[str, str]]:
    """Layer -> (mean topic, variance topic): ``<ns>/mean``, ``<ns>/variance`` for a magnitude map, else one pair
    per layer (``<ns>/mean/x`` ... ``<ns>/variance/norm``). ``namespace``: ``~`` (node-relative) or, for a bag,
    :data:`MAP_NAMESPACE`."""
    if tuple(layers) == MAGNITUDE_LAYERS:
        return {"magnitude": (f"{namespace}/mean", f"{namespace}/variance")}
    return {name: (f"{namespace}/mean/{name}", f"{namespace}/variance/{name}") for name in layers}


def scale_topic(namespace: str = "~") -> str:
    return f"{namespace}/scale"


def cloud_topic(namespace: str = "~") -> str:
    return f"{namespace}/cloud"


def map_topic_types(layers: Sequence[str], namespace: str = "~") -> dict[str, str]:
    """Every map topic -> its message type, in publishing order (scale, the grids layer by layer, cloud)."""
    topics = {scale_topic(namespace): FLOAT64_ARRAY}
    topics.update({t: OCCUPANCY_GRID for pair in map_topics(layers, namespace).values() for t in pair})
    topics[cloud_topic(namespace)] = POINT_CLOUD
    return topics


def cloud_field_names(layers: Sequence[str]) -> list[str]:
    """Cloud columns: x, y, z, then ``mean, variance`` (magnitude) or ``mean_<layer>``... ``variance_<layer>``."""
    if tuple(layers) == MAGNITUDE_LAYERS:
        return ["x", "y", "z", "mean", "variance"]
    return ["x", "y", "z"] + [f"mean_{n}" for n in layers] + [f"variance_{n}" for n in layers]


def scale_labels(layers: Sequence[str], field_unit: str) -> tuple[str, str]:
    """Labels of the scale matrix's two dimensions: ``layer:<names>`` and ``<SCALE_COLUMNS>;unit:<field unit>``."""
    return "layer:" + ",".join(layers), ",".join(SCALE_COLUMNS) + ";unit:" + field_unit


def parse_scale_labels(row_label: str, column_label: str) -> tuple[list[str], str]:
    """Inverse of :func:`scale_labels`: (layer names, field unit)."""
    if not row_label.startswith("layer:") or ";unit:" not in column_label:
        raise PublicationError("not a gp_mapping scale matrix (expected dims 'layer:...' and '...;unit:...')")
    columns, unit = column_label.split(";unit:")
    if tuple(columns.split(",")) != SCALE_COLUMNS:
        raise PublicationError(f"scale columns {columns!r} are not {','.join(SCALE_COLUMNS)}")
    return row_label[len("layer:"):].split(","), unit


@dataclass(frozen=True)
class EncodedLayer:
    """One layer of a grid as published: the grid payloads plus the affine maps back to field units."""

    name: str
    mean_data: np.ndarray  # int8 (H*W,), row-major, -1 unknown
    mean_offset: float
    mean_scale: float
    variance_data: np.ndarray
    variance_offset: float
    variance_scale: float

    @property
    def scale_row(self) -> tuple[float, float, float, float]:
        """This layer's row of the scale matrix (:data:`SCALE_COLUMNS`)."""
        return self.mean_offset, self.mean_scale, self.variance_offset, self.variance_scale


def publishable_known(grid: Any) -> np.ndarray:
    """Cells that are known and finite in every layer's mean and variance (the rest publish as unknown)."""
    known = np.asarray(grid.known, dtype=bool).copy()
    shape = (grid.spec.height, grid.spec.width)
    if known.shape != shape:
        raise PublicationError(f"grid 'known' has shape {known.shape}, expected (height, width) = {shape}")
    for name, (mean, var) in grid.layers.items():
        mean, var = np.asarray(mean), np.asarray(var)
        if mean.shape != shape or var.shape != shape:
            raise PublicationError(f"grid layer '{name}' has shapes {mean.shape} and {var.shape}, expected {shape}")
        known &= np.isfinite(mean) & np.isfinite(var)
    return known


def encode_layers(grid: Any, mean_range=None, variance_range=None, known: np.ndarray | None = None
                  ) -> list[EncodedLayer]:
    """Every layer of ``grid`` encoded to 0..100 / -1 with its offsets and scales (all finite); ``mean_range``,
    ``variance_range``: fixed ``[lo, hi]`` published as 0 and 100 (``grid.mean_range``; empty or None: each
    map's own min..max)."""
    known = publishable_known(grid) if known is None else known
    out = []
    for name, (mean, var) in grid.layers.items():
        m_data, m_off, m_scale = encode_occupancy(np.asarray(mean, dtype=np.float64), known, mean_range)
        v_data, v_off, v_scale = encode_occupancy(np.asarray(var, dtype=np.float64), known, variance_range)
        for what, value in (("mean offset", m_off), ("mean scale", m_scale), ("variance offset", v_off),
                            ("variance scale", v_scale)):
            if not math.isfinite(value):
                raise PublicationError(f"layer '{name}': {what} is {value!r}")
        out.append(EncodedLayer(name, np.asarray(m_data, dtype=np.int8).ravel(), float(m_off), float(m_scale),
                                np.asarray(v_data, dtype=np.int8).ravel(), float(v_off), float(v_scale)))
    return out


def unknown_data(grid: Any) -> np.ndarray:
    """A grid payload with every cell unknown (the cleared map after a reset)."""
    return np.full(grid.spec.width * grid.spec.height, -1, dtype=np.int8)


def cloud_points(grid: Any, known: np.ndarray | None = None, empty: bool = False) -> np.ndarray:
    """(N, F) float32 little-endian points, one per publishable cell in row-major order, columns
    :func:`cloud_field_names`; ``empty``: no points (the same columns)."""
    spec = grid.spec
    names = list(grid.layers)
    if empty:
        known = np.zeros(spec.shape, dtype=bool)
    elif known is None:
        known = publishable_known(grid)
    rows, cols = np.nonzero(known)
    columns = [spec.origin_x + (cols + 0.5) * spec.resolution, spec.origin_y + (rows + 0.5) * spec.resolution,
               np.full(rows.shape, float(grid.height))]
    columns += [np.asarray(grid.layers[n][0])[rows, cols] for n in names]
    columns += [np.asarray(grid.layers[n][1])[rows, cols] for n in names]
    return np.column_stack(columns).astype("<f4").reshape(-1, len(columns))


@dataclass(frozen=True)
class Publication:
    """One map as published, before it becomes messages: what both the node and the bag writer render."""

    grid: Any  # the MapGrid (geometry, frame, stamp)
    layers: list[EncodedLayer]
    cloud: np.ndarray  # cloud_points
    cloud_fields: list[str]
    scale_labels: tuple[str, str]

    @property
    def scale_data(self) -> list[float]:
        """The scale matrix, row-major (L x 4)."""
        return [v for layer in self.layers for v in layer.scale_row]


def publication(grid: Any, field_unit: str | None = None, mean_range=None, variance_range=None) -> Publication:
    """The publication of ``grid`` (a MapGrid); ``field_unit`` defaults to the grid's; the ranges as in
    :func:`encode_layers`."""
    known = publishable_known(grid)
    names = list(grid.layers)
    return Publication(grid=grid, layers=encode_layers(grid, mean_range, variance_range, known),
                       cloud=cloud_points(grid, known),
                       cloud_fields=cloud_field_names(names),
                       scale_labels=scale_labels(names, field_unit if field_unit is not None else grid.field_unit))
