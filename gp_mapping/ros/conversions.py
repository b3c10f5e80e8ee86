"""Message <-> array conversions for the mapping node. No math beyond unpacking and packing.

Inputs: stamps become float seconds; pose messages become ``(stamp, position (3,), orientation [x, y, z, w] (4,),
frame_id)``; ``MagneticField`` becomes ``(stamp, field_tesla (3,), frame_id)``.

Outputs, from a :class:`gp_mapping.mapping.grid.MapGrid`:

- ``nav_msgs/OccupancyGrid`` per layer and statistic: values 0..100 (``encode_occupancy``), -1 where unknown,
  row-major with row ``i`` at ``y = origin_y + (i + 0.5) * resolution``, origin = corner of cell (0, 0).
- ``sensor_msgs/PointCloud2``: one point per known cell at the cell centre, float32 fields ``x, y, z`` then
  ``mean, variance`` (magnitude maps) or ``mean_<layer>, variance_<layer>`` for the layers x, y, z, norm
  (vector maps), in the map's field unit (variance in unit squared). Lossless up to float32.
- the scale message (``std_msgs/Float64MultiArray``), see :func:`scale_to_msg` for its exact layout.

A cell whose mean or variance is not finite is published as unknown (-1) and left out of the cloud, so no NaN
ever reaches a map topic.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from builtin_interfaces.msg import Time
from geometry_msgs.msg import PoseStamped, PoseWithCovarianceStamped
from nav_msgs.msg import OccupancyGrid, Odometry
from sensor_msgs.msg import MagneticField, PointCloud2, PointField
from std_msgs.msg import Float64MultiArray, MultiArrayDimension

from gp_mapping.mapping.grid import decode_occupancy, encode_occupancy

POSE_TYPES: dict[str, type] = {
    "pose_stamped": PoseStamped,
    "odometry": Odometry,
    "pose_with_covariance": PoseWithCovarianceStamped,
}

# Column labels of the scale message, in order (one row per layer).
SCALE_COLUMNS = ("mean_offset", "mean_scale", "variance_offset", "variance_scale")


class ConversionError(ValueError):
    """A message cannot be converted (wrong type, or a grid with inconsistent shapes)."""


# ------------------------------------------------------------------------------------------------- stamps


def stamp_to_seconds(stamp: Time) -> float:
    """``builtin_interfaces/Time`` -> float seconds."""
    return float(stamp.sec) + 1e-9 * float(stamp.nanosec)


def seconds_to_stamp(seconds: float) -> Time:
    """Float seconds (finite, >= 0) -> ``builtin_interfaces/Time``, rounded to the nanosecond."""
    if not math.isfinite(seconds) or seconds < 0.0:
        raise ConversionError(f"a ROS time must be finite and non-negative, got {seconds!r}")
    total = int(round(seconds * 1e9))
    return Time(sec=total // 1_000_000_000, nanosec=total % 1_000_000_000)


# ------------------------------------------------------------------------------------------------- inputs


def pose_from_msg(msg: Any) -> tuple[float, np.ndarray, np.ndarray, str]:
    """PoseStamped, Odometry or PoseWithCovarianceStamped -> (stamp, position, orientation xyzw, frame_id).

    Odometry's pose is expressed in ``header.frame_id`` (its ``child_frame_id`` is the body), so the frame
    returned is the header's for all three types.
    """
    if isinstance(msg, PoseStamped):
        pose = msg.pose
    elif isinstance(msg, (Odometry, PoseWithCovarianceStamped)):
        pose = msg.pose.pose
    else:
        raise ConversionError(f"unsupported pose message type {type(msg).__name__}; expected one of "
                              f"{', '.join(t.__name__ for t in POSE_TYPES.values())}")
    p, q = pose.position, pose.orientation
    return (stamp_to_seconds(msg.header.stamp), np.array([p.x, p.y, p.z], dtype=np.float64),
            np.array([q.x, q.y, q.z, q.w], dtype=np.float64), msg.header.frame_id)


def field_from_msg(msg: MagneticField) -> tuple[float, np.ndarray, str]:
    """MagneticField -> (stamp, field in tesla (3,), frame_id)."""
    b = msg.magnetic_field
    return stamp_to_seconds(msg.header.stamp), np.array([b.x, b.y, b.z], dtype=np.float64), msg.header.frame_id


# ------------------------------------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class EncodedLayer:
    """One layer of a grid as published: OccupancyGrid payloads plus the affine maps back to field units."""

    name: str
    mean_data: np.ndarray  # int8 (H*W,), row-major, -1 unknown
    mean_offset: float
    mean_scale: float
    variance_data: np.ndarray
    variance_offset: float
    variance_scale: float


def publishable_known(grid: Any) -> np.ndarray:
    """Cells that are known and finite in every layer's mean and variance (the rest publish as unknown)."""
    known = np.asarray(grid.known, dtype=bool).copy()
    shape = (grid.spec.height, grid.spec.width)
    if known.shape != shape:
        raise ConversionError(f"grid 'known' has shape {known.shape}, expected (height, width) = {shape}")
    for name, (mean, var) in grid.layers.items():
        mean, var = np.asarray(mean), np.asarray(var)
        if mean.shape != shape or var.shape != shape:
            raise ConversionError(f"grid layer '{name}' has shapes {mean.shape} and {var.shape}, expected {shape}")
        known &= np.isfinite(mean) & np.isfinite(var)
    return known


def encode_layers(grid: Any, mean_range=None, variance_range=None) -> list[EncodedLayer]:
    """Every layer of ``grid`` encoded to 0..100 / -1 with its offsets and scales (all finite); ``mean_range``,
    ``variance_range``: fixed ``[lo, hi]`` published as 0 and 100 (``grid.mean_range``; empty: automatic)."""
    known = publishable_known(grid)
    out = []
    for name, (mean, var) in grid.layers.items():
        m_data, m_off, m_scale = encode_occupancy(np.asarray(mean, dtype=np.float64), known, mean_range)
        v_data, v_off, v_scale = encode_occupancy(np.asarray(var, dtype=np.float64), known, variance_range)
        for what, value in (("mean offset", m_off), ("mean scale", m_scale), ("variance offset", v_off),
                            ("variance scale", v_scale)):
            if not math.isfinite(value):
                raise ConversionError(f"layer '{name}': {what} is {value!r}")
        out.append(EncodedLayer(name, np.asarray(m_data, dtype=np.int8).ravel(), float(m_off), float(m_scale),
                                np.asarray(v_data, dtype=np.int8).ravel(), float(v_off), float(v_scale)))
    return out


def occupancy_msg(grid: Any, data: np.ndarray, stamp: Time) -> OccupancyGrid:
    """An OccupancyGrid with ``grid``'s geometry and frame holding ``data`` (int8, row-major)."""
    spec = grid.spec
    msg = OccupancyGrid()
    msg.header.stamp = stamp
    msg.header.frame_id = grid.frame_id
    msg.info.map_load_time = stamp
    msg.info.resolution = float(spec.resolution)
    msg.info.width = int(spec.width)
    msg.info.height = int(spec.height)
    msg.info.origin.position.x = float(spec.origin_x)
    msg.info.origin.position.y = float(spec.origin_y)
    msg.info.origin.orientation.w = 1.0
    if data.size != spec.width * spec.height:
        raise ConversionError(f"occupancy data has {data.size} cells, the grid {spec.width} x {spec.height}")
    msg.data = np.asarray(data, dtype=np.int8)
    return msg


def cloud_field_names(layer_names: list[str]) -> list[str]:
    """PointCloud2 field names for a grid's layers: x, y, z, then mean/variance per layer."""
    if list(layer_names) == ["magnitude"]:
        return ["x", "y", "z", "mean", "variance"]
    return ["x", "y", "z"] + [f"mean_{n}" for n in layer_names] + [f"variance_{n}" for n in layer_names]


def cloud_msg(grid: Any, stamp: Time, z: float = 0.0, empty: bool = False) -> PointCloud2:
    """One float32 point per publishable cell at the cell centre (height ``z``), with mean and variance;
    ``empty``: the same fields and no points (the cleared map after a reset)."""
    spec = grid.spec
    known = np.zeros(spec.shape, dtype=bool) if empty else publishable_known(grid)
    rows, cols = np.nonzero(known)  # row-major order
    names = list(grid.layers)
    columns = [spec.origin_x + (cols + 0.5) * spec.resolution, spec.origin_y + (rows + 0.5) * spec.resolution,
               np.full(rows.shape, float(z))]
    columns += [np.asarray(grid.layers[n][0])[rows, cols] for n in names]
    columns += [np.asarray(grid.layers[n][1])[rows, cols] for n in names]
    points = np.column_stack(columns).astype(np.float32) if rows.size else np.zeros((0, len(columns)), np.float32)
    msg = PointCloud2()
    msg.header.stamp = stamp
    msg.header.frame_id = grid.frame_id
    msg.height = 1
    msg.width = int(points.shape[0])
    msg.fields = [PointField(name=name, offset=4 * i, datatype=PointField.FLOAT32, count=1)
                  for i, name in enumerate(cloud_field_names(names))]
    msg.is_bigendian = sys.byteorder == "big"
    msg.point_step = 4 * points.shape[1]
    msg.row_step = msg.point_step * msg.width
    msg.data = points.tobytes()
    msg.is_dense = True
    return msg


def cloud_to_array(msg: PointCloud2) -> dict[str, np.ndarray]:
    """Inverse of :func:`cloud_msg` for float32 clouds: field name -> (N,) float64 array."""
    for f in msg.fields:
        if f.datatype != PointField.FLOAT32 or f.count != 1:
            raise ConversionError(f"cloud field '{f.name}' is not a single float32")
    dtype = np.dtype({"names": [f.name for f in msg.fields], "formats": ["<f4" if not msg.is_bigendian else ">f4"]
                      * len(msg.fields), "offsets": [f.offset for f in msg.fields], "itemsize": msg.point_step})
    records = np.frombuffer(bytes(msg.data), dtype=dtype, count=msg.width * msg.height)
    return {f.name: records[f.name].astype(np.float64) for f in msg.fields}


def scale_to_msg(layers: list[EncodedLayer], field_unit: str) -> Float64MultiArray:
    """The scale message: how to turn a published cell value ``c`` in 0..100 back into field units.

    Layout (a row-major L x 4 matrix, L = number of layers)::

        layout.dim[0].label = "layer:" + comma-separated layer names, e.g. "layer:magnitude" or "layer:x,y,z,norm"
        layout.dim[0].size = L,  layout.dim[0].stride = 4 * L
        layout.dim[1].label = "mean_offset,mean_scale,variance_offset,variance_scale;unit:" + field_unit
        layout.dim[1].size = 4,  layout.dim[1].stride = 4
        data[4 * i + 0 .. 3] = mean_offset, mean_scale, variance_offset, variance_scale of layer i

    mean = mean_offset + mean_scale * c (in ``field_unit``); variance = variance_offset + variance_scale * c
    (in ``field_unit`` squared); c = -1 means unknown.
    """
    msg = Float64MultiArray()
    n = len(layers)
    msg.layout.dim = [
        MultiArrayDimension(label="layer:" + ",".join(layer.name for layer in layers), size=n, stride=4 * n),
        MultiArrayDimension(label=",".join(SCALE_COLUMNS) + ";unit:" + field_unit, size=4, stride=4),
    ]
    msg.layout.data_offset = 0
    msg.data = [v for layer in layers for v in (layer.mean_offset, layer.mean_scale, layer.variance_offset,
                                                 layer.variance_scale)]
    return msg


def scale_from_msg(msg: Float64MultiArray) -> tuple[dict[str, dict[str, tuple[float, float]]], str]:
    """Parse a scale message: ({layer: {"mean": (offset, scale), "variance": (offset, scale)}}, field_unit)."""
    dims = msg.layout.dim
    if len(dims) != 2 or not dims[0].label.startswith("layer:") or ";unit:" not in dims[1].label:
        raise ConversionError("not a gp_mapping scale message (expected dims 'layer:...' and '...;unit:...')")
    names = dims[0].label[len("layer:"):].split(",")
    columns, unit = dims[1].label.split(";unit:")
    if tuple(columns.split(",")) != SCALE_COLUMNS or len(names) != dims[0].size or len(msg.data) != 4 * len(names):
        raise ConversionError(f"scale message layout does not match its data: {dims[0].label!r}, {dims[1].label!r},"
                              f" {len(msg.data)} values")
    data = list(msg.data)
    return ({name: {"mean": (data[4 * i], data[4 * i + 1]), "variance": (data[4 * i + 2], data[4 * i + 3])}
             for i, name in enumerate(names)}, unit)


def decode_occupancy_msg(msg: OccupancyGrid, offset: float, scale: float) -> np.ndarray:
    """OccupancyGrid -> (height, width) float array in field units, NaN where the cell is unknown (-1)."""
    return decode_occupancy(np.asarray(msg.data, dtype=np.int8), (msg.info.height, msg.info.width), offset, scale)
