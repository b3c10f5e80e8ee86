"""The spike gate (gp/outliers.py): what it drops, what it keeps, and the Mapper's count of it.

Bad input and what happens to it: an isolated spike (a reading far from the readings just before and after it)
is dropped and counted as ``dropped_spikes``; a burst of two spikes too; at a batch's first or last reading,
judged by its one side. Kept: a constant offset of the whole batch (another session), a step inside the batch
(an edge of the field), anything while the map has no data, batches shorter than MIN_READINGS, everything with
the gate at 0.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gp_mapping.config import ModelConfig
from gp_mapping.gp import build_model
from gp_mapping.gp.outliers import MIN_READINGS, isolated_spikes

NOISE = 0.3


def _field(x: np.ndarray) -> np.ndarray:
    return (50.0 + 3.0 * np.sin(x[:, 0] / 1.5) * np.cos(x[:, 1] / 2.0))[:, None]


def _path(n: int, y0: float) -> np.ndarray:
    s = np.linspace(0.0, 8.0, n)
    return np.stack([s, y0 + 0.3 * np.sin(s)], axis=1)


@pytest.fixture(scope="module")
def mapped():
    """A dual SVGP that has mapped three lanes of a smooth field (noise 0.3 uT), and a new pass along the middle."""
    rng = np.random.default_rng(0)
    model = build_model(dataclasses.replace(ModelConfig(device="cpu", seed=0, tile_size=0.0)), 2, 1)
    for y0 in (-1.0, 0.0, 1.0):
        x = _path(300, y0)
        y = _field(x) + NOISE * rng.standard_normal((len(x), 1))
        for i in range(0, len(x), 50):
            model.update(x[i:i + 50], y[i:i + 50])
    x = _path(50, 0.1)
    return model, x, _field(x) + NOISE * rng.standard_normal((len(x), 1))


def test_isolated_spikes_and_a_burst_of_two_are_found_and_nothing_else(mapped):
    model, x, y = mapped
    assert not isolated_spikes(model, x, y, 6.0).any()  # clean readings: none
    spiky = y.copy()
    spiky[10] += 25.0   # one spike
    spiky[30:32] -= 40.0  # a burst of two
    found = isolated_spikes(model, x, spiky, 6.0)
    assert np.flatnonzero(found).tolist() == [10, 30, 31]


def test_a_shifted_batch_and_a_step_inside_it_are_kept(mapped):
    """A session's offset moves every reading; an edge of the field moves the readings after it: neighbours
    agree on one side, so nothing is dropped, however far the map is off."""
    model, x, y = mapped
    assert not isolated_spikes(model, x, y + 8.0, 6.0).any()
    step = y.copy()
    step[25:] += 8.0
    assert not isolated_spikes(model, x, step, 6.0).any()


def test_what_the_gate_does_not_judge(mapped):
    model, x, y = mapped
    spiky = y.copy()
    spiky[[0, -1]] += 30.0  # a batch's first and last readings are judged by their one side
    assert np.flatnonzero(isolated_spikes(model, x, spiky, 6.0)).tolist() == [0, 49]
    spiky[20] += 30.0
    assert not isolated_spikes(model, x, spiky, 0.0).any()  # gate off
    assert not isolated_spikes(model, x[:MIN_READINGS - 1], spiky[:MIN_READINGS - 1], 6.0).any()
    empty = build_model(dataclasses.replace(ModelConfig(device="cpu", seed=0, tile_size=0.0)), 2, 1)
    assert not isolated_spikes(empty, x, spiky, 6.0).any()  # no data: no scale to judge by


def test_a_vector_reading_is_dropped_when_one_component_spikes():
    rng = np.random.default_rng(1)
    model = build_model(dataclasses.replace(ModelConfig(device="cpu", seed=0, tile_size=0.0)), 2, 3)
    x = _path(300, 0.0)
    y = np.hstack([_field(x), _field(x[:, ::-1]) - 70.0, 0.5 * _field(x)]) + NOISE * rng.standard_normal((300, 3))
    for i in range(0, 300, 50):
        model.update(x[i:i + 50], y[i:i + 50])
    xb, yb = x[100:150], y[100:150].copy()
    yb[7, 2] += 20.0
    assert np.flatnonzero(isolated_spikes(model, xb, yb, 6.0)).tolist() == [7]


def test_the_mapper_drops_counts_and_keeps_the_balance():
    """Spikes fed through the Mapper are dropped and counted; accepted = mapped + pending + dropped; the map
    of the spiky stream matches the clean one where the gate is on, and is worse with it off."""
    from gp_mapping.config import MapperConfig
    from gp_mapping.mapping.mapper import Mapper

    rng = np.random.default_rng(2)
    x = np.vstack([_path(400, y0) for y0 in (-1.0, 0.0, 1.0)])
    y = _field(x)[:, 0] + NOISE * rng.standard_normal(len(x))
    spikes = np.arange(149, len(x), 97)  # from batch 3 on (the first has no map to judge by); 149 ends a batch
    y_spiky = y.copy()
    y_spiky[spikes] += rng.choice([-1.0, 1.0], len(spikes)) * rng.uniform(20.0, 60.0, len(spikes))

    def run(values, gate):
        cfg = MapperConfig()
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device="cpu", tile_size=0.0,
                                                                 spike_gate=gate),
                                  batching=dataclasses.replace(cfg.batching, size=50))
        mapper = Mapper(cfg)
        for i, (p, v) in enumerate(zip(x, values)):
            t = 0.02 * i
            mapper.add_pose(t, (float(p[0]), float(p[1]), 0.0), (0.0, 0.0, 0.0, 1.0))
            direction = np.array([0.6, 0.0, -0.8])
            mapper.add_magnetic_field(t, direction * v * 1e-6)
            mapper.process()
        mapper.flush()
        probe = _path(60, 0.5)
        mean, _ = mapper.model.predict(probe)
        return mapper.diagnostics(), float(np.sqrt(np.mean((mean.numpy()[:, 0] - _field(probe)[:, 0]) ** 2)))

    d, rmse = run(y_spiky, 6.0)
    assert d["dropped_spikes"] == len(spikes) and d["dropped"] == len(spikes)
    assert d["accepted"] == d["num_seen"] + d["pending"] + d["dropped"]
    clean_d, clean_rmse = run(y, 6.0)
    assert clean_d["dropped_spikes"] == 0
    _, off_rmse = run(y_spiky, 0.0)
    assert rmse < 1.2 * clean_rmse and off_rmse > 1.5 * clean_rmse, (rmse, clean_rmse, off_rmse)


def _stating(sd: float, noise_floor: float):
    """An engine with 300 readings that states the SD ``sd`` for every reading, under ``noise_floor``."""
    import torch

    class Stating:
        num_seen = 300
        config = ModelConfig(noise_floor=noise_floor)

        def predict_reading(self, x, with_slope=True):
            assert with_slope is False  # the gate asks without the slope term, which neighbours share
            return torch.zeros(len(x), 1), torch.full((len(x), 1), sd ** 2)

    return Stating()


RAMP_X = np.stack([np.linspace(0.0, 1.0, 50), np.zeros(50)], axis=1)


def test_the_scale_is_never_finer_than_the_noise_floor():
    """An engine without the floor (smc_experts) stated 0.014 uT for a reading on a steady slope at a batch's
    edge (OptiTrack |B|, judged by one side): with the floor as the least SD it is kept; a spike is not. Here the
    batch's steps are 0 (a quantised sensor holding a value), so only the floor keeps a 1 uT change at the edge."""
    confident = _stating(0.014, noise_floor=0.09)
    held = np.full((50, 1), 44.0)
    held[-1] += 1.0
    assert not isolated_spikes(confident, RAMP_X, held, 6.0).any()
    ramp = 44.0 + 0.07 * np.arange(50)[:, None]
    assert not isolated_spikes(confident, RAMP_X, ramp, 6.0).any()
    ramp[-1] += 5.0
    assert np.flatnonzero(isolated_spikes(confident, RAMP_X, ramp, 6.0)).tolist() == [49]


def test_the_scale_is_never_finer_than_the_batch_s_own_steps():
    """With `noise_floor: 0` the learned noise on OptiTrack |B| collapsed to 0.06 uT and the gate dropped readings
    on steady slopes at batch edges (the map 1.99x the best peer's RMSE, was 1.33x): the batch's median step
    between consecutive readings is the least SD too. A spike still stands out of it."""
    collapsed = _stating(0.014, noise_floor=0.0)
    ramp = 44.0 + 0.07 * np.arange(50)[:, None]
    assert not isolated_spikes(collapsed, RAMP_X, ramp, 6.0).any()
    ramp[[0, 20]] += 5.0
    assert np.flatnonzero(isolated_spikes(collapsed, RAMP_X, ramp, 6.0)).tolist() == [0, 20]
