"""The map drawn from a Mapper's model: what a drawn map is (:class:`MapGrid`, its layers), and the part of the
:class:`~gp_mapping.mapping.mapper.Mapper` that draws it (:class:`MapDrawing`): the grid it is drawn on (the
fixed grid, or grow mode's window around the robot), when a map is due (:attr:`MapDrawing.map_changed`), a whole
or an incremental draw, and the map for a file."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gp_mapping.mapping.grid import (GridSpec, GridTooLargeError, cell_inputs, predict_grid, spec_from_bounds,
                                     window_bounds)
from gp_mapping.mapping.measurements import UNIT_SYMBOL

LOG = logging.getLogger("gp_mapping.mapper")


@dataclass
class MapGrid:
    """A predicted map over a grid.

    ``layers[name] = (mean (H, W), var (H, W))`` in ``field_unit`` (variance in unit squared): the posterior of
    the latent field f, not of a noisy reading. Target 'magnitude' gives the layer ``'magnitude'``; target
    'vector' gives ``'x'``, ``'y'``, ``'z'`` (map-frame components) and ``'norm'``, whose variance is the delta
    method's ``sum_i (m_i / |m|)^2 var_i`` (first order in the per-component uncertainty, components taken
    as independent; where ``|m|`` is 0 it falls back to ``sum_i var_i``). ``known`` (H, W) is False for cells
    farther than ``grid.unknown_distance`` from every sample (layers hold NaN there when the grid was predicted
    on known cells only). ``stamp`` is the newest sample stamp in the
    model; ``height`` the z of the cells when the inputs are 3-D (else 0). ``extent`` says what the grid covers:
    ``"window"`` (what the node publishes: grow mode's ``grid.window`` around the robot, cut to the visited area
    plus margin, or the fixed grid) or ``"full"`` (the whole visited area plus margin, for files).
    """

    spec: GridSpec
    frame_id: str
    field_unit: str
    layers: dict[str, tuple[np.ndarray, np.ndarray]]
    known: np.ndarray
    stamp: float
    height: float = 0.0
    extent: str = "window"  # "window": grow mode's published window (or the fixed grid); "full": the whole map
    #: per layer, the variance (H, W) of a reading (latent + noise, calibrated: docs/calibration.md); files only
    reading_variance: dict[str, np.ndarray] | None = None

    @property
    def unit_symbol(self) -> str:
        return UNIT_SYMBOL[self.field_unit]


@dataclass
class _DrawnGrid:
    """The last incremental draw (Mapper.grid(incremental=True)): what the next one may reuse."""

    model: Any            # the model it was drawn from (compared by identity)
    map_version: int      # Mapper._map_version then
    versions: Any         # model.prediction_versions() then, or None when the model cannot say what changed
    spec: GridSpec
    mean: np.ndarray      # (H, W, P) latent mean and variance, NaN where not drawn
    var: np.ndarray


def vector_layers(mean: np.ndarray, var: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layers 'x', 'y', 'z', 'norm' from a vector prediction ``(H, W, 3)`` (see :class:`MapGrid`)."""
    norm = np.linalg.norm(mean, axis=-1)
    safe = np.where(norm > 0, norm, 1.0)
    var_norm = np.where(norm > 0, np.sum((mean / safe[..., None]) ** 2 * var, axis=-1), np.sum(var, axis=-1))
    layers = {name: (mean[..., k].copy(), var[..., k].copy()) for k, name in enumerate("xyz")}
    layers["norm"] = (norm, var_norm)
    return layers


def _lattice_overlap(old: GridSpec, new: GridSpec):
    """((rows, cols) slices of ``old``, (rows, cols) slices of ``new``) holding the cells the two grids share,
    or None when they share none or do not lie on one lattice (another resolution, an origin off by a part of
    a cell)."""
    if old.resolution != new.resolution:
        return None
    shift = []
    for a, b in ((new.origin_x, old.origin_x), (new.origin_y, old.origin_y)):
        cells = (a - b) / new.resolution
        if abs(cells - round(cells)) > 1e-6:
            return None
        shift.append(int(round(cells)))
    dx, dy = shift  # new cell (j, i) is old cell (j + dy, i + dx)
    old_rows, new_rows = _shared_range(old.height, new.height, dy)
    old_cols, new_cols = _shared_range(old.width, new.width, dx)
    if old_rows is None or old_cols is None:
        return None
    return (old_rows, old_cols), (new_rows, new_cols)


def _shared_range(old_size: int, new_size: int, shift: int) -> tuple[slice | None, slice | None]:
    """Index i of the new axis is index i + shift of the old one: the slices of both that overlap."""
    lo, hi = max(0, -shift), min(new_size, old_size - shift)
    if hi <= lo:
        return None, None
    return slice(lo + shift, hi + shift), slice(lo, hi)


class MapDrawing:
    """Mixin of :class:`~gp_mapping.mapping.mapper.Mapper`: the map drawn from its model, and when one is due."""

    def _clear_drawing(self) -> None:
        # The map changed since the last publication while these differ (see map_changed).
        self._map_version = 0
        self._published_version = 0
        self._drawn: _DrawnGrid | None = None  # the last incremental draw (grid(incremental=True))

    def grid_spec(self, full: bool = False) -> GridSpec | None:
        """The grid the next map is predicted on; None before data. Fixed mode: the fixed grid. Grow mode: the
        visited area plus margin, cut to ``grid.window`` centred on the newest accepted position (``full``: not
        cut). Raises GridTooLargeError when the full grid would exceed ``grid.max_cells`` (a window never does:
        the config check refuses one that could)."""
        if self._fixed_spec is not None:
            return self._fixed_spec
        self._collect()  # the map covers every sample decided so far
        g = self.config.grid
        bounds = self._coverage.grow_bounds(g)
        if bounds is None:
            return None
        lo, hi = bounds
        if full:
            return spec_from_bounds(lo, hi, g, "the whole map")
        centre = self._last_xy if self._last_xy is not None else (lo + hi) / 2.0 * g.resolution
        w_lo, w_hi = window_bounds(centre, g)
        c_lo, c_hi = np.maximum(lo, w_lo), np.minimum(hi, w_hi)
        if np.any(c_hi <= c_lo):  # the robot is away from everything mapped (nothing accepted there yet)
            c_lo, c_hi = w_lo, w_hi
        return spec_from_bounds(c_lo, c_hi, g, "the window")

    @property
    def map_changed(self) -> bool:
        """Whether the map changed (an update ran, a state was loaded, :meth:`mark_changed`) since the last
        :meth:`mark_published`: the node and the replay publish a map only then."""
        return self._map_version != self._published_version

    def mark_changed(self) -> None:
        """A setting the prediction reads changed (``grid.unknown_distance`` ...): the next map is due, and is
        drawn whole."""
        self._map_version += 1
        self._drawn = None

    def mark_published(self) -> None:
        """The current map was published (or its publication attempted): no map is due until it changes."""
        self._published_version = self._map_version

    def grid(self, full: bool = False, predict_unknown: bool = True, incremental: bool = False) -> MapGrid | None:
        """Predict the map (tiled, on the model's device); None before the first update.

        The grid is :meth:`grid_spec` (``full``: the whole visited area, which raises GridTooLargeError beyond
        ``grid.max_cells``). ``model.predict`` is called on that grid's cells only, ``grid.tile_size`` at a time,
        so the cost of a map follows the window, not the explored area. ``predict_unknown`` False: only the
        known cells (within ``grid.unknown_distance`` of a sample) are predicted and the others hold NaN, which
        is all a publication shows (the node and the replay's map bag use it: same messages, a fraction of the
        cost).

        ``incremental`` (publications): re-predict only the cells whose prediction may have changed since the
        previous incremental draw, and take the others from it: all of them after no update; after an update of
        a tiled model (``model.changed_since``), the cells outside the tiles it touched; otherwise every cell. Cells
        keep their place as the window rolls, so those the window newly covers are predicted and the rest
        reused. The result equals a whole draw up to round-off (the same state on the same inputs, predicted in
        other groupings). Files (``export_grid``) are drawn whole.
        """
        if int(self.model.num_seen) == 0:
            return None
        spec = self.grid_spec(full=full)
        if spec is None:
            return None
        g = self.config.grid
        known = self._coverage.known_mask(spec, g.unknown_distance)
        wanted = None if predict_unknown else known
        if incremental:
            mean, var = self._draw_incremental(spec, wanted)
        else:
            mean, var = predict_grid(self.model, spec, g.tile_size, height=g.height, input_dims=self.input_dims,
                                     only=wanted)
        if self.output_dims == 1:
            layers = {"magnitude": (mean[..., 0], var[..., 0])}
        else:
            layers = vector_layers(mean, var)
        return MapGrid(spec=spec, frame_id=g.frame_id, field_unit=self.config.sync.field_unit, layers=layers,
                       known=known,
                       stamp=float(self.last_stamp) if math.isfinite(self.last_stamp) else 0.0,
                       height=float(g.height) if self.input_dims == 3 else 0.0,
                       extent="full" if full or self._fixed_spec is not None else "window")

    def _draw_incremental(self, spec: GridSpec, wanted: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance (H, W, P) of the cells ``wanted`` (None: all; NaN elsewhere), reusing the last
        incremental draw where the model says nothing there changed (see :meth:`grid`)."""
        import torch

        g = self.config.grid
        h, w = spec.shape
        want = np.ones((h, w), dtype=bool) if wanted is None else wanted
        reuse = np.zeros((h, w), dtype=bool)
        mean = var = None
        prev = self._drawn
        from gp_mapping.gp.base import IncrementalPrediction

        changed_since = self.model.changed_since if isinstance(self.model, IncrementalPrediction) else None
        # Reusable: the same model, and either no update since or a model that says where an update changed it.
        reusable = prev is not None and prev.model is self.model and (
            prev.map_version == self._map_version or (prev.versions is not None and changed_since is not None))
        overlap = _lattice_overlap(prev.spec, spec) if reusable else None
        if overlap is not None:
            (old_rows, old_cols), (new_rows, new_cols) = overlap
            p = prev.mean.shape[2]
            mean, var = np.full((h, w, p), np.nan), np.full((h, w, p), np.nan)
            mean[new_rows, new_cols] = prev.mean[old_rows, old_cols]
            var[new_rows, new_cols] = prev.var[old_rows, old_cols]
            reuse = want & np.isfinite(mean[..., 0])
            if prev.map_version != self._map_version and reuse.any():
                cells = np.flatnonzero(reuse)
                device = torch.device(self.model.device)
                x = cell_inputs(spec, torch.as_tensor(cells, device=device), g.height, self.input_dims)
                with torch.no_grad():
                    stale = changed_since(x, prev.versions).to("cpu").numpy()
                reuse.flat[cells[stale]] = False
        todo = want & ~reuse
        if todo.any() or mean is None:
            fresh_mean, fresh_var = predict_grid(self.model, spec, g.tile_size, height=g.height,
                                                 input_dims=self.input_dims, only=None if todo.all() else todo)
            if mean is None:
                mean, var = fresh_mean, fresh_var
            else:
                mean[todo], var[todo] = fresh_mean[todo], fresh_var[todo]
        mean[~want], var[~want] = np.nan, np.nan
        versions = self.model.prediction_versions if isinstance(self.model, IncrementalPrediction) else None
        self._drawn = _DrawnGrid(self.model, self._map_version, versions() if versions is not None else None, spec,
                                 mean.copy(), var.copy())
        return mean, var

    def export_grid(self) -> MapGrid | None:
        """The map for a file (replay's map.npz, ``gp-mapping export``): the whole visited area when it fits
        ``grid.max_cells``, else the window around the newest position (``extent`` says which; logged)."""
        try:
            grid = self.grid(full=True)
        except GridTooLargeError as err:
            LOG.warning("the whole map does not fit grid.max_cells (%s); the file holds the %s m window around "
                        "the newest position instead (the model still holds everything)", err,
                        self.config.grid.window)
            grid = self.grid()
        if grid is not None:  # a file also holds the variance of a reading taken there (MapGrid.reading_variance)
            g = self.config.grid
            mean, var = predict_grid(self.model, grid.spec, g.tile_size, height=g.height, input_dims=self.input_dims,
                                     only=grid.known, reading=True)
            layers = {"magnitude": (mean[..., 0], var[..., 0])} if self.output_dims == 1 else vector_layers(mean, var)
            grid.reading_variance = {name: v for name, (_, v) in layers.items()}
        return grid
