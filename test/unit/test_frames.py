"""Quaternion helpers against closed forms and against scipy's Rotation (an independent implementation)."""
import math

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from gp_mapping.mapping.frames import (FrameError, normalize_quaternion, quaternion_from_rpy, quaternion_inverse,
                                       quaternion_multiply, quaternion_norm_ok, quaternion_to_matrix, rotate_vectors,
                                       slerp, yaw_of)

RNG = np.random.default_rng(7)


def random_quaternions(n):
    q = RNG.normal(size=(n, 4))
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def test_yaw_quaternion_closed_form():
    yaw = 0.7
    q = quaternion_from_rpy(0.0, 0.0, yaw)
    np.testing.assert_allclose(q, [0, 0, math.sin(yaw / 2), math.cos(yaw / 2)], atol=1e-15)
    expected = np.array([[math.cos(yaw), -math.sin(yaw), 0], [math.sin(yaw), math.cos(yaw), 0], [0, 0, 1]])
    np.testing.assert_allclose(quaternion_to_matrix(q), expected, atol=1e-15)
    np.testing.assert_allclose(rotate_vectors(q, [1.0, 0.0, 0.0]), [math.cos(yaw), math.sin(yaw), 0], atol=1e-15)
    assert yaw_of(q) == pytest.approx(yaw)


def test_rpy_matches_scipy_extrinsic_xyz():
    rpy = RNG.uniform(-3, 3, size=(20, 3))
    q = quaternion_from_rpy(rpy[:, 0], rpy[:, 1], rpy[:, 2])
    ref = Rotation.from_euler("xyz", rpy).as_quat()  # scipy: extrinsic x, y, z and [x, y, z, w] order
    same = np.minimum(np.abs(q - ref).max(axis=1), np.abs(q + ref).max(axis=1))
    assert same.max() < 1e-12


def test_matrix_rotate_multiply_inverse_match_scipy():
    qa, qb = random_quaternions(50), random_quaternions(50)
    v = RNG.normal(size=(50, 3))
    ra, rb = Rotation.from_quat(qa), Rotation.from_quat(qb)
    np.testing.assert_allclose(quaternion_to_matrix(qa), ra.as_matrix(), atol=1e-12)
    np.testing.assert_allclose(rotate_vectors(qa, v), ra.apply(v), atol=1e-12)
    prod = quaternion_multiply(qa, qb)
    np.testing.assert_allclose(quaternion_to_matrix(prod), (ra * rb).as_matrix(), atol=1e-12)
    np.testing.assert_allclose(quaternion_to_matrix(quaternion_inverse(qa)), ra.inv().as_matrix(), atol=1e-12)
    ident = quaternion_multiply(qa, quaternion_inverse(qa))
    np.testing.assert_allclose(np.abs(ident[:, 3]), 1.0, atol=1e-12)
    # one quaternion broadcasts against many vectors
    np.testing.assert_allclose(rotate_vectors(qa[0], v), ra[0].apply(v), atol=1e-12)


def test_inverse_of_non_unit_quaternion():
    q = np.array([0.0, 0.0, 2.0, 2.0])  # 90 deg about z, norm 2*sqrt(2)
    prod = quaternion_multiply(q, quaternion_inverse(q))
    np.testing.assert_allclose(prod, [0, 0, 0, 1], atol=1e-15)


def test_slerp_midpoint_and_shortest_path():
    q0 = quaternion_from_rpy(0, 0, 0.2)
    q1 = quaternion_from_rpy(0, 0, 1.0)
    np.testing.assert_allclose(slerp(q0, q1, 0.5), quaternion_from_rpy(0, 0, 0.6), atol=1e-15)
    np.testing.assert_allclose(slerp(q0, q1, 0.0), q0, atol=1e-15)
    np.testing.assert_allclose(slerp(q0, q1, 1.0), q1, atol=1e-15)
    # -q1 is the same rotation; the interpolation must still take the 0.8 rad arc, not the long way round
    mid = slerp(q0, -q1, 0.5)
    assert yaw_of(mid) == pytest.approx(0.6)
    # across +-pi: yaw 3.0 to -3.0 is a 0.283 rad turn through pi
    mid = slerp(quaternion_from_rpy(0, 0, 3.0), quaternion_from_rpy(0, 0, -3.0), 0.5)
    assert abs(abs(yaw_of(mid)) - math.pi) < 1e-12


def test_slerp_batched_matches_scipy():
    from scipy.spatial.transform import Slerp

    q0, q1 = random_quaternions(30), random_quaternions(30)
    t = RNG.uniform(0, 1, size=30)
    out = slerp(q0, q1, t)
    for k in range(30):
        ref = Slerp([0, 1], Rotation.from_quat([q0[k], q1[k]]))(t[k]).as_matrix()
        np.testing.assert_allclose(quaternion_to_matrix(out[k]), ref, atol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-14)


def test_slerp_identical_quaternions_is_stable():
    q = random_quaternions(1)[0]
    out = slerp(q, q, 0.3)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, q, atol=1e-15)


@pytest.mark.parametrize("bad", [[0, 0, 0, 0], [np.nan, 0, 0, 1], [0, np.inf, 0, 1], [1e-12, 0, 0, 0]])
def test_bad_quaternions_are_refused(bad):
    assert quaternion_norm_ok(bad) is False
    with pytest.raises(FrameError):
        normalize_quaternion(bad)
    with pytest.raises(FrameError):
        rotate_vectors(bad, [1, 0, 0])


def test_wrong_shapes_are_refused():
    with pytest.raises(FrameError, match="shape"):
        normalize_quaternion([0, 0, 1])
    with pytest.raises(FrameError, match="shape"):
        rotate_vectors([0, 0, 0, 1], [1, 0])


def test_normalize_batch():
    q = np.array([[0, 0, 0, 2.0], [0, 3.0, 0, 0]])
    np.testing.assert_allclose(normalize_quaternion(q), [[0, 0, 0, 1], [0, 1, 0, 0]])
    assert quaternion_norm_ok(np.array([[0, 0, 0, 1.0], [0, 0, 0, 0]])).tolist() == [True, False]


# ------------------------------------------------------------- scipy's algebra against the closed forms it replaced


def _hamilton(a, b):
    ax, ay, az, aw = np.moveaxis(a, -1, 0)
    bx, by, bz, bw = np.moveaxis(b, -1, 0)
    return np.stack([aw * bx + ax * bw + ay * bz - az * by, aw * by - ax * bz + ay * bw + az * bx,
                     aw * bz + ax * by - ay * bx + az * bw, aw * bw - ax * bx - ay * by - az * bz], axis=-1)


def _sandwich(q, v):
    u, w = q[..., :3], q[..., 3:4]
    uv = np.cross(u, v)
    return v + 2.0 * w * uv + 2.0 * np.cross(u, uv)


def _slerp(a, b, t):
    a, b = np.broadcast_arrays(a, b)
    dot = np.sum(a * b, axis=-1)
    b = np.where((dot < 0.0)[..., None], -b, b)
    theta = np.arccos(np.clip(np.abs(dot), -1.0, 1.0))[..., None]
    t = np.asarray(t, dtype=np.float64)
    t = t[..., None] if t.ndim else t
    near = np.sin(theta) < 1e-8
    safe = np.where(near, 1.0, np.sin(theta))
    out = (np.where(near, 1.0 - t, np.sin((1.0 - t) * theta) / safe) * a
           + np.where(near, t, np.sin(t * theta) / safe) * b)
    return out / np.linalg.norm(out, axis=-1, keepdims=True)


def _rpy(r, p, y):
    r, p, y = (np.asarray(a, dtype=np.float64) * 0.5 for a in (r, p, y))
    cr, sr, cp, sp, cy, sy = np.cos(r), np.sin(r), np.cos(p), np.sin(p), np.cos(y), np.sin(y)
    return np.stack([sr * cp * cy - cr * sp * sy, cr * sp * cy + sr * cp * sy, cr * cp * sy - sr * sp * cy,
                     cr * cp * cy + sr * sp * sy], axis=-1)


@pytest.mark.parametrize("scale", [1.0, 1e-6, 1e3])
def test_library_algebra_equals_the_closed_forms_within_1e_12(scale):
    """The scipy Rotation / Slerp algebra gives the quaternions and vectors of the hand-written closed forms it
    replaced (Hamilton product, the sandwich, slerp, setRPY), sign included, for one quaternion and for batches,
    for quaternions of any norm, across the short/long arc and for nearly equal ones."""
    rng = np.random.default_rng(11)
    qa, qb = rng.normal(size=(200, 4)) * scale, rng.normal(size=(200, 4)) * scale
    ua, ub = (q / np.linalg.norm(q, axis=-1, keepdims=True) for q in (qa, qb))
    v = rng.normal(size=(200, 3)) * 10.0
    t = rng.uniform(0.0, 1.0, size=200)
    for q, vec in ((qa, v), (qa[0], v), (qa, v[0]), (qa[0], v[0])):
        unit = q / np.linalg.norm(q, axis=-1, keepdims=True)
        np.testing.assert_allclose(rotate_vectors(q, vec), _sandwich(unit, vec), rtol=0, atol=1e-12)
    for a, b in ((ua, ub), (ua[0], ub), (ua, ub[0]), (ua[0], ub[0])):
        np.testing.assert_allclose(quaternion_multiply(a, b), _hamilton(a, b), rtol=0, atol=1e-12)
    np.testing.assert_allclose(quaternion_multiply(qa, qb), _hamilton(ua, ub), rtol=0, atol=1e-12)
    for a, b, tt in ((qa, qb, t), (qa[0], qb[0], t), (qa, qb, 0.3), (qa, -qb, t), (qa, qa, t),
                     (qa, qa * (1.0 + 1e-10) + 1e-10 * scale, t), (qa, qb, 0.0), (qa, qb, 1.0)):
        unit_a, unit_b = (q / np.linalg.norm(q, axis=-1, keepdims=True) for q in (a, b))
        np.testing.assert_allclose(slerp(a, b, tt), _slerp(unit_a, unit_b, tt), rtol=0, atol=1e-12)
    m = quaternion_to_matrix(qa)
    e = np.eye(3)
    for k in range(3):  # the matrix's columns are the rotated axes
        np.testing.assert_allclose(m[:, :, k], _sandwich(ua, e[k]), rtol=0, atol=1e-12)
    rpy = rng.uniform(-10.0, 10.0, size=(200, 3))
    np.testing.assert_allclose(quaternion_from_rpy(*rpy.T), _rpy(*rpy.T), rtol=0, atol=1e-12)
    np.testing.assert_allclose(quaternion_from_rpy(0.0, 0.0, rpy[:, 2]), _rpy(0.0, 0.0, rpy[:, 2]), rtol=0,
                               atol=1e-12)
    assert quaternion_from_rpy(0.1, -2.0, 4.0).shape == (4,) and slerp(ua[0], ub[0], 0.5).shape == (4,)
    assert rotate_vectors(qa[0], v[0]).shape == (3,) and quaternion_to_matrix(qa[0]).shape == (3, 3)
