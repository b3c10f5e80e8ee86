"""The published grid: geometry, coverage (which cells are known), tiled prediction, occupancy encoding.

Geometry follows ``nav_msgs/OccupancyGrid``: cell ``(row j, column i)`` is stored at ``j * width + i``; the
origin is the map-frame corner of cell ``(0, 0)``; the centre of cell ``(j, i)`` is
``(origin_x + (i + 0.5) res, origin_y + (j + 0.5) res)``. Arrays are ``(height, width)`` indexed ``[j, i]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.ndimage import distance_transform_edt

from gp_mapping.config import ConfigError, GridConfig

OCCUPANCY_MAX = 100  # OccupancyGrid values run 0..100; -1 is unknown


class GridError(ValueError):
    """A grid cannot be built (bad geometry, too many cells, a model that predicts non-finite values)."""


class GridTooLargeError(GridError):
    """The grid would hold more cells than ``grid.max_cells``."""


@dataclass(frozen=True)
class GridSpec:
    """Geometry of a row-major grid of square cells in the map frame."""

    origin_x: float
    origin_y: float
    resolution: float
    width: int
    height: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.origin_x) and math.isfinite(self.origin_y)):
            raise GridError(f"grid origin must be finite, got ({self.origin_x}, {self.origin_y})")
        if not (math.isfinite(self.resolution) and self.resolution > 0):
            raise GridError(f"grid resolution must be a positive number, got {self.resolution}")
        if int(self.width) < 1 or int(self.height) < 1:
            raise GridError(f"grid must have at least one cell, got width {self.width}, height {self.height}")

    @property
    def num_cells(self) -> int:
        return int(self.width) * int(self.height)

    @property
    def shape(self) -> tuple[int, int]:
        """``(height, width)``: the shape of every per-cell array."""
        return int(self.height), int(self.width)

    def column_centres(self) -> np.ndarray:
        """x of the centres of columns ``0..width-1``."""
        return self.origin_x + (np.arange(self.width) + 0.5) * self.resolution

    def row_centres(self) -> np.ndarray:
        """y of the centres of rows ``0..height-1``."""
        return self.origin_y + (np.arange(self.height) + 0.5) * self.resolution

    def cell_centres(self) -> np.ndarray:
        """``(height * width, 2)`` centres in row-major order (the OccupancyGrid data order)."""
        xx, yy = np.meshgrid(self.column_centres(), self.row_centres())
        return np.stack([xx.ravel(), yy.ravel()], axis=1)

    def cell_index(self, xy) -> tuple[np.ndarray, np.ndarray]:
        """Row and column ``(j, i)`` of the cells holding points ``(N, 2)``; may lie outside the grid."""
        pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
        i = np.floor((pts[:, 0] - self.origin_x) / self.resolution).astype(np.int64)
        j = np.floor((pts[:, 1] - self.origin_y) / self.resolution).astype(np.int64)
        return j, i


def _check_cells(num_cells: int, max_cells: int, what: str) -> None:
    if num_cells > max_cells:
        raise GridTooLargeError(f"{what} needs {num_cells} cells, more than grid.max_cells = {max_cells}; raise "
                                f"grid.max_cells or grid.resolution")


def _cells_across(length: float, resolution: float) -> int:
    """Whole cells covering ``length`` metres (a whole number of cells up to float error gains no sliver)."""
    return max(1, math.ceil(length / resolution - 1e-9))


def check_grid_config(config: GridConfig) -> None:
    """The rules between grid keys that one key's range cannot say; raises ConfigError naming the keys.

    Grow mode: the window holds at most ``grid.max_cells`` cells. Both modes: ``grid.unknown_distance`` is at
    most the smaller side of the published area (``grid.window`` or ``grid.size``), so the known-cell mask is
    computed over at most 9 times the published cells."""
    res = float(config.resolution)
    if config.mode == "grow":
        w, h = (_cells_across(v, res) for v in config.window)
        if w * h > config.max_cells:
            raise ConfigError(f"config key 'grid.window': {config.window} m at grid.resolution {res} m is {w} x {h} "
                              f"= {w * h} cells, more than grid.max_cells = {config.max_cells}")
        side, name = min(config.window), "grid.window"
    else:
        side, name = min(config.size), "grid.size"
    if config.unknown_distance > side:
        raise ConfigError(f"config key 'grid.unknown_distance': {config.unknown_distance} m is larger than the "
                          f"smaller side of {name} ({side} m); allowed: at most {side} m, so the known-cell mask "
                          f"stays bounded by the published grid")


def fixed_grid_spec(config: GridConfig) -> GridSpec:
    """The grid of ``grid.origin`` and ``grid.size`` (size rounded up to whole cells)."""
    res = float(config.resolution)
    width = _cells_across(config.size[0], res)
    height = _cells_across(config.size[1], res)
    _check_cells(width * height, config.max_cells, f"the fixed grid {config.size[0]} x {config.size[1]} m at "
                 f"{res} m")
    return GridSpec(float(config.origin[0]), float(config.origin[1]), res, width, height)


def window_bounds(centre, config: GridConfig) -> tuple[np.ndarray, np.ndarray]:
    """Lattice indices ``[lo, hi)`` (x, y) of ``grid.window`` centred on ``centre`` (x, y), snapped to whole
    ``grid.resolution`` cells from the map origin so a cell keeps its place as the window rolls."""
    res = float(config.resolution)
    size = np.array([_cells_across(v, res) for v in config.window], dtype=np.int64)
    c = np.asarray(centre, dtype=np.float64)[:2]
    lo = np.floor(c / res - size / 2.0 + 1e-9).astype(np.int64)
    return lo, lo + size


def spec_from_bounds(lo: np.ndarray, hi: np.ndarray, config: GridConfig, what: str) -> GridSpec:
    """The grid of lattice indices ``[lo, hi)``, checked against ``grid.max_cells``."""
    res = float(config.resolution)
    width, height = (int(v) for v in (hi - lo))
    _check_cells(width * height, config.max_cells, f"{what} {width} x {height} cells")
    return GridSpec(float(lo[0] * res), float(lo[1] * res), res, width, height)


# Coverage is kept in square tiles of COVERAGE_TILE x COVERAGE_TILE cells (one byte a cell), created where the
# robot has been: memory follows the visited area, and the cells near a window are found without a scan.
COVERAGE_TILE = 64


class Coverage:
    """Visited cells (integer indices ``floor(xy / resolution)`` in the map frame): bounded by the area
    visited, not by the number of samples; stored in tiles (COVERAGE_TILE), so the known-cell mask of a window
    reads only the tiles around it."""

    def __init__(self, resolution: float) -> None:
        if not (math.isfinite(resolution) and resolution > 0):
            raise GridError(f"coverage resolution must be a positive number, got {resolution}")
        self.resolution = float(resolution)
        self.clear()

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        self._tiles: dict[tuple[int, int], np.ndarray] = {}
        self._count = 0
        self._lo: np.ndarray | None = None  # smallest and largest visited (ix, iy)
        self._hi: np.ndarray | None = None
        self._array: np.ndarray | None = None

    def add(self, xy) -> None:
        """Mark the cells of positions ``(N, 2)`` (extra columns ignored) as visited."""
        pts = np.asarray(xy, dtype=np.float64)
        if pts.ndim != 2 or pts.shape[1] < 2:
            raise GridError(f"coverage positions must have shape (N, >=2), got {pts.shape}")
        pts = pts[np.all(np.isfinite(pts[:, :2]), axis=1), :2]
        if pts.shape[0] == 0:
            return
        self._mark(np.floor(pts / self.resolution).astype(np.int64))

    def _mark(self, idx: np.ndarray) -> None:
        if idx.shape[0] == 0:
            return
        tiles = idx // COVERAGE_TILE
        local = idx - tiles * COVERAGE_TILE
        keys, inverse, counts = np.unique(tiles, axis=0, return_inverse=True, return_counts=True)
        order = np.argsort(inverse.reshape(-1), kind="stable")
        local = local[order]
        start = 0
        for key, n in zip(map(tuple, keys.tolist()), counts.tolist()):
            part = local[start:start + n]
            start += n
            tile = self._tiles.get(key)
            if tile is None:
                tile = self._tiles[key] = np.zeros((COVERAGE_TILE, COVERAGE_TILE), dtype=bool)
            before = int(np.count_nonzero(tile))
            tile[part[:, 0], part[:, 1]] = True
            added = int(np.count_nonzero(tile)) - before
            if added:
                self._count += added
                self._array = None
        lo, hi = idx.min(axis=0), idx.max(axis=0)
        self._lo = lo if self._lo is None else np.minimum(self._lo, lo)
        self._hi = hi if self._hi is None else np.maximum(self._hi, hi)

    def _cells_in(self, lo, hi) -> np.ndarray:
        """``(K, 2)`` visited cell indices with ``lo <= (ix, iy) < hi`` (reads only the tiles that overlap)."""
        if self._count == 0:
            return np.zeros((0, 2), dtype=np.int64)
        lo = np.maximum(np.asarray(lo, dtype=np.int64), self._lo)
        hi = np.minimum(np.asarray(hi, dtype=np.int64), self._hi + 1)
        if np.any(hi <= lo):
            return np.zeros((0, 2), dtype=np.int64)
        t_lo, t_hi = lo // COVERAGE_TILE, (hi - 1) // COVERAGE_TILE
        if (t_hi[0] - t_lo[0] + 1) * (t_hi[1] - t_lo[1] + 1) > len(self._tiles):
            keys = [k for k in self._tiles if t_lo[0] <= k[0] <= t_hi[0] and t_lo[1] <= k[1] <= t_hi[1]]
        else:
            keys = [(tx, ty) for tx in range(int(t_lo[0]), int(t_hi[0]) + 1)
                    for ty in range(int(t_lo[1]), int(t_hi[1]) + 1) if (tx, ty) in self._tiles]
        parts = [np.argwhere(self._tiles[k]) + np.array(k, dtype=np.int64) * COVERAGE_TILE for k in keys]
        if not parts:
            return np.zeros((0, 2), dtype=np.int64)
        cells = np.concatenate(parts)
        keep = np.all((cells >= lo) & (cells < hi), axis=1)
        return cells[keep]

    @property
    def cells(self) -> np.ndarray:
        """``(K, 2)`` int64 visited cell indices ``(ix, iy)``, sorted by ix, then iy."""
        if self._array is None:
            if self._count == 0:
                self._array = np.zeros((0, 2), dtype=np.int64)
            else:
                arr = np.concatenate([np.argwhere(t) + np.array(k, dtype=np.int64) * COVERAGE_TILE
                                      for k, t in self._tiles.items()])
                self._array = arr[np.lexsort((arr[:, 1], arr[:, 0]))]
        return self._array

    def set_cells(self, cells) -> None:
        """Replace the visited cells (restoring a saved map)."""
        self.clear()
        self._mark(np.asarray(cells, dtype=np.int64).reshape(-1, 2))

    def grow_bounds(self, config: GridConfig) -> tuple[np.ndarray, np.ndarray] | None:
        """Lattice indices ``[lo, hi)`` (x, y) of the visited cells plus ``grid.margin``, rounded out to whole
        ``grid.resolution`` cells from the map origin; None before any cell. Not checked against max_cells."""
        if self._count == 0:
            return None
        res = float(config.resolution)
        # Visited-cell extents in metres, then snapped outward to the grid lattice.
        lo = self._lo * self.resolution
        hi = (self._hi + 1) * self.resolution
        i_lo = np.floor((lo - config.margin) / res + 1e-9).astype(np.int64)
        i_hi = np.ceil((hi + config.margin) / res - 1e-9).astype(np.int64)
        return i_lo, i_hi

    def grow_spec(self, config: GridConfig) -> GridSpec | None:
        """Grid covering the visited cells plus ``grid.margin`` (rounded up to whole cells), or None before any.

        The origin is a whole number of ``grid.resolution`` steps from the map origin, so a cell keeps its
        place between publications as the grid grows. Raises GridTooLargeError beyond ``grid.max_cells``.
        """
        bounds = self.grow_bounds(config)
        if bounds is None:
            return None
        return spec_from_bounds(*bounds, config, "the grown grid")

    def known_mask(self, spec: GridSpec, distance: float) -> np.ndarray:
        """``(height, width)`` bool: True where a cell centre lies within ``distance`` of a visited cell centre.

        Distances are measured between cell centres (an exact Euclidean distance transform on the grid
        lattice), so they differ from the distance to the nearest sample by at most half a cell diagonal
        (``resolution / sqrt(2)``) when the coverage and the grid share their lattice, as in grow mode. Cost and
        memory follow the grid padded by ``distance`` on every side (only the visited cells there are read), not
        the visited area; ``check_grid_config`` bounds ``distance`` by the grid's size.
        """
        h, w = spec.shape
        if not self._count:
            return np.zeros((h, w), dtype=bool)
        pad = int(math.ceil(distance / spec.resolution)) + 1
        # The visited cells whose centres can fall in the padded grid (one coverage cell of slack each side).
        x0, y0 = spec.origin_x - pad * spec.resolution, spec.origin_y - pad * spec.resolution
        x1, y1 = x0 + (w + 2 * pad) * spec.resolution, y0 + (h + 2 * pad) * spec.resolution
        lo = np.floor(np.array([x0, y0]) / self.resolution).astype(np.int64) - 1
        hi = np.ceil(np.array([x1, y1]) / self.resolution).astype(np.int64) + 1
        cells = self._cells_in(lo, hi)
        if cells.shape[0] == 0:
            return np.zeros((h, w), dtype=bool)
        centres = (cells + 0.5) * self.resolution
        j, i = spec.cell_index(centres)
        j, i = j + pad, i + pad
        inside = (j >= 0) & (j < h + 2 * pad) & (i >= 0) & (i < w + 2 * pad)
        if not np.any(inside):
            return np.zeros((h, w), dtype=bool)
        visited = np.zeros((h + 2 * pad, w + 2 * pad), dtype=bool)
        visited[j[inside], i[inside]] = True
        dist = distance_transform_edt(~visited, sampling=spec.resolution)
        return dist[pad:pad + h, pad:pad + w] <= distance * (1 + 1e-12)


#: cells per prediction call when ``grid.tile_size`` is 0, by device (bench/grid_tiles.py times a 400x400 grid at
#: M = 256): on a CPU the tile's kernel matrix must stay in the cache; on a GPU each call is a few
#: hundred kernel launches and a copy to the host, so fewer, larger tiles win, as large as keeps a (cells, M)
#: matrix at GPU_TILE_ELEMENTS numbers (64 MiB in float64, which a small GPU still holds: 32768 cells at M = 256).
CPU_TILE_CELLS = 2048
GPU_TILE_ELEMENTS = 1 << 23


def tile_cells(tile_size: int, device, num_inducing: int | None = None) -> int:
    """Cells per prediction call: ``tile_size``, or by ``device`` (and the model's M, 256 if unknown) when 0."""
    import torch

    if tile_size < 0:
        raise GridError(f"tile_size must be at least 0 (0: by device), got {tile_size}")
    if tile_size > 0:
        return int(tile_size)
    if torch.device(device).type != "cuda":
        return CPU_TILE_CELLS
    return max(CPU_TILE_CELLS, GPU_TILE_ELEMENTS // max(1, int(num_inducing or 256)))


def cell_inputs(spec: GridSpec, idx, height: float = 0.0, input_dims: int = 2):
    """The model inputs (N, input_dims) float64 of the cells with row-major indices ``idx`` (an int64 tensor,
    on the device the inputs are wanted on): their centres, at z = ``height`` when ``input_dims`` is 3."""
    import torch

    idx = torch.as_tensor(idx, dtype=torch.int64)
    f64 = dict(dtype=torch.float64, device=idx.device)
    cols = [spec.origin_x + ((idx % spec.width).to(**f64) + 0.5) * spec.resolution,
            spec.origin_y + ((idx // spec.width).to(**f64) + 0.5) * spec.resolution]
    if input_dims == 3:
        cols.append(torch.full((idx.shape[0],), float(height), **f64))
    return torch.stack(cols, dim=1)


def predict_grid(model, spec: GridSpec, tile_size: int, height: float = 0.0,
                 input_dims: int = 2, only=None, reading: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Predict the latent mean and variance at every cell centre, ``tile_size`` cells at a time (0: by the
    model's device, :func:`tile_cells`). ``model``: an engine, or any predictor with its ``predict(x) -> (mean,
    var)`` (tensors) and ``device``. With ``reading``, the mean and variance of a reading taken exactly there
    instead (``model.predict_reading``: latent plus noise, calibrated, without the slope term that a reported
    position's error adds; docs/calibration.md).

    Cell centres are built on ``model.device`` (no host-to-device copy of the inputs); with ``input_dims``
    3 the cells sit at z = ``height``. ``only`` (H, W) bool: predict those cells alone (the known ones), NaN
    elsewhere. Returns float64 ``mean (H, W, P)`` and ``var (H, W, P)``; variances below zero from round-off
    are clipped to zero. Raises GridError if the model predicts non-finite values.
    """
    import torch

    if input_dims not in (2, 3):
        raise GridError(f"input_dims must be 2 or 3, got {input_dims}")
    device = torch.device(model.device)
    from gp_mapping.gp.base import Engine, reading_of

    # an engine's M sizes the chunks on a GPU; any other predictor (a view, a baseline) gets the default
    tile_size = tile_cells(tile_size, device, model.config.num_inducing if isinstance(model, Engine) else None)
    h, w = spec.shape
    cells = None
    if only is not None:
        only = np.asarray(only, dtype=bool)
        if only.shape != (h, w):
            raise GridError(f"predict_grid: 'only' has shape {only.shape}, expected {(h, w)}")
        cells = torch.as_tensor(np.flatnonzero(only), device=device)
    n = spec.num_cells if cells is None else int(cells.shape[0])
    mean_out: np.ndarray | None = None
    var_out: np.ndarray | None = None
    if n == 0:  # nothing to predict: the output width comes from one point
        mean, _ = model.predict(cell_inputs(spec, torch.zeros(1, dtype=torch.int64, device=device), height, input_dims))
        p = int(mean.shape[1])
        return np.full((h, w, p), np.nan), np.full((h, w, p), np.nan)
    def predict(x):
        return reading_of(model, x, with_slope=False) if reading else model.predict(x)

    with torch.no_grad():
        for start in range(0, n, tile_size):
            stop = min(n, start + tile_size)
            idx = torch.arange(start, stop, device=device) if cells is None else cells[start:stop]
            mean, var = predict(cell_inputs(spec, idx, height, input_dims))
            mean = mean.detach().to("cpu", torch.float64).numpy()
            var = var.detach().to("cpu", torch.float64).numpy()
            if mean.ndim != 2 or mean.shape[0] != stop - start or var.shape != mean.shape:
                raise GridError(f"model.predict returned shapes {mean.shape} and {var.shape} for {stop - start} "
                                f"inputs; expected (G, P) each")
            if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(var))):
                raise GridError("model.predict returned non-finite values on the grid")
            if mean_out is None:
                mean_out = np.empty((n, mean.shape[1]))
                var_out = np.empty((n, mean.shape[1]))
            mean_out[start:stop] = mean
            var_out[start:stop] = np.maximum(var, 0.0)
    assert mean_out is not None and var_out is not None
    p = mean_out.shape[1]
    if cells is None:
        return mean_out.reshape(h, w, p), var_out.reshape(h, w, p)
    flat = cells.to("cpu").numpy()
    mean_full, var_full = np.full((h * w, p), np.nan), np.full((h * w, p), np.nan)
    mean_full[flat], var_full[flat] = mean_out, var_out
    return mean_full.reshape(h, w, p), var_full.reshape(h, w, p)


def encode_occupancy(values, known, value_range=None) -> tuple[np.ndarray, float, float]:
    """Map a ``(H, W)`` layer to OccupancyGrid data: int8, row-major, 0..100, and -1 where unknown.

    Without ``value_range`` (None or empty), known finite cells are scaled linearly from their minimum (0) to
    their maximum (100), so that ``value ≈ offset + scale * cell`` within ``scale / 2``. A constant layer
    encodes as all 0 with ``offset`` = that value and ``scale`` = 1; a layer with no known finite cell as all
    -1, offset 0, scale 1. With ``value_range = (lo, hi)`` (``lo < hi``, the config's ``grid.mean_range`` /
    ``grid.variance_range``), ``lo`` is 0 and ``hi`` is 100 whatever the layer holds, so a cell value means the
    same field value in every map; values outside are clipped to 0 or 100. Cells that are known but not finite
    are written as -1 too.
    """
    vals = np.asarray(values, dtype=np.float64)
    mask = np.asarray(known, dtype=bool)
    if vals.ndim != 2 or mask.shape != vals.shape:
        raise GridError(f"encode_occupancy needs values (H, W) and known of the same shape, got {vals.shape} and "
                        f"{mask.shape}")
    use = mask & np.isfinite(vals)
    data = np.full(vals.shape, -1, dtype=np.int8)
    fixed = value_range is not None and len(value_range) > 0
    if fixed:
        lo, hi = (float(v) for v in value_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and hi / OCCUPANCY_MAX - lo / OCCUPANCY_MAX > 0):
            raise GridError(f"a fixed value range needs finite lo < hi, got {list(value_range)}")
    if not np.any(use):
        return data.ravel(), (lo if fixed else 0.0), (hi / OCCUPANCY_MAX - lo / OCCUPANCY_MAX if fixed else 1.0)
    if not fixed:
        lo, hi = float(vals[use].min()), float(vals[use].max())
        if not hi / OCCUPANCY_MAX - lo / OCCUPANCY_MAX > 0:  # constant, or a spread below float resolution
            data[use] = 0
            return data.ravel(), lo, 1.0
    # Dividing by 100 first keeps every difference finite even when hi - lo overflows float64.
    scale = hi / OCCUPANCY_MAX - lo / OCCUPANCY_MAX
    cells = np.clip(np.rint((vals[use] / OCCUPANCY_MAX - lo / OCCUPANCY_MAX) / scale * OCCUPANCY_MAX), 0,
                    OCCUPANCY_MAX)
    data[use] = cells.astype(np.int8)
    return data.ravel(), lo, float(scale)


def decode_occupancy(data, spec_or_shape, offset: float, scale: float) -> np.ndarray:
    """Inverse of :func:`encode_occupancy`: ``(H, W)`` float64, NaN where the cell is -1 (unknown)."""
    shape = spec_or_shape.shape if isinstance(spec_or_shape, GridSpec) else tuple(spec_or_shape)
    arr = np.asarray(data, dtype=np.int64).reshape(shape)
    out = offset + scale * arr.astype(np.float64)
    out[arr < 0] = np.nan
    return out
