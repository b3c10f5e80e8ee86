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

from gp_mapping.config import GridConfig

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


def fixed_grid_spec(config: GridConfig) -> GridSpec:
    """The grid of ``grid.origin`` and ``grid.size`` (size rounded up to whole cells)."""
    res = float(config.resolution)
    # A size that is a whole number of cells up to float error must not gain a sliver column.
    width = max(1, math.ceil(config.size[0] / res - 1e-9))
    height = max(1, math.ceil(config.size[1] / res - 1e-9))
    _check_cells(width * height, config.max_cells, f"the fixed grid {config.size[0]} x {config.size[1]} m at "
                 f"{res} m")
    return GridSpec(float(config.origin[0]), float(config.origin[1]), res, width, height)


class Coverage:
    """Visited cells (integer indices ``floor(xy / resolution)`` in the map frame): bounded by the area
    visited, not by the number of samples."""

    def __init__(self, resolution: float) -> None:
        if not (math.isfinite(resolution) and resolution > 0):
            raise GridError(f"coverage resolution must be a positive number, got {resolution}")
        self.resolution = float(resolution)
        self._cells: set[tuple[int, int]] = set()
        self._array: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._cells)

    def add(self, xy) -> None:
        """Mark the cells of positions ``(N, 2)`` (extra columns ignored) as visited."""
        pts = np.asarray(xy, dtype=np.float64)
        if pts.ndim != 2 or pts.shape[1] < 2:
            raise GridError(f"coverage positions must have shape (N, >=2), got {pts.shape}")
        pts = pts[np.all(np.isfinite(pts[:, :2]), axis=1), :2]
        if pts.shape[0] == 0:
            return
        idx = np.unique(np.floor(pts / self.resolution).astype(np.int64), axis=0)
        before = len(self._cells)
        self._cells.update(map(tuple, idx.tolist()))
        if len(self._cells) != before:
            self._array = None

    @property
    def cells(self) -> np.ndarray:
        """``(K, 2)`` int64 visited cell indices ``(ix, iy)``, sorted."""
        if self._array is None:
            arr = np.array(sorted(self._cells), dtype=np.int64).reshape(-1, 2)
            self._array = arr
        return self._array

    def set_cells(self, cells) -> None:
        """Replace the visited cells (restoring a saved map)."""
        arr = np.asarray(cells, dtype=np.int64).reshape(-1, 2)
        self._cells = set(map(tuple, arr.tolist()))
        self._array = None

    def clear(self) -> None:
        self._cells.clear()
        self._array = None

    def grow_spec(self, config: GridConfig) -> GridSpec | None:
        """Grid covering the visited cells plus ``grid.margin`` (rounded up to whole cells), or None before any.

        The origin is a whole number of ``grid.resolution`` steps from the map origin, so a cell keeps its
        place between publications as the grid grows.
        """
        if not self._cells:
            return None
        res = float(config.resolution)
        cells = self.cells
        # Visited-cell extents in metres, then snapped outward to the grid lattice.
        lo = cells.min(axis=0) * self.resolution
        hi = (cells.max(axis=0) + 1) * self.resolution
        i_lo = np.floor((lo - config.margin) / res + 1e-9).astype(np.int64)
        i_hi = np.ceil((hi + config.margin) / res - 1e-9).astype(np.int64)
        width, height = (int(v) for v in (i_hi - i_lo))
        _check_cells(width * height, config.max_cells, f"the grown grid {width} x {height} cells")
        return GridSpec(float(i_lo[0] * res), float(i_lo[1] * res), res, width, height)

    def known_mask(self, spec: GridSpec, distance: float) -> np.ndarray:
        """``(height, width)`` bool: True where a cell centre lies within ``distance`` of a visited cell centre.

        Distances are measured between cell centres (an exact Euclidean distance transform on the grid
        lattice), so they differ from the distance to the nearest sample by at most half a cell diagonal
        (``resolution / sqrt(2)``) when the coverage and the grid share their lattice, as in grow mode.
        """
        h, w = spec.shape
        if not self._cells:
            return np.zeros((h, w), dtype=bool)
        pad = int(math.ceil(distance / spec.resolution)) + 1
        centres = (self.cells + 0.5) * self.resolution
        j, i = spec.cell_index(centres)
        j, i = j + pad, i + pad
        inside = (j >= 0) & (j < h + 2 * pad) & (i >= 0) & (i < w + 2 * pad)
        if not np.any(inside):
            return np.zeros((h, w), dtype=bool)
        visited = np.zeros((h + 2 * pad, w + 2 * pad), dtype=bool)
        visited[j[inside], i[inside]] = True
        dist = distance_transform_edt(~visited, sampling=spec.resolution)
        return dist[pad:pad + h, pad:pad + w] <= distance * (1 + 1e-12)


def predict_grid(model, spec: GridSpec, tile_size: int, height: float = 0.0,
                 input_dims: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Predict the latent mean and variance at every cell centre, ``tile_size`` cells at a time.

    Cell centres are built on ``model.device`` (no host-to-device copy of the inputs); with ``input_dims``
    3 the cells sit at z = ``height``. Returns float64 ``mean (H, W, P)`` and ``var (H, W, P)``; variances
    below zero from round-off are clipped to zero. Raises GridError if the model predicts non-finite values.
    """
    import torch

    if input_dims not in (2, 3):
        raise GridError(f"input_dims must be 2 or 3, got {input_dims}")
    if tile_size < 1:
        raise GridError(f"tile_size must be at least 1, got {tile_size}")
    device = torch.device(getattr(model, "device", "cpu"))
    h, w = spec.shape
    n = spec.num_cells
    xs = spec.origin_x + (torch.arange(w, dtype=torch.float64, device=device) + 0.5) * spec.resolution
    ys = spec.origin_y + (torch.arange(h, dtype=torch.float64, device=device) + 0.5) * spec.resolution
    mean_out: np.ndarray | None = None
    var_out: np.ndarray | None = None
    with torch.no_grad():
        for start in range(0, n, tile_size):
            stop = min(n, start + tile_size)
            idx = torch.arange(start, stop, device=device)
            cols = [xs[idx % w], ys[idx // w]]
            if input_dims == 3:
                cols.append(torch.full((stop - start,), float(height), dtype=torch.float64, device=device))
            mean, var = model.predict(torch.stack(cols, dim=1))
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
    return mean_out.reshape(h, w, p), var_out.reshape(h, w, p)


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
