"""The typed configuration: the shipped YAML loads, and bad values or unknown keys are refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from support.paths import REPO_ROOT
from gp_mapping.config import (ConfigError, MapperConfig, config_from_dict, field_specs, load_config,
                               to_flat_parameters)


def test_shipped_yaml_is_the_defaults_and_documents_every_key():
    assert load_config(REPO_ROOT / "config/mapper.yaml") == MapperConfig()
    text = (REPO_ROOT / "config/mapper.yaml").read_text()
    for name in field_specs():
        section, key = name.split(".")
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(key + ":")), None)
        assert line is not None and "#" in line, f"{name} is not documented in config/mapper.yaml"


def test_ros_parameter_file_form_and_dotted_keys(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "use_sim_time": True, "model": {"kernel": "rbf", "num_inducing": 64}, "grid.resolution": 0.25}}}))
    config = load_config(path)
    assert config.model.kernel == "rbf" and config.model.num_inducing == 64
    assert config.grid.resolution == 0.25
    assert config.sync == MapperConfig().sync


def test_flat_parameters_round_trip():
    config = config_from_dict({"model": {"rho": 0.5}, "sync": {"sensor_translation": [0.1, 0, 0.2]}})
    flat = to_flat_parameters(config)
    assert flat["model.rho"] == 0.5 and flat["sync.sensor_translation"] == [0.1, 0.0, 0.2]
    assert config_from_dict(flat) == config


@pytest.mark.parametrize("values, names", [
    ({"model": {"num_inducing": 0}}, ["model.num_inducing", "[1, 8192]"]),
    ({"model": {"rho": 1.5}}, ["model.rho", "(0.0, 1.0]"]),
    ({"model": {"rho": 0.0}}, ["model.rho", "(0.0, 1.0]"]),
    ({"model": {"kernel": "cosine"}}, ["model.kernel", "'matern52'"]),
    ({"grid": {"resolution": -1.0}}, ["grid.resolution", "too small"]),
    ({"grid": {"resolution": float("nan")}}, ["grid.resolution", "not finite"]),
    ({"model": {"num_inducing": 12.5}}, ["model.num_inducing", "not an integer"]),
    ({"model": {"ard": "yes"}}, ["model.ard", "not a boolean"]),
    ({"model": {"ard": True, "lengthscales": "per_axis"}}, ["model.ard", "old name"]),
    ({"model": {"lengthscales": "planar"}}, ["model.lengthscales", "'horizontal'"]),
    ({"sync": {"sensor_rotation": [0, 0, 1]}}, ["sync.sensor_rotation", "length 4"]),
    ({"sync": {"sensor_translation": [0, float("inf"), 0]}}, ["sync.sensor_translation", "non-finite"]),
    ({"model": {"kernal": "rbf"}}, ["unknown config key 'model.kernal'", "kernel"]),
    ({"modle": {"kernel": "rbf"}}, ["unknown config key 'modle'", "model"]),
    ({"model": 3}, ["'model' must be a section"]),
])
def test_bad_values_are_refused_by_name(values, names):
    with pytest.raises(ConfigError) as err:
        config_from_dict(values)
    for fragment in names:
        assert fragment in str(err.value)


@pytest.mark.parametrize("ard, lengthscales", [(True, "per_axis"), (False, "isotropic")])
def test_the_old_ard_key_still_loads(ard, lengthscales):
    assert config_from_dict({"model": {"ard": ard}}).model.lengthscales == lengthscales
    assert config_from_dict({"model.ard": ard}).model.lengthscales == lengthscales


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"a": {"ros__parameters": {}}, "b": {"ros__parameters": {}}}))
    with pytest.raises(ConfigError, match="exactly one node entry"):
        load_config(two)


def test_every_field_has_a_rule_and_a_doc():
    for name, f in field_specs().items():
        assert f.metadata["doc"], name
        if f.type in ("int", "float"):
            assert f.metadata["low"] is not None and f.metadata["high"] is not None, name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.metadata["choices"]:
            assert default in f.metadata["choices"], name
