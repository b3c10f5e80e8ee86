"""The ROS-free localizer (gp_mapping.localization): closed forms for the motion model, the lookup and the
resampling; a synthetic field the filter must track, find from a global start and learn an offset on; bad input
refused and counted. Real recordings: test_localization_solin.py; the command: test_localization_cli.py."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from gp_mapping.gp.errors import ConfigError
from gp_mapping.localization import (REJECTION_REASONS, LocalizationError, Localizer, LocalizerConfig, MagneticMap,
                                     MapLoadError, ParticleFilter, config_from_dict, load_localizer_config)
from gp_mapping.localization.filter import kld_particles
from gp_mapping.localization.motion import compose, increment_stds, inverse, odometry_increment, sample_motion
from gp_mapping.mapping.grid import GridSpec

UT = 1e-6  # readings go in as tesla


# ------------------------------------------------------------------------------------------------ a synthetic world

def _field(xy: np.ndarray) -> np.ndarray:
    """|B| [uT] of a room: 50 uT plus fifteen smooth anomalies of +-4..12 uT, 0.4..0.9 m wide (fixed)."""
    rng = np.random.default_rng(7)
    centres = rng.uniform(-4.5, 4.5, (15, 2))
    amp = rng.uniform(4.0, 12.0, 15) * rng.choice([-1.0, 1.0], 15)
    width = rng.uniform(0.4, 0.9, 15)
    d2 = ((xy[:, None, :] - centres[None]) ** 2).sum(-1)
    return 50.0 + (amp * np.exp(-0.5 * d2 / width ** 2)).sum(-1)


def _vector_field(xy: np.ndarray) -> np.ndarray:
    """A room-frame vector field [uT] (x, y, z) whose magnitude varies like _field's."""
    m = _field(xy)
    ang = 0.6 * np.sin(0.7 * xy[:, 0]) + 0.4 * np.cos(0.9 * xy[:, 1])
    return np.column_stack([0.4 * m * np.cos(ang), 0.4 * m * np.sin(ang), -0.8 * m])


def _map(target: str = "magnitude", reading_sd: float = 0.5, known=None) -> MagneticMap:
    spec = GridSpec(-5.0, -5.0, 0.1, 100, 100)
    centres = spec.cell_centres()
    mean = (_field(centres)[:, None] if target == "magnitude" else _vector_field(centres)).reshape(100, 100, -1)
    return MagneticMap.from_arrays(spec, mean, np.full(mean.shape, reading_sd ** 2), known, target=target)


def _drive(seconds: float = 60.0, rate: float = 20.0):
    """A smooth closed drive (a rounded figure) through the room: stamps, poses (x, y, heading along the path)."""
    t = np.arange(0.0, seconds, 1.0 / rate)
    w = 2 * math.pi / 30.0
    xy = np.column_stack([3.0 * np.sin(w * t) + 0.6 * np.sin(3 * w * t), 2.5 * np.sin(2 * w * t)])
    v = np.gradient(xy, t, axis=0)
    return t, np.column_stack([xy, np.arctan2(v[:, 1], v[:, 0])])


def _odometry(t, poses, seed: int, scale: float = 0.05, drift_deg_s: float = 1.0):
    """The true increments with a scale error, a heading drift and noise, integrated from the odom origin."""
    rng = np.random.default_rng(seed)
    inc = compose(inverse(poses[:-1]), poses[1:])
    step = np.hypot(inc[:, 0], inc[:, 1])
    inc[:, :2] *= 1.0 + scale
    inc[:, :2] += rng.standard_normal((len(inc), 2)) * 0.01 * step[:, None]
    inc[:, 2] += math.radians(drift_deg_s) * np.diff(t) + rng.standard_normal(len(inc)) * 0.002
    odom = np.zeros_like(poses)
    for i in range(1, len(poses)):
        odom[i] = compose(odom[i - 1], inc[i - 1])
    return odom


def _run(loc: Localizer, t, odom, readings_tesla):
    stamps, poses, est = [], [], []
    for i in range(len(t)):
        loc.add_odometry_2d(t[i], *odom[i])
        for e in loc.add_magnetic_field(t[i], readings_tesla[i]):
            stamps.append(e.stamp)
            poses.append(e.pose)
            est.append(e)
    return np.array(stamps), np.array(poses).reshape(-1, 3), est


def _errors(stamps, poses, t, truth):
    return np.hypot(poses[:, 0] - np.interp(stamps, t, truth[:, 0]), poses[:, 1] - np.interp(stamps, t, truth[:, 1]))


def _magnitude_readings(truth, seed: int = 0, offset: float = 0.0):
    rng = np.random.default_rng(100 + seed)
    b = _field(truth[:, :2]) + offset + rng.standard_normal(len(truth)) * 0.3
    return np.column_stack([b, np.zeros_like(b), np.zeros_like(b)]) * UT  # along x: |B| is what counts


# ------------------------------------------------------------------------------------------------ config

def test_config_defaults_validate_and_refuse_with_the_key():
    cfg = LocalizerConfig()
    assert cfg.num_particles == 1000 and 0.0 < cfg.ess_threshold <= 1.0
    for bad, key in (({"num_particles": 0}, "localizer.num_particles"), ({"inflation": -1.0}, "localizer.inflation"),
                     ({"off_map": "zero"}, "localizer.off_map"), ({"initial_std": [0.1, 0.1]}, "localizer.initial_std"),
                     ({"alpha1": float("nan")}, "localizer.alpha1"), ({"seed": 1.5}, "localizer.seed")):
        with pytest.raises(ConfigError) as err:
            config_from_dict(bad)
        assert err.value.key == key and key in str(err.value)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            LocalizerConfig(**bad)  # direct construction validates too
    with pytest.raises(ConfigError, match="unknown config key 'localizer.particles'"):
        config_from_dict({"particles": 10})
    with pytest.raises(ConfigError, match="max_update_rate"):
        LocalizerConfig(update_min_d=0.0, update_min_a=0.0, max_update_rate=0.0)
    with pytest.raises(ConfigError, match="bias_prior_mean"):
        LocalizerConfig(bias_prior_mean=[1.0, 2.0, 3.0]).bias_mean(1)
    assert LocalizerConfig(bias_prior_mean=[2.0]).bias_mean(3) == [2.0, 2.0, 2.0]


def test_config_files_in_every_form(tmp_path):
    section = tmp_path / "a.yaml"
    section.write_text("localizer:\n  num_particles: 300\n  inflation: 2.0\n")
    ros = tmp_path / "b.yaml"
    ros.write_text("/**:\n  ros__parameters:\n    localizer:\n      num_particles: 400\n    model:\n      engine: x\n")
    flat = tmp_path / "c.yaml"
    flat.write_text("num_particles: 500\n")
    assert load_localizer_config(section).num_particles == 300 and load_localizer_config(section).inflation == 2.0
    assert load_localizer_config(ros).num_particles == 400
    assert load_localizer_config(flat).num_particles == 500
    bad = tmp_path / "d.yaml"
    bad.write_text("localizer:\n  num_particles: -3\n")
    with pytest.raises(ConfigError, match="localizer.num_particles"):
        load_localizer_config(bad)
    broken = tmp_path / "e.yaml"
    broken.write_text("localizer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_localizer_config(broken)


# ------------------------------------------------------------------------------------------------ motion model

def test_se2_and_the_odometry_increment_in_closed_form():
    a, b = np.array([1.0, 2.0, 0.3]), np.array([-0.5, 0.7, -2.0])
    np.testing.assert_allclose(compose(a, inverse(a)), [0.0, 0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(compose(inverse(a), compose(a, b)), b, atol=1e-12)
    assert odometry_increment([0, 0, 0], [1, 0, 0]) == pytest.approx((0.0, 1.0, 0.0))
    rot1, trans, rot2 = odometry_increment([1.0, 1.0, 0.0], [1.0, 2.0, math.pi / 2])
    assert (rot1, trans, rot2) == pytest.approx((math.pi / 2, 1.0, 0.0))
    rot1, trans, rot2 = odometry_increment([0.0, 0.0, 0.0], [-1.0, 0.0, 0.0])  # backwards: the noise uses 0 / pi
    assert abs(rot1) == pytest.approx(math.pi) and trans == pytest.approx(1.0)
    assert increment_stds(rot1, trans, rot2, (1.0, 0.0, 0.0, 0.0))[0] == pytest.approx(0.0, abs=1e-12)


def test_motion_noise_has_the_amcl_variances():
    rng = np.random.default_rng(0)
    n = 200_000
    # alpha3 alone: the translation of a 1 m straight move has std sqrt(alpha3) * 1 m, nothing else moves
    p = np.zeros((n, 3))
    sample_motion(p, [0, 0, 0], [1, 0, 0], (0.0, 0.0, 0.04, 0.0), rng)
    assert p[:, 0].mean() == pytest.approx(1.0, abs=2e-3) and p[:, 0].std() == pytest.approx(0.2, rel=0.01)
    assert np.abs(p[:, 1:]).max() < 1e-12
    # alpha2 alone: both rotations get std sqrt(alpha2) * trans; the heading sums them
    p = np.zeros((n, 3))
    sample_motion(p, [0, 0, 0], [1, 0, 0], (0.0, 0.01, 0.0, 0.0), rng)
    assert p[:, 2].std() == pytest.approx(math.sqrt(2) * 0.1, rel=0.01)
    assert p[:, 1].std() == pytest.approx(np.std(np.sin(0.1 * rng.standard_normal(n))), rel=0.02)
    # alpha1 alone, a turn on the spot: the second rotation's std is sqrt(alpha1) * |turn|
    p = np.zeros((n, 3))
    sample_motion(p, [0, 0, 0], [0, 0, math.pi / 2], (0.04, 0.0, 0.0, 0.0), rng)
    assert p[:, 2].mean() == pytest.approx(math.pi / 2, abs=2e-3)
    assert p[:, 2].std() == pytest.approx(0.2 * math.pi / 2, rel=0.01) and np.abs(p[:, :2]).max() < 1e-12
    # no noise: every particle moves by the increment in its own frame
    p = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, math.pi / 2]])
    sample_motion(p, [2.0, 2.0, 1.0], compose([2.0, 2.0, 1.0], [0.5, 0.2, 0.3]), (0, 0, 0, 0), rng)
    np.testing.assert_allclose(p, compose(np.array([[0.0, 0.0, 0.0], [1.0, -1.0, math.pi / 2]]), [0.5, 0.2, 0.3]),
                               atol=1e-12)


# ------------------------------------------------------------------------------------------------ lookup, resampling

def test_bilinear_lookup_is_exact_on_a_plane_and_knows_where_the_map_ends():
    spec = GridSpec(0.0, 0.0, 0.5, 8, 6)
    c = spec.cell_centres()
    plane = (3.0 + 2.0 * c[:, 0] - 1.5 * c[:, 1]).reshape(6, 8, 1)
    known = np.ones((6, 8), dtype=bool)
    known[:, 6:] = False  # the last two columns are unknown
    fmap = MagneticMap.from_arrays(spec, plane, np.full(plane.shape, 0.04), known)
    rng = np.random.default_rng(1)
    pts = np.column_stack([rng.uniform(0.25, 2.75, 500), rng.uniform(0.25, 2.75, 500)])  # among known centres
    mean, var, on = fmap.lookup(pts)
    np.testing.assert_allclose(mean[:, 0], 3.0 + 2.0 * pts[:, 0] - 1.5 * pts[:, 1], atol=1e-9)
    np.testing.assert_allclose(var, 0.04) and on.all()
    # with the position term: the plane's squared gradient, 2^2 + 1.5^2, times the position variance
    _, var_p, _ = fmap.lookup(pts, position_var=0.01)
    np.testing.assert_allclose(var_p[:, 0], 0.04 + 0.01 * (4.0 + 2.25), rtol=1e-9)
    # unknown cells and points off the grid read the map's marginal distribution, flagged off the map
    off = np.array([[3.4, 1.0], [10.0, 1.0], [-3.0, -3.0], [1.0, 99.0]])
    mean, var, on = fmap.lookup(off)
    assert not on.any()
    np.testing.assert_allclose(mean[:, 0], fmap.prior_mean[0]) and np.testing.assert_allclose(var[:, 0],
                                                                                               fmap.prior_var[0])
    assert fmap.prior_var[0] > np.var(plane[known]) * 0.99  # the spread of the map plus a reading's
    with pytest.raises(LocalizationError, match="no known cell"):
        MagneticMap.from_arrays(spec, plane, np.full(plane.shape, 0.04), np.zeros((6, 8), dtype=bool))
    with pytest.raises(LocalizationError, match="1 output"):
        MagneticMap.from_arrays(spec, np.zeros((6, 8, 3)), np.ones((6, 8, 3)))


def test_systematic_resampling_keeps_each_particle_floor_or_ceil_of_n_w_times():
    fmap = _map()
    pf = ParticleFilter(fmap, LocalizerConfig(num_particles=1000, seed=3, kld_err=0.0))  # a fixed count
    pf.initialise_gaussian([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    rng = np.random.default_rng(4)
    w = rng.exponential(size=1000) ** 3
    pf.weights = w / w.sum()
    pf.bias_mean[:, 0] = np.arange(1000)  # tags: where each particle came from
    before = pf.poses.copy()
    expected = 1000 * pf.weights
    pf.resample()
    counts = np.bincount(pf.bias_mean[:, 0].astype(int), minlength=1000)
    assert np.all(counts >= np.floor(expected) - 1e-9) and np.all(counts <= np.ceil(expected) + 1e-9)
    np.testing.assert_array_equal(pf.poses, before[pf.bias_mean[:, 0].astype(int)])  # states travel together
    np.testing.assert_allclose(pf.weights, 1e-3) and pytest.approx(pf.weights.sum()) == 1.0


def test_kld_sampling_sizes_the_cloud_by_how_many_bins_it_fills():
    # Fox (2003): n = (k - 1) / (2 eps) * (1 - 2 / (9 (k - 1)) + sqrt(2 / (9 (k - 1))) z)^3
    k, eps, z = 101, 0.05, 2.3263478740408408
    a = 2.0 / (9.0 * (k - 1))
    assert kld_particles(k, eps) == math.ceil((k - 1) / (2 * eps) * (1 - a + math.sqrt(a) * z) ** 3)
    assert kld_particles(1, eps) == 1 and kld_particles(400, eps) > kld_particles(40, eps) > kld_particles(4, eps)
    fmap = _map()
    cfg = LocalizerConfig(num_particles=200, max_particles=5000, kld_err=0.05, seed=0)
    pf = ParticleFilter(fmap, cfg)
    pf.initialise_global()  # spread over the room: the most particles
    assert pf.num_particles == 5000 and pf.target_count() == 5000
    pf.resample()
    assert pf.num_particles == 5000
    pf.initialise_gaussian([1.0, 1.0, 0.3], [0.05, 0.05, 0.02])  # one bin or two: the fewest
    assert pf.num_particles == 200
    pf.resample()
    assert pf.num_particles == 200 and pf.bias_mean.shape == (200, 1) and pf.weights.shape == (200,)
    pf.initialise_gaussian([0.0, 0.0, 0.0], [1.5, 1.5, 3.0])  # in between: the bound for the bins it fills
    pf.weights = np.full(200, 1 / 200)
    n = pf.target_count()
    assert 200 < n < 5000


# ------------------------------------------------------------------------------------------------ the filter

def test_filter_tracks_a_synthetic_field_through_drifting_odometry():
    fmap = _map()
    t, truth = _drive()
    rmses = []
    for seed in range(3):
        odom = _odometry(t, truth, seed)
        dr = compose(compose(truth[0], inverse(odom[0])), odom)
        dr_err = np.hypot(*(dr[:, :2] - truth[:, :2]).T)
        loc = Localizer(fmap, LocalizerConfig(num_particles=500, seed=seed))
        loc.initialise(truth[0])
        stamps, poses, est = _run(loc, t, odom, _magnitude_readings(truth, seed))
        err = _errors(stamps, poses, t, truth)
        assert dr_err.max() > 1.0  # the odometry alone drifts away ...
        assert err.max() < 0.8 and np.sqrt(np.mean(err ** 2)) < 0.25  # ... the filter stays on the track
        assert len(stamps) > 100 and loc.diagnostics()["rejected_total"] == 0
        # the reported spread is honest: most errors within 3 SD of the position estimate
        sd = np.array([e.std[:2].max() for e in est])
        assert np.mean(err < 3 * np.maximum(sd, 0.02)) > 0.7
        rmses.append(np.sqrt(np.mean(err ** 2)))
    assert np.mean(rmses) < 0.2


def test_global_localization_finds_the_robot_on_a_synthetic_field():
    fmap = _map()
    t, truth = _drive(seconds=60.0)
    found = 0
    for seed in range(3):
        loc = Localizer(fmap, LocalizerConfig(num_particles=500, max_particles=5000, seed=seed, bias_prior_std=0.0))
        loc.initialise_global()
        assert loc.filter.num_particles == 5000
        stamps, poses, est = _run(loc, t, _odometry(t, truth, seed), _magnitude_readings(truth, seed))
        err = _errors(stamps, poses, t, truth)
        late = stamps > t[0] + 40.0
        found += bool(err[late].max() < 0.5)
        assert loc.filter.num_particles < 5000  # KLD-sampling: fewer once it has found the robot
    assert found >= 2


def test_the_bias_state_learns_a_constant_offset_and_without_it_the_filter_suffers():
    fmap = _map()
    t, truth = _drive()
    odom = _odometry(t, truth, 1)
    readings = _magnitude_readings(truth, 1, offset=5.0)
    with_bias = Localizer(fmap, LocalizerConfig(num_particles=500, seed=1, bias_prior_std=5.0))
    with_bias.initialise(truth[0])
    stamps, poses, est = _run(with_bias, t, odom, readings)
    err_on = _errors(stamps, poses, t, truth)
    assert est[-1].bias[0] == pytest.approx(5.0, abs=0.5) and est[-1].bias_std[0] < 0.5
    assert np.sqrt(np.mean(err_on ** 2)) < 0.25
    assert with_bias.diagnostics()["bias"][0] == pytest.approx(est[-1].bias[0])
    without = Localizer(fmap, LocalizerConfig(num_particles=500, seed=1, bias_prior_std=0.0))
    without.initialise(truth[0])
    stamps, poses, _ = _run(without, t, odom, readings)
    err_off = _errors(stamps, poses, t, truth)
    assert np.sqrt(np.mean(err_off ** 2)) > 1.5 * np.sqrt(np.mean(err_on ** 2))
    assert without.diagnostics()["nis_mean"] > 3.0 * with_bias.diagnostics()["nis_mean"]  # it sees the misfit


def test_a_vector_map_makes_the_heading_observable():
    fmap = _map("vector", reading_sd=0.5)
    t, truth = _drive(seconds=30.0)
    rng = np.random.default_rng(2)
    room = _vector_field(truth[:, :2]) + rng.standard_normal((len(t), 3)) * 0.3
    c, s = np.cos(truth[:, 2]), np.sin(truth[:, 2])
    body = np.column_stack([c * room[:, 0] + s * room[:, 1], -s * room[:, 0] + c * room[:, 1], room[:, 2]]) * UT
    odom = _odometry(t, truth, 2)
    # the start is known in position only: the heading is off by 60 degrees with a wide spread
    loc = Localizer(fmap, LocalizerConfig(num_particles=1000, seed=2, bias_prior_std=0.0))
    loc.initialise(truth[0] + [0.0, 0.0, math.radians(60.0)], std=[0.05, 0.05, 1.5])
    stamps, poses, est = _run(loc, t, odom, body)
    yaw_err = np.abs(np.angle(np.exp(1j * (poses[:, 2] - np.interp(stamps, t, np.unwrap(truth[:, 2]))))))
    late = stamps > t[0] + 10.0
    assert np.degrees(yaw_err[late]).max() < 10.0
    assert _errors(stamps, poses, t, truth)[late].max() < 0.3


def test_off_map_particles_get_the_prior_likelihood_and_the_filter_carries_on():
    known = np.zeros((100, 100), dtype=bool)
    known[:, :60] = True  # the map ends at x = 1 m; the drive goes to x = 3.6 m
    t, truth = _drive()
    odom = _odometry(t, truth, 0, scale=0.0, drift_deg_s=0.0)
    for mode in ("prior", "uniform"):
        fmap = _map(known=known)
        loc = Localizer(fmap, LocalizerConfig(num_particles=300, seed=0, off_map=mode))
        loc.initialise(truth[0])
        weights = []
        for i in range(len(t)):
            loc.add_odometry_2d(t[i], *odom[i])
            if loc.add_magnetic_field(t[i], _magnitude_readings(truth[i:i + 1])[0]):
                weights.append(loc.diagnostics()["off_map_weight"])
        weights = np.array(weights)
        assert weights.max() > 0.99 and weights.min() < 0.01  # wholly off the map, and back on it
        assert np.isfinite(loc.last_estimate.pose).all() and loc.last_estimate.ess > 1.0
        if mode == "prior":  # off the map it dead-reckons, back on the map it locks on again
            assert np.hypot(*(loc.last_estimate.pose[:2] - truth[-1, :2])) < 0.3


# ------------------------------------------------------------------------------------------------ streams, bad input

def test_readings_get_the_odometry_interpolated_at_their_stamp_and_updates_are_gated():
    fmap = _map()
    loc = Localizer(fmap, LocalizerConfig(num_particles=50, update_min_d=0.1, update_min_a=0.5,
                                          max_update_rate=50.0))
    loc.initialise([0.0, 0.0, 0.0])
    loc.add_odometry_2d(0.0, 0.0, 0.0, 0.0)
    loc.add_odometry_2d(0.4, 0.4, 0.2, 0.4)
    pose, _ = loc.odometry_at(0.1)
    np.testing.assert_allclose(pose, [0.1, 0.05, 0.1], atol=1e-12)
    assert loc.odometry_at(0.5) is None and loc.odometry_at(-0.1) is None
    loc.add_odometry_2d(1.5, 0.4, 0.2, 0.4)  # a gap longer than max_odometry_gap: nothing in it is placed
    assert loc.odometry_at(1.0) is None
    loc2 = Localizer(fmap, LocalizerConfig(num_particles=50, update_min_d=0.1, update_min_a=0.5, max_update_rate=50.0))
    loc2.initialise([0.0, 0.0, 0.0])
    # 200 Hz readings while driving at 1 m/s: an update every 0.1 m, so about 10 a second of 200
    updates = 0
    for k in range(401):
        tk = k / 200.0
        loc2.add_odometry_2d(tk, tk, 0.0, 0.0)
        updates += len(loc2.add_magnetic_field(tk, [50 * UT, 0.0, 0.0]))
    assert 18 <= updates <= 22 and loc2.skipped == 401 - updates
    # standing still: no update at all after the first (the same reading again says nothing new)
    before = loc2.updates
    for k in range(401, 801):
        loc2.add_odometry_2d(k / 200.0, 2.0, 0.0, 0.0)
        loc2.add_magnetic_field(k / 200.0, [50 * UT, 0.0, 0.0])
    assert loc2.updates == before


def test_bad_input_is_refused_and_counted_never_raised():
    fmap = _map()
    t, truth = _drive(seconds=20.0)
    odom = _odometry(t, truth, 0, scale=0.0, drift_deg_s=0.0)
    readings = _magnitude_readings(truth)
    loc = Localizer(fmap, LocalizerConfig(num_particles=300, seed=0))
    assert loc.add_magnetic_field(-0.5, readings[0]) == []  # no odometry and no start yet: waits, then refused
    loc.initialise(truth[0])
    jump_at = len(t) // 2
    for i in range(len(t)):
        o = odom[i] + (np.array([10.0, -5.0, 0.0]) if i >= jump_at else 0.0)  # odometry teleports mid-way
        loc.add_odometry_2d(t[i], *o)
        if i % 7 == 3:
            loc.add_magnetic_field(t[i] - 1e-3, [math.nan, 0.0, 0.0])
        if i % 11 == 5:
            loc.add_odometry(t[i] + 1e-3, [math.inf, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0])
        loc.add_magnetic_field(t[i], readings[i])
        if i % 13 == 6:
            loc.add_magnetic_field(t[i] - 1.0, readings[i])  # a stamp that goes back
            loc.add_magnetic_field(t[i] + 5e-4, [0.0, 0.0, 0.0])
    loc.add_odometry(t[-1] - 5.0, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0])  # odometry going back in time
    loc.add_odometry(t[-1] + 1.0, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])  # a zero quaternion
    d = loc.diagnostics()
    r = d["rejected"]
    assert set(r) == set(REJECTION_REASONS)
    assert r["reading_nonfinite"] == len(range(3, len(t), 7)) and r["odometry_jump"] == 1 == d["odometry_jumps"]
    assert r["reading_zero"] == len(range(6, len(t), 13)) and r["reading_stamp"] == len(range(6, len(t), 13))
    assert r["odometry_nonfinite"] == len(range(5, len(t), 11)) + 1 and r["odometry_stamp"] >= 1
    # the jump was bridged: the estimate never left the track
    err = np.hypot(*(loc.last_estimate.pose[:2] - truth[-1, :2]))
    assert err < 0.5
    assert d["updates"] > 50 and d["readings"] == len(t) + len(range(3, len(t), 7)) + 2 * len(range(6, len(t), 13)) + 1
    # the reading before the start, with no odometry before it, could never be placed
    assert r["reading_no_odometry"] + r["reading_before_init"] >= 1


def test_programming_errors_raise_with_what_is_wrong():
    fmap = _map()
    pf = ParticleFilter(fmap, LocalizerConfig(num_particles=20))
    with pytest.raises(LocalizationError, match="no initial pose"):
        pf.correct([50.0])
    with pytest.raises(LocalizationError, match="three finite numbers"):
        pf.initialise_gaussian([0.0, math.nan, 0.0])
    pf.initialise_gaussian([0.0, 0.0, 0.0])
    with pytest.raises(LocalizationError, match="1 finite number"):
        pf.correct([50.0, 1.0, 2.0])
    with pytest.raises(LocalizationError, match="sensor_translation"):
        Localizer(fmap, sensor_translation=[0.0])
    with pytest.raises(LocalizationError, match="sensor_rotation"):
        Localizer(fmap, sensor_rotation=[0.0, 0.0, 0.0, 0.0])


def test_the_estimate_gives_the_map_to_odom_transform():
    fmap = _map()
    loc = Localizer(fmap, LocalizerConfig(num_particles=200, initial_std=[0.0, 0.0, 0.0], alpha1=0.0, alpha2=0.0,
                                          alpha3=0.0, alpha4=0.0))
    start = np.array([1.0, -2.0, 0.7])
    loc.initialise(start)
    loc.add_odometry_2d(0.0, 5.0, 5.0, -1.0)
    loc.add_odometry_2d(1.0, 5.5, 5.0, -1.0)
    loc.add_magnetic_field(0.0, [50 * UT, 0.0, 0.0])
    loc.add_magnetic_field(1.0, [50 * UT, 0.0, 0.0])
    est = loc.last_estimate
    np.testing.assert_allclose(compose(loc.map_to_odom(), est.odom_pose), est.pose, atol=1e-9)
    # with no noise the particles moved exactly by the odometry's increment, seen from the start
    np.testing.assert_allclose(est.pose, compose(start, compose(inverse([5.0, 5.0, -1.0]), [5.5, 5.0, -1.0])),
                               atol=1e-9)


# ------------------------------------------------------------------------------------------------ maps from state files

@pytest.fixture(scope="module")
def saved_map(tmp_path_factory):
    """A small real map state: a Mapper (dual_svgp, small M) fed 40 s of a drive over the synthetic field."""
    from gp_mapping.config import config_from_dict as mapper_config
    from gp_mapping.mapping.mapper import Mapper

    cfg = mapper_config({"model": {"num_inducing": 48, "hyper_steps": 5, "tile_size": 0.0, "device": "cpu"},
                         "grid": {"resolution": 0.2}})
    mapper = Mapper(cfg)
    t, truth = _drive(seconds=40.0, rate=10.0)
    b = _field(truth[:, :2])
    for i in range(len(t)):
        mapper.add_pose(float(t[i]), (truth[i, 0], truth[i, 1], 0.0), (0.0, 0.0, 0.0, 1.0))
        mapper.add_magnetic_field(float(t[i]), [b[i] * UT, 0.0, 0.0])
        mapper.process()
    mapper.flush()
    path = tmp_path_factory.mktemp("map") / "map.safetensors"
    mapper.save(path)
    return path, mapper


def test_a_saved_map_loads_as_a_lookup_of_the_reading_distribution(saved_map):
    import torch

    from gp_mapping.localization.field_map import reading_moments

    path, mapper = saved_map
    fmap = MagneticMap.load(path)
    assert fmap.frame_id == "map" and fmap.target == "magnitude" and fmap.field_unit == "microtesla"
    assert fmap.spec.resolution == 0.2 and fmap.known.sum() > 100
    pts = fmap.spec.cell_centres()[fmap.known.ravel()][::7]
    mean, var, on = fmap.lookup(pts)
    m, v = (a.numpy() for a in reading_moments(mapper.model, torch.as_tensor(pts)))
    np.testing.assert_allclose(mean, m, atol=1e-6) and np.testing.assert_allclose(var, v, rtol=1e-6)
    assert on.all()
    # with the noise floor's part at full width (what the filter weighs with): the same reading grid, c taken as 1
    full = reading_moments(mapper.model, torch.as_tensor(pts), full_floor=True)[1].numpy()
    np.testing.assert_allclose(fmap.lookup_parts(pts, full_floor=True)[1], full, rtol=1e-6)
    assert np.all(full >= v - 1e-12)
    _, latent = mapper.model.predict(torch.as_tensor(pts))
    assert np.all(var > latent.numpy())  # a reading's variance: the latent's plus the noise
    finer = MagneticMap.load(path, resolution=0.1)
    assert finer.spec.resolution == 0.1 and finer.known.sum() > 3 * fmap.known.sum()


def test_map_files_that_cannot_serve_are_refused_with_the_reason(saved_map, tmp_path):
    path, _ = saved_map
    with pytest.raises(MapLoadError, match="does not exist"):
        MagneticMap.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a map at all" * 10)
    with pytest.raises(MapLoadError, match="cannot load the map"):
        MagneticMap.load(junk)
    with pytest.raises(MapLoadError, match="in frame 'map', not 'odom'"):
        MagneticMap.load(path, frame_id="odom")
    assert MagneticMap.load(path, frame_id="map").frame_id == "map"


def test_reading_moments_falls_back_to_the_gaussian_density_without_predict_reading(saved_map):
    """An engine that lacks predict_reading gets the same numbers from its log predictive density."""
    import torch

    from gp_mapping.localization.field_map import reading_moments

    _, mapper = saved_map
    model = mapper.model

    class Bare:  # only the older contract: predict and log_predictive_density
        def predict(self, x):
            return model.predict(x)

        def log_predictive_density(self, x, y):
            return model.log_predictive_density(x, y)

    x = torch.as_tensor(np.array([[0.0, 0.0], [1.0, -1.0], [2.5, 2.0]]))
    m1, v1 = reading_moments(model, x)
    m2, v2 = reading_moments(Bare(), x)
    np.testing.assert_allclose(m1.numpy(), m2.numpy(), rtol=1e-12)
    if getattr(model, "calibrates", False):  # a calibrated reading variance is another number by design
        assert np.all(v2.numpy() > 0)
    else:
        np.testing.assert_allclose(v1.numpy(), v2.numpy(), rtol=1e-8)


def test_the_default_config_keeps_an_update_of_1000_particles_cheap():
    """Not a timed assertion (bench/ measures it): the update does a bounded number of array passes; here
    only that 1000-particle updates run and keep the ESS and the weights sane."""
    fmap = _map()
    t, truth = _drive(seconds=10.0)
    loc = Localizer(fmap, dataclasses.replace(LocalizerConfig(), num_particles=1000))
    loc.initialise(truth[0])
    stamps, poses, est = _run(loc, t, _odometry(t, truth, 0), _magnitude_readings(truth))
    assert len(est) > 20 and all(1.0 <= e.ess <= 1000.0 + 1e-6 for e in est)
    assert np.isclose(loc.filter.weights.sum(), 1.0)


def test_a_tilted_vector_reading_is_levelled_by_the_odometry_orientation():
    from gp_mapping.mapping.frames import quaternion_from_rpy, rotate_vectors, quaternion_inverse

    fmap = _map("vector")
    q = quaternion_from_rpy(0.3, -0.2, 1.0)
    room = np.array([12.0, -7.0, -40.0])  # uT, map frame
    body = rotate_vectors(quaternion_inverse(q), room)  # what a tilted sensor reads
    level = Localizer(fmap, LocalizerConfig(orientation="orientation"))
    levelled = level._reading_in_map_units(body * UT, q)
    # the heading is the filter's (per particle): what is left is the map-frame vector turned back by yaw 1.0
    np.testing.assert_allclose(levelled, rotate_vectors(quaternion_from_rpy(0.0, 0.0, -1.0), room), atol=1e-9)
    flat = Localizer(fmap, LocalizerConfig(orientation="level"))
    np.testing.assert_allclose(flat._reading_in_map_units(body * UT, q), body, atol=1e-9)  # taken as level
    # a sensor mounted upside down on the body: its extrinsic turns the reading first
    flip = quaternion_from_rpy(math.pi, 0.0, 0.0)
    mounted = Localizer(fmap, LocalizerConfig(orientation="level"), sensor_rotation=flip)
    np.testing.assert_allclose(mounted._reading_in_map_units(rotate_vectors(quaternion_inverse(flip), room) * UT, q),
                               room, atol=1e-9)
    magnitude = Localizer(_map(), LocalizerConfig())
    assert magnitude._reading_in_map_units(body * UT, q)[0] == pytest.approx(np.linalg.norm(room))


def test_correlation_length_is_the_e_folding_lag_of_the_maps_autocorrelation():
    from gp_mapping.localization.field_map import correlation_length

    spec = GridSpec(0.0, 0.0, 0.05, 400, 400)
    xy = spec.cell_centres()
    wavelength = 4.0  # cos(2 pi d / lambda) falls to 1/e at d = lambda acos(1/e) / (2 pi); along y it is constant
    mean = np.cos(2 * math.pi * xy[:, 0] / wavelength).reshape(spec.shape + (1,))
    known = np.ones(spec.shape, dtype=bool)
    # pooled over x (cos) and y (1 at every lag): the pooled correlation (cos + 1) / 2 reaches 1/e at
    expected = wavelength * math.acos(2 * math.exp(-1.0) - 1.0) / (2 * math.pi)
    assert correlation_length(mean, known, spec.resolution) == pytest.approx(expected, rel=0.03)
    fmap = MagneticMap.from_arrays(spec, mean, np.ones(spec.shape + (1,)))
    assert fmap.correlation_length == pytest.approx(expected, rel=0.03)


def _two_groups(fmap: MagneticMap, readings: int, **config) -> ParticleFilter:
    """Ten particles without an offset, resampling or outliers: five at x = 1 m and five at x = 3 m (y = 1 m),
    weighed by ``readings`` readings of 50 uT taken there without moving."""
    cfg = LocalizerConfig(num_particles=10, kld_err=0.0, ess_threshold=0.0, outlier_probability=0.0,
                          bias_prior_std=0.0, **config)
    pf = ParticleFilter(fmap, cfg)
    pf.initialise_gaussian((1.0, 1.0, 0.0), (0.0, 0.0, 0.0))
    pf.poses[5:, 0] = 3.0
    for _ in range(readings):
        pf.correct([50.0])
    return pf


def test_the_maps_error_is_shared_by_readings_at_one_place_not_counted_again_and_again():
    """Two groups of particles where the map says 50 and 53 uT, the reading 50 again and again without moving. With
    the map's error a state, the second group pays for a 3 uT misfit once (it may be the map's error there), not at
    every reading; taken as independent, its weight falls by a constant factor per reading."""
    spec = GridSpec(0.0, 0.0, 0.1, 40, 20)
    xy = spec.cell_centres()
    mean = np.where(xy[:, 0] < 2.0, 50.0, 53.0).reshape(spec.shape + (1,))
    var = np.full(spec.shape + (1,), 10.0)
    fmap = MagneticMap.from_arrays(spec, mean, var, error_var=np.full(spec.shape + (1,), 9.0))
    assert float(fmap.error_var.max()) == 9.0
    ratios = {}
    for correlated in (True, False):
        pf = _two_groups(fmap, 50, correlated_map_error=correlated)
        ratios[correlated] = pf.weights[5:].sum() / pf.weights[:5].sum()
        if correlated:  # the second group's error state has learned the map's 3 uT there, to the noise's precision
            assert np.allclose(pf.err_mean[5:], -3.0, atol=0.1) and np.all(pf.err_var[5:] < 0.05)
            assert np.allclose(pf.err_mean[:5], 0.0)
    assert ratios[True] > 0.3            # about exp(-9 / 20): one misfit against the map's whole variance
    assert ratios[False] < 1e-8          # exp(-50 * 9 / 20)


def test_a_multi_session_maps_offset_spread_goes_into_the_offset_prior_not_each_readings_map_error():
    """A map of several sessions adds the spread of their offsets to every reading's variance (a reading of a
    session it has not seen). That spread is one constant for the whole new session: with the offset state the
    filter takes it into the offset's prior and out of the readings' map error, which would otherwise count it
    again every correlation length travelled and flatten the likelihood. Without the state it stays."""
    spread = 9.0  # sessions at +-3 uT about the map's level
    base = _map(reading_sd=0.5)
    known = np.ones(base.spec.shape, dtype=bool)
    var = base.var + spread
    error = np.full(base.var.shape, spread)  # the map's own error is negligible here: all of it is the spread
    stated = MagneticMap.from_arrays(base.spec, base.mean, var, known, error_var=error, offset_var=[spread])
    as_error = MagneticMap.from_arrays(base.spec, base.mean, var, known, error_var=error)  # the spread unmarked
    assert stated.offset_var.tolist() == [spread] and as_error.offset_var.tolist() == [0.0]

    cfg = LocalizerConfig(num_particles=500, seed=1, bias_prior_std=1.0)
    pf = ParticleFilter(stated, cfg)
    assert pf.bias_var.shape == (500, 1) and np.allclose(pf.bias_var, 1.0 + spread)  # the prior holds it
    assert np.allclose(ParticleFilter(stated, dataclasses.replace(cfg, bias_prior_std=0.0)).bias_var, 0.0)

    t, truth = _drive()
    for seed in (0, 2):  # 4 seeds x spreads 4 / 9 / 25 uT^2 (a script, 2026-11-30): stated better on every one
        odom = _odometry(t, truth, seed)
        readings = _magnitude_readings(truth, seed, offset=3.0)  # the new session reads 3 uT above the map's level
        rmse, nis = {}, {}
        for name, fmap in (("stated", stated), ("as map error", as_error)):
            loc = Localizer(fmap, dataclasses.replace(cfg, seed=seed))
            loc.initialise(truth[0])
            stamps, poses, est = _run(loc, t, odom, readings)
            rmse[name] = float(np.sqrt(np.mean(_errors(stamps, poses, t, truth) ** 2)))
            nis[name] = loc.diagnostics()["nis_mean"]
            if name == "stated":
                assert est[-1].bias[0] == pytest.approx(3.0, abs=0.5)
        assert rmse["stated"] < 0.22 and rmse["as map error"] > 1.2 * rmse["stated"], rmse
        assert nis["as map error"] < 0.9 * nis["stated"], nis  # counted twice, the variance is overstated

    bad = dict(error_var=error)
    for offset_var, why in (([spread, 1.0], "one per output"), ([-1.0], ">= 0"), ([np.nan], "finite")):
        with pytest.raises(LocalizationError, match="offset variance"):
            MagneticMap.from_arrays(base.spec, base.mean, var, known, offset_var=offset_var, **bad)


def test_a_map_of_two_sessions_states_their_spread_as_the_offset_variance():
    """MagneticMap.from_mapper reads the spread of the sessions' offsets from the engine: 0 with one session,
    about (d/2)^2 for two sessions d apart; the grid's reading variance holds it."""
    import torch

    from gp_mapping.config import config_from_dict as mapper_config
    from gp_mapping.mapping.mapper import Mapper

    cfg = mapper_config({"model": {"num_inducing": 48, "hyper_steps": 5, "tile_size": 0.0, "device": "cpu"},
                         "grid": {"resolution": 0.2}})
    mapper = Mapper(cfg)
    t, truth = _drive(seconds=30.0, rate=10.0)
    b = _field(truth[:, :2])
    for session, offset in ((0, 0.0), (1, 4.0)):
        if session:
            mapper.start_session()
        for i in range(len(t)):
            stamp = float(t[i]) + 100.0 * session
            mapper.add_pose(stamp, (truth[i, 0], truth[i, 1], 0.0), (0.0, 0.0, 0.0, 1.0))
            mapper.add_magnetic_field(stamp, [(b[i] + offset) * UT, 0.0, 0.0])
            mapper.process()
        mapper.flush()
        fmap = MagneticMap.from_mapper(mapper)
        spread = float(mapper.model.sessions.spread()[0])
        assert fmap.offset_var.tolist() == pytest.approx([spread])
        if session == 0:
            assert spread == 0.0
        else:
            assert spread == pytest.approx(4.0, rel=0.25)  # (4 / 2)^2
            pts = torch.as_tensor(fmap.spec.cell_centres()[fmap.known.ravel()][::9])
            _, latent = mapper.model.predict(pts)
            assert np.all(fmap.lookup(pts.numpy())[1][:, 0] > latent.numpy()[:, 0] + spread)


def test_a_reading_is_weighed_with_the_noise_floor_at_full_width():
    """A map may state a sensor quieter than its noise floor (the calibration's factor c narrows the floor's part);
    the filter weighs readings with the floor's part at its full width (keep_noise_floor), since the robot reads
    with its own pose and heading errors. Two groups of particles where the map says 50.0 and 50.3 uT, one reading
    of 50.0: their weights part by exp(-0.3^2 / 2 s^2), s^2 the map's 0.01 plus the 0.08 the calibration took off
    the floor, or the map's 0.01 alone."""
    spec = GridSpec(0.0, 0.0, 0.1, 40, 20)
    mean = np.where(spec.cell_centres()[:, 0] < 2.0, 50.0, 50.3).reshape(spec.shape + (1,))
    var = np.full(spec.shape + (1,), 0.01)
    fmap = MagneticMap.from_arrays(spec, mean, var, error_var=np.zeros(spec.shape + (1,)),
                                   floor_var=np.full(spec.shape + (1,), 0.08))
    ratios = {}
    for keep in (True, False):
        pf = _two_groups(fmap, 1, keep_noise_floor=keep)
        ratios[keep] = pf.weights[5:].sum() / pf.weights[:5].sum()
    assert ratios[True] == pytest.approx(math.exp(-0.09 / (2 * 0.09)), rel=1e-6)
    assert ratios[False] == pytest.approx(math.exp(-0.09 / (2 * 0.01)), rel=1e-6)
    assert np.all(MagneticMap.from_arrays(spec, mean, var).floor_var == 0.0)  # none stated: nothing added back
    for bad in (np.full(spec.shape + (1,), -1.0), np.full(spec.shape + (1,), np.nan), np.zeros((3, 3, 1))):
        with pytest.raises(LocalizationError, match="noise floor's variance"):
            MagneticMap.from_arrays(spec, mean, var, floor_var=bad)
