"""Recorded messages decoded into plain numpy samples in SI units, stamped with their header time (the bag's
receive time only where a header stamp is zero); frame ids without the ROS 1 leading slash."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gp_mapping.mapping.transforms import TransformSample, frame_name  # noqa: F401 (re-exported)

from gp_mapping.bag.errors import TopicError

MAGNETIC_FIELD = "sensor_msgs/msg/MagneticField"
POSE_STAMPED = "geometry_msgs/msg/PoseStamped"
ODOMETRY = "nav_msgs/msg/Odometry"
POSE_WITH_COVARIANCE = "geometry_msgs/msg/PoseWithCovarianceStamped"
# Pose topic types in the order auto-detection prefers them; the value is the node's `node.pose_type` name.
POSE_TYPES = {POSE_STAMPED: "pose_stamped", ODOMETRY: "odometry", POSE_WITH_COVARIANCE: "pose_with_covariance"}
# tf2_msgs on ROS 2 and ROS 1; the old tf/tfMessage of ROS 1 has the same layout.
TF_TYPES = ("tf2_msgs/msg/TFMessage", "tf/msg/tfMessage")
TF_STATIC_TOPIC = "/tf_static"


_frame = frame_name  # tf2 frame ids carry no leading slash (ROS 1 bags often have '/base_link')


def _stamp(header, bag_time_ns: int) -> float:
    """Header stamp in seconds; the bag's receive time where the publisher left the stamp at zero; NaN (refused
    as a non-finite stamp, as the node does) for a malformed one whose nanosec is not below 1e9."""
    sec, nsec = int(header.stamp.sec), int(header.stamp.nanosec)
    if sec == 0 and nsec == 0:
        return bag_time_ns * 1e-9
    if not 0 <= nsec < 1_000_000_000:
        return math.nan
    return sec + nsec * 1e-9



# --------------------------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class MagSample:
    """One magnetometer reading, in tesla, in the sensor frame ``frame_id``."""

    stamp: float
    field: np.ndarray  # (3,) [T]; may hold NaN where the driver reported an invalid reading
    frame_id: str


@dataclass(frozen=True)
class PoseSample:
    """Pose of ``child_frame_id`` (the body) in ``frame_id``; orientation rotates body vectors into that frame."""

    stamp: float
    position: np.ndarray     # (3,) [m]
    orientation: np.ndarray  # (4,) [x, y, z, w]
    frame_id: str
    child_frame_id: str


def decode_magnetic_field(msg, bag_time_ns: int) -> MagSample:
    """sensor_msgs/MagneticField → MagSample (tesla, as ROS requires; no unit conversion here)."""
    v = msg.magnetic_field
    return MagSample(_stamp(msg.header, bag_time_ns), np.array([v.x, v.y, v.z], dtype=np.float64),
                     _frame(msg.header.frame_id))


def decode_pose(msg, msgtype: str, bag_time_ns: int) -> PoseSample:
    """PoseStamped, Odometry or PoseWithCovarianceStamped → PoseSample."""
    if msgtype == POSE_STAMPED:
        pose, child = msg.pose, ""
    elif msgtype == ODOMETRY:
        pose, child = msg.pose.pose, _frame(msg.child_frame_id)
    elif msgtype == POSE_WITH_COVARIANCE:
        pose, child = msg.pose.pose, ""
    else:
        raise TopicError(f"message type {msgtype} is not a pose; expected one of {', '.join(POSE_TYPES)}")
    p, q = pose.position, pose.orientation
    return PoseSample(_stamp(msg.header, bag_time_ns), np.array([p.x, p.y, p.z], dtype=np.float64),
                      np.array([q.x, q.y, q.z, q.w], dtype=np.float64), _frame(msg.header.frame_id), child)


def decode_tf(msg, bag_time_ns: int) -> list[TransformSample]:
    """tf2_msgs/TFMessage → one TransformSample per transform in it."""
    out = []
    for ts in msg.transforms:
        t, q = ts.transform.translation, ts.transform.rotation
        out.append(TransformSample(_stamp(ts.header, bag_time_ns), _frame(ts.header.frame_id),
                                   _frame(ts.child_frame_id), np.array([t.x, t.y, t.z], dtype=np.float64),
                                   np.array([q.x, q.y, q.z, q.w], dtype=np.float64)))
    return out

