"""A bag's tf tree (``/tf`` and ``/tf_static``), read into the transform buffer the live node uses too
(:class:`gp_mapping.mapping.transforms.TransformBuffer`: each edge interpolated with the rule the sync applies to
pose topics, without extrapolation, as tf2's BufferCore does)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from gp_mapping.bag.decode import TF_STATIC_TOPIC, TF_TYPES, decode_tf
from gp_mapping.mapping.frames import FrameError, normalize_quaternion
from gp_mapping.mapping.transforms import IDENTITY, TransformBuffer, compose, invert  # noqa: F401 (re-exported)


def transform_buffer_from_bag(bag, topics: Sequence[str] | None = None) -> TransformBuffer:
    """Every /tf and /tf_static transform of ``bag`` (``topics``: default every tf topic; a topic ending in
    /tf_static, also /robot1/tf_static, is static)."""
    buffer = TransformBuffer()
    for topic, bag_time, _, msg in bag.messages(list(topics) if topics else bag.topics_of_type(TF_TYPES)):
        for sample in decode_tf(msg, bag_time):
            buffer.add(sample, static=topic.endswith(TF_STATIC_TOPIC))
    buffer.freeze()
    return buffer


def is_identity_extrinsic(translation: Sequence[float], rotation: Sequence[float], tol: float = 1e-9) -> bool:
    """True when a sensor extrinsic (translation, [x, y, z, w]) is the identity (q and -q alike)."""
    try:
        q = normalize_quaternion(rotation)
    except FrameError:
        return False
    return bool(np.all(np.abs(np.asarray(translation, dtype=np.float64)) <= tol) and abs(abs(q[3]) - 1.0) <= tol)
