"""The simulated world, trajectories and magnetometer (gp_mapping.sim) against closed forms and their own rules."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gp_mapping.sim import (
    MU0,
    SensorConfig,
    SimulationError,
    TrajectoryConfig,
    World,
    WorldConfig,
    dipole_field,
    earth_field,
    make_trajectory,
    simulate,
    truth_grid,
)


def _rotate(q_xyzw: np.ndarray, v: np.ndarray) -> np.ndarray:
    """v' = q v q* written out from the quaternion product (independent of scipy's Rotation)."""
    x, y, z, w = q_xyzw.T
    u = np.stack([x, y, z], axis=1)
    t = 2.0 * np.cross(u, v)
    return v + w[:, None] * t + np.cross(u, t)


# ------------------------------------------------------------------------------------------- dipole field


@pytest.mark.parametrize("r", [0.3, 1.0, 2.5])
def test_dipole_on_axis_and_equatorial_closed_forms(r):
    m0 = 7.5  # A m^2 along +z
    pos, mom = np.zeros((1, 3)), np.array([[0.0, 0.0, m0]])
    on_axis = dipole_field(np.array([[0.0, 0.0, r], [0.0, 0.0, -r]]), pos, mom)
    expected = MU0 * m0 / (2 * math.pi * r**3)
    np.testing.assert_allclose(on_axis, [[0, 0, expected], [0, 0, expected]], rtol=1e-12, atol=1e-22)
    equator = dipole_field(np.array([[r, 0, 0], [0, r, 0], [-r / math.sqrt(2), r / math.sqrt(2), 0]]), pos, mom)
    expected_eq = -MU0 * m0 / (4 * math.pi * r**3)  # antiparallel to m
    np.testing.assert_allclose(equator, np.tile([0, 0, expected_eq], (3, 1)), rtol=1e-12, atol=1e-22)


def test_dipole_field_is_minus_mu0_gradient_of_scalar_potential():
    # Independent formula: B = -mu0 grad(phi), phi = m . r / (4 pi |r|^3), by central differences.
    rng = np.random.default_rng(3)
    pos = np.array([[0.2, -0.1, -0.7]])
    mom = np.array([[1.5, -2.0, 3.0]])
    pts = rng.uniform(-1.0, 1.0, size=(20, 3)) + np.array([0, 0, 0.5])

    def phi(p):
        r = p - pos[0]
        return (r @ mom[0]) / (4 * math.pi * np.linalg.norm(r, axis=1) ** 3)

    h = 1e-5
    grad = np.stack([(phi(pts + h * e) - phi(pts - h * e)) / (2 * h) for e in np.eye(3)], axis=1)
    np.testing.assert_allclose(dipole_field(pts, pos, mom), -MU0 * grad, rtol=1e-6, atol=1e-13)


def test_dipole_field_rotates_with_the_moment():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(3, 3))
    q, _ = np.linalg.qr(a)  # orthogonal
    pos, mom = np.array([[0.1, 0.2, -0.5]]), np.array([[0.3, 1.0, -2.0]])
    pts = rng.uniform(-2, 2, size=(10, 3)) + [0, 0, 1.0]
    b = dipole_field(pts, pos, mom)
    b_rot = dipole_field(pts @ q.T, pos @ q.T, mom @ q.T)
    np.testing.assert_allclose(b_rot, b @ q.T, rtol=1e-10, atol=1e-18)


def test_world_field_is_divergence_and_curl_free():
    world = World.from_config(WorldConfig(n_dipoles=8), np.random.default_rng(11))
    rng = np.random.default_rng(12)
    pts = np.column_stack([rng.uniform(-5, 5, 40), rng.uniform(-5, 5, 40), rng.uniform(0.0, 0.5, 40)])
    dist = np.linalg.norm(pts[:, None, :] - world.dipole_positions[None], axis=2).min(axis=1)
    assert dist.min() > 0.4  # buried at least 0.5 m below z = 0: far from the singularities
    h = 1e-4
    jac = np.stack([(world.field(pts + h * e) - world.field(pts - h * e)) / (2 * h) for e in np.eye(3)],
                   axis=2)  # jac[n, i, j] = dB_i / dx_j
    scale = np.linalg.norm(jac, axis=(1, 2))
    div = np.trace(jac, axis1=1, axis2=2)
    curl = np.stack([jac[:, 2, 1] - jac[:, 1, 2], jac[:, 0, 2] - jac[:, 2, 0], jac[:, 1, 0] - jac[:, 0, 1]], axis=1)
    # central differences with h = 1e-4 m at >= 0.4 m: truncation error ~ (h / r)^2 ~ 1e-7 of the gradient
    assert np.all(np.abs(div) <= 1e-6 * scale)
    assert np.all(np.linalg.norm(curl, axis=1) <= 1e-6 * scale)
    assert scale.min() > 1e-8  # the gradients are real (not a constant field passing trivially)


def test_field_at_a_dipole_is_refused():
    with pytest.raises(SimulationError, match="infinite"):
        dipole_field(np.array([[1.0, 2.0, 3.0]]), np.array([[1.0, 2.0, 3.0]]), np.array([[0.0, 0.0, 1.0]]))


def test_earth_field_enu_convention():
    np.testing.assert_allclose(earth_field(50e-6, 0.0, 0.0), [0, 50e-6, 0], atol=1e-20)  # horizontal, north
    np.testing.assert_allclose(earth_field(50e-6, 90.0, 0.0), [0, 0, -50e-6], atol=1e-20)  # straight down
    np.testing.assert_allclose(earth_field(50e-6, 0.0, 90.0), [50e-6, 0, 0], atol=1e-20)  # east
    b = earth_field(48e-6, 65.0, -8.0)
    assert np.linalg.norm(b) == pytest.approx(48e-6, rel=1e-12)
    assert math.degrees(math.asin(-b[2] / np.linalg.norm(b))) == pytest.approx(65.0)
    assert math.degrees(math.atan2(b[0], b[1])) == pytest.approx(-8.0)
    world = World(b)
    np.testing.assert_allclose(world.field(np.zeros((2, 3))), np.tile(b, (2, 1)))


def test_random_world_follows_its_config():
    cfg = WorldConfig(n_dipoles=50, area=(-2.0, -1.0, 3.0, 4.0), margin=0.5, plane_height=1.2,
                      depth_range=(0.3, 0.9), anomaly_range=(1e-6, 8e-6))
    world = World.from_config(cfg, np.random.default_rng(0))
    p = world.dipole_positions
    assert p.shape == (50, 3)
    assert np.all((p[:, 0] >= -2.5) & (p[:, 0] <= 3.5) & (p[:, 1] >= -1.5) & (p[:, 1] <= 4.5))
    depth = 1.2 - p[:, 2]
    assert np.all((depth >= 0.3) & (depth <= 0.9))
    anomaly = MU0 * np.linalg.norm(world.dipole_moments, axis=1) / (2 * math.pi * depth**3)
    assert np.all((anomaly >= 1e-6 * (1 - 1e-9)) & (anomaly <= 8e-6 * (1 + 1e-9)))
    # the on-axis anomaly formula holds for the field the world computes, directly above an aligned dipole
    single = World(np.zeros(3), p[:1], [[0, 0, np.linalg.norm(world.dipole_moments[0])]])
    above = single.field(np.array([[p[0, 0], p[0, 1], 1.2]]))
    assert above[0, 2] == pytest.approx(anomaly[0], rel=1e-12)


def test_truth_grid_matches_the_world():
    world = World.from_config(WorldConfig(n_dipoles=3), np.random.default_rng(5))
    xs, ys, grid = truth_grid(world, (-1.0, -2.0, 1.0, 1.0), 0.5, 0.25)
    np.testing.assert_allclose(xs, [-1.0, -0.5, 0.0, 0.5, 1.0])
    np.testing.assert_allclose(ys, [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0])
    assert grid.shape == (7, 5, 3)
    np.testing.assert_allclose(grid[2, 4], world.field(np.array([[1.0, -1.0, 0.25]]))[0], rtol=1e-14)


# -------------------------------------------------------------------------------------------- trajectory


@pytest.mark.parametrize("patterns", [("lawnmower",), ("loop",), ("random_walk",), ("lawnmower", "loop"),
                                      ("random_walk", "loop", "lawnmower")])
def test_trajectory_is_a_smooth_drive_inside_the_area(patterns):
    cfg = TrajectoryConfig(patterns=patterns, duration=120.0, rate=20.0, speed=0.8, roll_amplitude_deg=3.0,
                           pitch_amplitude_deg=2.0, height=0.7)
    t, pos, q = make_trajectory(cfg, np.random.default_rng(1))
    assert len(t) == 2400 and np.allclose(np.diff(t), 0.05)
    assert np.all(pos[:, 0] >= -5.0) and np.all(pos[:, 0] <= 5.0)
    assert np.all(pos[:, 1] >= -5.0) and np.all(pos[:, 1] <= 5.0)
    np.testing.assert_allclose(pos[:, 2], 0.7)
    step = np.linalg.norm(np.diff(pos[:, :2], axis=0), axis=1)
    np.testing.assert_allclose(step, 0.8 * 0.05, rtol=0.02)  # constant speed (chords of curves are shorter)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-12)
    assert np.all(np.einsum("ij,ij->i", q[1:], q[:-1]) > 0.99)  # no sign flips, no jumps
    # heading (body x in the map) along the direction of travel, level within the wobble
    forward = _rotate(q, np.tile([1.0, 0.0, 0.0], (len(q), 1)))
    travel = np.diff(pos[:, :2], axis=0)
    mid = (forward[1:, :2] + forward[:-1, :2]) / 2
    cos = np.einsum("ij,ij->i", mid, travel) / (np.linalg.norm(mid, axis=1) * np.linalg.norm(travel, axis=1))
    assert np.degrees(np.arccos(np.clip(cos, -1, 1))).max() < 3.0
    up = _rotate(q, np.tile([0.0, 0.0, 1.0], (len(q), 1)))
    tilt = np.degrees(np.arccos(np.clip(up[:, 2], -1, 1)))
    assert tilt.max() <= math.hypot(3.0, 2.0) + 1e-6 and tilt.max() > 1.0
    # turn rate bounded by speed / min_turn_radius
    yaw = np.unwrap(np.arctan2(forward[:, 1], forward[:, 0]))
    assert np.abs(np.diff(yaw)).max() / 0.05 <= 0.8 / cfg.min_turn_radius * 1.05


def test_lawnmower_covers_its_rows_and_loop_its_circle():
    cfg = TrajectoryConfig(patterns=("lawnmower",), duration=200.0, rate=10.0, speed=1.0, line_spacing=2.0)
    _, pos, _ = make_trajectory(cfg, np.random.default_rng(0))
    for y_row in (-4.5, -2.5, -0.5, 1.5, 3.5):  # rows from ymin + inset every line_spacing
        on_row = np.abs(pos[:, 1] - y_row) < 0.05
        assert np.ptp(pos[on_row, 0]) > 6.0
    cfg = TrajectoryConfig(patterns=("loop",), duration=60.0, rate=10.0, loop_radius=3.0, speed=1.0)
    _, pos, _ = make_trajectory(cfg, np.random.default_rng(0))
    r = np.linalg.norm(pos[:, :2], axis=1)
    np.testing.assert_allclose(r[20:], 3.0, atol=0.05)  # after settling onto the circle from its start


@pytest.mark.parametrize("kwargs, field", [
    ({"duration": -1.0}, "duration"), ({"duration": float("nan")}, "duration"), ({"rate": 0.0}, "rate"),
    ({"patterns": ("spiral",)}, "spiral"), ({"patterns": ()}, "patterns"), ({"speed": 0.0}, "speed"),
    ({"area": (0, 0, -1, 1)}, "area"), ({"inset": 6.0}, "inset"), ({"loops": 0}, "loops"),
])
def test_bad_trajectory_config_is_refused_by_name(kwargs, field):
    with pytest.raises(SimulationError, match=field):
        TrajectoryConfig(**kwargs)


@pytest.mark.parametrize("cls, kwargs, field", [
    (SensorConfig, {"noise_std": -1e-7}, "noise_std"), (SensorConfig, {"dropout_rate": 1.0}, "dropout_rate"),
    (SensorConfig, {"spike_rate": 1.5}, "spike_rate"), (SensorConfig, {"rotation": (0, 0, 0, 2)}, "rotation"),
    (SensorConfig, {"bias": (0, 0)}, "bias"), (WorldConfig, {"depth_range": (0.0, 1.0)}, "depth_range"),
    (WorldConfig, {"n_dipoles": -1}, "n_dipoles"), (WorldConfig, {"inclination_deg": 91.0}, "inclination"),
])
def test_bad_world_and_sensor_config_is_refused_by_name(cls, kwargs, field):
    with pytest.raises(SimulationError, match=field):
        cls(**kwargs)


# ------------------------------------------------------------------------------------------------ sensor

_TRAJ = TrajectoryConfig(duration=40.0, rate=50.0, roll_amplitude_deg=4.0, pitch_amplitude_deg=4.0,
                         height_amplitude=0.1)


def test_simulation_is_deterministic_by_seed():
    sensor = SensorConfig(spike_rate=0.01, dropout_rate=0.01)
    a = simulate(WorldConfig(), _TRAJ, sensor, seed=7)
    b = simulate(WorldConfig(), _TRAJ, sensor, seed=7)
    c = simulate(WorldConfig(), _TRAJ, sensor, seed=8)
    for name in ("position", "orientation_xyzw", "field_sensor_tesla", "is_spike", "dropped"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.world.dipole_positions, b.world.dipole_positions)
    assert not np.allclose(a.world.dipole_positions, c.world.dipole_positions)
    assert not np.allclose(a.field_sensor_tesla, c.field_sensor_tesla)
    # independent streams: more noise moves neither the dipoles nor the path
    d = simulate(WorldConfig(), _TRAJ, SensorConfig(noise_std=1e-6, spike_rate=0.01, dropout_rate=0.01), seed=7)
    np.testing.assert_array_equal(a.world.dipole_moments, d.world.dipole_moments)
    np.testing.assert_array_equal(a.position, d.position)


def test_readings_rotated_back_give_the_truth_plus_bias_and_noise():
    bias = np.array([0.5e-6, -0.3e-6, 1.0e-6])
    ext = (0.0, math.sin(math.radians(20) / 2), 0.0, math.cos(math.radians(20) / 2))  # 20 deg about y
    sensor = SensorConfig(noise_std=0.2e-6, bias=tuple(bias), translation=(0.3, -0.1, 0.4), rotation=ext)
    rec = simulate(WorldConfig(), _TRAJ, sensor, seed=3)
    # sensor pose from the body pose and the extrinsic
    np.testing.assert_allclose(rec.sensor_position,
                               rec.position + _rotate(rec.orientation_xyzw, np.tile([0.3, -0.1, 0.4], (len(rec), 1))),
                               atol=1e-12)
    np.testing.assert_allclose(rec.field_map_tesla_true, rec.world.field(rec.sensor_position), rtol=1e-14)
    # sensor-to-map rotation = body rotation after the extrinsic
    v = np.random.default_rng(0).normal(size=(len(rec), 3))
    np.testing.assert_allclose(_rotate(rec.sensor_orientation_xyzw, v),
                               _rotate(rec.orientation_xyzw, _rotate(np.tile(ext, (len(rec), 1)), v)), atol=1e-12)
    # reading - bias, rotated into the map: truth + white noise of the configured std, in every axis
    back = _rotate(rec.sensor_orientation_xyzw, rec.field_sensor_tesla - bias)
    resid = back - rec.field_map_tesla_true
    n = len(rec)
    assert np.all(np.abs(resid.mean(axis=0)) < 5 * 0.2e-6 / math.sqrt(n))
    np.testing.assert_allclose(resid.std(axis=0), 0.2e-6, rtol=0.05)
    # noise-free: exact
    exact = simulate(WorldConfig(), _TRAJ, SensorConfig(noise_std=0.0, translation=(0.3, -0.1, 0.4), rotation=ext),
                     seed=3)
    np.testing.assert_allclose(_rotate(exact.sensor_orientation_xyzw, exact.field_sensor_tesla),
                               exact.field_map_tesla_true, rtol=0, atol=1e-18)
    assert np.ptp(np.linalg.norm(rec.field_map_tesla_true, axis=1)) > 2e-6  # the path meets real anomalies


def test_spikes_and_dropouts_happen_at_their_rates():
    traj = TrajectoryConfig(patterns=("loop",), duration=600.0, rate=50.0)
    sensor = SensorConfig(noise_std=0.1e-6, spike_rate=0.02, dropout_rate=0.05, spike_magnitude_range=(30e-6, 60e-6))
    rec = simulate(World(earth_field(50e-6, 60, 0)), traj, sensor, seed=2)
    n = len(rec)
    assert n == 30000
    for mask, p in ((rec.is_spike, 0.02), (rec.dropped, 0.05)):
        assert abs(mask.sum() - n * p) < 5 * math.sqrt(n * p * (1 - p))
    assert rec.received.sum() == n - rec.dropped.sum()
    excess = np.linalg.norm(rec.field_sensor_tesla - rec.field_sensor_tesla_true, axis=1)
    assert np.all(excess[rec.is_spike] > 30e-6 - 1e-6) and np.all(excess[rec.is_spike] < 60e-6 + 1e-6)
    assert np.all(excess[~rec.is_spike] < 6 * 0.1e-6 * math.sqrt(3))
    clean = simulate(World(earth_field(50e-6, 60, 0)), traj, SensorConfig(), seed=2)
    assert not clean.is_spike.any() and not clean.dropped.any()


def test_bad_seed_is_refused():
    with pytest.raises(SimulationError, match="seed"):
        simulate(WorldConfig(), _TRAJ, SensorConfig(), seed=-1)
