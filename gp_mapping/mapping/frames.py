"""Quaternions and rotations in ROS order ``[x, y, z, w]`` (Hamilton convention, active rotations).

All functions take one quaternion ``(4,)`` or a batch ``(N, 4)`` (vectors ``(3,)`` or ``(N, 3)``) and broadcast
a single quaternion against a batch. ``q`` rotates a vector from its child frame into its parent frame, as a
``geometry_msgs/Pose`` orientation rotates body-frame vectors into the map frame.
"""
from __future__ import annotations

import numpy as np

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


def quaternion_to_matrix(q) -> np.ndarray:
    """Rotation matrix ``(3, 3)`` (or ``(N, 3, 3)``) of a quaternion, normalised first."""
    x, y, z, w = np.moveaxis(normalize_quaternion(q), -1, 0)
    m = np.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
        2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
        2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
    ], axis=-1)
    return m.reshape(m.shape[:-1] + (3, 3))


def rotate_vectors(q, v) -> np.ndarray:
    """``R(q) v`` for one or many quaternions and vectors (a single one broadcasts against a batch)."""
    qn = normalize_quaternion(q)
    vec = _as_vectors(v)
    u, w = qn[..., :3], qn[..., 3:4]
    # v' = v + 2 w (u x v) + 2 u x (u x v): the quaternion sandwich without building matrices.
    uv = np.cross(u, vec)
    return vec + 2.0 * w * uv + 2.0 * np.cross(u, uv)


def quaternion_multiply(a, b) -> np.ndarray:
    """Hamilton product ``a * b``: the rotation that applies ``b`` first, then ``a``."""
    qa, qb = _as_quaternions(a), _as_quaternions(b)
    ax, ay, az, aw = np.moveaxis(qa, -1, 0)
    bx, by, bz, bw = np.moveaxis(qb, -1, 0)
    return np.stack([
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
        aw * bw - ax * bx - ay * by - az * bz,
    ], axis=-1)


def quaternion_inverse(q) -> np.ndarray:
    """``q^-1`` (conjugate over squared norm), so that ``q * q^-1`` is the identity."""
    arr = normalize_quaternion(q) / np.linalg.norm(_as_quaternions(q), axis=-1, keepdims=True)
    return arr * np.array([-1.0, -1.0, -1.0, 1.0])


def slerp(q0, q1, t) -> np.ndarray:
    """Spherical linear interpolation from ``q0`` (t = 0) to ``q1`` (t = 1) along the shorter arc.

    ``t`` is a scalar or ``(N,)``; the result is unit-norm. Nearly parallel quaternions fall back to a
    normalised linear blend, whose error there is below float64 resolution.
    """
    a, b = normalize_quaternion(q0), normalize_quaternion(q1)
    tt = np.asarray(t, dtype=np.float64)
    a, b = np.broadcast_arrays(a, b)
    dot = np.sum(a * b, axis=-1)
    # q and -q are the same rotation: flip one so that the path is the short one.
    b = np.where((dot < 0.0)[..., None], -b, b)
    dot = np.abs(dot)
    tt = tt[..., None] if tt.ndim else tt
    theta = np.arccos(np.clip(dot, -1.0, 1.0))[..., None]
    sin_theta = np.sin(theta)
    near = sin_theta < 1e-8
    safe = np.where(near, 1.0, sin_theta)
    w0 = np.where(near, 1.0 - tt, np.sin((1.0 - tt) * theta) / safe)
    w1 = np.where(near, tt, np.sin(tt * theta) / safe)
    out = w0 * a + w1 * b
    return out / np.linalg.norm(out, axis=-1, keepdims=True)


def quaternion_from_rpy(roll, pitch, yaw) -> np.ndarray:
    """Quaternion of fixed-axis roll (x), pitch (y), yaw (z), applied in that order: ``R = Rz Ry Rx``.

    This is the ROS ``tf2::Quaternion::setRPY`` convention. Scalars give ``(4,)``, arrays ``(N, 4)``.
    """
    r, p, y = (np.asarray(a, dtype=np.float64) * 0.5 for a in (roll, pitch, yaw))
    cr, sr, cp, sp, cy, sy = np.cos(r), np.sin(r), np.cos(p), np.sin(p), np.cos(y), np.sin(y)
    return np.stack([
        sr * cp * cy - cr * sp * sy,
        cr * sp * cy + sr * cp * sy,
        cr * cp * sy - sr * sp * cy,
        cr * cp * cy + sr * sp * sy,
    ], axis=-1)


def yaw_of(q) -> np.ndarray | float:
    """Heading (rotation about z) of a quaternion, in (-pi, pi]."""
    x, y, z, w = np.moveaxis(normalize_quaternion(q), -1, 0)
    out = np.arctan2(2.0 * (w * z + x * y), 1.0 - 2.0 * (y * y + z * z))
    return float(out) if np.ndim(out) == 0 else out
