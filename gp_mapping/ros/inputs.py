"""The mapping node's inputs: subscriptions, message callbacks, and the hand-over of messages to the Mapper.

Subscriptions (sensor-data QoS: best effort, keep last ``node.queue_depth``)
    ``mag``   sensor_msgs/MagneticField, tesla, in the magnetometer frame (placed on the body by
              ``sync.sensor_translation`` / ``sync.sensor_rotation``).
    ``pose``  geometry_msgs/PoseStamped, nav_msgs/Odometry or geometry_msgs/PoseWithCovarianceStamped as
              ``node.pose_type`` says; the body pose in ``grid.frame_id`` (a pose in another frame is
              rejected and counted as ``pose_frame_mismatch``).
    ``/tf``, ``/tf_static``  tf2_msgs/TFMessage, instead of ``pose`` when ``node.pose_source`` is ``tf``: each
              reading gets the pose of ``grid.frame_id`` -> its frame (mount from /tf_static), or ->
              ``node.base_frame`` with the configured extrinsic (:class:`gp_mapping.mapping.transforms.TfPoseMatcher`;
              refusals ``tf_missing``, ``tf_stale``).
    Stamps come from the message headers; a header left at zero gets the receive time on the node's clock
    (the offline replay uses the bag's receive time for such messages).

The callbacks only convert a message (:mod:`gp_mapping.ros.conversions`) and put it in the update thread's inbox
(:mod:`gp_mapping.ros.update_worker`); :meth:`MapperInputs._feed_inbox` hands the inbox to the Mapper there, in
arrival order. Bad input: every refused message is counted by reason. The queues are bounded: the subscriptions
keep ``node.queue_depth`` messages (what the transport drops beyond them shows as ``transport_lost_mag`` /
``transport_lost_pose``, from gaps in each publisher's sequence numbers), the inbox 2 x ``batching.max_pending``
(oldest dropped, ``inbox_overflow``), the Mapper ``batching.max_pending`` samples (oldest dropped,
``dropped_overflow``).
"""
from __future__ import annotations

from typing import Any

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import MagneticField

from gp_mapping.mapping.transforms import TfPoseMatcher
from gp_mapping.ros import conversions
from gp_mapping.ros.process import NodeStartError

MAX_TRACKED_PUBLISHERS = 64  # per input topic, for counting messages lost in transport


class SequenceGaps:
    """Messages the transport lost on one topic, from gaps in each publisher's sequence numbers (a full
    subscription queue under load drops messages before the node can take them)."""

    def __init__(self) -> None:
        self._last: dict[bytes, int] = {}  # publisher gid -> its highest sequence number seen

    def lost(self, info: dict[str, Any]) -> int:
        """How many messages of this message's publisher were lost since its previous one (``info``: the message
        info rclpy hands a two-argument subscription callback)."""
        sequence, gid = info.get("publication_sequence_number"), info.get("publisher_gid")
        if not sequence or gid is None:  # None or 0 where the middleware does not number its messages
            return 0
        key = bytes(gid.get("data", b"")) if isinstance(gid, dict) else bytes(gid)
        last = self._last.pop(key, None)
        self._last[key] = sequence if last is None else max(sequence, last)
        if len(self._last) > MAX_TRACKED_PUBLISHERS:  # publishers that come and go: forget the longest silent
            del self._last[next(iter(self._last))]
        return sequence - last - 1 if last is not None and sequence > last + 1 else 0


def sensor_qos(depth: int) -> QoSProfile:
    """Sensor-data QoS: best effort, volatile, keep the last ``depth`` messages."""
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth, reliability=ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.VOLATILE)


class MapperInputs:
    """Mixin of the mapping node: its subscriptions and callbacks, and :meth:`_feed_inbox` (update thread)."""

    def _setup_inputs(self) -> None:
        self._node_rejected: dict[str, int] = {"pose_frame_mismatch": 0, "inbox_overflow": 0,
                                               "transport_lost_mag": 0, "transport_lost_pose": 0}
        self._sequence_gaps = {"mag": SequenceGaps(), "pose": SequenceGaps()}
        self._last_seen: dict[str, float | None] = {"magnetometer": None, "pose": None}  # node clock [s]
        self._tf_dynamic_messages = 0
        self._tf: TfPoseMatcher | None = None

    def _subscribe_inputs(self) -> list:
        """The subscriptions of ``mag`` and of ``pose`` or /tf and /tf_static."""
        qos = sensor_qos(self.config.node.queue_depth)
        # The two-argument callbacks get the message info: its sequence numbers reveal messages that the
        # transport dropped before the node could take them (a full subscription queue under load).
        subscriptions = [self.create_subscription(MagneticField, "mag",
                                                  lambda msg, info: self._receive("mag", msg, info), qos)]
        if self.config.node.pose_source == "tf":
            return subscriptions + self._subscribe_tf()
        return subscriptions + [self.create_subscription(conversions.POSE_TYPES[self.config.node.pose_type], "pose",
                                                         lambda msg, info: self._receive("pose", msg, info), qos)]

    def _subscribe_tf(self) -> list:
        """``node.pose_source: tf``: /tf and /tf_static (the QoS of tf2_ros's listener) feed the transform
        buffer that places each reading (mapping/transforms.py, shared with the replay)."""
        try:
            from tf2_msgs.msg import TFMessage
        except ImportError as err:
            raise NodeStartError("node.pose_source is 'tf' but the tf2_msgs Python package is not installed (it "
                                 "comes with ROS; in this repository's venv `make venv` builds it)") from err
        c = self.config
        self._tf = TfPoseMatcher(c.grid.frame_id, c.node.base_frame,
                                 (c.sync.sensor_translation, c.sync.sensor_rotation), c.sync.max_pose_gap,
                                 c.node.tf_timeout, cache_seconds=max(c.sync.pose_buffer_seconds, 10.0))
        dynamic = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.VOLATILE)
        static = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                            durability=DurabilityPolicy.TRANSIENT_LOCAL)
        return [self.create_subscription(TFMessage, "/tf", lambda msg: self.on_tf(msg, static=False), dynamic),
                self.create_subscription(TFMessage, "/tf_static", lambda msg: self.on_tf(msg, static=True), static)]

    # ---------------------------------------------------------------------------------------- callbacks

    def _now(self) -> float | None:
        """The node clock [s], or None before it runs (sim time before the first /clock)."""
        now = self.get_clock().now().nanoseconds * 1e-9
        return now if now > 0 else None

    def _enqueue(self, item: tuple[str, float, Any, Any, float | None]) -> None:
        """``(kind, stamp, values, (orientation, frame_id) or frame_id or static, receive time or None)`` into the
        inbox, bounded like the mapper's own queue (a reading and a pose per sample): the mapper cannot keep up
        when it is full, and the oldest message is dropped, counted."""
        if self._push(item, 2 * self.config.batching.max_pending):
            self._node_rejected["inbox_overflow"] += 1

    def _receive_stamp(self, stamp: float, now: float | None) -> float:
        """A message stamp, or the receive time (node clock) where the publisher left it at zero, as the
        offline replay uses the bag's receive time for such messages."""
        if stamp != 0.0:
            return stamp
        self._counts["stamps_from_clock"] += 1
        return now if now is not None else 0.0

    def _receive(self, topic: str, msg: Any, info: dict[str, Any]) -> None:
        """A subscription callback: count what the transport lost since this publisher's previous message
        (a gap in its sequence numbers), then handle the message."""
        lost = self._sequence_gaps[topic].lost(info)
        if lost:
            self._node_rejected[f"transport_lost_{topic}"] += lost
        (self.on_mag if topic == "mag" else self.on_pose)(msg)

    def on_mag(self, msg: MagneticField) -> None:
        """Subscription callback of ``mag`` (public so that tests can drive the node without DDS)."""
        stamp, field_tesla, frame = conversions.field_from_msg(msg)
        now = self._now()
        self._counts["mag_messages"] += 1
        self._last_seen["magnetometer"] = now
        self._enqueue(("field", self._receive_stamp(stamp, now), field_tesla, frame, now))

    def on_pose(self, msg: Any) -> None:
        """Subscription callback of ``pose``."""
        stamp, position, orientation, frame = conversions.pose_from_msg(msg)
        now = self._now()
        stamp = self._receive_stamp(stamp, now)
        self._counts["pose_messages"] += 1
        self._last_seen["pose"] = now
        self._enqueue(("pose", stamp, position, (orientation, frame), now))

    def on_tf(self, msg: Any, static: bool = False) -> None:
        """Subscription callback of ``/tf`` and ``/tf_static`` (``node.pose_source: tf``)."""
        samples = conversions.transforms_from_msg(msg)
        self._counts["tf_messages"] += 1
        now = self._now()
        if not static:  # /tf is the pose stream (the diagnostics' silence and rate checks)
            self._tf_dynamic_messages += 1
            self._last_seen["pose"] = now
        self._enqueue(("tf", 0.0, samples, static, now))

    # ------------------------------------------------------------------------------- on the update thread

    def _feed_inbox(self) -> None:
        """Hand every buffered message to the mapper in arrival order (caller holds ``_lock``)."""
        items = self._take_inbox()
        tf = self._tf
        for kind, stamp, a, b, now in items:
            if kind == "pose":
                self.mapper.add_pose(stamp, a, b[0], receive_time=now, frame_id=b[1])
            elif kind == "tf":
                for sample in a:
                    tf.add_transform(sample, static=b)
                for notice in tf.buffer.take_notices():  # each re-parenting or refusal kind once (tf2 warns too)
                    self.get_logger().warning(notice)
            elif tf is not None:
                tf.add_field(stamp, a, b, receive_time=now)
            else:
                self.mapper.add_magnetic_field(stamp, a, frame_id=b, receive_time=now)
        if tf is not None:  # readings whose transforms have come, in arrival order, each with its pose
            for stamp, position, orientation, reading in tf.ready():
                self.mapper.add_pose(stamp, position, orientation, receive_time=reading.receive_time,
                                     frame_id=self.config.grid.frame_id)
                self.mapper.add_magnetic_field(stamp, reading.field, frame_id=reading.frame_id,
                                               receive_time=reading.receive_time)
        refused = self.mapper.pose_frame_mismatch  # the Mapper's rule: a pose must be in grid.frame_id
        if refused != self._node_rejected["pose_frame_mismatch"]:
            if refused > self._node_rejected["pose_frame_mismatch"]:
                frames = ", ".join(repr(f) for f in sorted(self.mapper.refused_pose_frames))
                self.get_logger().warning(f"poses in frame(s) {frames}, expected grid.frame_id "
                                          f"'{self.config.grid.frame_id}'; rejected (node.pose_source topic: the "
                                          "pose topic must be in the map frame; node.pose_source tf looks frames "
                                          "up in /tf)", throttle_duration_sec=5.0)
            self._node_rejected["pose_frame_mismatch"] = refused
