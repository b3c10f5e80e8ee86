"""Quaternions and rotations in ROS order ``[x, y, z, w]`` (Hamilton convention, active rotations).

All functions take one quaternion ``(4,)`` or a batch ``(N, 4)`` (vectors ``(3,)`` or ``(N, 3)``) and broadcast
a single quaternion against a batch. ``q`` rotates a vector from its child frame into its parent frame, as a
``geometry_msgs/Pose`` orientation rotates body-frame vectors into the map frame.

The algebra is scipy's :class:`~scipy.spatial.transform.Rotation` (same order, same convention); what is kept
here is the checking at the edge: a quaternion with a non-finite entry or a (near-)zero norm, or an array of the
wrong shape, is refused with :class:`FrameError` instead of being normalised into a rotation it does not describe.
"""
from __future__ import annotations

import numpy as np
from scipy.spatial.transform import Rotation

# Below this norm a quaternion carries no rotation (the all-zero default of a ROS message, say).
MIN_QUATERNION_NORM = 1e-9


class FrameError(ValueError):
    """A quaternion or vector cannot describe a rotation (zero or non-finite norm, wrong shape)."""


def _as_quaternions(q) -> np.ndarray:
    arr = np.asarray(q, dtype=np.float64)
    if arr.shape[-1:] != (4,) or arr.ndim > 2:
        raise FrameError(f"a quaternion must have shape (4,) or (N, 4) in [x, y, z, w] order, got {arr.shape}")
    return arr


def _as_vectors(v) -> np.ndarray:
    arr = np.asarray(v, dtype=np.float64)
    if arr.shape[-1:] != (3,) or arr.ndim > 2:
        raise FrameError(f"a vector must have shape (3,) or (N, 3), got {arr.shape}")
    return arr


def quaternion_norm_ok(q) -> np.ndarray | bool:
    """True where ``q`` can be normalised (finite entries and norm above MIN_QUATERNION_NORM)."""
    arr = _as_quaternions(q)
    finite = np.all(np.isfinite(arr), axis=-1)
    norm = np.linalg.norm(np.where(np.isfinite(arr), arr, 0.0), axis=-1)
    ok = finite & (norm > MIN_QUATERNION_NORM)
    return bool(ok) if arr.ndim == 1 else ok


def normalize_quaternion(q) -> np.ndarray:
    """``q / |q|``; raises FrameError on a non-finite entry or a (near-)zero norm."""
    arr = _as_quaternions(q)
    if not np.all(np.isfinite(arr)):
        raise FrameError(f"quaternion has a non-finite entry: {arr.tolist() if arr.ndim == 1 else 'in batch'}")
    norm = np.linalg.norm(arr, axis=-1, keepdims=True)
    if np.any(norm <= MIN_QUATERNION_NORM):
        raise FrameError(f"quaternion has (near-)zero norm {float(norm.min()):.3g}; it describes no rotation")
    return arr / norm


def _rotations(q) -> Rotation:
    """scipy Rotations of validated quaternions (one or a batch), normalised first."""
    return Rotation.from_quat(normalize_quaternion(q))


def quaternion_to_matrix(q) -> np.ndarray:
    """Rotation matrix ``(3, 3)`` (or ``(N, 3, 3)``) of a quaternion, normalised first."""
    return _rotations(q).as_matrix()


def rotate_vectors(q, v) -> np.ndarray:
    """``R(q) v`` for one or many quaternions and vectors (a single one broadcasts against a batch)."""
    return _rotations(q).apply(_as_vectors(v))


def quaternion_multiply(a, b) -> np.ndarray:
    """Hamilton product ``a * b`` of the normalised quaternions: the rotation that applies ``b`` first, then
    ``a`` (unit norm; a single quaternion broadcasts against a batch)."""
    return (_rotations(a) * _rotations(b)).as_quat()


def quaternion_inverse(q) -> np.ndarray:
    """``q^-1`` (conjugate over squared norm), so that ``q * q^-1`` is the identity also for a quaternion that is
    not of unit norm (a scipy Rotation knows unit quaternions only; the conjugate keeps ``q``'s sign)."""
    arr = normalize_quaternion(q) / np.linalg.norm(_as_quaternions(q), axis=-1, keepdims=True)
    return arr * np.array([-1.0, -1.0, -1.0, 1.0])


def slerp(q0, q1, t) -> np.ndarray:
    """Spherical linear interpolation from ``q0`` (t = 0) to ``q1`` (t = 1) along the shorter arc.

    ``t`` is a scalar or ``(N,)``; pairs of quaternions broadcast as in :func:`quaternion_multiply`. The result is
    unit-norm, on ``q0``'s side of the sphere (``q`` and ``-q`` are one rotation). It is scipy's ``Slerp`` between
    each pair: ``q0`` turned by ``t`` times the rotation vector of ``q0^-1 q1``, which is at most pi long.
    """
    r0, r1 = _rotations(q0), _rotations(q1)
    tt = np.asarray(t, dtype=np.float64)
    step = (r0.inv() * r1).as_rotvec()
    return (r0 * Rotation.from_rotvec(step * (tt[..., None] if tt.ndim else tt))).as_quat()


def quaternion_from_rpy(roll, pitch, yaw) -> np.ndarray:
    """Quaternion of fixed-axis roll (x), pitch (y), yaw (z), applied in that order: ``R = Rz Ry Rx``.

    This is the ROS ``tf2::Quaternion::setRPY`` convention (scipy's extrinsic ``"xyz"``). Scalars give ``(4,)``,
    arrays ``(N, 4)``.
    """
    angles = np.stack(np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in (roll, pitch, yaw))), axis=-1)
    return Rotation.from_euler("xyz", angles).as_quat()


def yaw_of(q) -> np.ndarray | float:
    """Heading (rotation about z) of a quaternion, in (-pi, pi]: the direction of its x axis in the parent's x-y
    plane, ``atan2(R[1, 0], R[0, 0])`` from the quaternion (scipy's Euler angles would warn and pick an angle at
    pitch +-90 degrees, where this keeps its value)."""
    x, y, z, w = np.moveaxis(normalize_quaternion(q), -1, 0)
    out = np.arctan2(2.0 * (w * z + x * y), 1.0 - 2.0 * (y * y + z * z))
    return float(out) if np.ndim(out) == 0 else out
