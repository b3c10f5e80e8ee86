"""Degenerate data never gives a NaN or a crash: every sample at one point, duplicated inputs, extreme
lengthscales, a huge first batch; a Cholesky failure is rolled back, counted and logged by the Mapper."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from gp_mapping.config import ModelConfig, config_from_dict
from gp_mapping.gp import DualSVGP, GPNumericalError
from gp_mapping.mapping.mapper import Mapper

torch.set_num_threads(1)
Q = [0.0, 0.0, 0.0, 1.0]


def model(**kw) -> DualSVGP:
    base = {"num_inducing": 16, "memory_size": 50, "hyper_steps": 5, "device": "cpu"}
    base.update(kw)
    return DualSVGP(ModelConfig(**base), input_dims=2, output_dims=1)


def finite_prediction(m, x) -> tuple[np.ndarray, np.ndarray]:
    mean, var = m.predict(torch.as_tensor(x, dtype=torch.float64))
    mean, var = mean.detach().numpy(), var.detach().numpy()
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and np.all(var >= 0)
    return mean, var


GRID = np.stack(np.meshgrid(np.linspace(-3, 3, 7), np.linspace(-3, 3, 7)), -1).reshape(-1, 2)


def test_every_sample_at_one_point():
    m = model()
    x = np.zeros((50, 2))
    y = 50.0 + 0.01 * np.random.default_rng(0).normal(size=(50, 1))
    for _ in range(3):
        m.update(x, y)
    mean, var = finite_prediction(m, GRID)
    at = np.argmin(np.linalg.norm(GRID, axis=1))
    assert abs(mean[at, 0] - y.mean()) < 0.05  # the point's value is learnt
    assert var[at, 0] < var.max()              # and it is the best-known place


def test_constant_targets_at_one_point():
    m = model()
    m.update(np.zeros((20, 2)), np.full((20, 1), 42.0))
    mean, _ = finite_prediction(m, GRID)
    assert abs(mean[np.argmin(np.linalg.norm(GRID, axis=1)), 0] - 42.0) < 1e-3


def test_duplicated_inputs_and_batches():
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, size=(30, 2))
    y = np.sin(x[:, :1]) + 50.0
    m = model()
    for _ in range(4):  # the same batch again and again, each with every point repeated
        m.update(np.repeat(x, 3, axis=0), np.repeat(y, 3, axis=0))
    mean, _ = finite_prediction(m, x)
    assert np.max(np.abs(mean - y)) < 0.1


@pytest.mark.parametrize("lengthscale", [1e-4, 1e4])
def test_extreme_lengthscales(lengthscale):
    rng = np.random.default_rng(2)
    x = rng.uniform(-2, 2, size=(60, 2))
    y = 50.0 + np.sin(x[:, :1])
    m = model(lengthscale=lengthscale)
    for k in range(3):
        m.update(x[20 * k:20 * (k + 1)], y[20 * k:20 * (k + 1)])
    finite_prediction(m, GRID)
    finite_prediction(m, x)


def test_extreme_signal_and_noise_variances():
    rng = np.random.default_rng(3)
    x = rng.uniform(-2, 2, size=(40, 2))
    y = 50.0 + np.sin(x[:, :1])
    for kw in ({"noise_variance": 1e-6, "signal_variance": 1e4}, {"noise_variance": 100.0}):
        m = model(**kw)
        m.update(x, y)
        m.update(x, y)
        finite_prediction(m, GRID)


def test_huge_first_batch():
    rng = np.random.default_rng(4)
    x = rng.uniform(-5, 5, size=(20_000, 2))
    y = 50.0 + np.sin(x[:, :1]) * np.cos(x[:, 1:])
    m = model(num_inducing=32, hyper_steps=2)
    stats = m.update(x, y)
    assert stats["n_batch"] == 20_000 and m.num_seen == 20_000
    mean, _ = finite_prediction(m, x[:500])
    assert np.sqrt(np.mean((mean - y[:500]) ** 2)) < 0.3


def test_far_away_and_huge_coordinates_predict_the_prior_not_nan():
    m = model()
    rng = np.random.default_rng(5)
    x = rng.uniform(-2, 2, size=(40, 2))
    m.update(x, 50.0 + np.sin(x[:, :1]))
    finite_prediction(m, np.array([[1e6, 1e6], [-1e7, 3.0], [1e3, -1e3]]))


# ---------------------------------------------------------------------------------------------- the Mapper


def mapper(**model_kw) -> Mapper:
    return Mapper(config_from_dict({"model": {"num_inducing": 16, "memory_size": 50, "hyper_steps": 3,
                                              "device": "cpu", **model_kw},
                                    "batching": {"size": 25}, "grid": {"resolution": 0.5, "tile_size": 1000}}))


def test_mapper_robot_standing_still():
    """A robot that never moves: every sample at one point, a constant reading."""
    m = mapper()
    for k in range(200):
        t = 0.1 * k
        m.add_pose(t, [1.0, 1.0, 0.0], Q)
        m.add_magnetic_field(t + 0.05, [50e-6, 0.0, 0.0])
        m.process()
    m.flush()
    d = m.diagnostics()
    assert d["updates"] >= 7 and d["failed_updates"] == 0
    grid = m.grid()
    mean, var = grid.layers["magnitude"]
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and grid.known.sum() >= 1
    assert abs(mean[grid.known].mean() - 50.0) < 0.01


def test_cholesky_failure_is_rolled_back_counted_and_logged(monkeypatch, caplog):
    """A factorisation that fails even at the largest jitter: the update is rolled back (the model is exactly as
    before), its batch counted as dropped, the error logged and kept, and the next batches map normally."""
    m = mapper()
    real = m.model.update
    calls, saved = [], {}

    def failing(x, y, mode=None, t=None):
        calls.append(len(x))
        if len(calls) == 2:
            saved.update({k: v.clone() for k, v in m.model.state_dict().items()})
            real(x, y, mode, t=t)  # half-done work that must be undone
            raise GPNumericalError("Cholesky factorisation failed even with jitter 1e-2 (simulated)")
        return real(x, y, mode, t=t)

    monkeypatch.setattr(m.model, "update", failing)
    with caplog.at_level(logging.WARNING, logger="gp_mapping.mapper"):
        for k in range(120):
            t = 0.1 * k
            m.add_pose(t, [0.05 * k, 0.0, 0.0], Q)
            m.add_magnetic_field(t + 0.05, [(50 + math.sin(0.05 * k)) * 1e-6, 0.0, 0.0])
            m.process()
            if len(calls) == 2 and saved:
                after = m.model.state_dict()
                assert all(torch.equal(saved[name], after[name]) for name in saved)  # rolled back exactly
                saved.clear()
    d = m.diagnostics()
    assert d["failed_updates"] == 1 and d["dropped_failed_update"] == 25 and d["updates"] == len(calls) - 1
    assert "Cholesky" in d["last_error"]
    assert any("rolled back" in r.getMessage() and "Cholesky" in r.getMessage() for r in caplog.records)
    assert d["accepted"] == d["num_seen"] + d["pending"] + d["dropped"]
    assert np.all(np.isfinite(m.grid().layers["magnitude"][0]))


def test_non_finite_model_after_an_update_is_rolled_back(monkeypatch):
    m = mapper()
    real = m.model.update

    def poisoning(x, y, mode=None, t=None):
        stats = real(x, y, mode, t=t)
        if m.model.num_seen > 25:
            # the engine that holds the map (with tiles, the first tile's)
            engine = m.model.tile(m.model.tile_indices()[0]) if hasattr(m.model, "tile_indices") else m.model
            with torch.no_grad():
                for p in engine.buffers():
                    if p.is_floating_point() and p.numel():
                        p.fill_(math.nan)
                        break
        return stats

    for k in range(30):
        m.add_pose(0.1 * k, [0.05 * k, 0, 0], Q)
        m.add_magnetic_field(0.1 * k + 0.05, [50e-6, 0, 0])
    m.process()
    monkeypatch.setattr(m.model, "update", poisoning)
    for k in range(30, 60):
        m.add_pose(0.1 * k, [0.05 * k, 0, 0], Q)
        m.add_magnetic_field(0.1 * k + 0.05, [50e-6, 0, 0])
    m.process()
    d = m.diagnostics()
    assert d["failed_updates"] >= 1 and "non-finite" in d["last_error"]
    grid = m.grid()
    assert np.all(np.isfinite(grid.layers["magnitude"][0])) and np.all(np.isfinite(grid.layers["magnitude"][1]))


def test_jitter_escalation_is_counted_and_logged(monkeypatch, caplog):
    """The engine reports the jitter its Cholesky factorisations needed; the Mapper counts and logs each rise."""
    m = mapper()
    real = m.model.update
    jitters = iter([1e-6, 1e-6, 1e-4, 1e-4, 1e-2, 1e-2])

    def escalating(x, y, mode=None, t=None):
        stats = real(x, y, mode, t=t)
        return {**stats, "jitter": next(jitters)}

    monkeypatch.setattr(m.model, "update", escalating)
    with caplog.at_level(logging.INFO, logger="gp_mapping.mapper"):
        for k in range(150):
            m.add_pose(0.1 * k, [0.05 * k, 0, 0], Q)
            m.add_magnetic_field(0.1 * k + 0.05, [(50 + 1e-2 * k) * 1e-6, 0, 0])
            m.process()
    d = m.diagnostics()
    assert d["updates"] == 5 and d["jitter_escalations"] == 2
    assert sum("more jitter" in r.getMessage() for r in caplog.records) == 2
