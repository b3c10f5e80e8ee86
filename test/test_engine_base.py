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

GP_DIR = Path(__file__).resolve().parents[1] / "gp_mapping" / "gp"


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
