"""The Mapper end to end on a synthetic field with the real GP engine, and its state files.

Truth: |B| = 50 + 3 sin(x) cos(y) microtesla, read by a magnetometer carried along a lawnmower path over
[0, 3] x [0, 3] m (lanes 0.3 m apart, 20 Hz poses, 40 Hz field samples). The field varies on a ~1.5 m
scale and is sampled far more densely than that, without noise, so what is left is the error of the sparse
approximation (M = 48 inducing points over 9 m^2, about 0.4 m apart, against a ~1 m lengthscale) and of the
hyperparameters still being learned online. The bound on the visited-cell RMSE is 0.05 uT, under 2% of the
3 uT amplitude; the measured value is about 0.003 uT (0.003-0.005 uT per component for the vector target).
"""
import json
import math
import os

import numpy as np
import pytest
import torch

from gp_mapping.config import ConfigError, config_from_dict
from gp_mapping.mapping.frames import quaternion_from_rpy, rotate_vectors
from gp_mapping.mapping.mapper import Mapper, vector_layers
from gp_mapping.mapping.state import SCHEMA_VERSION, MapState, MapStateError, read_state, write_state

torch.set_num_threads(1)


def truth(x, y):
    return 50.0 + 3.0 * np.sin(x) * np.cos(y)


def truth_vector(x, y):
    """A smooth map-frame field (uT) whose components all vary."""
    return np.stack([20.0 + 2.0 * np.sin(x), -5.0 + 2.0 * np.cos(y), -42.0 + np.sin(x + y)], axis=-1)


def lawnmower(rate=20.0, speed=0.6, lane=0.3, extent=3.0):
    """Stamps, positions and headings of a boustrophedon over [0, extent]^2 at constant speed."""
    pts = []
    for k, y in enumerate(np.arange(0.0, extent + 1e-9, lane)):
        xs = (0.0, extent) if k % 2 == 0 else (extent, 0.0)
        pts += [(xs[0], y), (xs[1], y)]
    pts = np.array(pts)
    seg = np.linalg.norm(np.diff(pts, axis=0), axis=1)
    s_knots = np.concatenate([[0.0], np.cumsum(seg)])
    t = np.arange(0.0, s_knots[-1] / speed, 1.0 / rate)
    s = t * speed
    xy = np.stack([np.interp(s, s_knots, pts[:, 0]), np.interp(s, s_knots, pts[:, 1])], axis=1)
    d = np.gradient(xy, axis=0)
    yaw = np.arctan2(d[:, 1], d[:, 0])
    return t, np.column_stack([xy, np.zeros(len(t))]), yaw


def config(**sections):
    base = {
        "model": {"num_inducing": 48, "memory_size": 100, "memory_per_batch": 10, "hyper_steps": 10,
                  "lengthscale": 1.0, "device": "cpu"},
        "batching": {"mode": "count", "size": 150},
        "grid": {"resolution": 0.1, "margin": 0.3, "unknown_distance": 0.3, "tile_size": 500},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def feed(mapper, target="magnitude", field_rate=40.0, every=None, until=math.inf):
    """Stream poses and field samples (up to ``until`` seconds) merged by stamp. Returns stats, field count."""
    t, pos, yaw = lawnmower()
    keep = t < until
    t, pos, yaw = t[keep], pos[keep], yaw[keep]
    stats = []
    tf = np.arange(t[0] + 0.001, t[-1], 1.0 / field_rate)
    x = np.interp(tf, t, pos[:, 0])
    y = np.interp(tf, t, pos[:, 1])
    yaw_f = np.interp(tf, t, np.unwrap(yaw))
    if target == "magnitude":
        fields = np.column_stack([truth(x, y), np.zeros_like(x), np.zeros_like(x)]) * 1e-6
    else:
        b_map = truth_vector(x, y)
        # the sensor (identity extrinsic) reads the map-frame field in the body frame: R(yaw)^T b
        fields = rotate_vectors(quaternion_from_rpy(0.0, 0.0, -yaw_f), b_map) * 1e-6
    events = sorted([(s, 1, k) for k, s in enumerate(t)] + [(s, 0, k) for k, s in enumerate(tf)])
    for n, (s, kind, k) in enumerate(events):
        if kind == 1:
            mapper.add_pose(s, pos[k], quaternion_from_rpy(0.0, 0.0, yaw[k]))
        else:
            mapper.add_magnetic_field(s, fields[k])
        if every and n % every == 0:
            stats += mapper.process()
    stats += mapper.process()
    return stats, len(tf)


def visited_rmse(grid, fn, layer):
    """RMSE of a layer's mean against the truth on cells within 0.15 m of the path's interior."""
    c = grid.spec.cell_centres()
    inside = (c[:, 0] > 0.0) & (c[:, 0] < 3.0) & (c[:, 1] > 0.0) & (c[:, 1] < 3.0)
    mean = grid.layers[layer][0].ravel()
    mask = grid.known.ravel() & inside
    return float(np.sqrt(np.mean((mean[mask] - fn(c[mask, 0], c[mask, 1])) ** 2))), int(mask.sum())


@pytest.fixture(scope="module")
def mapped():
    mapper = Mapper(config())
    stats, n_fields = feed(mapper, every=97)
    stats += mapper.flush()
    return mapper, stats, n_fields


# ------------------------------------------------------------------------------------------- end to end


def test_magnitude_map_matches_truth_on_visited_cells(mapped):
    mapper, stats, n_fields = mapped
    grid = mapper.grid()
    assert set(grid.layers) == {"magnitude"} and grid.field_unit == "microtesla" and grid.frame_id == "map"
    rmse, cells = visited_rmse(grid, truth, "magnitude")
    print(f"visited-cell RMSE {rmse:.4f} uT over {cells} cells")
    assert cells > 500
    assert rmse < 0.05
    mean, var = grid.layers["magnitude"]
    assert mean.shape == var.shape == grid.known.shape == grid.spec.shape
    assert np.all(np.isfinite(mean)) and np.all(var >= 0)
    # the grown grid covers the path plus the margin, snapped to the 0.1 m lattice
    assert grid.spec.origin_x == pytest.approx(-0.3) and grid.spec.origin_y == pytest.approx(-0.3)
    assert grid.stamp == pytest.approx(mapper.diagnostics()["last_stamp"])


def test_counts_and_batches(mapped):
    mapper, stats, n_fields = mapped
    d = mapper.diagnostics()
    assert d["accepted"] + d["samples_rejected"] == n_fields and d["poses_rejected"] == 0
    assert d["rejected_total"] == d["rejected"]["no_pose_after"] <= 1  # only a last sample after the last pose
    sizes = [s["batch_size"] for s in stats]
    assert all(s == 150 for s in sizes[:-1]) and 0 < sizes[-1] <= 150
    assert sum(sizes) == d["accepted"] == d["num_seen"]
    assert d["updates"] == len(stats) and d["dropped"] == 0 and d["pending"] == 0
    assert d["median_update_seconds"] > 0
    stamps = [s["stamp"] for s in stats]
    assert stamps == sorted(stamps)
    assert len(mapper.trajectory) > 100 and mapper.trajectory.shape[1] == 2


def test_unknown_cells_far_from_the_path(mapped):
    """Known cells lie within grid.unknown_distance (+ half a cell diagonal) of the path, and vice versa."""
    mapper, _, _ = mapped
    grid = mapper.grid()
    _, pos, _ = lawnmower()
    c = grid.spec.cell_centres()
    d = np.min(np.linalg.norm(c[:, None, :] - pos[None, ::4, :2], axis=2), axis=1)
    known = grid.known.ravel()
    slack = 0.1 / math.sqrt(2) + 0.03  # half a cell diagonal, plus the path subsampling above (0.12 m steps)
    assert np.all(d[known] <= 0.3 + slack) and np.all(d[~known] >= 0.3 - slack)
    assert known.any() and (~known).any()


def test_save_load_gives_identical_grid(mapped, tmp_path):
    mapper, _, _ = mapped
    path = tmp_path / "map.safetensors"
    mapper.save(path)
    loaded = Mapper.load(path)
    a, b = mapper.grid(), loaded.grid()
    assert a.spec == b.spec
    np.testing.assert_array_equal(a.layers["magnitude"][0], b.layers["magnitude"][0])
    np.testing.assert_array_equal(a.layers["magnitude"][1], b.layers["magnitude"][1])
    np.testing.assert_array_equal(a.known, b.known)
    np.testing.assert_array_equal(mapper.trajectory, loaded.trajectory)
    da, db = mapper.diagnostics(), loaded.diagnostics()
    for key in ("accepted", "rejected", "dropped", "updates", "num_seen", "last_stamp", "coverage_cells"):
        assert da[key] == db[key], key
    assert [p for p in os.listdir(tmp_path)] == ["map.safetensors"]  # no temporary left behind


def test_load_with_changed_config(mapped, tmp_path):
    mapper, _, _ = mapped
    path = tmp_path / "map.safetensors"
    mapper.save(path)
    # grid settings may change
    coarse = Mapper.load(path, config(grid={"resolution": 0.2}))
    assert coarse.grid().spec.resolution == 0.2
    # the meaning of the model may not
    with pytest.raises(MapStateError, match="sync.field_unit"):
        Mapper.load(path, config(sync={"field_unit": "nanotesla"}))
    with pytest.raises(MapStateError, match="sync.target"):
        Mapper.load(path, config(sync={"target": "vector"}))


def test_reset_clears_everything():
    mapper = Mapper(config())
    feed(mapper, until=12.0)
    mapper.flush()
    assert mapper.grid() is not None
    mapper.reset()
    assert mapper.grid() is None
    d = mapper.diagnostics()
    assert d["accepted"] == d["rejected_total"] == d["updates"] == d["num_seen"] == d["coverage_cells"] == 0
    assert d["pending"] == d["waiting"] == 0 and len(mapper.trajectory) == 0
    fresh = Mapper(config())
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(mapper.model.state_dict()[key], value), key
    # and after a reset it maps exactly as a new mapper does
    for m in (mapper, fresh):
        feed(m, until=12.0)
        m.flush()
    a, b = mapper.grid(), fresh.grid()
    assert a.spec == b.spec
    np.testing.assert_array_equal(a.layers["magnitude"][0], b.layers["magnitude"][0])


def test_vector_target_layers():
    mapper = Mapper(config(sync={"target": "vector"}))
    feed(mapper, target="vector")
    mapper.flush()
    grid = mapper.grid()
    assert set(grid.layers) == {"x", "y", "z", "norm"}
    for k, name in enumerate("xyz"):
        rmse, _ = visited_rmse(grid, lambda x, y: truth_vector(x, y)[..., k], name)
        print(f"component {name}: visited RMSE {rmse:.4f} uT")
        assert rmse < 0.05
    rmse, _ = visited_rmse(grid, lambda x, y: np.linalg.norm(truth_vector(x, y), axis=-1), "norm")
    assert rmse < 0.05


def test_time_batching_is_cut_in_data_time():
    """Batches close on sample stamps, so how often process() is called does not change them."""
    runs = []
    for every in (50, 7):
        mapper = Mapper(config(batching={"mode": "time", "period": 4.0}))
        stats, _ = feed(mapper, every=every, until=32.0)
        runs.append([(s["batch_size"], s["stamp"]) for s in stats])
    assert runs[0] == runs[1]
    sizes = [n for n, _ in runs[0]]
    stamps = np.array([t for _, t in runs[0]])
    assert len(sizes) >= 7 and all(159 <= n <= 161 for n in sizes)  # 40 Hz for 4 s
    np.testing.assert_allclose(np.diff(stamps), 4.0, atol=0.03)


def test_time_batches_capped_by_max_pending():
    mapper = Mapper(config(batching={"mode": "time", "period": 10.0, "max_pending": 120}))
    stats, _ = feed(mapper, every=10, until=35.0)
    assert len(stats) >= 10 and all(s["batch_size"] == 120 for s in stats)
    assert mapper.diagnostics()["dropped"] == 0


def test_pending_bound_drops_oldest_when_updates_fall_behind():
    # catch_up_after 0: one batch an update however far behind (the catch-up is test_catch_up.py's)
    mapper = Mapper(config(batching={"size": 50, "max_pending": 120, "catch_up_after": 0}))
    t, pos, yaw = lawnmower()
    updates = 0
    for k in range(600):
        mapper.add_pose(t[k], pos[k], quaternion_from_rpy(0, 0, yaw[k]))
        mapper.add_magnetic_field(t[k] + 0.01, [50e-6, 0, 0])
        if k % 200 == 199:  # a node that can afford one update now and then
            updates += len(mapper.process(max_updates=1))
    d = mapper.diagnostics()
    assert updates == 3 and d["updates"] == 3 and d["num_seen"] == 150
    assert d["pending"] <= 120 + 1 and d["dropped"] > 0
    # every accepted sample is used, dropped, or still pending
    assert d["accepted"] == d["dropped"] + d["num_seen"] + d["pending"]


def test_failed_update_is_counted_and_mapping_goes_on(monkeypatch):
    mapper = Mapper(config(batching={"size": 100}))
    real_update = mapper.model.update
    calls = []

    def flaky(x, y, mode=None, t=None):
        calls.append(len(x))
        if len(calls) == 2:
            raise RuntimeError("simulated numerical failure")
        return real_update(x, y, mode, t=t)

    monkeypatch.setattr(mapper.model, "update", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        feed(mapper, until=10.0)
    feed_rest = mapper.process()
    d = mapper.diagnostics()
    assert d["failed_updates"] == 1 and d["dropped"] == 100 and d["updates"] == 1 + len(feed_rest)
    assert d["accepted"] == d["dropped"] + d["num_seen"] + d["pending"]


def test_count_batch_larger_than_pending_bound_is_refused():
    with pytest.raises(ConfigError, match="batching.size"):
        Mapper(config(batching={"size": 200, "max_pending": 100}), model=object())


# ------------------------------------------------------------------------------------------- pieces


def test_vector_norm_variance_delta_method():
    mean = np.array([[[3.0, 4.0, 0.0], [0.0, 0.0, 0.0]]])
    var = np.array([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])
    layers = vector_layers(mean, var)
    assert layers["norm"][0].tolist() == [[5.0, 0.0]]
    np.testing.assert_allclose(layers["norm"][1], [[(9 * 1 + 16 * 2) / 25, 6.0]])
    # first-order check against Monte Carlo at a mean far from zero
    rng = np.random.default_rng(0)
    m, v = np.array([30.0, -10.0, 40.0]), np.array([0.2, 0.5, 0.1])
    samples = m + rng.normal(size=(200_000, 3)) * np.sqrt(v)
    mc = np.var(np.linalg.norm(samples, axis=1))
    delta = vector_layers(m[None, None], v[None, None])["norm"][1][0, 0]
    assert delta == pytest.approx(mc, rel=0.02)


def _state(n=5):
    return MapState(config={"note": "x"}, model_state={"w": torch.arange(float(n)), "k": torch.tensor(3)},
                    arrays={"cells": np.arange(6, dtype=np.int64).reshape(3, 2)}, info={"updates": 2})


def test_state_round_trip(tmp_path):
    path = tmp_path / "s.safetensors"
    write_state(path, _state())
    s = read_state(path)
    assert s.config == {"note": "x"} and s.info == {"updates": 2}
    assert torch.equal(s.model_state["w"], torch.arange(5.0)) and int(s.model_state["k"]) == 3
    np.testing.assert_array_equal(s.arrays["cells"], np.arange(6).reshape(3, 2))
    # overwrite is atomic and leaves nothing else behind
    write_state(path, _state(7))
    assert read_state(path).model_state["w"].shape == (7,)
    assert os.listdir(tmp_path) == ["s.safetensors"]


def test_state_truncated_corrupt_and_foreign_files(tmp_path):
    path = tmp_path / "s.safetensors"
    write_state(path, _state())
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:-7])
    with pytest.raises(MapStateError, match="truncated|corrupt"):
        read_state(bad)
    bad.write_bytes(data[:5])
    with pytest.raises(MapStateError, match="truncated"):
        read_state(bad)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # a bit flip in the tensor data: only the checksum can notice
    bad.write_bytes(bytes(flipped))
    with pytest.raises(MapStateError, match="checksum"):
        read_state(bad)
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(MapStateError, match="corrupt header"):
        read_state(bad)
    with pytest.raises(MapStateError, match="cannot read"):
        read_state(tmp_path / "missing.safetensors")

    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, str(bad))
    with pytest.raises(MapStateError, match="not a map state file"):
        read_state(bad)
    save_file({"a": torch.zeros(2)}, str(bad), metadata={"format": "gp_mapping.map_state",
                                                        "schema_version": str(SCHEMA_VERSION + 1)})
    with pytest.raises(MapStateError, match="schema version"):
        read_state(bad)


def test_state_refuses_non_tensors_and_keeps_old_file(tmp_path):
    path = tmp_path / "s.safetensors"
    write_state(path, _state())
    before = path.read_bytes()
    broken = _state()
    broken.model_state["extra"] = "not a tensor"
    with pytest.raises(MapStateError, match="only tensors"):
        write_state(path, broken)
    broken = _state()
    broken.info["bad"] = float("nan")
    with pytest.raises(MapStateError, match="JSON"):
        write_state(path, broken)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["s.safetensors"]


def test_loaded_state_with_mismatched_model_is_refused(tmp_path):
    """A state file whose model tensors do not fit the model built from its config."""
    mapper = Mapper(config())
    path = tmp_path / "map.safetensors"
    mapper.save(path)
    s = read_state(path)
    s.model_state = {"not_a_parameter": torch.zeros(3)}
    write_state(path, s)
    with pytest.raises(MapStateError, match="does not fit the model"):
        Mapper.load(path)
    s = read_state(path)
    s.config = {"model": {"kernel": "no_such_kernel"}}
    write_state(path, s)
    with pytest.raises(MapStateError, match="invalid config"):
        Mapper.load(path)
    assert json.loads(json.dumps(mapper.diagnostics()))  # diagnostics are plain JSON


@pytest.mark.gpu
def test_cuda_mapper_matches_cpu_and_its_state_loads_on_cpu(tmp_path):
    """The same messages give the same map on CUDA as on the CPU (float64 both), and a state file saved
    from the GPU loads into a CPU mapper with the identical grid."""
    cpu = Mapper(config(model={"device": "cpu"}))
    gpu = Mapper(config(model={"device": "cuda"}))
    for m in (cpu, gpu):
        feed(m, until=20.0)
        m.flush()
    assert gpu.diagnostics()["device"].startswith("cuda")
    a, b = cpu.grid(), gpu.grid()
    assert a.spec == b.spec
    np.testing.assert_array_equal(a.known, b.known)
    np.testing.assert_allclose(b.layers["magnitude"][0], a.layers["magnitude"][0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(b.layers["magnitude"][1], a.layers["magnitude"][1], rtol=1e-4, atol=1e-10)
    path = tmp_path / "gpu.safetensors"
    gpu.save(path)
    moved = Mapper.load(path, config(model={"device": "cpu"}))
    np.testing.assert_allclose(moved.grid().layers["magnitude"][0], b.layers["magnitude"][0], rtol=0, atol=1e-9)


@pytest.mark.parametrize("target", ["magnitude", "vector"])
def test_files_hold_the_variance_of_a_reading(tmp_path, target):
    # map.npz holds, per layer, a reading's variance (latent + noise, calibrated) beside the latent's: equal to
    # the engine's predict_reading at the known cells, never below the learned noise, and read back as written.
    from gp_mapping.mapping.grid import cell_inputs
    from gp_mapping.mapping.map_files import read_map_npz, write_map_npz

    mapper = Mapper(config(sync={"target": target}))
    feed(mapper, target=target)
    grid = mapper.export_grid()
    assert grid.reading_variance is not None and set(grid.reading_variance) == set(grid.layers)
    idx = np.flatnonzero(grid.known.ravel())[::97]
    x = cell_inputs(grid.spec, torch.as_tensor(idx), 0.0, 2)
    _, expected = mapper.model.predict_reading(x)
    first = "magnitude" if target == "magnitude" else "x"
    assert np.allclose(grid.reading_variance[first].ravel()[idx], expected[:, 0].numpy(), rtol=1e-9)
    assert np.all(grid.reading_variance[first][grid.known] > 0)
    back, _ = read_map_npz(write_map_npz(tmp_path / "map.npz", grid, mapper.trajectory))
    for name, var in grid.reading_variance.items():
        assert np.array_equal(back.reading_variance[name], var, equal_nan=True)


def test_an_engine_that_learns_from_time_is_handed_each_batchs_stamps(monkeypatch):
    """model.time_error (the default): the Mapper gives the engine (tiles of dual_svgp) every batch's field stamps,
    in data time and in order (Engine.wants_stamps), and the map stays finite. White noise alone wants none."""
    mapper = Mapper(config())
    assert mapper.model.wants_stamps and not Mapper(config(model={"time_error": False})).model.wants_stamps
    seen, update = [], mapper.model.update

    def spy(x, y, mode=None, t=None):
        seen.append((len(x), None if t is None else np.asarray(t)))
        return update(x, y, mode=mode, t=t)

    monkeypatch.setattr(mapper.model, "update", spy)
    _, n_fields = feed(mapper, until=12.0)
    mapper.flush()
    assert seen and all(t is not None and len(t) == n for n, t in seen)
    stamps = np.concatenate([t for _, t in seen])
    assert len(stamps) == n_fields and np.all(np.diff(stamps) > 0) and 0.0 < stamps[0] and stamps[-1] < 12.0
    grid = mapper.grid()
    assert np.isfinite(grid.layers["magnitude"][0][grid.known]).all()
