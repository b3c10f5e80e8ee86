"""The localizer node's inputs: subscriptions, message callbacks, and the refusals counted there.

Subscriptions (topics and rules: :mod:`gp_mapping.ros.localizer_node`)
    ``mag``          sensor_msgs/MagneticField (sensor-data QoS, keep last ``localizer.queue_depth``);
    ``odom``         nav_msgs/Odometry in ``localizer.odom_frame`` (``localizer.odom_source: topic``; sensor-data QoS);
    ``/tf``, ``/tf_static``  with ``odom_source: tf`` (the QoS of tf2_ros's listener): ``odom_frame ->
                     base_frame`` is looked up in a :class:`~gp_mapping.mapping.transforms.TransformBuffer` at the
                     stamps of each /tf message, each newer than the odometry taken before;
    ``/initialpose`` geometry_msgs/PoseWithCovarianceStamped (reliable, depth 1).

The callbacks convert a message (:mod:`gp_mapping.ros.conversions`) and hand it to the
:class:`~gp_mapping.localization.Localizer` at once (an update costs about a millisecond); what it gives back goes
to the node's outputs. Stamps come from the message headers; a header left at zero gets the receive time on the
node's clock. Every refusal is counted by reason: the filter's (``rejected/<reason>``,
:data:`gp_mapping.localization.REJECTION_REASONS`) and the node's (``node/rejected/<reason>``,
:data:`NODE_REJECTION_REASONS`); an unexpected error in a callback is reported, never raised.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from geometry_msgs.msg import PoseWithCovarianceStamped
from nav_msgs.msg import Odometry
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import MagneticField

from gp_mapping.config import shorten
from gp_mapping.mapping.transforms import TransformBuffer, TransformError, TransformNotYetError, frame_name
from gp_mapping.ros import conversions
from gp_mapping.ros.inputs import SequenceGaps, sensor_qos

NODE_REJECTION_REASONS = {
    "odometry_frame": "an odometry message in another frame than localizer.odom_frame",
    "odometry_tf": "odom_frame -> base_frame could not be looked up in /tf at a transform's stamp",
    "initialpose_frame": "an /initialpose in another frame than localizer.global_frame",
    "initialpose_invalid": "an /initialpose with a non-finite position or an unusable orientation",
    "map_refused": "a new localizer.map that could not be used (missing, unreadable, empty, another frame)",
    "transport_lost_mag": "magnetometer messages lost in transport (gaps in a publisher's sequence numbers)",
    "transport_lost_odom": "odometry messages lost in transport",
}
TF_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                    durability=DurabilityPolicy.VOLATILE)
TF_STATIC_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                           durability=DurabilityPolicy.TRANSIENT_LOCAL)

#: Between filter updates the map -> odom transform is sent again with the readings, at most this often [s].
TF_REPUBLISH_PERIOD = 0.1
INITIAL_POSE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                              durability=DurabilityPolicy.VOLATILE)


def _guarded(callback):
    """A callback that never raises: an unexpected error is reported (logged, ERROR in the diagnostics)."""
    def run(self, *args):
        try:
            callback(self, *args)
        except Exception as err:  # one message must not take the node down
            self._report(f"{callback.__name__} failed: {type(err).__name__}: {err}")
    run.__name__, run.__doc__ = callback.__name__, callback.__doc__
    return run


class LocalizerInputs:
    """Mixin of the localizer node: its subscriptions and callbacks. The node provides ``localizer``, ``config``,
    ``_publish_estimates(estimates)``, ``_publish_transform(stamp)``, ``_report(message)`` and ``_counts``."""

    def _setup_inputs(self) -> None:
        self._node_rejected = {reason: 0 for reason in NODE_REJECTION_REASONS}
        self._gaps = {"mag": SequenceGaps(), "odom": SequenceGaps()}
        self._last_seen: dict[str, float | None] = {"magnetometer": None, "odometry": None}  # node clock [s]
        self._tf_from = -math.inf  # stamp of the reading the last map -> odom came from
        self._tf_buffer = TransformBuffer(fixed_frame=self.config.node.global_frame)  # odom_source tf
        self._tf_newest = self._tf_taken = -math.inf  # newest /tf stamp; stamp of the last odometry taken from it

    def _subscribe_inputs(self) -> list:
        node = self.config.node
        qos = sensor_qos(node.queue_depth)
        # The two-argument callbacks get the message info: gaps in its sequence numbers are messages lost.
        subscriptions = [
            self.create_subscription(MagneticField, "mag", lambda m, i: self._received("mag", m, i), qos),
            self.create_subscription(PoseWithCovarianceStamped, "/initialpose", self.on_initial_pose,
                                     INITIAL_POSE_QOS)]
        if node.odom_source == "tf":
            from tf2_msgs.msg import TFMessage

            return subscriptions + [
                self.create_subscription(TFMessage, "/tf", lambda m: self.on_tf(m, False), TF_QOS),
                self.create_subscription(TFMessage, "/tf_static", lambda m: self.on_tf(m, True), TF_STATIC_QOS)]
        return subscriptions + [self.create_subscription(Odometry, "odom",
                                                         lambda m, i: self._received("odom", m, i), qos)]

    def _now(self) -> float | None:
        now = self.get_clock().now().nanoseconds * 1e-9
        return now if now > 0 else None

    def _stamp(self, stamp: float) -> float:
        """A message stamp, or the receive time (node clock) where the publisher left it at zero."""
        if stamp != 0.0:
            return stamp
        self._counts["stamps_from_clock"] += 1
        return self._now() or 0.0

    def _received(self, topic: str, msg: Any, info: dict[str, Any]) -> None:
        lost = self._gaps[topic].lost(info)
        if lost:
            self._node_rejected[f"transport_lost_{topic}"] += lost
        (self.on_mag if topic == "mag" else self.on_odom)(msg)

    @_guarded
    def on_mag(self, msg: MagneticField) -> None:
        """A reading: an update when the robot moved enough since the last one (the filter's rule)."""
        stamp, field_tesla, _frame = conversions.field_from_msg(msg)
        stamp = self._stamp(stamp)
        self._counts["mag_messages"] += 1
        self._last_seen["magnetometer"] = self._now()
        estimates = self.localizer.add_magnetic_field(stamp, field_tesla)
        self._publish_estimates(estimates)
        if not estimates and math.isfinite(stamp) and stamp - self._tf_from >= TF_REPUBLISH_PERIOD:
            self._publish_transform(stamp)  # keep map -> odom fresh for tf users between updates

    @_guarded
    def on_odom(self, msg: Odometry) -> None:
        """Odometry (``odom_source: topic``): its header frame must be ``odom_frame``."""
        stamp, position, orientation, frame = conversions.pose_from_msg(msg)
        self._counts["odom_messages"] += 1
        self._last_seen["odometry"] = self._now()
        if frame_name(frame) != frame_name(self.config.node.odom_frame):
            self._node_rejected["odometry_frame"] += 1
            self.get_logger().warning(f"odometry in frame '{shorten(frame, 100)}', expected localizer.odom_frame "
                                      f"'{self.config.node.odom_frame}'; refused", throttle_duration_sec=5.0)
            return
        self._publish_estimates(self.localizer.add_odometry(self._stamp(stamp), position, orientation))

    @_guarded
    def on_tf(self, msg: Any, static: bool = False) -> None:
        """/tf and /tf_static (``odom_source: tf``): the odometry is ``odom_frame -> base_frame`` at the stamps of
        each /tf message (newer than the last odometry taken)."""
        node = self.config.node
        odom, base = frame_name(node.odom_frame), frame_name(node.base_frame)
        self._counts["tf_messages"] += 1
        stamps = set()
        for sample in conversions.transforms_from_msg(msg):
            if sample.parent == frame_name(node.global_frame) and sample.child == odom:
                continue  # map -> odom: ours (or another localizer's), not odometry
            if self._tf_buffer.add(sample, static=static) and not static:
                stamps.add(sample.stamp)
        if not stamps:
            return
        self._last_seen["odometry"] = self._now()
        self._tf_newest = max(self._tf_newest, *stamps)
        self._tf_buffer.prune(self._tf_newest - max(10.0, 4.0 * self.config.filter.max_odometry_gap))
        for stamp in sorted(s for s in stamps if s > self._tf_taken):
            try:
                position, orientation = self._tf_buffer.lookup(odom, base, stamp, self.config.filter.max_odometry_gap)
            except TransformNotYetError:
                continue  # another edge of the chain has not come that far yet
            except TransformError:
                self._node_rejected["odometry_tf"] += 1
                continue
            self._tf_taken = stamp
            self._publish_estimates(self.localizer.add_odometry(stamp, position, orientation))

    @_guarded
    def on_initial_pose(self, msg: PoseWithCovarianceStamped) -> None:
        """/initialpose: restart the filter around the pose (RViz's "2D Pose Estimate")."""
        node, cfg = self.config.node, self.config.filter
        try:
            _stamp, pose, std, frame = conversions.planar_pose_from_msg(msg)
        except conversions.ConversionError as err:
            self._node_rejected["initialpose_invalid"] += 1
            self.get_logger().warning(f"/initialpose refused: {err}")
            return
        if frame_name(frame) != frame_name(node.global_frame):
            self._node_rejected["initialpose_frame"] += 1
            self.get_logger().warning(f"/initialpose in frame '{shorten(frame, 100)}' refused: the map frame is "
                                      f"'{node.global_frame}'")
            return
        std = np.where(np.isfinite(std), std, np.asarray(cfg.initial_std, dtype=np.float64))
        self.localizer.initialise(pose, std)
        self._counts["initial_poses"] += 1
        self._tf_from = -math.inf
        self.get_logger().info(f"initial pose x {pose[0]:.3f} m, y {pose[1]:.3f} m, yaw {pose[2]:.3f} rad "
                               f"(std {std[0]:.2f} m, {std[1]:.2f} m, {std[2]:.2f} rad): the filter restarts")
