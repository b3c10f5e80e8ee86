"""The engine contract (gp/base.py): every registered engine is an Engine, gp/ stands alone, and device and
setting errors name the key the way the layer that reads it knows it."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from gp_mapping.config import ConfigError, config_from_dict
from gp_mapping.gp import ENGINES, Engine, ModelConfig, build_model, resolve_device
from gp_mapping.mapping import Mapper

GP_DIR = Path(__file__).resolve().parents[2] / "gp_mapping" / "gp"


def test_gp_imports_nothing_from_the_package_outside_gp():
    for path in sorted(GP_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                outside = node.level >= 2 or (node.level == 0 and (node.module or "").startswith("gp_mapping")
                                              and not (node.module or "").startswith("gp_mapping.gp"))
                assert not outside, f"{path.name}:{node.lineno} imports {'.' * node.level}{node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("gp_mapping") or alias.name.startswith("gp_mapping.gp"), \
                        f"{path.name}:{node.lineno} imports {alias.name}"


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_keeps_the_contract_through_a_state_round_trip(name):
    config = ModelConfig(engine=name, num_inducing=16, hyper_steps=2, device="cpu")
    model = build_model(config, 2, 1)
    assert isinstance(model, Engine) and model.device == torch.device("cpu")
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (60, 2))
    y = np.sin(x[:, :1]) + 0.05 * rng.standard_normal((60, 1))
    stats = model.update(x, y)
    assert isinstance(stats, dict) and model.num_seen == 60 and model.num_updates == 1
    mean, var = model.predict(x[:7])
    assert mean.shape == var.shape == (7, 1) and bool((var >= 0).all())
    assert model.log_predictive_density(x[:7], y[:7]).shape == (7, 1)
    fresh = build_model(config, 2, 1)
    fresh.load_state_dict(model.state_dict())  # resizable state takes the saved shapes
    mean2, var2 = fresh.predict(x[:7])
    assert torch.equal(mean, mean2) and torch.equal(var, var2)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_predicts_its_prior_before_any_reading_and_far_from_its_data(name):
    """A map asked before its first reading (a node's first grid, a localizer started early) answers with its
    prior, and far from its data it says the same variance as there: smc_experts raised IndexError on a fresh
    map (no expert to gate yet)."""
    config = ModelConfig(engine=name, num_inducing=16, hyper_steps=2, device="cpu")
    model = build_model(config, 2, 1)
    mean, var = model.predict(np.zeros((3, 2)))
    assert torch.isfinite(mean).all() and bool((var > 0).all())
    reading_mean, reading_var = model.predict_reading(np.zeros((3, 2)))
    assert torch.isfinite(reading_mean).all() and bool((reading_var >= var).all())
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (60, 2))
    model.update(x, np.sin(x[:, :1]) + 0.05 * rng.standard_normal((60, 1)))
    prior = model._prior_latent_variance()
    _, far = model.predict(np.full((1, 2), 1.0e4))
    assert prior.shape == (1,) and torch.allclose(prior, far[0], rtol=1e-6)
    _, near = model.predict(x[:5])
    assert bool((near < prior).all())


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ENGINES))
@pytest.mark.parametrize("outputs", [1, 3])
def test_every_engine_on_cuda_matches_the_cpu_and_its_state_loads_on_the_cpu(name, outputs):
    """The same stream on the GPU and the CPU (float64 both, random draws from CPU generators): the same map
    within reduction-order rounding, outputs on the GPU, and a state saved on the GPU that predicts the same on
    the CPU."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, (120, 2))
    y = np.column_stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 0] * x[:, 1]])[:, :outputs]
    y = y + 0.05 * rng.standard_normal(y.shape)
    models = {}
    for device in ("cpu", "cuda"):
        config = ModelConfig(engine=name, num_inducing=24, hyper_steps=3, device=device)
        model = build_model(config, 2, outputs)
        for lo in range(0, 120, 40):
            model.update(x[lo:lo + 40], y[lo:lo + 40])
        models[device] = model
    test_x = rng.uniform(-2, 2, (50, 2))
    (mc, vc), (mg, vg) = models["cpu"].predict(test_x), models["cuda"].predict(test_x)
    assert mg.device.type == vg.device.type == "cuda" and bool(torch.isfinite(mg).all() & (vg >= 0).all())
    np.testing.assert_allclose(mg.cpu().numpy(), mc.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(vg.cpu().numpy(), vc.numpy(), rtol=1e-6, atol=1e-6)
    moved = build_model(ModelConfig(engine=name, num_inducing=24, hyper_steps=3, device="cpu"), 2, outputs)
    moved.load_state_dict({k: v.cpu() if torch.is_tensor(v) else v for k, v in models["cuda"].state_dict().items()})
    mm, vm = moved.predict(test_x)
    np.testing.assert_allclose(mm.numpy(), mg.cpu().numpy(), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(vm.numpy(), vg.cpu().numpy(), rtol=1e-9, atol=1e-9)


def test_device_settings_cuda_n_and_the_key_named_by_each_layer():
    assert resolve_device("cpu") == torch.device("cpu")
    assert config_from_dict({"model": {"device": "cuda:1"}}).model.device == "cuda:1"
    with pytest.raises(ConfigError, match=r"model\.device.*'cuda:N'"):
        config_from_dict({"model": {"device": "cuda:one"}})
    with pytest.raises(ConfigError, match="^config key 'device'"):  # gp/ names its own setting
        resolve_device("gpu")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        with pytest.raises(ConfigError, match=f"{count} CUDA device"):
            resolve_device(f"cuda:{count}")
        return
    with pytest.raises(ConfigError, match="^config key 'device'.*not available"):
        build_model({"device": "cuda:0"}, 2, 1)
    with pytest.raises(ConfigError, match="^config key 'model.device'.*not available"):  # the Mapper: the YAML key
        Mapper(config_from_dict({"model": {"device": "cuda:0"}}))
    with pytest.raises(ConfigError, match="^config key 'model.inducing'"):
        Mapper(config_from_dict({"model": {"inducing": "grid"}, "sync": {"input_dims": 3}}))


def test_symmetrise_is_exactly_half_of_a_plus_its_transpose_in_every_layout():
    """symmetrise copies A^T into A's layout before adding (mixed layouts are several times slower): the result
    must be (A + A^T) / 2 bit for bit for row-major, column-major (LAPACK's results), batched and 1 x 1 inputs,
    leave its input untouched, and pass gradients (learned inducing inputs differentiate through it)."""
    from gp_mapping.gp.base import symmetrise

    g = torch.Generator().manual_seed(0)
    row = torch.randn(7, 7, dtype=torch.float64, generator=g)
    cases = {"row-major": row, "column-major": row.mT, "batched": torch.randn(3, 5, 5, dtype=torch.float64, generator=g),
             "batched column-major": torch.randn(2, 6, 6, dtype=torch.float64, generator=g).mT,
             "1 x 1": torch.ones(1, 1, 1, dtype=torch.float64)}
    for name, a in cases.items():
        before = a.clone()
        out = symmetrise(a)
        assert torch.equal(out, 0.5 * (a + a.transpose(-1, -2))), name
        assert torch.equal(out, out.transpose(-1, -2)) and torch.equal(a, before), name
        assert out.data_ptr() != a.data_ptr(), name
    leaf = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.randn(4, 4, dtype=torch.float64, generator=g)
    (symmetrise(leaf) * weights).sum().backward()
    assert torch.allclose(leaf.grad, 0.5 * (weights + weights.T), rtol=0, atol=1e-15)
