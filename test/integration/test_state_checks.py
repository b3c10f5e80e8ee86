"""State files are checked before use (issue 38, item 2): every tensor finite, shapes consistent with the config,
metadata of the right types, frame and unit equal to the node's, and named reasons for malformed headers. One
check (gp_mapping.mapping.state.check_state / check_model, called by Mapper.load) serves the node's
node.initial_map and ~/load_map, export, merge and replay --save-state."""
from __future__ import annotations

import json
import struct
import types

import numpy as np
import pytest
import torch

from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import (FORMAT, SCHEMA_VERSION, STATE_ERROR_REASONS, MapStateError, read_state,
                                      write_state)
from support.state import fed_mapper, small_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("states") / "good.safetensors"
    fed_mapper(small_config()).save(path)
    return path


def rewritten(good, tmp_path, change, name="bad.safetensors"):
    """``good`` read, changed by ``change(state)``, written again (a valid checksum over the changed contents)."""
    state = read_state(good)
    change(state)
    path = tmp_path / name
    write_state(path, state)
    return path


def refused(path, reason, config=None, match=None):
    with pytest.raises(MapStateError) as err:
        Mapper.load(path, config=config)
    assert err.value.reason == reason, str(err.value)
    assert reason in STATE_ERROR_REASONS
    if match:
        assert match in str(err.value)
    return str(err.value)


def _first(state, suffix):
    return next(k for k in state.model_state if k.endswith(suffix))


def _nan_in_model(state):
    key = _first(state, "engine.a_w")
    state.model_state[key] = torch.full_like(state.model_state[key], float("nan"))


def test_a_good_state_loads_and_maps_the_same(good):
    mapper = Mapper.load(good, config=small_config())
    assert mapper.updates > 0 and np.all(np.isfinite(mapper.grid().layers["magnitude"][0]))


@pytest.mark.parametrize("what, change, reason", [
    ("NaN in a model tensor", _nan_in_model, "non_finite"),
    ("an infinity in the trajectory", lambda s: s.arrays["trajectory"].__setitem__((0, 0), np.inf), "non_finite"),
    ("inducing inputs with 3 columns in a 2-D map",
     lambda s: s.model_state.__setitem__(_first(s, "engine.Z"), torch.zeros(4, 3, dtype=torch.float64)), "shape"),
    ("a model tensor of another dtype",
     lambda s: s.model_state.__setitem__(_first(s, "engine.a_w"), s.model_state[_first(s, "engine.a_w")].float()),
     "shape"),
    ("pending inputs with 3 columns", lambda s: s.arrays.__setitem__("pending_x", np.zeros((2, 3))), "shape"),
    ("pending rows that do not go together",
     lambda s: s.arrays.__setitem__("pending_t", np.zeros(5)), "shape"),
    ("a model tensor missing", lambda s: s.model_state.pop(_first(s, "scale_std")), "model_mismatch"),
    ("num_seen: 'lots'", lambda s: s.info.__setitem__("num_seen", "lots"), "metadata"),
    ("a counter that is a string", lambda s: s.info.__setitem__("accepted", "lots"), "metadata"),
    ("a negative count", lambda s: s.info["rejected"].__setitem__("pose_gap", -3), "metadata"),
    ("a stamp that is a list", lambda s: s.info.__setitem__("last_stamp", [1, 2]), "metadata"),
    ("a resolution of zero", lambda s: s.info.__setitem__("coverage_resolution", 0), "metadata"),
    ("a lineage of numbers", lambda s: s.info.__setitem__("lineage", [1, 2]), "metadata"),
])
def test_malformed_contents_with_a_valid_checksum_are_refused_by_name(good, tmp_path, what, change, reason):
    path = rewritten(good, tmp_path, change)
    refused(path, reason)  # export and merge load without a config
    refused(path, reason, config=small_config())  # the node's initial_map and ~/load_map


def test_frame_and_unit_must_equal_the_nodes(good, tmp_path):
    odom = rewritten(good, tmp_path, lambda s: s.config["grid"].__setitem__("frame_id", "odom"), "odom.safetensors")
    message = refused(odom, "frame_mismatch", config=small_config(), match="grid.frame_id = 'odom'")
    assert "'map'" in message
    Mapper.load(odom, config=small_config(**{"grid.frame_id": "odom"}))  # a node mapping in odom takes it
    Mapper.load(odom)  # export: the file's own frame
    nano = rewritten(good, tmp_path, lambda s: s.config["sync"].__setitem__("field_unit", "nanotesla"))
    refused(nano, "unit_mismatch", config=small_config())


def _raw_state(tmp_path, header: bytes, payload: bytes = b"", name="raw.safetensors"):
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return path


def _meta():
    return {"format": FORMAT, "schema_version": str(SCHEMA_VERSION), "config": "{}", "info": "{}", "checksum": "x"}


def test_malformed_headers_are_refused_by_name_never_with_a_raw_python_error(tmp_path):
    huge = b'{"__metadata__": ' + json.dumps(_meta()).encode() + \
        b', "model/a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 1e999]}}'
    refused(_raw_state(tmp_path, huge, b"\0" * 8, "huge.safetensors"), "bad_offsets")
    floats = huge.replace(b"1e999", b"8.0")
    refused(_raw_state(tmp_path, floats, b"\0" * 8, "floats.safetensors"), "bad_offsets")
    negative = huge.replace(b"[0, 1e999]", b"[-8, 0]")
    refused(_raw_state(tmp_path, negative, b"", "negative.safetensors"), "bad_offsets")
    deep = b'{"__metadata__": ' + json.dumps(_meta()).encode() + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    refused(_raw_state(tmp_path, deep, b"", "deep.safetensors"), "header_too_deep")
    digits = b'{"__metadata__": ' + json.dumps(_meta()).encode() + b', "x": ' + b"9" * 5000 + b"}"
    refused(_raw_state(tmp_path, digits, b"", "digits.safetensors"), "corrupt_header")
    entry = b'{"__metadata__": ' + json.dumps(_meta()).encode() + b', "model/a": "not a mapping"}'
    refused(_raw_state(tmp_path, entry, b"", "entry.safetensors"), "corrupt_header")


def test_deeply_nested_or_mistyped_metadata_is_refused_by_name(good, tmp_path):
    from safetensors.torch import save

    state = read_state(good)
    tensors = {f"model/{k}": v.contiguous() for k, v in state.model_state.items()}
    tensors.update({f"mapper/{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.arrays.items()})
    from gp_mapping.mapping.state import _checksum
    base = {"format": FORMAT, "schema_version": str(SCHEMA_VERSION), "config": json.dumps(state.config),
            "info": json.dumps(state.info), "checksum": _checksum(tensors)}
    for info, reason in (("[" * 50_000 + "]" * 50_000, "header_too_deep"), ("[1, 2]", "metadata"),
                         ("not json", "metadata")):
        path = tmp_path / "meta.safetensors"
        path.write_bytes(save(tensors, metadata={**base, "info": info}))
        refused(path, reason)


def test_a_model_that_cannot_predict_is_refused(good, tmp_path):
    def break_factor(state):  # finite, right shape, not a posterior: a hugely negative precision
        for key in [k for k in state.model_state if k.endswith("engine.W")]:
            state.model_state[key] = -1e12 * torch.ones_like(state.model_state[key])
    refused(rewritten(good, tmp_path, break_factor), "model_fails")


@pytest.mark.parametrize("keys", [
    {"model.tile_size": 0.0},
    {"model.engine": "continual_mogp", "sync.target": "vector", "sync.input_dims": 3, "model.tile_size": 0.0},
    {"model.engine": "smc_experts", "model.smc_particles": 4},
    {"model.engine": "var_gp", "model.vargp_block_size": 8, "sync.target": "vector"},
], ids=["dual_svgp_global", "continual_mogp_vector_3d", "smc_experts", "var_gp_vector"])
def test_every_engines_states_pass_the_checks_fresh_and_after_updates(tmp_path, keys):
    config = small_config(**keys)
    for name, mapper in (("fresh", Mapper(config)), ("fed", fed_mapper(config, n=40))):
        path = tmp_path / f"{name}.safetensors"
        mapper.save(path)
        Mapper.load(path, config=config)


def test_export_and_merge_of_a_nan_state_end_with_one_line_and_status_1(good, tmp_path, capsys):
    from gp_mapping.cli import main

    bad = rewritten(good, tmp_path, _nan_in_model)
    for argv in (["export", str(bad), "--out", str(tmp_path / "e")],
                 ["merge", str(bad), str(good), "--out", str(tmp_path / "m")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "non-finite" in err, err


def test_replay_save_state_reads_back_what_it_wrote(good, tmp_path):
    from gp_mapping.replay import _save_state

    mapper = Mapper.load(good)
    result = types.SimpleNamespace(mapper=mapper, files={})
    _save_state(result, tmp_path / "ok.safetensors")
    assert result.files["state"] == tmp_path / "ok.safetensors"
    with torch.no_grad():
        for key, value in mapper.model.state_dict().items():
            if key.endswith("engine.a_w"):
                value.fill_(float("nan"))
    result = types.SimpleNamespace(mapper=mapper, files={})
    with pytest.raises(MapStateError) as err:
        _save_state(result, tmp_path / "nan.safetensors")
    assert err.value.reason == "non_finite" and "state" not in result.files


def test_the_node_refuses_bad_states_by_name_at_start_and_on_load_map(good, tmp_path):
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter
    from std_srvs.srv import Trigger

    from gp_mapping.ros.mapper_node import MapperNode, NodeStartError

    params = {"model.num_inducing": 16, "model.memory_size": 30, "model.hyper_steps": 2, "model.device": "cpu",
              "batching.size": 20, "grid.resolution": 0.25}
    nan = rewritten(good, tmp_path, _nan_in_model, "nan.safetensors")
    odom = rewritten(good, tmp_path, lambda s: s.config["grid"].__setitem__("frame_id", "odom"), "odom.safetensors")
    context = Context()
    rclpy.init(context=context)
    try:
        def make(**extra):
            overrides = [Parameter(k, value=v) for k, v in {**params, **extra}.items()]
            return MapperNode(context=context, parameter_overrides=overrides)

        with pytest.raises(NodeStartError, match="non-finite"):
            make(**{"node.initial_map": str(nan)})
        long_name = str(tmp_path / ("x" * 200_000))
        with pytest.raises(NodeStartError) as err:
            make(**{"node.initial_map": long_name})
        assert len(str(err.value)) < 1000  # a 200 kB value is quoted by its start
        node = make(**{"node.initial_map": str(good)})
        try:
            seen = node.mapper.diagnostics()["num_seen"]
            for path, reason in ((nan, "non_finite"), (odom, "frame_mismatch")):
                node.set_parameters([Parameter("node.initial_map", value=str(path))])
                answer = node.on_load_map(Trigger.Request(), Trigger.Response())
                assert not answer.success and f"({reason})" in answer.message, answer.message
                assert node.mapper.diagnostics()["num_seen"] == seen  # the map stays
            node.set_parameters([Parameter("node.initial_map", value=str(good))])
            assert node.on_load_map(Trigger.Request(), Trigger.Response()).success
        finally:
            node.close()
    finally:
        context.try_shutdown()
