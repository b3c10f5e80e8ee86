"""Local submaps: overlapping tiles of local GP engines, for maps that grow at constant cost.

One global set of M inducing points has to cover everything the robot has seen, and an engine's cost is cubic
in M: a building needs M in the thousands. A :class:`TiledModel` instead covers the map with square tiles
(cubes when ``model.tile_height`` > 0 and the inputs are 3-D) of side ``s = model.tile_size``, and gives each
tile its own engine (``model.engine``: dual_svgp or continual_mogp) with ``model.num_inducing`` inducing points,
created when data first fall in the tile. Neighbouring tiles overlap by a band of width ``o = model.tile_overlap``
centred on their common border. Tile 0 is centred on the map origin: a map's origin is usually where the robot
started, so a room mapped from there lies in one tile's core and is mapped as by one engine; tiles come in only
when the robot leaves it. The lattice and the blending weights: :mod:`.layout`; the shared hyperparameters and
the common target unit: :mod:`.shared`; merging tiled maps tile by tile: :mod:`.merge`.

Updates. A sample is given to every tile whose span holds it (1 tile in a core, 2 in a band, up to 4 at a
2-D corner, 8 at a 3-D one); an update touches only those tiles, so its cost depends on M, the engine's memory
and the batch, never on how many tiles exist. The map's memory is the tiles that exist: proportional to the
area driven over, not to the samples. Each touched tile runs its engine's own update (its ``mode``, or its
own ``full_update_every`` counter when ``mode`` is None; a tile that gets fewer than FAST_FRACTION = 1/4 of
the samples of the batch's busiest tile -- a corner clipped -- conditions fast, and those samples wait as the engine's pending data for its next
full update, so a batch costs at most a few full tile updates, never one per tile it grazes).

Hyperparameter budget. ``model.hyper_warmup`` (up to ``hyper_steps`` steps per full update while the
hyperparameters are young, then one per ``hyper_batch`` new samples) is the shared hyperparameters' warm-up:
it counts the steps of all tiles together (``hyper_steps_t``), and each touched tile's engine is given the
warm-up (``model.hyper_warmup``) while that count is below it, none after. With each engine's own count every
new tile restarted the warm-up, so a drive into new ground kept paying up to ``hyper_steps`` steps per tile
update for hyperparameters already learned (the bench section ``large`` shows the steps per update), and an
update in a tile that had filled up (all M inducing points, a full memory) cost more than one in a young tile.

Variance. The blend is the mixture p(f(x)) = sum_t w_t(x) N(m_t(x), v_t(x)) (a latent indicator picks tile t
with probability w_t(x)). Its moments, by the law of total variance, are

    m(x) = sum_t w_t m_t,     v(x) = sum_t w_t (v_t + m_t^2) - m^2 = sum_t w_t v_t + sum_t w_t (m_t - m)^2:

inside a core this is the tile's own (m_t, v_t); in a band it is the weighted average of the two tiles'
variances plus their disagreement, so it never claims more certainty than either tile where they differ.
(Treating the tiles as independent estimates, sum_t w_t^2 v_t, would shrink the variance in every band
although the two tiles share the band's data.) ``log_predictive_density`` is the mixture's:
log sum_t w_t p_t(y | x).

GPU: every tile lives on the model's device; routing and blending are vectorised tensor operations there;
tiles are updated and predicted one after another (a batch touches at most 2^D of them). Stacking the tiles
a grid covers into one batched product per step does not pay on a CPU, where a tile's fixed cost (its calls
and the swap of its hyperparameters) is small against its cells' arithmetic; on a GPU, where the fixed cost
is kernel launches, it may.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..base import (UNSTAMPED_GAP, Engine, counted_as_moving, fold_moving_targets, moments_scale, resolve_device,
                    spans_space)
from ..config import ModelConfig
from ..errors import ConfigError
from ..merging import MergeError, MergeResult, load_merged
from ..revisits import Moments
from .layout import TileLayout, parse_tile_key, tile_key
from .shared import VERSIONS, SharedHyperparameters, Tile, shared_hyperparameter_names

_TILE_PREFIX = "tiles."
#: with mode None, a tile given fewer than this fraction of the busiest tile's samples conditions fast
FAST_FRACTION = 0.25


@dataclasses.dataclass
class TiledSummary:
    """A tiled map as merging needs it (:meth:`TiledModel.tile_summaries`): its lattice, each tile's engine
    summary (``recyclable_summary()``, original target units) by tile index, the tiles' target unit
    (``scale_offset``, ``scale_std``) and running target statistics, samples seen and shared warm-up steps."""

    layout: TileLayout
    tiles: dict[tuple[int, ...], dict]
    input_dims: int
    output_dims: int
    num_seen: int
    hyper_steps: int
    target_count: torch.Tensor
    target_mean: torch.Tensor
    target_m2: torch.Tensor
    scale_offset: torch.Tensor
    scale_std: torch.Tensor


class TiledModel(SharedHyperparameters, Engine):
    """Overlapping tiles of local engines with shared hyperparameters; see the module docstring.

    ``factory(config, input_dims, output_dims)`` builds one engine (a registered ``model.engine``). An engine
    itself (:class:`~gp_mapping.gp.base.Engine`: the same checks, counters and device), with one difference:
    its ``_latent`` is the blend of the tiles in the targets' own units (each tile keeps the target scale it
    was created with, so there is no common standardised unit), and ``predict`` returns it unscaled.
    """

    def __init__(self, config: ModelConfig, input_dims: int, output_dims: int,
                 factory: Callable[[ModelConfig, int, int], nn.Module]) -> None:
        super().__init__(config, input_dims, output_dims)
        d, p = self.input_dims, self.output_dims
        self._factory = factory
        sizes = [float(config.tile_size)] * 2
        if d == 3 and float(config.tile_height) > 0:
            sizes.append(float(config.tile_height))
        if d < 2:
            raise ConfigError(f"tiles need 2-D or 3-D inputs, got input_dims {d}", "tile_size")
        self.layout = TileLayout(tuple(sizes), float(config.tile_overlap), centred=True)
        if config.inducing == "grid" and d != 2:
            raise ConfigError("'grid' needs 2-D inputs; use 'pivoted_cholesky'", "inducing")
        self._device = resolve_device(config.device)
        # An engine that never sees data: the owner of the shared hyperparameters, and the prior where no tile
        # exists. Its scaling follows the running target statistics.
        self.prior = factory(self._tile_config((0,) * self.layout.dims), d, p)
        self._shared_names = shared_hyperparameter_names(type(self.prior))
        self._shared_list: list[torch.Tensor] | None = None
        if not self._shared_names:
            raise ConfigError(f"engine {config.engine!r} does not say which of its parts are hyperparameters "
                              "(SHARED_HYPERPARAMETERS); it cannot be tiled", "tile_size")
        self.tiles = nn.ModuleDict()
        f64 = dict(dtype=torch.float64)
        self.register_buffer("target_count", torch.zeros(p, **f64))
        self.register_buffer("target_mean", torch.zeros(p, **f64))
        self.register_buffer("target_m2", torch.zeros(p, **f64))
        self.register_buffer("target_moved", torch.tensor(False))  # the moments count moving data only
        self.register_buffer("max_jitter", torch.tensor(float(config.jitter), **f64))
        # Hyperparameter steps taken by all tiles together: the age of the shared hyperparameters.
        self.register_buffer("hyper_steps_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("lattice_centred", torch.tensor(True))  # the layout saved with the tiles
        # The unit every tile standardises its targets in, and how often it was re-expressed.
        self.register_buffer("scale_offset", torch.zeros(p, **f64))
        self.register_buffer("scale_std", torch.ones(p, **f64))
        self.register_buffer("scale_set", torch.tensor(False))
        self.register_buffer("rescalings_t", torch.tensor(0, dtype=torch.int64))
        # sum_t n_t theta_t, sum_t n_t and the tiles with samples: the consensus hyperparameters (see _consensus)
        self.register_buffer("consensus_sum", torch.zeros_like(self._theta()))
        self.register_buffer("consensus_weight", torch.tensor(0.0, **f64))
        self.register_buffer("consensus_tiles", torch.tensor(0.0, **f64))
        self._journal: dict[str, Any] | None = None
        # Renewed whenever what the prior engine predicts (where no tile exists) may have changed.
        self._prior_version = next(VERSIONS)
        self.to(self._device)

    # ------------------------------------------------------------------ properties
    # num_seen (Engine) counts samples once, however many tiles a sample went to.
    @property
    def num_tiles(self) -> int:
        return len(self.tiles)

    @property
    def jitter(self) -> float:
        return float(self.max_jitter)

    @property
    def kernel(self) -> nn.Module:
        """The shared kernel (continual_mogp: the shared latent kernels)."""
        return getattr(self.prior, "kernel", None) or getattr(self.prior, "kernels")

    @property
    def likelihood(self) -> nn.Module:
        return self.prior.likelihood

    def tile_indices(self) -> list[tuple[int, ...]]:
        return [parse_tile_key(k) for k in self.tiles.keys()]

    def tile(self, index: tuple[int, ...]) -> nn.Module | None:
        """The engine of tile ``index``, or None when no data have fallen in it."""
        key = tile_key(index)
        return self.tiles[key].engine if key in self.tiles else None

    def _apply(self, fn, *args, **kwargs):
        self._shared_list = None
        out = super()._apply(fn, *args, **kwargs)
        self._renew_versions()  # another device or dtype predicts in other round-off
        return out

    # ------------------------------------------------------------------ tiles
    @property
    def hyperparameters_young(self) -> bool:
        """Whether the shared hyperparameters are still in their warm-up: fewer than ``model.hyper_warmup``
        steps taken by all tiles together (module docstring, 'Hyperparameter budget')."""
        return int(self.hyper_steps_t) < int(self.config.hyper_warmup)

    def _tile_config(self, index: tuple[int, ...]) -> ModelConfig:
        # The map calibrates a reading's variance as a whole (a tile alone sees too few revisits to fit it).
        cfg = dataclasses.replace(self.config, tile_size=0.0, calibration="none")
        seed = (int(self.config.seed) + sum((k + 1) * 1_000_003 * int(i) for k, i in enumerate(index))) % (2 ** 31)
        changes: dict[str, Any] = {"seed": seed}
        if cfg.inducing == "grid":
            (x0, x1), (y0, y1) = self.layout.span(index)[:2]
            changes["inducing_bounds"] = [x0, y0, x1, y1]
        return dataclasses.replace(cfg, **changes)

    def _new_tile(self, index: tuple[int, ...]) -> Tile:
        engine = self._factory(self._tile_config(index), self.input_dims, self.output_dims)
        engine.to(self.device)
        self._share(engine)
        self._scale(engine)
        return Tile(engine, self._theta()).to(self.device)

    # ------------------------------------------------------------------ transactions
    def begin_update(self) -> None:
        """Start recording what the next updates change, so that :meth:`rollback` can undo them; the record
        holds only the tiles touched (the cost does not grow with the map)."""
        self._journal = {"tiles": {}, "shared": self._theta(),
                         "buffers": {name: buf.detach().clone() for name, buf in self._buffers.items()},
                         "calibration": {k: v.detach().clone() for k, v in self.calibration.state_dict().items()},
                         "sessions": {k: v.detach().clone() for k, v in self.sessions.state_dict().items()}}

    def _journal_prior(self) -> None:
        """Record the prior engine before its unit changes (the only change to it that is not the shared theta)."""
        if self._journal is not None and "prior" not in self._journal:
            self._journal["prior"] = {k: v.detach().clone() for k, v in self.prior.state_dict().items()}

    def _journal_tile(self, key: str) -> None:
        if self._journal is None or key in self._journal["tiles"]:
            return
        slot = self.tiles[key] if key in self.tiles else None
        self._journal["tiles"][key] = (None if slot is None else
                                       {k: v.detach().clone() for k, v in slot.state_dict().items()})

    def end_update(self) -> None:
        self._journal = None

    def rollback(self) -> None:
        """Return to the state at the last :meth:`begin_update` (tiles created since are removed)."""
        if self._journal is None:
            raise RuntimeError("rollback() without begin_update()")
        journal = self._journal
        self._journal = None
        for key, state in journal["tiles"].items():
            if state is None:
                if key in self.tiles:
                    del self.tiles[key]
            else:
                if key not in self.tiles:
                    self.tiles[key] = self._new_tile(parse_tile_key(key))
                self.tiles[key].load_state_dict(state)
        if "prior" in journal:
            self.prior.load_state_dict(journal["prior"])
        self._set_theta(journal["shared"])
        with torch.no_grad():
            for name, value in journal["buffers"].items():
                self._buffers[name].copy_(value)
        self.calibration.load_state_dict(journal["calibration"])
        self.sessions.load_state_dict(journal["sessions"])
        self._loaded()

    # ------------------------------------------------------------------ sessions (base.Engine._calibrate_on)
    @property
    def reexpresses_sessions(self) -> bool:
        return self.prior.reexpresses_sessions

    def _close_session(self) -> None:
        for slot in self.tiles.values():
            slot.engine._close_session()

    def _reexpress_session(self, delta: torch.Tensor) -> None:
        """Each tile that holds the session's data re-expresses them, under the hyperparameters it was fitted
        with."""
        for key, slot in self.tiles.items():
            if slot.engine._holds_session_data():
                self._journal_tile(key)
                with self._hyperparameters(slot.theta):
                    slot.engine._reexpress_session(delta)
                slot.version = next(VERSIONS)

    # ------------------------------------------------------------------ update
    def _check_y(self, y, n: int, name: str = "y") -> torch.Tensor:
        """Targets (N, P) with NaN kept where a channel is missing: the tiles' engines decide whether they
        take missing channels (continual_mogp does, dual_svgp refuses them)."""
        filled, mask = self._check_targets(y, n, name, allow_missing=True)
        return torch.where(mask, filled, torch.full_like(filled, math.nan))

    @property
    def wants_stamps(self) -> bool:  # Engine.wants_stamps: the tiles' engine's (model.time_error)
        return bool(getattr(self.prior, "wants_stamps", False))

    def update(self, x, y, mode: str | None = None, t=None) -> dict:
        """Condition on a batch: each sample goes to every tile whose span holds it (see the module docstring).
        ``mode`` is passed to every touched tile's engine (None: each follows its own full_update_every); ``t``
        (N,), the samples' stamps, to an engine that wants them."""
        start = time.perf_counter()
        if mode not in (None, "fast", "full"):
            raise ValueError(f"update mode must be 'fast', 'full' or None, got {mode!r}")
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        tt = self._check_stamps(t, xt.shape[0], UNSTAMPED_GAP) if self.wants_stamps else None
        stats: dict[str, Any] = {"mode": mode or "fast", "n_batch": int(xt.shape[0]), "tiles_touched": 0,
                                 "tiles_created": 0, "z_moved": 0, "hyper_steps": 0}
        if xt.shape[0] > 0:
            own = self._journal is None
            if own:  # an update that fails half way leaves the model as it was
                self.begin_update()
            try:
                observed = ~torch.isnan(yt)
                yt = torch.where(observed, self._calibrate_on(xt, torch.where(observed, yt, torch.zeros_like(yt)),
                                                              observed), yt)
                self._update_tiles(xt, yt, mode, stats, tt)
            except BaseException:
                if own:
                    self.rollback()
                raise
            if own:
                self._journal = None
        stats.update({"seconds": time.perf_counter() - start, "num_seen": self.num_seen, "tiles": self.num_tiles,
                      "jitter": self.jitter})
        return stats

    def _update_tiles(self, xt: torch.Tensor, yt: torch.Tensor, mode: str | None, stats: dict,
                      tt: torch.Tensor | None = None) -> None:
        prior_before = (self._theta(), self.scale_offset.clone(), self.scale_std.clone())
        with torch.no_grad():
            fold_moving_targets(self.target_count, self.target_mean, self.target_m2, self.target_moved, yt,
                                spans_space(xt, self.config.lengthscale), ~torch.isnan(yt))
            self._follow_targets()
        pts, tiles = self.layout.memberships(xt)
        groups = self.layout.group(tiles)  # sorted: a fixed order
        most = max(len(members) for _, members in groups)
        modes = []
        for index, members in groups:
            key = tile_key(index)
            rows = pts[members]
            self._journal_tile(key)
            if key not in self.tiles:
                self.tiles[key] = self._new_tile(index)
                stats["tiles_created"] += 1
            slot = self.tiles[key]
            before = (float(slot.engine.num_seen), slot.theta.clone())
            self._bring_up_to_date(slot)
            warmup = int(self.config.hyper_warmup) if self.hyperparameters_young else 0
            if slot.engine.config.hyper_warmup != warmup:  # the warm-up is the shared hyperparameters'
                slot.engine.config = dataclasses.replace(slot.engine.config, hyper_warmup=warmup)
            # A tile that only clips a corner of the batch conditions fast; its samples wait (the engine's
            # pending data) for its next full update, when the robot is in it.
            tile_mode = mode
            if mode is None and rows.numel() < FAST_FRACTION * most:
                tile_mode = "fast"
            consensus = self._theta()
            stamps = {} if tt is None else {"t": tt[rows.cpu()]}
            if hasattr(slot.engine, "revisits"):  # e is the walk's, not the tile's: every tile's revisits bound it
                slot.engine.revisits_elsewhere = self._revisits_besides(key)
            out = slot.engine.update(xt[rows], yt[rows], mode=tile_mode, **stamps)
            slot.version = next(VERSIONS)
            proposal = self._theta()
            slot.theta.copy_(proposal)  # the tile's posterior is fitted under its own proposal
            self._count_proposal(slot, before)
            if not torch.equal(proposal, consensus):  # it learned (a fast update leaves theta as it was)
                self._set_theta(self._consensus(proposal, float(slot.engine.num_seen)))
            self._freeze_after_first_update()  # before the batch's next tile learns it too
            modes.append(out.get("mode"))
            stats["z_moved"] += int(out.get("z_moved", 0))
            stats["hyper_steps"] += int(out.get("hyper_steps", 0))
            self.hyper_steps_t += int(out.get("hyper_steps", 0))
            jitter = out.get("jitter", getattr(slot.engine, "jitter", None))
            if jitter is not None and float(jitter) > float(self.max_jitter):
                self.max_jitter.fill_(float(jitter))
        stats["tiles_touched"] = len(modes)
        stats["mode"] = "full" if "full" in modes else (modes[0] if modes else stats["mode"])
        if not (torch.equal(self._theta(), prior_before[0]) and torch.equal(self.scale_offset, prior_before[1])
                and torch.equal(self.scale_std, prior_before[2])):
            self._prior_version = next(VERSIONS)  # what the prior predicts moved with the hyperparameters or unit
        with torch.no_grad():
            self.num_seen_t += xt.shape[0]
            self.num_updates_t += 1

    def _revisits_besides(self, key: str) -> Moments | None:
        """The revisit moments of every tile but ``key`` (gp/revisits.py), None when there is no other tile."""
        others = [slot.engine.revisits.moments() for k, slot in self.tiles.items() if k != key]
        return functools.reduce(operator.add, others) if others else None

    def _freeze_after_first_update(self) -> None:
        # continual_mogp: the mixing matrix is learned in the first tile's first update only (module docstring).
        mixing = getattr(self.prior, "mixing_raw", None)
        if isinstance(mixing, nn.Parameter) and len(self.tiles) > 0:
            mixing.requires_grad_(False)

    # ------------------------------------------------------------------ prediction
    def _each_tile(self, xt: torch.Tensor) -> Iterator[tuple[torch.Tensor, nn.Module, torch.Tensor]]:
        """(rows, engine, weights) for every tile with positive weight at the points ``xt``: ``rows`` index
        ``xt``. A tile is yielded under the hyperparameters it was fitted with; tiles without data as the
        prior engine (current hyperparameters, running scaling), once for all their rows."""
        pts, tiles, w = self.layout.blend(xt)
        missing = torch.zeros(pts.shape[0], dtype=torch.bool, device=pts.device)
        for index, sel in self.layout.group(tiles):
            key = tile_key(index)
            if key not in self.tiles:
                missing[sel] = True
                continue
            slot = self.tiles[key]
            with self._hyperparameters(slot.theta):
                yield pts[sel], slot.engine, w[sel]
        if bool(missing.any()):
            yield pts[missing], self.prior, w[missing]

    def predict(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """Blended mean and variance (G, P) of the latent f: the mixture's moments (module docstring)."""
        xt = self._check_x(x)
        with torch.no_grad():
            mean, var = self._latent(xt)
            return mean + self.sessions.level(), var

    def _latent(self, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixture's moments at checked inputs, in the targets' units (each tile predicts in its own)."""
        g, p = xt.shape[0], self.output_dims
        parts = [(rows, w[:, None], *engine.predict(xt[rows])) for rows, engine, w in self._each_tile(xt)]
        mean = torch.zeros(g, p, dtype=torch.float64, device=xt.device)
        for rows, w, m, _ in parts:
            mean.index_add_(0, rows, w * m)
        # sum_t w_t (v_t + (m_t - m)^2) = sum_t w_t (v_t + m_t^2) - m^2 without the cancellation
        var = torch.zeros(g, p, dtype=torch.float64, device=xt.device)
        for rows, w, m, v in parts:
            dev = m - mean[rows]
            var.index_add_(0, rows, w * (v + dev * dev))
        return mean, var.clamp_min(0.0)

    @property
    def calibrates(self) -> bool:
        """The map as a whole calibrates a reading's variance (Engine.calibrates); its tiles do not."""
        return self.config.calibration == "prequential" and hasattr(self.prior.likelihood, "noise_variance")

    def _reading_moments(self, xt: torch.Tensor, reported: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, latent variance, noise variance) of the blend, targets' units: the noise is the tiles'
        noise variances weighted as their means are (``reported``: Engine._reading_moments)."""
        mean, var = self._latent(xt)
        noise = torch.zeros_like(var)
        for rows, engine, w in self._each_tile(xt):
            noise.index_add_(0, rows, w[:, None] * engine._noise_variance(xt[rows], reported) * engine.y_std ** 2)
        return mean, var, noise

    def _reading_slope2(self, xt: torch.Tensor) -> torch.Tensor | None:
        """The tiles' squared slopes weighted as their means are (targets' units per m^2); None where no tile
        states one."""
        slope2, stated = torch.zeros(xt.shape[0], self.output_dims, dtype=torch.float64, device=xt.device), False
        for rows, engine, w in self._each_tile(xt):
            part = engine._reading_slope2(xt[rows])
            if part is not None:
                slope2.index_add_(0, rows, w[:, None] * part)
                stated = True
        return slope2 if stated else None

    def _target_variance(self) -> torch.Tensor:
        return self.target_m2 / self.target_count.clamp_min(1.0)

    def _shared_noise_variance(self) -> torch.Tensor:
        """The prior engine's (the tiles share their hyperparameters, Engine._shared_noise_variance)."""
        return self.prior._shared_noise_variance()

    def _prior_latent_variance(self) -> torch.Tensor:
        """The prior engine's (current hyperparameters, running scaling): what a tile without data states, as
        the blend does far from every tile, without routing a point through the lattice (8x the cost)."""
        return self.prior._prior_latent_variance()

    def tiles_near_path(self) -> set[str]:
        """Keys of the tiles within reach of where the map is now (the last reading's position): those the next two
        calibration lags of path can reach, 2 model.calibration_lag + tile_overlap, and so what the lagged copy
        of the map holds (_snapshot)."""
        reach = 2.0 * float(self.config.calibration_lag) + self.layout.overlap
        here = self.calibration.last_x.detach().cpu().tolist()
        near = set()
        for key in self.tiles.keys():
            span = self.layout.span(parse_tile_key(key))
            gap = math.sqrt(sum(max(lo - p, 0.0, p - hi) ** 2 for (lo, hi), p in zip(span, here)))
            if gap <= reach:
                near.add(key)
        return near

    def _snapshot(self) -> "TiledModel":
        """The lagged copy of the map (Engine._keep_lagged) holds only the tiles near the path
        (:meth:`tiles_near_path`): it predicts the batches of the next two lags of path, which cannot leave that
        reach, and a copy of every tile would cost as much as the map (2.4x the CPU of a 36-tile drive)."""
        near = self.tiles_near_path()
        everything = self.tiles
        self.tiles = nn.ModuleDict({key: slot for key, slot in everything.items() if key in near})
        try:
            return super()._snapshot()
        finally:
            self.tiles = everything

    def log_predictive_density(self, x, y) -> torch.Tensor:
        """log p(y*|x*) (N, P) of the blend: log sum_t w_t p_t(y*|x*) (a log-sum-exp over the tiles); where the
        map calibrates, the Gaussian of a reading's calibrated variance (Engine.log_predictive_density)."""
        if self.calibrates or self.sessions.current > 0:
            return super().log_predictive_density(x, y)
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        with torch.no_grad():
            parts = [(rows, torch.log(w)[:, None] + engine.log_predictive_density(xt[rows], yt[rows]))
                     for rows, engine, w in self._each_tile(xt)]
            shape = (xt.shape[0], self.output_dims)
            top = torch.full(shape, -math.inf, dtype=torch.float64, device=xt.device)
            for rows, terms in parts:
                top.scatter_reduce_(0, rows[:, None].expand_as(terms), terms, "amax")
            total = torch.zeros(shape, dtype=torch.float64, device=xt.device)
            for rows, terms in parts:
                total.index_add_(0, rows, torch.exp(terms - top[rows]))
            return top + torch.log(total)

    # ------------------------------------------------------------------ merging maps
    def recyclable_summary(self) -> dict:
        """The summary of a map of one tile (a room) for merging maps (gp/merging/): its engine's, under
        the hyperparameters it was fitted with. Several tiles overlap and share the data in their bands, so
        summing them would count those data twice: such a map has no single summary (a MergeError says so) and
        merges tile by tile instead (:meth:`tile_summaries`, :func:`merge_tiled`)."""
        if self.num_tiles != 1:
            raise MergeError(f"a map of {self.num_tiles} tiles has no single summary (overlapping tiles share "
                             "data); it merges tile by tile with maps tiled alike (gp-mapping merge), or make "
                             "it with model.tile_size 0")
        slot = next(iter(self.tiles.values()))
        with self._hyperparameters(slot.theta):
            return self._summary_of(slot)

    def tile_samples(self) -> dict[tuple[int, ...], int]:
        """Samples each tile has taken (its engine's num_seen), by tile index: what changed since a summary."""
        return {parse_tile_key(key): int(slot.engine.num_seen) for key, slot in self.tiles.items()}

    def tile_summaries(self, indices=None) -> "TiledSummary":
        """What merging needs of this map, tile by tile (:func:`merge_tiled`): the lattice, every tile's engine
        summary (or those of ``indices`` only: a part of the map, see mapping/merge.py) under the hyperparameters
        its posterior was fitted with, the target unit and statistics."""
        tiles = {}
        keys = sorted(self.tiles.keys()) if indices is None else sorted(tile_key(i) for i in indices)
        for key in keys:
            if key not in self.tiles:
                raise KeyError(f"no tile {key!r} in this map")
            slot = self.tiles[key]
            with self._hyperparameters(slot.theta):
                tiles[parse_tile_key(key)] = self._summary_of(slot)
        cpu = dict(device="cpu")
        return TiledSummary(layout=self.layout, tiles=tiles, input_dims=self.input_dims,
                            output_dims=self.output_dims, num_seen=int(self.num_seen),
                            hyper_steps=int(self.hyper_steps_t),
                            target_count=self.target_count.to(**cpu).clone(),
                            target_mean=self.target_mean.to(**cpu).clone(),
                            target_m2=self.target_m2.to(**cpu).clone(),
                            scale_offset=self.scale_offset.to(**cpu).clone(),
                            scale_std=self.scale_std.to(**cpu).clone())

    @staticmethod
    def _summary_of(slot: Tile) -> dict:
        summarise = getattr(slot.engine, "recyclable_summary", None)
        if summarise is None:
            raise MergeError(f"engine {type(slot.engine).__name__} cannot be summarised for a merge")
        return summarise()

    def set_merged_tiles(self, results: dict[tuple[int, ...], MergeResult], summary: "TiledSummary") -> None:
        """Make this (empty, dual_svgp) tiled map the merge: one merged posterior per tile (:func:`merge_tiled`),
        each under the hyperparameters its merge learned (the tile's theta_t), the consensus their average
        weighted by the samples each tile holds, and the unit, statistics and counters of ``summary``."""
        if self.tiles or self.layout != summary.layout:
            raise MergeError("merged tiles go into an empty tiled map of the sources' layout")
        with torch.no_grad():
            dev = self.device
            self.target_count.copy_(summary.target_count.to(dev))
            self.target_mean.copy_(summary.target_mean.to(dev))
            self.target_m2.copy_(summary.target_m2.to(dev))
            self.target_moved.copy_(counted_as_moving(summary.target_count))
            self.scale_offset.copy_(summary.scale_offset.to(dev))
            self.scale_std.copy_(summary.scale_std.to(dev))
            self.scale_set.fill_(True)
            self.num_seen_t.fill_(int(summary.num_seen))
            self.hyper_steps_t.fill_(int(summary.hyper_steps))
            self.lattice_centred.fill_(bool(summary.layout.centred))
            shared = self._theta()
            self._scale(self.prior)
            self._set_theta(shared)
            self.consensus_sum.zero_()
            self.consensus_weight.zero_()
            self.consensus_tiles.zero_()
            for index in sorted(results):
                result = results[index]
                slot = self._new_tile(index)
                self.tiles[tile_key(index)] = slot
                load_merged(slot.engine, result)  # the merged kernel and noise land in the shared modules
                slot.theta.copy_(self._theta())
                self._count_proposal(slot, (0.0, torch.zeros_like(slot.theta)))
                self.max_jitter.fill_(max(float(self.max_jitter), float(result.jitter)))
            if float(self.consensus_weight) > 0:
                self._set_theta(self.consensus_sum / self.consensus_weight)
        self._prior_version = next(VERSIONS)
        self._journal = None

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state with any number of tiles: tiles are created or removed to match it first."""
        wanted = []
        for name in state_dict:
            if name.startswith(_TILE_PREFIX):
                key = name[len(_TILE_PREFIX):].split(".", 1)[0]
                if key not in wanted:
                    wanted.append(key)
        if "lattice_centred" not in state_dict:  # saved by version 0.1: tiles cornered on the origin
            state_dict = {**state_dict, "lattice_centred": torch.tensor(False)}
        self.layout = dataclasses.replace(self.layout, centred=bool(state_dict["lattice_centred"]))
        for key in list(self.tiles.keys()):
            if key not in wanted:
                del self.tiles[key]
        for key in wanted:
            if key not in self.tiles:
                try:
                    index = parse_tile_key(key)
                except ValueError as err:
                    raise RuntimeError(f"Error(s) in loading state_dict for TiledModel: {err}") from None
                if len(index) != self.layout.dims:
                    raise RuntimeError(f"Error(s) in loading state_dict for TiledModel: tile {key!r} has "
                                       f"{len(index)} indices, this layout tiles {self.layout.dims} axes")
                self.tiles[key] = self._new_tile(index)
        recount = "consensus_sum" not in state_dict  # saved by version 0.1: the sums come from the tiles
        if recount:
            state_dict = {**state_dict, "consensus_sum": self.consensus_sum.clone(),
                          "consensus_weight": self.consensus_weight.clone()}
        count_tiles = "consensus_tiles" not in state_dict  # saved before it was kept: counted from the tiles
        if count_tiles:
            state_dict = {**state_dict, "consensus_tiles": self.consensus_tiles.clone()}
        if "scale_set" not in state_dict:  # saved by version 0.1: each tile kept the scale it was made with
            offset, std = moments_scale(state_dict["target_count"], state_dict["target_mean"],
                                        state_dict["target_m2"])
            state_dict = {**state_dict, "scale_offset": offset, "scale_std": std,
                          "scale_set": torch.as_tensor(bool((state_dict["target_count"] > 0).any())),
                          "rescalings_t": torch.tensor(0, dtype=torch.int64)}
        if "target_moved" not in state_dict:  # saved before the moments counted moving data only
            state_dict = {**state_dict, "target_moved": counted_as_moving(state_dict["target_count"])}
        if "hyper_steps_t" not in state_dict:
            # A state saved before the shared warm-up was counted: every step the tiles took was a shared one.
            steps = sum(int(v) for k, v in state_dict.items()
                        if k.startswith(_TILE_PREFIX) and k.endswith(".engine.adam_step"))
            state_dict = {**state_dict, "hyper_steps_t": torch.tensor(steps, dtype=torch.int64)}
        # The shared parts appear under every tile too (one module): every copy holds the same values.
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._shared_list = None  # (assign=True replaces the tensors)
        if recount:
            self._recount_proposals()
        elif count_tiles:
            self._count_tiles()
        self._journal = None
        return result

    def _loaded(self) -> None:  # Engine: called once a state is loaded (and by rollback)
        self._freeze_after_first_update()
        self._renew_versions()

    # ------------------------------------------------------------------ what changed (incremental maps)
    def _renew_versions(self) -> None:
        for slot in self.tiles.values():
            slot.version = next(VERSIONS)
        self._prior_version = next(VERSIONS)

    def prediction_versions(self) -> tuple[int, dict[str, int]]:
        """A token of what every part of the blend predicts from: the prior's version and each tile's. Give it
        back to :meth:`changed_since` to learn which points' predictions may have changed since it was taken.
        A version is renewed by every change to a tile (its update, a re-expression in a new unit, a rollback,
        a load, a move to another device) and the prior's by an update that moved the shared hyperparameters or the
        unit, a merge, a rollback or a load."""
        return self._prior_version, {key: slot.version for key, slot in self.tiles.items()}

    def changed_since(self, x, versions: tuple[int, dict[str, int]]) -> torch.Tensor:
        """(N,) bool: the points of ``x`` whose prediction may differ from when :meth:`prediction_versions`
        gave ``versions``: those blending a tile that changed, appeared or went, or blending the prior (no tile
        there) after the prior changed. The others predict what they predicted then (up to round-off: the same
        state on the same inputs). Costs the blend's weights, not a prediction."""
        xt = self._check_x(x)
        prior_then, tiles_then = versions
        prior_changed = prior_then != self._prior_version
        pts, tiles, _ = self.layout.blend(xt)
        changed = torch.zeros(xt.shape[0], dtype=torch.bool, device=xt.device)
        for index, sel in self.layout.group(tiles):
            key = tile_key(index)
            now = self.tiles[key].version if key in self.tiles else None
            then = tiles_then.get(key)
            if now != then or (now is None and prior_changed):
                changed[pts[sel]] = True
        return changed

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, tile_sizes={self.layout.sizes}, "
                f"overlap={self.layout.overlap}, tiles={self.num_tiles}, engine={self.config.engine}")


__all__ = ["FAST_FRACTION", "TiledModel", "TiledSummary"]
