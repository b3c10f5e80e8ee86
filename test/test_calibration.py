"""Prequential calibration of a reading's variance (gp/calibration.py) and the calibration bench's scores."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gp_mapping.config import ModelConfig
from gp_mapping.evaluation import calibration as bench
from gp_mapping.gp import build_model
from gp_mapping.gp.calibration import CALIBRATION_MIN_RECORDS, PrequentialCalibration


def _config(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig(device="cpu", seed=0, tile_size=0.0), **overrides)


def test_refit_recovers_a_known_variance_model():
    # Errors drawn from N(0, a v + n + tau^2) with a = 4, tau^2 = 0.3: maximum likelihood finds both.
    rng = np.random.default_rng(0)
    n = 2048
    v = rng.uniform(0.01, 2.0, n)
    noise = np.full(n, 0.05)
    err = rng.normal(size=n) * np.sqrt(4.0 * v + noise + 0.3)
    cal = PrequentialCalibration(2, 1, records=n, history=10, radius=0.1)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)[:, None]  # noqa: E731
    cal.record(t(err), t(v), t(noise), torch.ones(n, 1, dtype=torch.bool))
    cal.refit(torch.ones(1, dtype=torch.float64))
    assert float(cal.scale) == pytest.approx(4.0, rel=0.15)
    assert float(cal.extra) == pytest.approx(0.3, rel=0.3)
    s2 = cal.reading_variance(t([1.0]), t([0.05]))
    assert float(s2) == pytest.approx(float(cal.scale) + 0.05 + float(cal.extra))


def test_too_few_records_leave_the_model_as_it_is():
    cal = PrequentialCalibration(2, 1, records=1000, history=10, radius=0.1)
    k = CALIBRATION_MIN_RECORDS - 1
    cal.record(torch.full((k, 1), 5.0, dtype=torch.float64), torch.ones(k, 1, dtype=torch.float64),
               torch.ones(k, 1, dtype=torch.float64), torch.ones(k, 1, dtype=torch.bool))
    cal.refit(torch.ones(1, dtype=torch.float64))
    assert float(cal.scale) == 1.0 and float(cal.extra) == 0.0


def test_readings_on_the_track_just_driven_are_not_scored():
    cal = PrequentialCalibration(2, 1, records=100, history=4, radius=0.5)
    cal.remember_inputs(torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    away = cal.away_from_track(torch.tensor([[0.2, 0.0], [1.4, 0.0], [3.0, 0.0]], dtype=torch.float64))
    assert away.tolist() == [False, False, True]
    # the ring forgets the oldest inputs: after four more, (0, 0) is no longer the recent track
    cal.remember_inputs(torch.tensor([[9.0, 9.0]] * 4, dtype=torch.float64))
    assert cal.away_from_track(torch.tensor([[0.2, 0.0]], dtype=torch.float64)).tolist() == [True]


def test_uncalibrated_reading_variance_is_latent_plus_noise():
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 4, (400, 2))
    y = np.sin(x[:, :1]) + 0.1 * rng.normal(size=(400, 1))
    model = build_model(_config(calibration="none"), 2, 1)
    for i in range(0, 400, 50):
        model.update(x[i:i + 50], y[i:i + 50])
    mean, var = model.predict(x[:20])
    mean_r, var_r = model.predict_reading(x[:20])
    noise = float(model.likelihood.noise_variance.detach()) * float(model.y_std) ** 2
    assert torch.equal(mean, mean_r)
    assert torch.allclose(var_r, var + noise, rtol=1e-12)


def test_state_saved_before_calibration_loads_uncalibrated():
    rng = np.random.default_rng(2)
    x = rng.uniform(0, 4, (200, 2))
    y = np.cos(x[:, :1])
    model = build_model(_config(), 2, 1)
    model.update(x[:100], y[:100])
    model.update(x[100:], y[100:])
    old = {k: v for k, v in model.state_dict().items() if not k.startswith("calibration.")}
    fresh = build_model(_config(), 2, 1)
    fresh.load_state_dict(old)
    assert torch.allclose(fresh.predict(x[:10])[0], model.predict(x[:10])[0])
    assert float(fresh.calibration.scale) == 1.0 and int(fresh.calibration.record_count) == 0
    # and a state with another store size brings its own shapes
    small = build_model(_config(calibration_records=16, calibration_history=8), 2, 1)
    small.update(x[:100], y[:100])
    small.update(x[100:], y[100:])
    other = build_model(_config(), 2, 1)
    other.load_state_dict(small.state_dict())
    assert other.calibration.err2.shape[0] == 16 and other.calibration.recent_x.shape[0] == 8


def test_scores_of_a_calibrated_gaussian():
    rng = np.random.default_rng(3)
    y = rng.normal(size=(20000, 1)) * 2.0
    s = bench.scores(np.zeros_like(y), np.full_like(y, 4.0), y)
    assert s["within_1sd"] == pytest.approx(0.683, abs=0.01)
    assert s["within_2sd"] == pytest.approx(0.954, abs=0.01)
    assert s["z_std"] == pytest.approx(1.0, abs=0.02)
    assert s["reliability"]["0.5"] == pytest.approx(0.5, abs=0.015)
    assert s["nlpd"] == pytest.approx(0.5 * np.log(2 * np.pi * 4.0) + 0.5, abs=0.02)
