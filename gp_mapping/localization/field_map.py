"""The map as a measurement model: a precomputed grid of the predictive mean and variance of a *reading*, looked up
by bilinear interpolation for many particles at once (numpy, vectorised).

A reading is the latent field plus the sensor's noise: its predictive variance is the map's latent variance plus
the noise the engine learned (:func:`reading_moments`). The grid is predicted once from a saved map state
(:meth:`MagneticMap.load`, through :meth:`gp_mapping.mapping.mapper.Mapper.load` and
:func:`gp_mapping.mapping.grid.predict_grid`) over the mapped area plus the map's margin, on the cells the map
calls known (:meth:`gp_mapping.mapping.grid.Coverage.known_mask`: within ``grid.unknown_distance`` of its data);
a lookup on an unknown cell or off the grid says so (``on_map`` False) and the filter gives that particle the
off-map likelihood instead of a number the map never vouched for.

The grid also holds the part of a reading's variance that is the map's own error (``error_var``: the reading
variance less the sensor's noise the engine learned, :meth:`MagneticMap.from_mapper`), which successive readings
along a path share; the sensor's noise is new at every reading. The
filter models that shared part as a correlated error along the path (filter.py), over the map's correlation length
(:attr:`MagneticMap.correlation_length`: the e-folding distance of the spatial autocorrelation of the map's own
mean, :func:`correlation_length`).

Outputs: a magnitude map (``sync.target: magnitude``) has one output, |B|; a vector map three, the map-frame
components x, y, z. Values are in the map's ``field_unit``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gp_mapping.localization.config import LocalizationError, MapLoadError
from gp_mapping.mapping.grid import GridError, GridSpec, predict_grid, spec_from_bounds

#: The map's own lookup is refused above this many cells (a 2 km x 2 km map at 0.1 m); a coarser
#: ``grid_resolution`` (LocalizerConfig) or a smaller map is needed beyond it.
MAX_LOOKUP_CELLS = 50_000_000


def reading_moments(model, x, with_slope: bool = False, full_floor: bool = False):
    """The predictive mean and variance (G, P) of a *reading* at inputs ``x``: latent variance plus the noise, in
    the targets' units, from ``model.predict_reading`` (the engine contract, :class:`gp_mapping.gp.base.Engine`).
    By default of a reading taken exactly at x, as a particle's position is (the calibration's fit without its
    slope term; ``with_slope``: at a reported position, as a new pass's readings are; gp/calibration.py), and
    with the noise floor's part as the calibration states it (``full_floor``: at its full width).

    An engine without ``predict_reading`` (a model object from outside the package, or an older engine) falls
    back to its Gaussian log predictive density at the mean, ``log p(y = m | x) = -log(2 pi v) / 2``, which gives
    the reading variance ``v`` of a Gaussian likelihood exactly (of a tiled map, the blend's density at its mean;
    of a Student-t likelihood, the Gaussian of the same peak density)."""
    import torch

    from gp_mapping.gp.base import reading_of

    if callable(getattr(model, "predict_reading", None)):
        return reading_of(model, x, with_slope, full_floor)
    with torch.no_grad():
        mean, var = model.predict(x)
        lpd = model.log_predictive_density(x, mean)
        reading_var = torch.exp(-2.0 * lpd - math.log(2.0 * math.pi))
        return mean, torch.maximum(reading_var, var)


class _NoiseView:
    """A model whose ``predict`` gives the sensor's noise variance (the engine's learned likelihood noise, targets'
    units; where the engine calibrates, its floor's part times the calibration's noise factor, as a reading's
    variance counts it) as the variance, so :func:`predict_grid` draws the part of a reading's variance that is new
    at every reading. An engine without the package's ``_reading_moments`` gives 0 there (its whole reading
    variance is then taken as the map's error)."""

    def __init__(self, model) -> None:
        self._model = model
        self.device = getattr(model, "device", "cpu")
        self.config = getattr(model, "config", None)

    def predict(self, x):
        import torch

        moments = getattr(self._model, "_reading_moments", None)
        with torch.no_grad():
            if callable(moments):
                xt = self._model._check_x(x) if hasattr(self._model, "_check_x") else x
                mean, _, noise = moments(xt)
                if getattr(self._model, "calibrates", False):
                    noise = self._model.calibration.noise_part(noise)
                return mean, noise
            mean, var = self._model.predict(x)
            return mean, torch.zeros_like(var)


class _ReadingView:
    """A model whose ``predict`` is :func:`reading_moments`, so :func:`predict_grid` draws reading grids."""

    def __init__(self, model, full_floor: bool = False) -> None:
        self._model = model
        self._full_floor = full_floor
        self.device = getattr(model, "device", "cpu")
        self.config = getattr(model, "config", None)

    def predict(self, x):
        return reading_moments(self._model, x, full_floor=self._full_floor)


def _cell_values(values, shape: tuple[int, ...], what: str) -> np.ndarray:
    """A per-cell array of a map (H, W, P), given as that or (H, W) for one output; refused unless it fits
    ``shape``."""
    out = np.asarray(values, dtype=np.float64)
    if out.ndim == 2:
        out = out[..., None]
    if out.shape != shape:
        raise LocalizationError(f"{what} has shape {out.shape}; the mean {shape}")
    return out


def _squared_gradient(mean: np.ndarray, resolution: float) -> np.ndarray:
    """``|grad m|^2`` (H, W, P) of a grid (NaN where unknown): central differences where both neighbours are
    known, one-sided where one is, 0 along an axis where neither is."""
    out = np.zeros(mean.shape)
    for axis in (0, 1):
        pad = [(0, 0)] * mean.ndim
        pad[axis] = (1, 1)
        m = np.pad(mean, pad, constant_values=np.nan)
        lo = np.take(m, np.arange(0, mean.shape[axis]), axis=axis)
        hi = np.take(m, np.arange(2, mean.shape[axis] + 2), axis=axis)
        central = (hi - lo) / (2.0 * resolution)
        forward = (hi - mean) / resolution
        backward = (mean - lo) / resolution
        d = np.where(np.isfinite(central), central, np.where(np.isfinite(forward), forward, backward))
        out += np.where(np.isfinite(d), d * d, 0.0)
    return out


def correlation_length(mean: np.ndarray, known: np.ndarray, resolution: float) -> float:
    """The e-folding distance [m] of the spatial autocorrelation of a map's mean ``(H, W, P)`` over its known
    cells ``(H, W)``: the lag (along x and y, pooled, averaged over outputs) at which the correlation of the
    mean's deviations from its average first falls below 1/e, linearly interpolated between grid lags; at least
    one cell, and at most the grid's smaller side when it never falls that far. For an exponential (Ornstein-
    Uhlenbeck) correlation ``exp(-d / L)`` it is L itself; the filter takes it as the distance over which the map's
    errors along a path decorrelate (the errors of a GP map vary on the scale of the field it has learned)."""
    h, w, p = mean.shape
    max_lag = max(1, min(h, w) - 1)
    lengths = []
    for k in range(p):
        d = np.where(known, mean[..., k] - mean[..., k][known].mean(), 0.0)
        var = float(np.mean(d[known] ** 2))
        if not var > 0:
            lengths.append(resolution)
            continue
        prev, found = 1.0, None
        for lag in range(1, max_lag + 1):
            both_x = known[:, :-lag] & known[:, lag:]
            both_y = known[:-lag, :] & known[lag:, :]
            count = int(both_x.sum() + both_y.sum())
            if count == 0:
                break
            rho = float((np.sum((d[:, :-lag] * d[:, lag:])[both_x]) + np.sum((d[:-lag, :] * d[lag:, :])[both_y]))
                        / (count * var))
            if rho < math.exp(-1.0):
                found = (lag - 1 + (prev - math.exp(-1.0)) / max(prev - rho, 1e-12)) * resolution
                break
            prev = rho
        lengths.append(found if found is not None else max_lag * resolution)
    return float(max(np.mean(lengths), resolution))


@dataclass
class MagneticMap:
    """A grid of the predictive mean and reading variance of the field (see the module docstring).

    ``mean`` and ``var`` are ``(H, W, P)`` over ``spec`` (row j = y, column i = x, as OccupancyGrid); ``known``
    ``(H, W)``; values of unknown cells are never read. ``target`` is ``'magnitude'`` (P = 1) or ``'vector'``
    (P = 3, map-frame x, y, z). ``error_var`` ``(H, W, P)`` (optional) is the part of ``var`` that is the map's
    own error (clipped to ``var``; the rest is the sensor's noise); without it the filter takes every reading's
    error as independent. ``offset_var`` ``(P,)`` (optional, 0 by default) is the part of ``var`` and
    ``error_var`` that is the spread of the map's sessions' offsets about its level
    (:meth:`gp_mapping.gp.calibration.SessionOffsets.spread`): the same for every reading of a new session, which a
    filter that estimates its own offset takes into that offset's prior instead (filter.py). ``floor_var``
    ``(H, W, P)`` (optional, 0 by default) is what the map's calibration took off the noise floor's part of
    ``var`` (its factor c < 1: a sensor quieter than the floor); a filter that keeps the floor adds it back
    (``lookup_parts(..., full_floor=True)``, LocalizerConfig.keep_noise_floor)."""

    spec: GridSpec
    mean: np.ndarray
    var: np.ndarray
    known: np.ndarray
    frame_id: str = "map"
    field_unit: str = "microtesla"
    target: str = "magnitude"
    source: str = ""
    sensor_translation: tuple = (0.0, 0.0, 0.0)  # the map's sync.sensor_translation (the robot that made it)
    sensor_rotation: tuple = (0.0, 0.0, 0.0, 1.0)  # and its sync.sensor_rotation [x, y, z, w]
    hard_iron: tuple = (0.0, 0.0, 0.0)  # and its magnetometer calibration: sync.hard_iron [field_unit]
    soft_iron: tuple = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)  # and sync.soft_iron (3x3 row-major)
    error_var: np.ndarray | None = None
    offset_var: np.ndarray | None = None
    floor_var: np.ndarray | None = None
    _mean_flat: np.ndarray = field(init=False, repr=False)
    _var_flat: np.ndarray = field(init=False, repr=False)
    _known_flat: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        h, w = self.spec.shape
        mean = np.asarray(self.mean, dtype=np.float64)
        var = np.asarray(self.var, dtype=np.float64)
        if mean.ndim == 2:
            mean, var = mean[..., None], var[..., None]
        if mean.shape[:2] != (h, w) or var.shape != mean.shape:
            raise LocalizationError(f"map arrays have shapes {mean.shape} and {var.shape}; the grid is {h} x {w}")
        known = np.asarray(self.known, dtype=bool)
        if known.shape != (h, w):
            raise LocalizationError(f"the known mask has shape {known.shape}; the grid is {h} x {w}")
        if self.target not in ("magnitude", "vector"):
            raise LocalizationError(f"map target must be 'magnitude' or 'vector', got {self.target!r}")
        p = mean.shape[2]
        if (self.target == "magnitude") != (p == 1) or p not in (1, 3):
            raise LocalizationError(f"a {self.target} map has {'1 output' if self.target == 'magnitude' else '3 outputs'}"
                                    f", these arrays have {p}")
        usable = known & np.all(np.isfinite(mean), axis=2) & np.all(np.isfinite(var) & (var >= 0), axis=2)
        if not usable.any():
            raise LocalizationError("the map has no known cell with a finite mean and variance")
        if self.error_var is not None:
            latent = _cell_values(self.error_var, mean.shape, "the error variance")
            usable &= np.all(np.isfinite(latent) & (latent >= 0), axis=2)
            if not usable.any():
                raise LocalizationError("the map has no known cell with a finite mean and variance")
            latent = np.where(usable[..., None], np.minimum(latent, var), 0.0)
        else:
            latent = np.zeros(mean.shape)
        floor = np.zeros(mean.shape)
        if self.floor_var is not None:
            floor = _cell_values(self.floor_var, mean.shape, "the noise floor's variance")
            if not np.all(np.isfinite(floor[usable]) & (floor[usable] >= 0)):
                raise LocalizationError("the noise floor's variance must be finite and >= 0 on the known cells")
            floor = np.where(usable[..., None], floor, 0.0)
        self.floor_var = floor
        offset = np.zeros(p) if self.offset_var is None else np.asarray(self.offset_var, dtype=np.float64).reshape(-1)
        if offset.shape != (p,) or not np.all(np.isfinite(offset) & (offset >= 0)):
            raise LocalizationError(f"the sessions' offset variance is {offset.tolist()}; it takes {p} finite "
                                    "value(s) >= 0, one per output")
        self.mean, self.var, self.known, self.error_var, self.offset_var = mean, var, usable, latent, offset
        self.correlation_length = correlation_length(np.where(usable[..., None], mean, 0.0), usable,
                                                     self.spec.resolution)
        # Padded by one unknown cell on every side, flattened: a lookup gathers without bounds checks.
        self._mean_flat = np.zeros((h + 2, w + 2, p))
        self._var_flat = np.ones((h + 2, w + 2, p))
        self._known_flat = np.zeros((h + 2, w + 2))
        self._latent_flat = np.zeros((h + 2, w + 2, p))
        self._latent_flat[1:-1, 1:-1] = latent
        self._floor_flat = np.zeros((h + 2, w + 2, p))
        self._floor_flat[1:-1, 1:-1] = floor
        self._mean_flat[1:-1, 1:-1] = np.where(usable[..., None], mean, 0.0)
        self._var_flat[1:-1, 1:-1] = np.where(usable[..., None], var, 1.0)
        self._known_flat[1:-1, 1:-1] = usable
        # The squared gradient of the mean per output (central differences over known cells, one-sided at their
        # edge, 0 where a cell has no known neighbour along an axis): a position error of s metres moves a reading
        # by about |grad m| s, the variance the filter adds for it (LocalizerConfig.position_std).
        self._grad2_flat = np.zeros((h + 2, w + 2, p))
        self._grad2_flat[1:-1, 1:-1] = _squared_gradient(np.where(usable[..., None], mean, np.nan),
                                                          self.spec.resolution)
        self._mean_flat = self._mean_flat.reshape(-1, p)
        self._var_flat = self._var_flat.reshape(-1, p)
        self._latent_flat = self._latent_flat.reshape(-1, p)
        self._floor_flat = self._floor_flat.reshape(-1, p)
        self._known_flat = self._known_flat.reshape(-1)
        self._grad2_flat = self._grad2_flat.reshape(-1, p)
        # The off-map likelihood: the map's marginal distribution of readings (prior) or a uniform density over
        # the range of its readings (uniform), per output.
        m, v = mean[usable], var[usable]
        self.prior_mean = m.mean(axis=0)
        self.prior_var = m.var(axis=0) + np.median(v, axis=0)
        spread = m.max(axis=0) - m.min(axis=0) + 6.0 * np.sqrt(np.median(v, axis=0))
        self.uniform_log_density = -np.log(np.maximum(spread, 1e-12))

    # ------------------------------------------------------------------------------------------------ lookups

    @property
    def outputs(self) -> int:
        return int(self.mean.shape[2])

    @property
    def extent(self) -> tuple[float, float, float, float]:
        """(xmin, xmax, ymin, ymax) of the grid [m]."""
        s = self.spec
        return s.origin_x, s.origin_x + s.width * s.resolution, s.origin_y, s.origin_y + s.height * s.resolution

    def lookup(self, xy: np.ndarray, position_var: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bilinear mean and reading variance ``(N, P)`` at points ``(N, 2)``, and ``on_map`` ``(N,)``: whether the
        cell holding the point is known. The interpolation uses the known cells among the four around the point
        (weights renormalised), so a point near the edge of the known area reads the known side only. Off the
        map the mean and variance are the map's marginal ones (``prior_mean``, ``prior_var``)."""
        mean, var, _, on_map = self.lookup_parts(xy, position_var)
        return mean, var, on_map

    def lookup_parts(self, xy: np.ndarray, position_var: float = 0.0, full_floor: bool = False):
        """:meth:`lookup` and the map-error part of the reading variance (``error_var``): ``(mean, var, error,
        on_map)``; the error part is 0 off the map (there the whole variance is the map's marginal spread).
        ``full_floor``: the reading variance with the noise floor's part at its full width (``floor_var`` added
        back)."""
        s = self.spec
        wp = s.width + 2
        cx = (xy[:, 0] - s.origin_x) / s.resolution
        cy = (xy[:, 1] - s.origin_y) / s.resolution
        # The cell holding the point, in padded indices (clipped into the unknown border when outside).
        ci = np.clip(np.floor(cx), -1, s.width).astype(np.int64) + 1
        cj = np.clip(np.floor(cy), -1, s.height).astype(np.int64) + 1
        on_map = self._known_flat[cj * wp + ci] > 0
        # The four cell centres around the point (padded indices: centre of padded cell k at k - 0.5 cells).
        ux, uy = cx + 0.5, cy + 0.5
        i0 = np.clip(np.floor(ux), 0, s.width).astype(np.int64)
        j0 = np.clip(np.floor(uy), 0, s.height).astype(np.int64)
        fx = np.clip(ux - i0, 0.0, 1.0)
        fy = np.clip(uy - j0, 0.0, 1.0)
        k00 = j0 * wp + i0
        corners = (k00, k00 + 1, k00 + wp, k00 + wp + 1)
        weights = ((1.0 - fx) * (1.0 - fy), fx * (1.0 - fy), (1.0 - fx) * fy, fx * fy)
        known = self._known_flat
        total = np.zeros(xy.shape[0])
        mean = np.zeros((xy.shape[0], self.outputs))
        var = np.zeros((xy.shape[0], self.outputs))
        latent = np.zeros((xy.shape[0], self.outputs))
        for k, wgt in zip(corners, weights):
            wk = wgt * known[k]
            total += wk
            mean += wk[:, None] * self._mean_flat[k]
            latent += wk[:, None] * self._latent_flat[k]
            if full_floor:
                var += wk[:, None] * self._floor_flat[k]
            if position_var > 0:
                var += wk[:, None] * (self._var_flat[k] + position_var * self._grad2_flat[k])
            else:
                var += wk[:, None] * self._var_flat[k]
        inside = total > 0
        safe = np.where(inside, total, 1.0)[:, None]
        mean /= safe
        var /= safe
        latent /= safe
        on_map &= inside
        if not on_map.all():  # off the map: the map's marginal distribution of readings
            off = ~on_map
            mean[off] = self.prior_mean
            var[off] = self.prior_var
            latent[off] = 0.0
        return mean, var, latent, on_map

    def map_grid(self, stamp: float = math.nan):
        """The lookup grid as a :class:`~gp_mapping.mapping.mapper.MapGrid` (layers as the mapper publishes them,
        their variance a reading's), for the map topics of the localizer node."""
        from gp_mapping.mapping.drawing import MapGrid, vector_layers

        layers = ({"magnitude": (self.mean[..., 0], self.var[..., 0])} if self.target == "magnitude"
                  else vector_layers(self.mean, self.var))
        return MapGrid(spec=self.spec, frame_id=self.frame_id, field_unit=self.field_unit, layers=layers,
                       known=self.known.copy(), stamp=stamp, extent="full")

    def known_cell_centres(self) -> np.ndarray:
        """``(K, 2)`` centres of the known cells (global initialisation draws from them)."""
        return self.spec.cell_centres()[self.known.ravel()]

    # ------------------------------------------------------------------------------------------------ building

    @classmethod
    def from_arrays(cls, spec: GridSpec, mean, var, known=None, **kw) -> "MagneticMap":
        """A map from arrays (tests, baselines); ``known`` defaults to every cell."""
        known = np.ones(spec.shape, dtype=bool) if known is None else known
        return cls(spec=spec, mean=mean, var=var, known=known, **kw)

    @classmethod
    def from_mapper(cls, mapper, resolution: float = 0.0, source: str = "") -> "MagneticMap":
        """The lookup grid of a :class:`~gp_mapping.mapping.mapper.Mapper`: the visited area plus ``grid.margin``
        at ``resolution`` (0: the map's ``grid.resolution``; fixed-mode maps use their fixed grid), the known
        cells predicted with :func:`reading_moments` (tiled, :func:`predict_grid`)."""
        cfg = mapper.config
        g = cfg.grid
        if int(mapper.model.num_seen) == 0:
            raise MapLoadError(f"the map {source} holds no data yet (no update ran): there is nothing to localize in")
        res = float(resolution) if resolution and resolution > 0 else float(g.resolution)
        try:
            if g.mode == "fixed":  # the fixed grid's area at the lookup's resolution
                spec = GridSpec(float(g.origin[0]), float(g.origin[1]), res,
                                max(1, math.ceil(g.size[0] / res - 1e-9)), max(1, math.ceil(g.size[1] / res - 1e-9)))
            else:
                grid_cfg = dataclasses.replace(g, resolution=res, max_cells=MAX_LOOKUP_CELLS)
                bounds = mapper.coverage.grow_bounds(grid_cfg)
                if bounds is None:
                    raise MapLoadError(f"the map {source} has no visited cells: there is nothing to localize in")
                spec = spec_from_bounds(*bounds, grid_cfg, "the localizer's lookup grid")
        except GridError as err:
            raise MapLoadError(f"{err} (set localizer.grid_resolution coarser)") from err
        if spec.num_cells > MAX_LOOKUP_CELLS:
            raise MapLoadError(f"the lookup grid of {spec.num_cells} cells is larger than {MAX_LOOKUP_CELLS}; set "
                               "localizer.grid_resolution coarser")
        known = mapper.coverage.known_mask(spec, g.unknown_distance)
        if not known.any():
            raise MapLoadError(f"the map {source} has no known cell on its grid")
        input_dims = int(cfg.sync.input_dims)
        mean, var = predict_grid(_ReadingView(mapper.model), spec, g.tile_size, height=g.height,
                                 input_dims=input_dims, only=known)
        floor_var = None
        calibration = getattr(mapper.model, "calibration", None)
        if getattr(mapper.model, "calibrates", False) and bool((calibration.noise_scale < 1).any()):
            _, full = predict_grid(_ReadingView(mapper.model, full_floor=True), spec, g.tile_size, height=g.height,
                                   input_dims=input_dims, only=known)
            floor_var = np.maximum(full - var, 0.0)
        _, noise = predict_grid(_NoiseView(mapper.model), spec, g.tile_size, height=g.height, input_dims=input_dims,
                                only=known)
        sessions = getattr(mapper.model, "sessions", None)
        offset_var = sessions.spread().detach().cpu().numpy() if sessions is not None else None
        return cls(spec=spec, mean=mean, var=var, known=known, error_var=np.maximum(var - noise, 0.0),
                   offset_var=offset_var, floor_var=floor_var, frame_id=g.frame_id, field_unit=cfg.sync.field_unit,
                   target=cfg.sync.target, source=source, sensor_translation=tuple(cfg.sync.sensor_translation),
                   sensor_rotation=tuple(cfg.sync.sensor_rotation), hard_iron=tuple(cfg.sync.hard_iron),
                   soft_iron=tuple(cfg.sync.soft_iron))

    @classmethod
    def load(cls, path: str | Path, resolution: float = 0.0, frame_id: str | None = None) -> "MagneticMap":
        """The lookup grid of a saved map state (``~/save_map``, a checkpoint, ``gp-mapping replay
        --save-state``). ``frame_id``: the frame the caller localizes in; a map of another frame is refused.
        Raises MapLoadError naming the problem (missing, unreadable, empty, another frame)."""
        from gp_mapping.mapping.mapper import Mapper

        path = Path(path)
        if not path.exists():
            raise MapLoadError(f"map file {path} does not exist")
        try:
            mapper = Mapper.load(path)
        except Exception as err:  # MapStateError, and whatever an unreadable or foreign file raises
            raise MapLoadError(f"cannot load the map {path}: {err}") from err
        if frame_id is not None and frame_id != mapper.config.grid.frame_id:
            raise MapLoadError(f"the map {path} is in frame '{mapper.config.grid.frame_id}', not '{frame_id}'; "
                               "localize in the map's frame (or transform the poses into it)")
        return cls.from_mapper(mapper, resolution, source=str(path))


__all__ = ["MAX_LOOKUP_CELLS", "MagneticMap", "reading_moments"]
