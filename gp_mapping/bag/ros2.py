"""What every ROS 2 bag this package reads or writes shares: the message typestore and the latched QoS."""
from __future__ import annotations

# The newest ROS 2 distribution this rosbags knows among those whose messages we use (identical in all). Message
# types of a bag without embedded definitions (rosbag2 before Iron) are also taken from it.
ROS2_DISTROS = ("ROS2_KILTED", "ROS2_JAZZY", "ROS2_HUMBLE")


def ros2_typestore():
    """The rosbags typestore of the newest ROS 2 distribution among :data:`ROS2_DISTROS`."""
    from rosbags.typesys import Stores, get_typestore

    for name in ROS2_DISTROS:
        if hasattr(Stores, name):
            return get_typestore(getattr(Stores, name))
    raise RuntimeError("this rosbags has no ROS 2 typestore (need rosbags >= 0.10)")


def latched_qos() -> list:
    """Reliable + transient-local, depth 1: how the node offers its maps (played back latched for RViz)."""
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    zero = QosTime(0, 0)
    return [Qos(QosHistory.KEEP_LAST, 1, QosReliability.RELIABLE, QosDurability.TRANSIENT_LOCAL, zero, zero,
                QosLiveliness.AUTOMATIC, zero, False)]
