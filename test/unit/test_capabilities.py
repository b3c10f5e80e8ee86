"""Declared engine capabilities (gp/base.py): undo, time-aware inputs, incremental prediction, recyclable."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gp_mapping.config import ModelConfig
from gp_mapping.gp import IncrementalPrediction, Recyclable, build_model

SMALL = {"num_inducing": 16, "memory_size": 50, "hyper_steps": 2, "smc_particles": 2, "smc_max_experts": 4,
         "smc_expert_memory": 8, "vargp_block_size": 8, "device": "cpu", "seed": 0}


@pytest.mark.parametrize("engine,tiled,recyclable,stamps", [
    ("dual_svgp", 0.0, True, True), ("dual_svgp", 3.0, True, True), ("continual_mogp", 0.0, True, False),
    ("var_gp", 0.0, False, False), ("smc_experts", 0.0, False, True)])
def test_every_engine_declares_what_it_can_do(engine, tiled, recyclable, stamps):
    cfg = dataclasses.replace(ModelConfig(), engine=engine, tile_size=tiled, **SMALL)
    model = build_model(cfg, 2, 1)
    assert isinstance(model, Recyclable) is recyclable
    assert isinstance(model, IncrementalPrediction) is (tiled > 0)
    assert model.wants_stamps is stamps
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 4, (60, 2))
    y = np.sin(x[:, :1])
    kw = {"t": np.arange(60.0)} if stamps else {}
    model.update(x[:30], y[:30], **{k: v[:30] for k, v in kw.items()})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = torch.as_tensor(x[:5])
    mean_before = model.predict(probe)[0].clone()
    model.begin_update()  # undo: the state and the prediction return exactly
    model.update(x[30:], y[30:] + 3.0, **{k: v[30:] for k, v in kw.items()})
    model.rollback()
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(model.predict(probe)[0], mean_before)
    with pytest.raises(RuntimeError):
        model.rollback()  # nothing to undo
