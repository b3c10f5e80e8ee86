"""Bags, the second adapter beside ``ros/``: recorded ROS 1 / ROS 2 bags read, and the replay's maps written, with
the ``rosbags`` library and no ROS installation.

- :mod:`~gp_mapping.bag.reader`: :class:`Bag` (topics, time span, messages in bag-time order) and the choice of
  pose source (:func:`choose_pose_source`: a pose topic or the tf tree);
- :mod:`~gp_mapping.bag.decode`: messages as numpy samples in SI units;
- :mod:`~gp_mapping.bag.tf`: the bag's tf tree (:class:`TransformBuffer`);
- :mod:`~gp_mapping.bag.writer`: :class:`MapBagWriter`, the published maps as a rosbag2 folder (or a bare MCAP
  file);
- :mod:`~gp_mapping.bag.ros2`: the typestore and latched QoS every bag written here shares (the demo bag too);
- :mod:`~gp_mapping.bag.errors`: every error a user can cause, a :class:`BagError`.
"""
from gp_mapping.bag.decode import (MAGNETIC_FIELD, ODOMETRY, POSE_STAMPED, POSE_TYPES, POSE_WITH_COVARIANCE,
                                   TF_STATIC_TOPIC, TF_TYPES, MagSample, PoseSample, TransformSample,
                                   decode_magnetic_field, decode_pose, decode_tf)
from gp_mapping.bag.errors import (BagError, BagNotFoundError, CorruptBagError, MapBagError, NoMagneticFieldError,
                                   NoPoseSourceError, NotABagError, NoTransformChainError, TopicError,
                                   TransformError)
from gp_mapping.bag.reader import Bag, MagneticFieldSeries, PoseSource, choose_pose_source, read_magnetic_field
from gp_mapping.bag.tf import TransformBuffer, compose, invert, is_identity_extrinsic
from gp_mapping.bag.writer import MapBagWriter

__all__ = [
    "Bag", "BagError", "BagNotFoundError", "CorruptBagError", "MAGNETIC_FIELD", "MagSample", "MagneticFieldSeries",
    "MapBagError", "MapBagWriter", "NoMagneticFieldError", "NoPoseSourceError", "NoTransformChainError",
    "NotABagError", "ODOMETRY", "POSE_STAMPED", "POSE_TYPES", "POSE_WITH_COVARIANCE", "PoseSample", "PoseSource",
    "TF_STATIC_TOPIC", "TF_TYPES", "TopicError", "TransformBuffer", "TransformError", "TransformSample",
    "choose_pose_source", "compose", "decode_magnetic_field", "decode_pose", "decode_tf", "invert",
    "is_identity_extrinsic", "read_magnetic_field",
]
