"""The motion model: odometry increments with nav2 AMCL's differential-drive noise (Thrun, Burgard and Fox,
*Probabilistic Robotics*, 2005, table 5.6, ``sample_motion_model_odometry``; nav2 ``DifferentialMotionModel``).

The odometry's move between two filter updates, from pose ``(x0, y0, yaw0)`` to ``(x1, y1, yaw1)`` in the odom
frame, is a first rotation ``rot1``, a translation ``trans`` and a second rotation ``rot2``. Each particle moves
by its own noisy copy of them:

    rot1'  = rot1  - N(0, alpha1 rot1n^2 + alpha2 trans^2)
    trans' = trans - N(0, alpha3 trans^2 + alpha4 (rot1n^2 + rot2n^2))
    rot2'  = rot2  - N(0, alpha1 rot2n^2 + alpha2 trans^2)

where ``rotKn`` is the rotation's distance to 0 or to pi, whichever is nearer (so that driving backwards is not
mistaken for two half turns: nav2's rule). The noise is applied once per filter update to the whole increment,
as AMCL does: applying it to every small odometry message instead would shrink it with the message rate.

SE(2) helpers (poses as ``(x, y, yaw)``) live here too.
"""
from __future__ import annotations

import math

import numpy as np

#: Below this translation [m] the first rotation is taken as 0 (nav2: its direction is noise).
MIN_TRANSLATION = 0.01


def wrap_angle(a):
    """Angles wrapped to [-pi, pi)."""
    return (np.asarray(a, dtype=np.float64) + math.pi) % (2.0 * math.pi) - math.pi


def compose(a, b) -> np.ndarray:
    """SE(2) ``a * b`` of poses ``(x, y, yaw)`` (b expressed in a's frame); broadcasts over leading axes."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    c, s = np.cos(a[..., 2]), np.sin(a[..., 2])
    return np.stack([a[..., 0] + c * b[..., 0] - s * b[..., 1], a[..., 1] + s * b[..., 0] + c * b[..., 1],
                     wrap_angle(a[..., 2] + b[..., 2])], axis=-1)


def inverse(a) -> np.ndarray:
    """SE(2) inverse of poses ``(x, y, yaw)``."""
    a = np.asarray(a, dtype=np.float64)
    c, s = np.cos(a[..., 2]), np.sin(a[..., 2])
    return np.stack([-c * a[..., 0] - s * a[..., 1], s * a[..., 0] - c * a[..., 1], wrap_angle(-a[..., 2])], axis=-1)


def odometry_increment(old, new) -> tuple[float, float, float]:
    """``(rot1, trans, rot2)`` of the move from pose ``old`` to ``new`` (both in the odom frame)."""
    dx, dy = float(new[0] - old[0]), float(new[1] - old[1])
    trans = math.hypot(dx, dy)
    rot1 = 0.0 if trans < MIN_TRANSLATION else float(wrap_angle(math.atan2(dy, dx) - old[2]))
    rot2 = float(wrap_angle(float(new[2] - old[2]) - rot1))
    return rot1, trans, rot2


def _to_zero_or_pi(a: float) -> float:
    return min(abs(float(wrap_angle(a))), abs(float(wrap_angle(a - math.pi))))


def increment_stds(rot1: float, trans: float, rot2: float, alphas) -> tuple[float, float, float]:
    """Standard deviations of the noise on ``rot1``, ``trans`` and ``rot2`` (the module docstring's formula)."""
    a1, a2, a3, a4 = (float(a) for a in alphas)
    r1, r2 = _to_zero_or_pi(rot1), _to_zero_or_pi(rot2)
    return (math.sqrt(a1 * r1 * r1 + a2 * trans * trans),
            math.sqrt(a3 * trans * trans + a4 * (r1 * r1 + r2 * r2)),
            math.sqrt(a1 * r2 * r2 + a2 * trans * trans))


def sample_motion(poses: np.ndarray, old, new, alphas, rng: np.random.Generator) -> None:
    """Move particle poses ``(N, 3)`` in place by the odometry increment from ``old`` to ``new`` with noise."""
    rot1, trans, rot2 = odometry_increment(old, new)
    s1, st, s2 = increment_stds(rot1, trans, rot2, alphas)
    n = poses.shape[0]
    noise = rng.standard_normal((3, n))
    r1 = rot1 - s1 * noise[0]
    tr = trans - st * noise[1]
    r2 = rot2 - s2 * noise[2]
    heading = poses[:, 2] + r1
    poses[:, 0] += tr * np.cos(heading)
    poses[:, 1] += tr * np.sin(heading)
    poses[:, 2] = wrap_angle(heading + r2)


__all__ = ["MIN_TRANSLATION", "compose", "increment_stds", "inverse", "odometry_increment", "sample_motion",
           "wrap_angle"]
