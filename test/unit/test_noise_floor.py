"""The Gaussian likelihood's noise floor (model.noise_floor, gp/likelihoods.py): the learned noise of a reading
never falls below it, in the targets' units, whatever the engine's target scale."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from gp_mapping.config import ModelConfig
from gp_mapping.gp import build_model
from gp_mapping.gp.likelihoods import GaussianLikelihood


def _config(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig(device="cpu", seed=0, tile_size=0.0, num_inducing=32), **overrides)


def _noise_in_targets_units(model) -> torch.Tensor:
    return model.likelihood.noise_variance.detach() * model.y_std ** 2


def _noiseless_drive(n: int = 600) -> tuple[np.ndarray, np.ndarray]:
    # a smooth field read without noise along a dense track: the likelihood alone would learn a noise near 0
    t = np.linspace(0.0, 1.0, n)
    x = np.column_stack([3.0 * np.cos(7.0 * t), 3.0 * np.sin(5.0 * t)])
    return x, 40.0 + 6.0 * np.sin(x[:, :1]) * np.cos(0.5 * x[:, 1:2])


@pytest.mark.parametrize("engine", ["dual_svgp", "continual_mogp", "var_gp"])
def test_the_learned_noise_stays_above_the_floor_in_the_targets_units(engine):
    x, y = _noiseless_drive()
    floored, free = (build_model(_config(engine=engine, noise_floor=floor), 2, 1) for floor in (0.09, 0.0))
    for model in (floored, free):
        for i in range(0, len(x), 50):
            model.update(x[i:i + 50], y[i:i + 50])
    assert float(_noise_in_targets_units(floored)) >= 0.09 * (1 - 1e-9)
    assert float(_noise_in_targets_units(free)) < 0.09  # the floor is what holds it up
    # a reading's predictive variance carries it too
    _, reading_var = floored.predict_reading(x[:5])
    assert bool((reading_var >= 0.09).all())


def test_a_change_of_target_scale_keeps_the_floor_and_rescales_the_learned_part():
    owner = torch.nn.Module()
    owner.register_buffer("y_std", torch.tensor([2.0], dtype=torch.float64))
    lik = GaussianLikelihood(1, noise_variance=0.01, noise_floor=0.09)
    lik.measure_with(owner)
    before = float(lik.noise_variance.detach()) * 4.0  # targets' units: 0.01 * 4 + 0.09
    assert before == pytest.approx(0.04 + 0.09)
    lik.rescale_targets(torch.tensor([0.5], dtype=torch.float64))  # y_std 2 -> 4: standardised y halves
    owner.y_std.fill_(4.0)
    assert float(lik.noise_variance.detach()) * 16.0 == pytest.approx(before)
    # without an owner (or with floor 0) the likelihood is the plain learned noise
    plain = GaussianLikelihood(1, noise_variance=0.01, noise_floor=0.09)
    assert float(plain.noise_variance.detach()) == pytest.approx(0.01)


def test_a_copy_of_an_engine_reads_its_own_scale():
    # the lagged copy the calibration predicts from (Engine._snapshot) must not read the live engine's scale
    x, y = _noiseless_drive(200)
    model = build_model(_config(noise_floor=0.09), 2, 1)
    model.update(x[:100], y[:100])
    snap = copy.deepcopy(model)
    assert snap.likelihood._scale_owner is snap and model.likelihood._scale_owner is model
    snap.y_std.mul_(10.0)
    assert float(_noise_in_targets_units(model)) >= 0.09 * (1 - 1e-9)
    assert not torch.equal(snap.likelihood.noise_variance, model.likelihood.noise_variance)
