"""Target scaling that adapts (issue 13): never frozen on a first batch.

A robot that stands still for its first seconds gives a first batch whose spread is the sensor noise, a
thousand times smaller than the field's. Every engine tracks running statistics of the targets, re-expresses
its data terms exactly when they drift, and learns no hyperparameters from a batch at rest; the map of a
drive that starts with a rest is the map of the drive alone.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gp_mapping.config import ModelConfig
from gp_mapping.gp import build_model
from gp_mapping.gp.base import (difference_noise_estimate, fold_moving_targets, merge_moments, moments_scale,
                                spans_space)
from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

REST_SAMPLES = 100  # 2 s at 50 Hz
REST_NOISE_UT = 0.01  # a quantised magnetometer at rest: far below the field's spread (~4 uT here)


def _drive(seconds: float, target: str, seed: int = 3):
    rec = simulate(WorldConfig(), TrajectoryConfig(duration=seconds), SensorConfig(noise_std=0.1e-6), seed=seed)
    x = rec.sensor_position[:, :2]
    field = rec.field_map_tesla_true * 1e6 + np.random.default_rng(0).normal(scale=0.1, size=(len(x), 3))
    y = np.linalg.norm(field, axis=1, keepdims=True) if target == "magnitude" else field
    test = np.random.default_rng(2).choice(len(x), 600, replace=False)
    xt = x[test] + np.random.default_rng(3).normal(scale=0.2, size=(600, 2))
    ft = rec.world.field(np.column_stack([xt, np.zeros(len(xt))])) * 1e6
    yt = np.linalg.norm(ft, axis=1, keepdims=True) if target == "magnitude" else ft
    return x, y, xt, yt


def _map(engine: str, x, y, xt, yt, tile_size: float = 0.0) -> tuple[float, float]:
    # the noise floor is the simulated sensor's (0.1 uT), as a user sets it: the default's 0.3 uT is 9x its variance
    config = ModelConfig(engine=engine, num_inducing=64, device="cpu", tile_size=tile_size, noise_floor=0.01)
    model = build_model(config, 2, y.shape[1])
    for i in range(0, len(x), 50):
        model.update(x[i:i + 50], y[i:i + 50])
    mean, _ = model.predict(xt)
    noisy = yt + np.random.default_rng(5).normal(scale=0.1, size=yt.shape)
    return (float(np.sqrt(np.mean((mean.numpy() - yt) ** 2))),
            float(-model.log_predictive_density(xt, noisy).mean()))


@pytest.mark.parametrize("engine,target,tile_size", [
    ("dual_svgp", "magnitude", 0.0), ("dual_svgp", "vector", 0.0), ("continual_mogp", "magnitude", 0.0),
    ("continual_mogp", "vector", 0.0), ("var_gp", "magnitude", 0.0), ("var_gp", "vector", 0.0),
    # Tiles of 4 m over the 10 m x 10 m drive: the first tile adapts its scale while it is alone and is
    # re-expressed in the running scale when the second is made (gp/tiles/shared.py, 'Target scaling').
    ("dual_svgp", "magnitude", 4.0), ("continual_mogp", "vector", 4.0)])
def test_a_rest_before_the_drive_leaves_the_map_of_the_drive(engine, target, tile_size):
    # One drive's ratio varies by several per cent with the path (dual_svgp |B|, drives 3-6: 1.04, 0.95, 1.11,
    # 1.05), so the bound holds for the mean over three drives. The scaling frozen on the first batch gave 1.60 / 1.16 with NLPD 6.6 / 5.8 against 0.2 / 0.6.
    # (var_gp, drive 3 alone: 0.94 / 0.90; continual_mogp 1.01 / 0.99: those two, several times slower, are run
    # on drive 3 only.)
    seconds = 30.0 if engine == "continual_mogp" else 40.0
    ratios, nlpd_gaps = [], []
    for seed in ((3, 4, 5) if engine == "dual_svgp" else (3,)):
        x, y, xt, yt = _drive(seconds, target, seed)
        rest_x = np.repeat(x[:1], REST_SAMPLES, 0)
        rest_y = y[:1] + np.random.default_rng(1).normal(scale=REST_NOISE_UT, size=(REST_SAMPLES, y.shape[1]))
        rmse_drive, nlpd_drive = _map(engine, x, y, xt, yt, tile_size)
        rmse_rest, nlpd_rest = _map(engine, np.vstack([rest_x, x]), np.vstack([rest_y, y]), xt, yt, tile_size)
        constant = float(np.sqrt(np.mean((yt - y.mean(0)) ** 2)))
        assert rmse_drive < 0.5 * constant  # the drive alone maps the field (measured 0.1-0.44 of the mean's)
        assert rmse_rest <= 1.15 * rmse_drive  # no single drive far off
        ratios.append(rmse_rest / rmse_drive)
        nlpd_gaps.append(nlpd_rest - nlpd_drive)
    assert np.mean(ratios) <= 1.05, ratios
    assert np.mean(nlpd_gaps) <= 0.5, nlpd_gaps


def test_running_statistics_are_those_of_every_target_seen():
    rng = np.random.default_rng(0)
    model = build_model(ModelConfig(device="cpu", learn_hyperparameters=False, tile_size=0.0), 2, 2)
    xs, ys = [], []
    for scale in (0.01, 1.0, 5.0, 20.0):
        x = rng.uniform(0, 5, (40, 2))
        y = 50.0 + scale * rng.standard_normal((40, 2))
        model.update(x, y)
        xs.append(x)
        ys.append(y)
    y_all = np.vstack(ys)
    np.testing.assert_allclose(model.y_run_mean.numpy(), y_all.mean(0), rtol=1e-12)
    np.testing.assert_allclose((model.y_run_m2 / model.y_count).numpy(), y_all.var(0), rtol=1e-10)
    # the scale followed the data (a factor of 2 at most from the running std), and it took few rescalings
    run_std = y_all.std(0)
    assert np.all(model.y_std.numpy() > run_std / 2) and np.all(model.y_std.numpy() < 2 * run_std)
    assert 1 <= model.rescalings <= 4


def test_merged_moments_with_missing_entries_are_those_of_the_entries_present():
    """The one running-moment merge every engine uses (gp.base.merge_moments), against numpy per column."""
    rng = np.random.default_rng(4)
    batches = [rng.normal(3.0, s, (n, 2)) for s, n in ((0.1, 1), (2.0, 7), (10.0, 30))]
    masks = [rng.random(b.shape) > 0.3 for b in batches]
    masks[0][:] = [True, False]  # the second column starts unseen
    count, mean, m2 = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), \
        torch.zeros(2, dtype=torch.float64)
    for b, m in zip(batches, masks):
        merge_moments(count, mean, m2, torch.as_tensor(np.where(m, b, np.nan)), torch.as_tensor(m))
    for col in range(2):
        present = np.concatenate([b[m[:, col], col] for b, m in zip(batches, masks)])
        assert count[col] == len(present)
        np.testing.assert_allclose(float(mean[col]), present.mean(), rtol=1e-12)
        np.testing.assert_allclose(float(m2[col]) / len(present), present.var(), rtol=1e-10)
    # no spread yet: the scale is 1 (the original units), not 0
    one, mu, zero = torch.ones(1, dtype=torch.float64), torch.full((1,), 7.0, dtype=torch.float64), \
        torch.zeros(1, dtype=torch.float64)
    assert float(moments_scale(one, mu, zero)[1]) == 1.0


def test_dual_svgp_rescaling_re_expresses_the_data_exactly():
    """With the kernel's variances scaled by alpha^2 as well (the exact re-expression of the prior), a rescaled
    model predicts what it predicted before, in the original units: the sites, the old part and the memory are
    transformed exactly. A shift of the offset (d != 0) is exact in the data terms too (through b_old) but moves
    the prior mean, which the constant kernel absorbs: near the data the map moves by a small fraction."""
    rng = np.random.default_rng(1)
    # jitter 1e-9: the jitter on K is the one term that does not scale with the variances
    model = build_model(ModelConfig(device="cpu", num_inducing=30, memory_size=40, memory_per_batch=10,
                                    learn_hyperparameters=False, full_update_every=2, jitter=1e-9, tile_size=0.0),
                        2, 1)
    for _ in range(6):  # full and fast updates: memory, pending points and an old part
        x = rng.uniform(0, 4, (50, 2))
        model.update(x, (10.0 + np.sin(x[:, :1]) * 3 + 0.1 * rng.standard_normal((50, 1))))
    assert model.memory_size > 0 and float(model.W_old.abs().sum()) > 0 and model.pend_x.shape[0] > 0
    xt = torch.as_tensor(rng.uniform(0, 4, (200, 2)))
    mean0, var0 = model.predict(xt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for shift in (0.0, 0.7):
        model.load_state_dict(state)
        new_mean, new_std = model.y_mean + shift * model.y_std, model.y_std * 3.0
        alpha = model.y_std / new_std
        with torch.no_grad():
            model.hyper_learned.fill_(True)  # the noise is re-expressed too
            model._rescale_targets(new_mean.clone(), new_std.clone())
        with model.hyperparameter_change():
            for part in model.kernel.parts:
                part.variance_param.set(part.variance.detach() * alpha[0] ** 2)
        mean1, var1 = model.predict(xt)
        if shift == 0.0:
            np.testing.assert_allclose(mean1.numpy(), mean0.numpy(), rtol=1e-7)
            np.testing.assert_allclose(var1.numpy(), var0.numpy(), rtol=1e-5, atol=1e-9)
        else:
            # measured 0.012 y_std with the shipped two kernel scales
            assert np.abs(mean1.numpy() - mean0.numpy()).max() < 0.02 * float(state["y_std"])


def test_continual_mogp_channel_rescaling_through_the_mixing_rows_is_exact():
    """Channel scales changing by factors whose geometric mean is 1 go entirely into the mixing rows and
    the noise: the map in the original units does not move."""
    rng = np.random.default_rng(2)
    model = build_model(ModelConfig(engine="continual_mogp", device="cpu", num_inducing=20, hyper_steps=5,
                                    num_latents=2, tile_size=0.0), 2, 2)
    x = rng.uniform(0, 4, (60, 2))
    model.update(x, np.column_stack([np.sin(x[:, 0]), 3 * np.cos(x[:, 1])]) + 0.05 * rng.standard_normal((60, 2)))
    xt = torch.as_tensor(rng.uniform(0, 4, (100, 2)))
    mean0, var0 = model.predict(xt)
    with torch.no_grad():
        model.hyper_learned.fill_(True)
        model._rescale_targets(model.y_std * torch.tensor([2.0, 0.5], dtype=torch.float64))
    mean1, var1 = model.predict(xt)
    np.testing.assert_allclose(mean1.numpy(), mean0.numpy(), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(var1.numpy(), var0.numpy(), rtol=1e-9, atol=1e-12)
    assert model.rescalings == 1


def test_moving_data_alone_set_the_unit_once_there_are_some():
    """base.fold_moving_targets: batches at rest count only until the first batch that spans space, which
    restarts the moments; later batches at rest are left out. A stream that never moves keeps them all."""
    rng = np.random.default_rng(7)
    f64 = dict(dtype=torch.float64)
    count, mean, m2, moved = torch.zeros((), **f64), torch.zeros(2, **f64), torch.zeros(2, **f64), torch.tensor(False)
    rest = [torch.as_tensor(rng.normal(90.0, 0.01, (50, 2))) for _ in range(3)]
    walk = [torch.as_tensor(rng.normal(40.0, 3.0, (50, 2))) for _ in range(2)]
    fold_moving_targets(count, mean, m2, moved, rest[0], False)
    assert not bool(moved) and float(count) == 50  # nothing moving yet: the rest is all there is
    fold_moving_targets(count, mean, m2, moved, walk[0], True)
    fold_moving_targets(count, mean, m2, moved, rest[1], False)
    fold_moving_targets(count, mean, m2, moved, walk[1], True)
    fold_moving_targets(count, mean, m2, moved, rest[2], False)
    both = torch.cat(walk)
    assert bool(moved) and float(count) == 100
    np.testing.assert_allclose(mean.numpy(), both.mean(0).numpy(), rtol=1e-12)
    np.testing.assert_allclose((m2 / count).numpy(), both.var(0, unbiased=False).numpy(), rtol=1e-10)


@pytest.mark.parametrize("engine,tile_size", [("dual_svgp", 0.0), ("dual_svgp", 4.0), ("continual_mogp", 0.0),
                                              ("var_gp", 0.0)])
def test_a_rest_where_the_field_differs_sets_no_part_of_the_unit(engine, tile_size):
    """A sensor that lies on the floor before the walk (the OptiTrack recordings: 6 s, where the field differs
    from the walk's by several uT) reads one place to the sensor's noise. Counted in the running statistics, it set
    the unit the first hyperparameters were learned in and pulled the scale the map kept (OptiTrack |B| mapped at
    0.514 uT, 0.489 without it). Now the unit after the rest and the drive is the drive's alone, exactly."""
    x, y, _, _ = _drive(15.0, "vector")
    rest_x = np.repeat(x[:1] + np.array([[0.3, 0.0]]), REST_SAMPLES, 0)  # 30 cm from where the drive starts
    rest_y = y[:1] + 8.0 + np.random.default_rng(1).normal(scale=REST_NOISE_UT, size=(REST_SAMPLES, y.shape[1]))
    units = []
    for xs, ys in ((x, y), (np.vstack([rest_x, x]), np.vstack([rest_y, y]))):
        config = ModelConfig(engine=engine, num_inducing=32, device="cpu", tile_size=tile_size,
                             learn_hyperparameters=False)
        model = build_model(config, 2, y.shape[1])
        for i in range(0, len(xs), 50):  # the rest is two whole batches: the drive's batches are the same
            model.update(xs[i:i + 50], ys[i:i + 50])
        scale = (model.scale_offset, model.scale_std) if tile_size else (model.y_run_mean, model.y_std)
        units.append([t.clone().numpy() for t in scale])
    np.testing.assert_allclose(units[1][0], units[0][0], rtol=1e-12)
    np.testing.assert_allclose(units[1][1], units[0][1], rtol=1e-12)


def test_batches_at_rest_teach_no_hyperparameters():
    x_rest = torch.zeros(100, 2, dtype=torch.float64) + torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert not spans_space(x_rest + 1e-3 * torch.randn(100, 2, dtype=torch.float64), 1.0)  # 1 mm jitter
    assert spans_space(torch.linspace(0, 0.2, 50, dtype=torch.float64)[:, None].expand(50, 2), 1.0)  # a slow walk
    model = build_model(ModelConfig(device="cpu", tile_size=0.0), 2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    stats = model.update(x_rest, 40.0 + 0.01 * torch.randn(100, 1, dtype=torch.float64), mode="full")
    assert stats["hyper_steps"] == 0 and not bool(model.hyper_learned)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_difference_noise_estimate_measures_the_sensor_along_a_smooth_path():
    t = torch.linspace(0, 10, 2000, dtype=torch.float64)
    smooth = 5.0 * torch.sin(t)[:, None]
    noisy = smooth + 0.3 * torch.randn(2000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float(difference_noise_estimate(noisy)[0]) == pytest.approx(0.09, rel=0.1)
