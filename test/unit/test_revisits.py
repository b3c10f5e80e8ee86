"""The revisit bound on model.time_error's shared error (gp/revisits.py): the moment estimate against known
passes, and the engine held to it.

What is checked: passes with a known error shared along each pass give its variance back, whatever the field's
slope; white noise alone gives 0; no revisit gives no bound; a tiled map pools its tiles' evidence; the engine's
e stays below the bound, which travels with the state (a map saved before it loads unbounded); and on a simulated
world with white noise alone the engine with time_error learns the sensor's noise, not a shared error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gp_mapping.evaluation import calibration
from gp_mapping.gp import ModelConfig, build_model
from gp_mapping.gp.revisits import MIN_GAP, RevisitNugget


def _passes(rng, n_passes=6, shared_sd=1.0, white_sd=0.3, slope=4.0, rate=10.0):
    """Passes along one 20 m line, 0.5 m/s, each with its own constant error (an error shared along the pass:
    an OU process with a timescale longer than the pass) and white noise; the field rises ``slope`` per metre.
    x (N, 2), y (N, 1), t (N,) with the passes MIN_GAP and more apart."""
    xs, ys, ts = [], [], []
    times = np.arange(0.0, 40.0, 1.0 / rate)
    for k in range(n_passes):
        x = np.column_stack([0.5 * times, rng.uniform(-0.05, 0.05, len(times))])
        y = slope * x[:, 0] + shared_sd * rng.standard_normal() + white_sd * rng.standard_normal(len(times))
        xs.append(x)
        ys.append(y)
        ts.append(times + k * (40.0 + 2 * MIN_GAP))
    return np.vstack(xs), np.concatenate(ys)[:, None], np.concatenate(ts)


def _estimate(x, y, t, batch=100):
    """Stream the readings into one estimator, each batch against all earlier readings."""
    est = RevisitNugget(1)
    x, y, t = (torch.as_tensor(v, dtype=torch.float64) for v in (x, y, t))
    for i in range(0, len(t), batch):
        est.observe(x[i:i + batch], y[i:i + batch], t[i:i + batch], x[:i], y[:i], t[:i])
    return est


def test_passes_with_a_shared_error_give_its_variance_whatever_the_slope():
    # 40 passes: the estimate's spread is that of 40 draws of the passes' errors (their sample variance)
    for slope in (0.0, 4.0):
        rng = np.random.default_rng(1)
        x, y, t = _passes(rng, n_passes=40, slope=slope)
        est = _estimate(x, y, t)
        assert float(est.moments().white_variance()[0]) == pytest.approx(0.09, rel=0.2)
        assert float(est.shared_variance()[0]) == pytest.approx(1.0, rel=0.35)


def test_white_noise_alone_gives_no_shared_error():
    x, y, t = _passes(np.random.default_rng(2), shared_sd=0.0)
    assert float(_estimate(x, y, t).shared_variance()[0]) < 0.02  # white noise 0.09


def test_one_pass_gives_no_bound():
    x, y, t = _passes(np.random.default_rng(3), n_passes=1)
    est = _estimate(x, y, t)
    assert float(est.moments().pair_sums[0, 0]) == 0
    assert torch.isinf(est.shared_variance()).all()


def test_unknown_stamps_pair_with_nothing():
    x, y, t = _passes(np.random.default_rng(4))
    est = RevisitNugget(1)
    xt, yt, tt = (torch.as_tensor(v, dtype=torch.float64) for v in (x, y, t))
    est.observe(xt[-400:], yt[-400:], tt[-400:], xt[:400], yt[:400], torch.full((400,), float("nan")))
    assert float(est.moments().pair_sums[0, 0]) == 0


def test_the_tiles_pool_their_evidence():
    # evidence split between two estimators adds up to one's
    x, y, t = _passes(np.random.default_rng(5))
    half = len(t) // 2
    a, b = _estimate(x[:half], y[:half], t[:half]), _estimate(x[half:], y[half:], t[half:])
    pooled = a.moments() + b.moments()
    torch.testing.assert_close(pooled.pair_sums, a.pair_sums + b.pair_sums)
    torch.testing.assert_close(a.shared_variance(b.moments()), pooled.shared_variance())


def _engine():
    return build_model(ModelConfig(device="cpu", seed=0, tile_size=0.0, time_error=True, kernel_scales=1), 2, 1)


def test_the_engine_holds_e_below_the_bound_and_the_bound_travels_with_the_state():
    x, y, t = _passes(np.random.default_rng(6), shared_sd=0.0, n_passes=4)
    model = _engine()
    for i in range(0, len(t), 100):
        model.update(x[i:i + 100], y[i:i + 100], t=t[i:i + 100])
    error = model.likelihood.time_error
    bound = model.revisits.shared_variance() / model.y_std ** 2
    assert torch.isfinite(bound).all()
    assert bool((error.variance <= torch.maximum(bound, torch.full_like(bound, 1e-4)) + 1e-12).all())
    assert model.mem_t.shape[0] == model.mem_x.shape[0] and torch.isfinite(model.mem_t).all()
    state = model.state_dict()
    again = _engine()
    again.load_state_dict(state)
    torch.testing.assert_close(again.likelihood.time_error.variance, error.variance)
    torch.testing.assert_close(again.revisits.pair_sums, model.revisits.pair_sums)
    # a map saved before the bound existed: unbounded, no evidence yet, its memory's stamps unknown
    old = {k: v for k, v in state.items() if not k.startswith("revisits.") and k != "mem_t"
           and not k.endswith("variance_cap")}
    older = _engine()
    older.load_state_dict(old)
    assert torch.isinf(older.likelihood.time_error.variance_cap).all()
    assert older.mem_t.shape == model.mem_t.shape and torch.isnan(older.mem_t).all()
    older.update(x[:100], y[:100], t=t[:100] + 1e4)  # and it goes on learning
    assert float(older.revisits.white_batches) == 1


def test_with_white_noise_alone_the_time_error_engine_learns_the_sensors_noise():
    """The calibration bench's sim_revisit (white 0.25 uT^2 alone): unbounded, e took 1.03 uT^2 of field detail
    beside a white noise of 0.27; its revisits bound e near 0, and a reading's noise is the sensor's."""
    rec = calibration.load("sim_revisit", None, {})
    model, _ = calibration.stream_engine(calibration.shipped(time_error=True, position_noise=0.05), rec)
    engines = [slot.engine for slot in model.tiles.values()]
    unit = float(engines[0].y_std) ** 2
    assert float(engines[0].likelihood.time_error.variance.detach()) * unit < 0.02
    for engine in engines:  # the tiles share one likelihood
        assert float(engine.likelihood.noise_variance.detach()) * unit == pytest.approx(0.25, rel=0.2)


def test_a_robot_at_rest_is_not_a_revisit():
    """60 s standing at one place (the field there and the sensor's noise; nothing moves, so no shared error),
    then six passes with a shared error. Standing still for longer than MIN_GAP, the readings would pair with
    themselves as 'other passes', agree to the sensor's noise and pull e's bound towards 0 for the rest of the
    stream (0.34 against the passes' own 2.42 before batches at rest stopped pairing); a batch at rest does not
    pair, so the passes' revisits set the bound as they do without the stop."""
    x, y, t = _passes(np.random.default_rng(7), n_passes=6)
    rest_t = np.arange(0.0, 60.0, 0.1)
    rest_x = np.tile(x[:1], (len(rest_t), 1))
    rest_y = y[:1] + 0.3 * np.random.default_rng(8).standard_normal((len(rest_t), 1))
    bounds = {}
    for stop in (False, True):
        xs, ys, ts = (np.vstack([rest_x, x]), np.vstack([rest_y, y]), np.concatenate([rest_t - 70.0, t])) if stop \
            else (x, y, t)
        model = _engine()
        for i in range(0, len(ts), 100):
            model.update(xs[i:i + 100], ys[i:i + 100], t=ts[i:i + 100])
        bounds[stop] = float(model.revisits.shared_variance()[0])
    at_rest_only = _engine()
    for i in range(0, len(rest_t), 100):
        at_rest_only.update(rest_x[i:i + 100], rest_y[i:i + 100], t=rest_t[i:i + 100])
    assert float(at_rest_only.revisits.pair_sums[0, 0]) == 0  # nothing pairs while the robot stands
    assert bounds[True] == pytest.approx(bounds[False], rel=0.3), bounds
