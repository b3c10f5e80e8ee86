"""Checkpoints: atomic, complete, code-free; a node killed with SIGKILL resumes from its last checkpoint; bad files
(truncated, corrupt, mismatched, carrying a pickle payload) give a clear error and execute nothing."""
from __future__ import annotations

import os
import pickle
import signal
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gp_mapping.config import config_from_dict, to_dict
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import FORMAT, SCHEMA_VERSION, MapStateError, read_state, write_state

torch.set_num_threads(1)
Q = [0.0, 0.0, 0.0, 1.0]


def small_config(**sections):
    base = {"model": {"num_inducing": 16, "memory_size": 50, "hyper_steps": 3, "device": "cpu"},
            "batching": {"size": 30}, "grid": {"resolution": 0.5, "tile_size": 1000}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def feed(mapper, t0: float, t1: float) -> int:
    n = 0
    for t in np.round(np.arange(t0, t1, 0.1), 6):
        t = float(t)
        mapper.add_pose(t, [np.sin(0.3 * t), np.cos(0.2 * t), 0.0], Q)
        mapper.add_magnetic_field(t + 0.05, [(50 + np.sin(0.3 * t)) * 1e-6, 0.0, 0.0], "mag")
        n += 1
        mapper.process()
    return n


class Payload:
    """Unpickling this runs ``open(sentinel, 'w')``: it must never happen when a state file is read."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def test_checkpoint_is_the_whole_state_and_resumes_bit_identically(tmp_path):
    config = small_config()
    a = Mapper(config)
    feed(a, 0.0, 20.0)
    path = tmp_path / "ckpt.safetensors"
    assert a.checkpoint(path) == path and a.checkpoints == 1
    state = read_state(path)
    assert state.config == to_dict(config)  # the config it was made with travels with it
    assert state.info["checkpoints"] == 1 and int(state.arrays["pending_x"].shape[0]) == a.num_pending > 0
    b = Mapper.load(path, config)
    assert b.diagnostics() == {**a.diagnostics(), "last_update_seconds": b.diagnostics()["last_update_seconds"],
                               "median_update_seconds": b.diagnostics()["median_update_seconds"]}
    # the same future: both continue with the same data and stay identical, batches included
    feed(a, 20.0, 30.0)
    feed(b, 20.0, 30.0)
    a.flush(), b.flush()
    ga, gb = a.grid(), b.grid()
    np.testing.assert_array_equal(ga.layers["magnitude"][0], gb.layers["magnitude"][0])
    np.testing.assert_array_equal(ga.layers["magnitude"][1], gb.layers["magnitude"][1])
    assert a.diagnostics()["updates"] == b.diagnostics()["updates"]
    # no temporary file is left behind by the atomic write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_checkpoint_write_is_atomic_the_old_file_survives_a_failed_write(tmp_path, monkeypatch):
    mapper = Mapper(small_config())
    feed(mapper, 0.0, 10.0)
    path = tmp_path / "ckpt.safetensors"
    mapper.checkpoint(path)
    before = path.read_bytes()
    feed(mapper, 10.0, 20.0)

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(MapStateError, match="No space left"):
        mapper.checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and mapper.checkpoints == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
    read_state(path)  # still valid


def test_a_map_saved_with_the_old_ard_key_loads_with_per_axis_lengthscales(tmp_path):
    """model.ard (before model.lengthscales) in a saved map's config: true means per_axis, and the map loads."""
    mapper = Mapper(small_config(model={"lengthscales": "per_axis"}))
    feed(mapper, 0.0, 10.0)
    path = tmp_path / "ckpt.safetensors"
    mapper.checkpoint(path)
    state = read_state(path)
    del state.config["model"]["lengthscales"]
    state.config["model"]["ard"] = True
    write_state(path, state)
    loaded = Mapper.load(path)
    assert loaded.config.model.lengthscales == "per_axis"
    x = np.array([[0.5, 0.2], [1.0, -0.3]])
    assert np.array_equal(loaded.model.predict(x)[0].detach().numpy(), mapper.model.predict(x)[0].detach().numpy())


def _saved_before_the_key_existed(tmp_path, key: str, value):
    """A mapper made with model.``key`` = ``value``, fed and saved without that key in its config (a file written
    before the key existed), loaded back without a config: (the mapper, the file, the loaded mapper), after checking
    that the loaded one has ``value`` and predicts as the saved one."""
    mapper = Mapper(small_config(model={key: value}))
    feed(mapper, 0.0, 10.0)
    path = tmp_path / "ckpt.safetensors"
    mapper.checkpoint(path)
    state = read_state(path)
    del state.config["model"][key]
    write_state(path, state)
    loaded = Mapper.load(path)
    assert getattr(loaded.config.model, key) == value
    x = np.array([[0.5, 0.2], [1.0, -0.3]])
    assert np.array_equal(loaded.model.predict(x)[0].detach().numpy(), mapper.model.predict(x)[0].detach().numpy())
    return mapper, path, loaded


def test_a_map_saved_before_kernel_scales_existed_loads_with_one_kernel(tmp_path):
    """A saved map's config without model.kernel_scales was made with one kernel (the default is now two): it
    loads as one, predicts as saved, and a config asking for two scales is refused by name."""
    _, path, _ = _saved_before_the_key_existed(tmp_path, "kernel_scales", 1)
    with pytest.raises(MapStateError, match=r"model.kernel_scales = 1, but the config asks for 2"):
        Mapper.load(path, small_config())


def test_a_map_saved_before_time_error_existed_loads_with_white_noise(tmp_path):
    """A saved map's config without model.time_error was made with white noise alone (the default is now an error
    in time beside it): it loads as white noise and predicts as saved; a config asking for the error in time is
    refused by name, and the same map saved with it resumes under today's defaults."""
    _, path, loaded = _saved_before_the_key_existed(tmp_path, "time_error", False)
    assert not loaded.model.wants_stamps
    with pytest.raises(MapStateError, match=r"model.time_error = False, but the config asks for True"):
        Mapper.load(path, small_config())
    shipped = Mapper(small_config())
    feed(shipped, 0.0, 10.0)
    shipped.checkpoint(path)
    assert Mapper.load(path, small_config()).model.wants_stamps


def test_resume_with_an_incompatible_config_names_the_mismatch(tmp_path):
    mapper = Mapper(small_config())
    feed(mapper, 0.0, 10.0)
    path = tmp_path / "ckpt.safetensors"
    mapper.checkpoint(path)
    with pytest.raises(MapStateError, match=r"model.kernel = 'matern52', but the config asks for 'rbf'"):
        Mapper.load(path, small_config(model={"kernel": "rbf"}))
    with pytest.raises(MapStateError, match=r"sync.target"):
        Mapper.load(path, small_config(sync={"target": "vector"}))
    with pytest.raises(MapStateError, match=r"model.lengthscales = 'horizontal', but the config asks for 'per_axis'"):
        Mapper.load(path, small_config(model={"lengthscales": "per_axis"}))
    # grid, batching and node settings may change
    Mapper.load(path, small_config(grid={"resolution": 0.25}, batching={"size": 10}))


def _files(tmp_path: Path, good: Path) -> dict[str, Path]:
    """Bad state files of every kind."""
    data = good.read_bytes()
    out = {}
    for name, content in (("empty", b""), ("truncated_header", data[:6]), ("truncated_data", data[:-100]),
                          ("half", data[:len(data) // 2])):
        out[name] = tmp_path / f"{name}.safetensors"
        out[name].write_bytes(content)
    flipped = bytearray(data)
    flipped[-50] ^= 0x01
    out["bit_flip"] = tmp_path / "bit_flip.safetensors"
    out["bit_flip"].write_bytes(bytes(flipped))
    return out


def test_truncated_and_corrupt_files_are_refused_by_name(tmp_path):
    mapper = Mapper(small_config())
    feed(mapper, 0.0, 10.0)
    good = tmp_path / "good.safetensors"
    mapper.checkpoint(good)
    for name, path in _files(tmp_path, good).items():
        with pytest.raises(MapStateError, match=r"truncated|corrupt|checksum") as err:
            Mapper.load(path)
        assert str(path) in str(err.value), name


@pytest.mark.parametrize("container", ["raw_pickle", "torch_save", "npz_object_array", "pickle_in_metadata"])
def test_a_file_carrying_a_pickle_payload_is_refused_and_nothing_runs(tmp_path, container):
    sentinel = tmp_path / "PWNED"
    payload = Payload(sentinel)
    # The payload works: unpickling it does create the sentinel (then it is removed again).
    pickle.loads(pickle.dumps(payload)).close()
    assert sentinel.exists()
    sentinel.unlink()

    path = tmp_path / "map.safetensors"
    if container == "raw_pickle":
        path.write_bytes(pickle.dumps({"model/Z": payload}))
    elif container == "torch_save":
        torch.save({"model/Z": payload}, path)
        assert zipfile.is_zipfile(path)
    elif container == "npz_object_array":
        with open(path, "wb") as fh:
            np.savez(fh, model=np.array([payload], dtype=object))
    else:
        # A well-formed safetensors file whose metadata smuggles a pickle into the config.
        from safetensors.torch import save

        raw = save({"model/x": torch.zeros(1)}, metadata={"format": FORMAT, "schema_version": str(SCHEMA_VERSION),
                                                        "config": pickle.dumps(payload).hex(), "info": "{}",
                                                        "checksum": "0"})
        path.write_bytes(raw)
    with pytest.raises(MapStateError) as err:
        Mapper.load(path)
    assert str(path) in str(err.value)
    assert not sentinel.exists()


# ------------------------------------------------------------------------------- a real node, killed


def _accepted_in(checkpoint: Path) -> int:
    """Accepted-sample count in a checkpoint file; 0 while there is none (files are replaced atomically)."""
    try:
        return int(read_state(checkpoint).info["accepted"])
    except (MapStateError, FileNotFoundError):
        return 0


def test_node_killed_with_sigkill_resumes_from_its_last_checkpoint(tmp_path, ros_env):
    """The node checkpoints every second while it maps; SIGKILL mid-stream; the restarted node resumes from the
    checkpoint (logged), having lost at most the messages of one checkpoint interval, and keeps mapping."""
    from support.mapper_process import (MapperProcess, diagnostic_values, node_env, publish_recording, simulate,
                                        subscribe_map, wait_for_node, write_params)
    from support.ros import RosHarness

    interval = 1.0
    params = write_params(tmp_path / "params.yaml", node={"checkpoint_interval_s": interval}, batching={"size": 25})
    rec = simulate()
    env = node_env(ros_env, tmp_path)
    name = "mapper_sigkill"
    checkpoint = tmp_path / "gp_mapping" / f"{name}_checkpoint.safetensors"
    with RosHarness("sigkill_test") as harness:
        proc = MapperProcess(tmp_path, env, params, name=name, batch=25)
        try:
            view = subscribe_map(harness, proc)
            wait_for_node(harness, view, proc)
            start = time.monotonic()
            sent = publish_recording(harness, proc, rec, "pose_stamped", count=250)
            rate = sent / (time.monotonic() - start)  # magnetometer messages per second of wall time
            # Checkpoints are timed, so the first ones may predate the burst's processing: wait for one that
            # holds the burst (up to one batch in flight) and for a second timer firing.
            harness.spin_until(lambda: int(diagnostic_values(view).get("node/checkpoints_written", "0")) >= 2
                               and _accepted_in(checkpoint) >= 250 - 25, 30.0, "a checkpoint holding the burst")
            later = SimpleNamespace(**{k: getattr(rec, k)[250:400] for k in
                                       ("t", "position", "orientation_xyzw", "field_sensor_tesla")})
            sent += publish_recording(harness, proc, later, "pose_stamped")
            harness.spin_for(0.3)
            os.killpg(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait(timeout=10)
            assert proc.proc.returncode == -signal.SIGKILL
        finally:
            proc.stop()
        saved = read_state(checkpoint)  # the file is whole: no partial write survives a SIGKILL
        restored = saved.info["accepted"]
        print(f"checkpoint holds {restored} accepted samples of {sent} sent; publish rate {rate:.0f}/s")

        proc2 = MapperProcess(tmp_path, env, params, name=name, batch=25, log="resumed.log")
        with proc2:
            view2 = subscribe_map(harness, proc2)
            wait_for_node(harness, view2, proc2)
            assert "resumed from the checkpoint" in proc2.output
            values = diagnostic_values(view2)
            assert int(values["accepted"]) == restored and int(values["checkpoints"]) >= 2
            # Lost: what arrived after the last checkpoint, at most one interval of the stream (plus the 0.3 s
            # the test waited and the time the kill took).
            lost = sent - restored
            assert lost <= rate * (interval + 0.3 + 0.5) + 25, (lost, rate)
            assert restored >= 250 - 25  # at least everything before the second burst (up to one batch in flight)
            # It maps on from there: new data after the old stamps are accepted.
            harness.spin_until(lambda: bool(view2.mean), 30.0, "the resumed map")
    print(f"SIGKILL: {lost} of {sent} samples lost (interval {interval} s at {rate:.0f} msg/s)")


def test_node_refuses_to_start_on_an_incompatible_or_corrupt_checkpoint(tmp_path, ros_env):
    from support.mapper_process import MapperProcess, node_env, write_params

    env = node_env(ros_env, tmp_path)
    checkpoint = tmp_path / "ckpt.safetensors"
    mapper = Mapper(small_config())
    feed(mapper, 0.0, 5.0)
    mapper.checkpoint(checkpoint)
    before = checkpoint.read_bytes()
    params = write_params(tmp_path / "params.yaml", node={"checkpoint_interval_s": 1.0,
                                                           "checkpoint_path": str(checkpoint)},
                          model={"kernel": "rbf"})
    with MapperProcess(tmp_path, env, params) as proc:
        assert proc.wait(timeout=60.0) == 2, proc.output
        out = proc.output
    assert "cannot resume from the checkpoint" in out and "model.kernel" in out and "node.resume" in out
    assert checkpoint.read_bytes() == before  # the learned map is never overwritten by an empty one
