"""Grid geometry, grow-mode snapping, coverage and the known mask, tiled prediction, occupancy encoding."""
import math

import numpy as np
import pytest
import torch

from gp_mapping.config import GridConfig
from gp_mapping.mapping.grid import (CPU_TILE_CELLS, GPU_TILE_ELEMENTS, Coverage, GridError, GridSpec, GridTooLargeError,
                                     decode_occupancy, encode_occupancy, fixed_grid_spec, predict_grid, tile_cells)


def test_cell_centres_closed_form():
    spec = GridSpec(origin_x=-1.0, origin_y=2.0, resolution=0.5, width=4, height=3)
    c = spec.cell_centres()
    assert c.shape == (12, 2) and spec.shape == (3, 4)
    # row-major: index j * width + i is the cell at column i, row j
    for j in range(3):
        for i in range(4):
            np.testing.assert_allclose(c[j * 4 + i], [-1.0 + (i + 0.5) * 0.5, 2.0 + (j + 0.5) * 0.5])
    j, i = spec.cell_index(c)
    assert (j == np.repeat(np.arange(3), 4)).all() and (i == np.tile(np.arange(4), 3)).all()
    j, i = spec.cell_index([[-1.01, 2.0]])
    assert (j[0], i[0]) == (0, -1)


def test_bad_specs_refused():
    with pytest.raises(GridError, match="resolution"):
        GridSpec(0, 0, 0.0, 1, 1)
    with pytest.raises(GridError, match="at least one cell"):
        GridSpec(0, 0, 1.0, 0, 1)
    with pytest.raises(GridError, match="origin"):
        GridSpec(float("nan"), 0, 1.0, 1, 1)


def test_fixed_grid_from_config():
    spec = fixed_grid_spec(GridConfig(mode="fixed", origin=[-5.0, -2.0], size=[10.0, 3.0], resolution=0.1))
    assert (spec.origin_x, spec.origin_y, spec.width, spec.height) == (-5.0, -2.0, 100, 30)
    spec = fixed_grid_spec(GridConfig(mode="fixed", origin=[0.0, 0.0], size=[1.05, 1.0], resolution=0.1))
    assert spec.width == 11  # a partial cell is covered, never cut off
    with pytest.raises(GridTooLargeError, match="grid.max_cells"):
        fixed_grid_spec(GridConfig(mode="fixed", size=[10.0, 10.0], resolution=0.01, max_cells=1000))


def test_grow_mode_snaps_to_the_lattice():
    cfg = GridConfig(mode="grow", resolution=0.25, margin=0.6)
    cov = Coverage(cfg.resolution)
    assert cov.grow_spec(cfg) is None
    cov.add(np.array([[0.1, 0.1], [1.37, -0.4]]))
    spec = cov.grow_spec(cfg)
    # visited cells span x in [0, 1.5), y in [-0.5, 0.25); margin 0.6 rounds out to whole 0.25 m cells
    assert spec.origin_x == pytest.approx(-0.75) and spec.origin_y == pytest.approx(-1.25)
    assert spec.width == round((2.25 + 0.75) / 0.25) and spec.height == round((1.0 + 1.25) / 0.25)
    # growing the visited area keeps every existing cell where it was (origin moves by whole cells)
    cov.add(np.array([[-2.3, 3.9]]))
    spec2 = cov.grow_spec(cfg)
    shift = (spec.origin_x - spec2.origin_x) / cfg.resolution
    assert abs(shift - round(shift)) < 1e-9 and spec2.width > spec.width
    # adding a point inside a visited cell changes nothing
    cov.add(np.array([[0.11, 0.12]]))
    assert cov.grow_spec(cfg) == spec2


def test_grow_mode_respects_max_cells():
    cfg = GridConfig(mode="grow", resolution=0.1, margin=0.0, max_cells=100)
    cov = Coverage(cfg.resolution)
    cov.add(np.array([[0.0, 0.0], [0.95, 0.95]]))
    assert cov.grow_spec(cfg).num_cells == 100
    cov.add(np.array([[1.05, 0.0]]))
    with pytest.raises(GridTooLargeError, match="max_cells"):
        cov.grow_spec(cfg)


def test_coverage_is_bounded_by_cells_not_samples():
    cov = Coverage(0.5)
    pts = np.random.default_rng(0).uniform(0, 2, size=(10_000, 2))
    cov.add(pts)
    assert len(cov) == 16
    cov.add(np.array([[np.nan, 0.0]]))
    assert len(cov) == 16


def test_known_mask_matches_brute_force_distance():
    res, dist = 0.2, 0.5
    spec = GridSpec(-1.0, -1.0, res, 15, 12)
    cov = Coverage(res)
    pts = np.array([[0.05, 0.05], [1.3, 0.9], [2.1, -1.1]])  # the last one is outside the grid
    cov.add(pts)
    known = cov.known_mask(spec, dist)
    centres = spec.cell_centres()
    visited_centres = (np.floor(pts / res) + 0.5) * res
    d = np.min(np.linalg.norm(centres[:, None, :] - visited_centres[None], axis=2), axis=1)
    np.testing.assert_array_equal(known.ravel(), d <= dist + 1e-12)
    # the outside point still makes nearby cells known
    assert known[0, -1]
    assert not Coverage(res).known_mask(spec, dist).any()


def test_known_mask_error_to_true_samples_is_bounded():
    """Cells known are within unknown_distance + res/sqrt(2) of a sample; unknown ones at least
    unknown_distance - res/sqrt(2) away."""
    rng = np.random.default_rng(3)
    res, dist = 0.1, 0.35
    spec = GridSpec(0.0, 0.0, res, 30, 30)
    pts = rng.uniform(0.5, 2.5, size=(6, 2))
    cov = Coverage(res)
    cov.add(pts)
    known = cov.known_mask(spec, dist).ravel()
    d = np.min(np.linalg.norm(spec.cell_centres()[:, None] - pts[None], axis=2), axis=1)
    slack = res / math.sqrt(2)
    assert np.all(d[known] <= dist + slack) and np.all(d[~known] >= dist - slack)


class AnalyticModel(torch.nn.Module):
    """A stand-in with a known predict: mean = (sin x, x*y), var = (1 + x^2, 0.5); counts the tile sizes."""

    def __init__(self):
        super().__init__()
        self.device = torch.device("cpu")
        self.tiles = []

    def predict(self, x):
        self.tiles.append(x.shape[0])
        assert x.dtype == torch.float64 and x.device == self.device
        mean = torch.stack([torch.sin(x[:, 0]), x[:, 0] * x[:, 1]], dim=1)
        var = torch.stack([1 + x[:, 0] ** 2, torch.full_like(x[:, 0], 0.5)], dim=1)
        return mean, var


def test_predict_grid_tiles_cover_every_cell_in_order():
    spec = GridSpec(-1.0, 0.5, 0.3, 7, 5)
    model = AnalyticModel()
    mean, var = predict_grid(model, spec, tile_size=8)
    assert model.tiles == [8, 8, 8, 8, 3]
    assert mean.shape == (5, 7, 2) and var.shape == (5, 7, 2) and mean.dtype == np.float64
    c = spec.cell_centres()
    np.testing.assert_allclose(mean[..., 0].ravel(), np.sin(c[:, 0]))
    np.testing.assert_allclose(mean[..., 1].ravel(), c[:, 0] * c[:, 1])
    np.testing.assert_allclose(var[..., 0].ravel(), 1 + c[:, 0] ** 2)


def test_tile_size_zero_tiles_by_the_models_device():
    assert tile_cells(0, "cpu") == tile_cells(0, "cpu", 4096) == CPU_TILE_CELLS
    assert tile_cells(0, torch.device("cuda")) == tile_cells(0, "cuda:1", 256) == GPU_TILE_ELEMENTS // 256 == 32768
    assert tile_cells(0, "cuda", 512) == 16384 and tile_cells(0, "cuda", 4480) == CPU_TILE_CELLS  # bounded memory
    assert tile_cells(700, "cuda") == 700 and tile_cells(700, "cpu") == 700  # a set size is kept
    with pytest.raises(GridError, match="at least 0"):
        tile_cells(-1, "cpu")
    spec = GridSpec(0.0, 0.0, 0.1, 100, 30)  # 3000 cells: one CPU tile and the rest
    model = AnalyticModel()
    mean, _ = predict_grid(model, spec, tile_size=0)
    assert model.tiles == [CPU_TILE_CELLS, 3000 - CPU_TILE_CELLS]
    np.testing.assert_array_equal(mean, predict_grid(AnalyticModel(), spec, tile_size=64)[0])
    assert GridConfig().tile_size == 0  # the shipped setting


@pytest.mark.gpu
def test_gpu_tiles_give_the_cpu_tiles_map():
    """On CUDA, tile_size 0 predicts in tiles of GPU_TILE_ELEMENTS / M cells and draws the map that tiles of 2048
    draw."""
    from gp_mapping.gp import ModelConfig, build_model

    rng = np.random.default_rng(4)
    x = rng.uniform(0, 10, (300, 2))
    y = np.sin(x[:, :1]) + 0.1 * x[:, 1:]
    model = build_model(ModelConfig(num_inducing=64, hyper_steps=3, device="cuda"), 2, 1)
    model.update(x, y)
    spec = GridSpec(0.0, 0.0, 0.05, 200, 200)
    calls = []
    predict = model.predict
    model.predict = lambda xs: calls.append(xs.shape[0]) or predict(xs)
    mean, var = predict_grid(model, spec, tile_size=0)
    tile = GPU_TILE_ELEMENTS // 64
    assert calls == [tile] * (40000 // tile) + [40000 % tile]
    small_mean, small_var = predict_grid(model, spec, tile_size=CPU_TILE_CELLS)
    np.testing.assert_allclose(mean, small_mean, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(var, small_var, rtol=1e-9, atol=1e-9)


def test_predict_grid_3d_inputs_at_height():
    class Height(AnalyticModel):
        def predict(self, x):
            assert x.shape[1] == 3
            return x[:, 2:3].clone(), torch.zeros_like(x[:, 2:3]) - 1e-15

    mean, var = predict_grid(Height(), GridSpec(0, 0, 1.0, 3, 2), tile_size=100, height=1.5, input_dims=3)
    assert np.all(mean == 1.5) and np.all(var == 0.0)  # round-off negative variance clipped


def test_predict_grid_refuses_non_finite_predictions():
    class Broken(AnalyticModel):
        def predict(self, x):
            m, v = super().predict(x)
            m[0, 0] = float("nan")
            return m, v

    with pytest.raises(GridError, match="non-finite"):
        predict_grid(Broken(), GridSpec(0, 0, 1.0, 3, 2), tile_size=4)


def test_encode_decode_round_trip_within_half_step():
    rng = np.random.default_rng(1)
    values = 45.0 + 10 * rng.normal(size=(20, 30))
    known = rng.uniform(size=values.shape) > 0.3
    data, offset, scale = encode_occupancy(values, known)
    assert data.dtype == np.int8 and data.shape == (600,)
    assert data[known.ravel()].min() == 0 and data[known.ravel()].max() == 100
    assert np.all(data[~known.ravel()] == -1)
    assert offset == pytest.approx(values[known].min())
    assert scale == pytest.approx((values[known].max() - values[known].min()) / 100)
    back = decode_occupancy(data, values.shape, offset, scale)
    assert np.all(np.abs(back[known] - values[known]) <= scale / 2 + 1e-12)
    assert np.all(np.isnan(back[~known]))


def test_encode_constant_empty_and_non_finite_layers():
    data, offset, scale = encode_occupancy(np.full((3, 4), 7.25), np.ones((3, 4), bool))
    assert np.all(data == 0) and offset == 7.25 and scale > 0
    np.testing.assert_allclose(decode_occupancy(data, (3, 4), offset, scale), 7.25)
    data, offset, scale = encode_occupancy(np.zeros((2, 2)), np.zeros((2, 2), bool))
    assert np.all(data == -1) and math.isfinite(offset) and scale > 0
    vals = np.array([[1.0, np.nan], [np.inf, 3.0]])
    data, offset, scale = encode_occupancy(vals, np.ones((2, 2), bool))
    assert data.tolist() == [0, -1, -1, 100] and offset == 1.0 and scale == pytest.approx(0.02)
    data, offset, scale = encode_occupancy(np.array([[-1e308, 1e308]]), np.ones((1, 2), bool))
    assert data.tolist() == [0, 100] and math.isfinite(scale)
    with pytest.raises(GridError, match="same shape"):
        encode_occupancy(np.zeros((2, 2)), np.zeros((2, 3), bool))
