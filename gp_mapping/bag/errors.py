"""The errors of reading and writing bags, in one module: every failure a user can cause (a missing path, a file
that is not a bag, a topic that is absent, of the wrong type or ambiguous, no pose source, a transform chain that
does not exist, an output that exists) raises a :class:`BagError` subclass whose message says what is wrong and
what to pass instead."""
from __future__ import annotations

from gp_mapping.mapping import transforms


class BagError(Exception):
    """A bag cannot serve the replay: the message says what is wrong and what to do."""


class BagNotFoundError(BagError, FileNotFoundError):
    """The bag path does not exist."""


class NotABagError(BagError):
    """The path exists but is not a ROS 1 bag, a rosbag2 folder, or an MCAP / sqlite3 file rosbags can read."""


class CorruptBagError(NotABagError):
    """The bag opened, but reading or decoding its messages failed part way (truncated or corrupt data, or a
    message type whose definition the bag does not carry). ``messages_read`` were delivered before it."""

    def __init__(self, message: str, messages_read: int = 0) -> None:
        super().__init__(message)
        self.messages_read = messages_read


class TopicError(BagError):
    """A topic the replay needs is absent, has the wrong message type, or cannot be chosen unambiguously."""


class NoMagneticFieldError(TopicError):
    """The bag has no sensor_msgs/MagneticField topic."""


class NoPoseSourceError(TopicError):
    """The bag has neither a pose topic nor a /tf chain from the map frame to the magnetometer frame."""


# The tf tree is shared with the live node (mapping/transforms.py, ROS-free): a lookup's error is that module's.
TransformError = transforms.TransformError


class NoTransformChainError(BagError, TransformError):
    """The bag's tf tree does not connect the frames asked for (``--tf PARENT CHILD``): a bag problem like the
    others, and a TransformError."""


class MapBagError(BagError):
    """The map bag cannot be written (the output exists, or a grid is inconsistent)."""

