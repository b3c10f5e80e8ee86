"""Message <-> array conversions for the mapping node. No math beyond unpacking and packing.

Inputs: stamps become float seconds; pose messages become ``(stamp, position (3,), orientation [x, y, z, w] (4,),
frame_id)``; ``MagneticField`` becomes ``(stamp, field_tesla (3,), frame_id)``.

Outputs, from a :class:`gp_mapping.mapping.mapper.MapGrid`, in the layout of :mod:`gp_mapping.mapping.publication`
(layers, encodings, topics, scale rows, cloud columns; the map-bag writer renders the same layout):
``nav_msgs/OccupancyGrid`` per layer and statistic (:func:`occupancy_msg`), ``sensor_msgs/PointCloud2``
(:func:`cloud_msg`) and the scale message ``std_msgs/Float64MultiArray`` (:func:`scale_to_msg`).

Planar poses (x, y, yaw) for the localizer: ``PoseWithCovarianceStamped`` both ways (:func:`planar_pose_from_msg`,
:func:`pose_with_covariance_msg`; the covariance's x, y and yaw rows are 0, 1 and 5 of the 6 x 6),
``geometry_msgs/PoseArray`` (:func:`pose_array_msg`) and one transform as a ``tf2_msgs/TFMessage``
(:func:`transform_msg`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from builtin_interfaces.msg import Time
from geometry_msgs.msg import Pose, PoseArray, PoseStamped, PoseWithCovarianceStamped, TransformStamped
from nav_msgs.msg import OccupancyGrid, Odometry
from sensor_msgs.msg import MagneticField, PointCloud2, PointField
from std_msgs.msg import Float64MultiArray, MultiArrayDimension

from gp_mapping.mapping.frames import FrameError, normalize_quaternion, yaw_of
from gp_mapping.mapping.grid import decode_occupancy
from gp_mapping.mapping.publication import (SCALE_COLUMNS, EncodedLayer, PublicationError, cloud_field_names,  # noqa: F401
                                            cloud_points, encode_layers, parse_scale_labels, publishable_known,
                                            scale_labels)
from gp_mapping.mapping.transforms import TransformSample, frame_name

POSE_TYPES: dict[str, type] = {
    "pose_stamped": PoseStamped,
    "odometry": Odometry,
    "pose_with_covariance": PoseWithCovarianceStamped,
}

class ConversionError(ValueError):
    """A message cannot be converted (wrong type, or a grid with inconsistent shapes)."""


# ------------------------------------------------------------------------------------------------- stamps


def stamp_to_seconds(stamp: Time) -> float:
    """``builtin_interfaces/Time`` -> float seconds; NaN (refused as a non-finite stamp, counted) for a malformed
    one whose ``nanosec`` is not below 1e9 (a stamp is normalised: 1.5 s is sec 1, nanosec 5e8), so a publisher's
    bug is not read as seconds ahead."""
    if not 0 <= stamp.nanosec < 1_000_000_000:
        return math.nan
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


#: Rows (and columns) of x, y and yaw in a pose message's 6 x 6 covariance (x, y, z, roll, pitch, yaw).
PLANAR_COVARIANCE_AXES = (0, 1, 5)


def planar_pose_from_msg(msg: PoseWithCovarianceStamped) -> tuple[float, np.ndarray, np.ndarray, str]:
    """PoseWithCovarianceStamped (RViz's "2D Pose Estimate" on /initialpose) -> (stamp, (x, y, yaw), (3,)
    standard deviations of x, y, yaw from the covariance's diagonal (NaN where not positive and finite),
    frame_id). ConversionError for a non-finite position or an unusable quaternion."""
    stamp, position, orientation, frame = pose_from_msg(msg)
    try:
        yaw = float(yaw_of(normalize_quaternion(orientation)))
    except FrameError as err:
        raise ConversionError(f"the orientation is unusable: {err}") from None
    if not np.all(np.isfinite(position[:2])):
        raise ConversionError(f"the position {position[:2].tolist()} is not finite")
    cov = np.asarray(msg.pose.covariance, dtype=np.float64).reshape(6, 6)
    diag = np.array([cov[k, k] for k in PLANAR_COVARIANCE_AXES])
    std = np.where(np.isfinite(diag) & (diag > 0), np.sqrt(np.where(diag > 0, diag, 0.0)), np.nan)
    return stamp, np.array([position[0], position[1], yaw]), std, frame


def _planar_pose(pose: Pose, xyyaw) -> Pose:
    pose.position.x, pose.position.y = float(xyyaw[0]), float(xyyaw[1])
    pose.orientation.z, pose.orientation.w = math.sin(0.5 * float(xyyaw[2])), math.cos(0.5 * float(xyyaw[2]))
    return pose


def pose_with_covariance_msg(stamp: Time, frame_id: str, xyyaw, covariance) -> PoseWithCovarianceStamped:
    """A planar pose (x, y, yaw) and its 3 x 3 covariance as PoseWithCovarianceStamped (z, roll, pitch 0)."""
    msg = PoseWithCovarianceStamped()
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    _planar_pose(msg.pose.pose, xyyaw)
    cov = np.zeros((6, 6))
    cov[np.ix_(PLANAR_COVARIANCE_AXES, PLANAR_COVARIANCE_AXES)] = np.asarray(covariance, dtype=np.float64)
    msg.pose.covariance = cov.ravel()
    return msg


def pose_array_msg(stamp: Time, frame_id: str, poses: np.ndarray) -> PoseArray:
    """Planar poses ``(N, 3)`` (x, y, yaw) as a PoseArray (the particles, as AMCL's particle cloud)."""
    msg = PoseArray()
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.poses = [_planar_pose(Pose(), p) for p in np.asarray(poses, dtype=np.float64)]
    return msg


def transform_msg(stamp: Time, parent: str, child: str, xyyaw) -> Any:
    """The planar transform ``parent -> child`` (x, y, yaw: the child's origin and heading in the parent) as a
    tf2_msgs/TFMessage for /tf."""
    from tf2_msgs.msg import TFMessage

    ts = TransformStamped()
    ts.header.stamp, ts.header.frame_id, ts.child_frame_id = stamp, parent, child
    ts.transform.translation.x, ts.transform.translation.y = float(xyyaw[0]), float(xyyaw[1])
    ts.transform.rotation.z = math.sin(0.5 * float(xyyaw[2]))
    ts.transform.rotation.w = math.cos(0.5 * float(xyyaw[2]))
    return TFMessage(transforms=[ts])


def transforms_from_msg(msg: Any) -> list[TransformSample]:
    """tf2_msgs/TFMessage -> one TransformSample per transform (stamp, parent, child, translation, rotation)."""
    out = []
    for ts in msg.transforms:
        t, q = ts.transform.translation, ts.transform.rotation
        out.append(TransformSample(stamp_to_seconds(ts.header.stamp), frame_name(ts.header.frame_id),
                                   frame_name(ts.child_frame_id), np.array([t.x, t.y, t.z], dtype=np.float64),
                                   np.array([q.x, q.y, q.z, q.w], dtype=np.float64)))
    return out


# ------------------------------------------------------------------------------------------------ outputs
# The layout (layers, encodings, topics, scale rows, cloud columns) is gp_mapping.mapping.publication's; these
# functions only turn it into messages.


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


def cloud_msg(grid: Any, stamp: Time, z: float | None = None, empty: bool = False,
              points: np.ndarray | None = None) -> PointCloud2:
    """The cloud of :func:`gp_mapping.mapping.publication.cloud_points` (``points``, computed from ``grid`` when
    not given; ``empty``: the same fields and no points, the cleared map after a reset). ``z`` is the grid's
    height, the only one the layout allows (kept for callers that pass it)."""
    if z is not None and float(z) != float(grid.height):
        raise ConversionError(f"cloud height {z!r} is not the grid's height {grid.height!r}")
    if points is None:
        points = cloud_points(grid, empty=empty)
    msg = PointCloud2()
    msg.header.stamp = stamp
    msg.header.frame_id = grid.frame_id
    msg.height = 1
    msg.width = int(points.shape[0])
    msg.fields = [PointField(name=name, offset=4 * i, datatype=PointField.FLOAT32, count=1)
                  for i, name in enumerate(cloud_field_names(list(grid.layers)))]
    msg.is_bigendian = False  # cloud_points are little-endian float32
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

    Layout (a row-major L x 4 matrix, L = number of layers; :func:`gp_mapping.mapping.publication.scale_labels`)::

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
    rows_label, columns_label = scale_labels([layer.name for layer in layers], field_unit)
    msg.layout.dim = [MultiArrayDimension(label=rows_label, size=n, stride=4 * n),
                      MultiArrayDimension(label=columns_label, size=4, stride=4)]
    msg.layout.data_offset = 0
    msg.data = [v for layer in layers for v in layer.scale_row]
    return msg


def scale_from_msg(msg: Float64MultiArray) -> tuple[dict[str, dict[str, tuple[float, float]]], str]:
    """Parse a scale message: ({layer: {"mean": (offset, scale), "variance": (offset, scale)}}, field_unit)."""
    dims = msg.layout.dim
    if len(dims) != 2:
        raise ConversionError("not a gp_mapping scale message (expected dims 'layer:...' and '...;unit:...')")
    try:
        names, unit = parse_scale_labels(dims[0].label, dims[1].label)
    except PublicationError as err:
        raise ConversionError(f"not a gp_mapping scale message: {err}") from None
    if len(names) != dims[0].size or len(msg.data) != 4 * len(names):
        raise ConversionError(f"scale message layout does not match its data: {dims[0].label!r}, {dims[1].label!r},"
                              f" {len(msg.data)} values")
    data = list(msg.data)
    return ({name: {"mean": (data[4 * i], data[4 * i + 1]), "variance": (data[4 * i + 2], data[4 * i + 3])}
             for i, name in enumerate(names)}, unit)


def decode_occupancy_msg(msg: OccupancyGrid, offset: float, scale: float) -> np.ndarray:
    """OccupancyGrid -> (height, width) float array in field units, NaN where the cell is unknown (-1)."""
    return decode_occupancy(np.asarray(msg.data, dtype=np.int8), (msg.info.height, msg.info.width), offset, scale)
