"""Local submaps: overlapping tiles of local GP engines, for maps that grow at constant cost.

One global set of M inducing points has to cover everything the robot has seen, and an engine's cost is cubic
in M: a building needs M in the thousands. A :class:`TiledModel` instead covers the map with square tiles
(cubes when ``model.tile_height`` > 0 and the inputs are 3-D) of side ``s = model.tile_size``, and gives each
tile its own engine (``model.engine``: dual_svgp or continual_mogp) with ``model.num_inducing`` inducing points,
created when data first fall in the tile. Neighbouring tiles overlap by a band of width ``o = model.tile_overlap``
centred on their common border. Tile 0 is centred on the map origin: a map's origin is usually where the robot
started, so a room mapped from there lies in one tile's core and is mapped as by one engine; tiles come in only
when the robot leaves it. Below, for brevity, coordinates are taken shifted by s/2 so that tile ``i`` (per axis)
spans ``[i s - o/2, (i + 1) s + o/2)`` (states saved by version 0.1 used that lattice unshifted, and keep it).

Updates. A sample is given to every tile whose span holds it (1 tile in a core, 2 in a band, up to 4 at a
2-D corner, 8 at a 3-D one); an update touches only those tiles, so its cost depends on M, the engine's memory
and the batch, never on how many tiles exist. The map's memory is the tiles that exist: proportional to the
area driven over, not to the samples. Each touched tile runs its engine's own update (its ``mode``, or its
own ``full_update_every`` counter when ``mode`` is None; a tile that gets fewer than FAST_FRACTION = 1/4 of
the samples of the batch's busiest tile -- a corner clipped -- conditions fast, and those samples wait as the engine's pending data for its next
full update, so a batch costs at most a few full tile updates, never one per tile it grazes).

Shared hyperparameters. All tiles share one kernel and one likelihood module (continual_mogp: its latent
kernels, likelihood and mixing matrix), holding the consensus theta. The tile being updated starts from theta
and learns on its own batch and memory, as a single engine would; what it ends at, theta_t, is its proposal,
and its posterior is fitted under it. The consensus is then the average of every tile's latest proposal, each
weighted by the samples that tile has learned from: theta = sum_t n_t theta_t / sum_t n_t (raw parameters:
logarithms of lengthscales and variances). A single tile's batch often cannot identify every hyperparameter
(lanes 4 m apart in a 10 m tile say little about the lengthscale across them); letting each tile's Adam steps
set the shared theta made it swing (a lengthscale from 2.4 m to 0.45 m within two minutes of a simulated drive)
and the map lose 30 % of its accuracy on ground it revisited. Alone, a tile's proposal is the consensus, so a
map that has one tile (a room) learns exactly as one engine does; an earlier rule, a running average of all
proposals ever made (theta += (n_t / N) (theta_t - theta)), slowed a lone tile's learning as 1 / N and cost
2 % on Solin protocol 1. Each tile records the hyperparameters theta_t its posterior was last fitted under. A
tile is never changed when others learn; when it is next *updated* it is first carried to the current theta by its engine's ``hyperparameter_change()``
(dual_svgp: the old data's pseudo-likelihood on u = f(Z) is kept, held data are recomputed -- the same
transport the engine applies to its own hyperparameter steps). continual_mogp has no such hook and needs
none: its q(u) on u = f(Z) is stored unwhitened and is kept as the prior changes (its own convention
between updates). Predictions of a tile use theta_t (its posterior is exact for the theta it was fitted
under), so publishing a map never changes the model: the node and the replay give identical maps whatever
their publication timing. The mixing matrix of continual_mogp is learned in the first tile's first update and
frozen afterwards (a later tile relearning it would move every other tile's map without data).

Hyperparameter budget. ``model.hyper_warmup`` (up to ``hyper_steps`` steps per full update while the
hyperparameters are young, then one per ``hyper_batch`` new samples) is the shared hyperparameters' warm-up:
it counts the steps of all tiles together (``hyper_steps_t``), and each touched tile's engine is given the
warm-up (``model.hyper_warmup``) while that count is below it, none after. With each engine's own count every
new tile restarted the warm-up, so a drive into new ground kept paying up to ``hyper_steps`` steps per tile
update for hyperparameters already learned (the bench section ``large`` shows the steps per update), and an
update in a tile that had filled up (all M inducing points, a full memory) cost more than one in a young tile.

Target scaling. Shared hyperparameters live in standardised units, so all tiles standardise in one unit
(``scale_offset``, ``scale_std``), which adapts as a single engine's does (base.Engine._track_targets): the
wrapper keeps running per-output means and variances of every sample it has seen, the first batch sets the
unit, and when the statistics drift from it (base.scale_drifted) every tile is re-expressed in the new unit by
its engine's set_standardisation (exact in the data; the noise once learned), under its own hyperparameters.
A unit fixed at the first batch failed on a robot that stands still for its first second: the batch's spread is
the sensor noise, a thousandth of the field's. The engines' own adaptive re-scaling is off in tiles (it would put
each tile in its own unit). Re-expressions are rare (logarithmic in how far the first unit was off) and cost one
re-expression per tile. With one tile this is the single engine's rule on the same data, bit for bit.

Blending (partition of unity). Per axis, with r(u) = 6u^5 - 15u^4 + 10u^3 on u clamped to [0, 1] (C^2,
r(0) = 0, r(1) = 1, r(u) + r(1 - u) = 1, flat at both ends), tile i's weight at coordinate x is

    phi_i(x) = r((x - (i s - o/2)) / o) * (1 - r((x - ((i + 1) s - o/2)) / o)),

which is 1 in the tile's core [i s + o/2, (i + 1) s - o/2], 0 outside its span, and falls from 1 to 0 across
each band while its neighbour's rises: phi_i + phi_{i+1} = 1 there (the second factor of phi_i and the first
of phi_{i+1} are 1 - r(u) and r(u) of the same u; since o <= s, at most two tiles' spans hold x, and those
two factors are the only ones not equal to 1). In 2-D and 3-D the weight is the product over the tiled axes,
w_t(x) = prod_d phi_{t_d}(x_d), and sum_t w_t(x) = prod_d sum_i phi_i(x_d) = 1. The weights are C^2 in x, so
a blend of continuous tile predictions has no seam. A tile that does not exist (no data ever fell in its
span) contributes the prior: mean = running target mean, variance = the shared kernel's prior variance in
the running scale. Far from data every tile has reverted to (about) its prior, so this blends smoothly too.

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

import contextlib
import dataclasses
import hashlib
import itertools
import math
import time
from typing import Any, Callable, Iterator, Sequence
import torch
from torch import nn

from .base import Engine, merge_moments, moments_scale, pool_moments, resolve_device, scale_drifted
from .config import ModelConfig
from .dual_svgp import DualSVGP
from .errors import ConfigError
from .recyclable import MergeError, MergeResult, RigidTransform, Source, load_merged, merge

#: the hyperparameter attributes tiles share, by engine class name (an engine may declare its own with a
#: class attribute ``SHARED_HYPERPARAMETERS``)
_SHARED_BY_ENGINE = {"DualSVGP": ("kernel", "likelihood"),
                     "ContinualMOGP": ("kernels", "likelihood", "mixing_raw")}
_TILE_PREFIX = "tiles."
#: with mode None, a tile given fewer than this fraction of the busiest tile's samples conditions fast
FAST_FRACTION = 0.25
#: prediction versions (TiledModel.prediction_versions): drawn from one counter for every model in the process,
#: so a number is never reused (not after a tile is removed, a state loaded, or another model built)
_VERSIONS = itertools.count(1)


def shared_hyperparameter_names(engine_class) -> tuple[str, ...]:
    """The parts of an engine class that its tiles share (its ``SHARED_HYPERPARAMETERS``, or the table above)."""
    return tuple(getattr(engine_class, "SHARED_HYPERPARAMETERS",
                         _SHARED_BY_ENGINE.get(getattr(engine_class, "__name__", ""), ())))


def can_tile(engine_class) -> bool:
    """Whether an engine class says which of its parts are the hyperparameters its tiles share. smc_experts and
    var_gp do not: they cover a growing map their own way (experts opened anywhere; region blocks)."""
    return bool(shared_hyperparameter_names(engine_class))


def smootherstep(u: torch.Tensor) -> torch.Tensor:
    """r(u) = 6u^5 - 15u^4 + 10u^3 on u clamped to [0, 1]."""
    u = u.clamp(0.0, 1.0)
    return u * u * u * (u * (6.0 * u - 15.0) + 10.0)


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Tile geometry: pitch per tiled axis (``sizes``, the first ``len(sizes)`` input axes) and ``overlap``."""

    sizes: tuple[float, ...]
    overlap: float
    #: tiles centred on the origin (tile 0's core is centred on it) rather than cornered there; see
    #: TiledModel: a map's origin is usually where the robot started, so a room mapped from there stays in
    #: one tile's core. False: the layout of states saved by version 0.1.
    centred: bool = False

    def __post_init__(self) -> None:
        if not self.sizes or not all(math.isfinite(s) and s > 0 for s in self.sizes):
            raise ConfigError(f"tile sizes must be positive, got {self.sizes}", "tile_size")
        if not (math.isfinite(self.overlap) and 0.0 < self.overlap <= min(self.sizes)):
            raise ConfigError(f"{self.overlap!r} must be > 0 and at most the smallest tile side {min(self.sizes)} "
                              "(so a point lies in at most two tiles per axis)", "tile_overlap")

    @property
    def dims(self) -> int:
        return len(self.sizes)

    def _lattice(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pitch (dims,), coordinates (N, dims)) of points (N, >= dims) on the lattice whose tile i starts at
        i s: shifted by half a tile when the tiles are centred on the origin."""
        s = torch.as_tensor(self.sizes, dtype=x.dtype, device=x.device)
        xd = x[:, :self.dims]
        return s, (xd + 0.5 * s if self.centred else xd)

    def _per_axis(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For points (N, >= dims): the lower tile index per axis (N, dims) (the other candidate is +1) and
        the blending weights of the lower and upper candidates (N, dims) each."""
        s, xd = self._lattice(x)
        h = 0.5 * self.overlap
        lo = torch.floor((xd - h) / s)
        # Band between tile lo and lo + 1 centred on (lo + 1) s: the upper tile's rising ramp.
        up = smootherstep((xd - ((lo + 1.0) * s - h)) / self.overlap)
        return lo.to(torch.int64), 1.0 - up, up

    def memberships(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (point, tile) pair whose tile span holds the point: point indices (K,) and tile indices
        (K, dims), sorted by point. Spans are half-open, [i s - o/2, (i + 1) s + o/2) (less s/2 when centred)."""
        s, xd = self._lattice(x)
        h = 0.5 * self.overlap
        lo = torch.floor((xd - h) / s).to(torch.int64)
        hi = torch.floor((xd + h) / s).to(torch.int64)
        return self._combine(lo, (hi > lo))

    def blend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Partition-of-unity weights at points (N, >= dims): point indices (K,), tile indices (K, dims) and
        weights (K,) > 0 of every tile whose weight is positive; the weights of each point sum to 1."""
        lo, w_lo, w_up = self._per_axis(x)
        pts, tiles, sel = self._combine(lo, w_up > 0, with_selection=True)
        per_axis = torch.where(sel.bool(), w_up[pts], w_lo[pts])
        w = per_axis.prod(dim=1)
        keep = w > 0
        return pts[keep], tiles[keep], w[keep]

    def _combine(self, lo: torch.Tensor, has_upper: torch.Tensor, with_selection: bool = False):
        n, d = lo.shape
        corners = torch.tensor([[(c >> k) & 1 for k in range(d)] for c in range(2 ** d)], dtype=torch.int64,
                               device=lo.device)  # (C, d) 0: lower, 1: upper candidate
        valid = (~corners.bool()[None, :, :] | has_upper[:, None, :]).all(dim=2)  # (N, C)
        pts, cidx = torch.nonzero(valid, as_tuple=True)
        sel = corners[cidx]
        tiles = lo[pts] + sel
        if with_selection:
            return pts, tiles, sel
        return pts, tiles

    @staticmethod
    def group(tiles: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """The distinct tiles of (K, dims) tile indices, in lexicographic order, each with the positions (in
        increasing order) of its rows. One sort of a scalar key per row (the indices offset to >= 0, row-major):
        ``torch.unique(dim=0)`` sorts rows lexicographically and costs 40 x more (a third of a grid's
        prediction)."""
        if tiles.shape[0] == 0:
            return []
        low = tiles.min(0).values
        span = tiles.max(0).values - low + 1
        key = torch.zeros(tiles.shape[0], dtype=torch.int64, device=tiles.device)
        for d in range(tiles.shape[1]):
            key = key * span[d] + (tiles[:, d] - low[d])
        order = torch.argsort(key, stable=True)
        counts = torch.unique_consecutive(key[order], return_counts=True)[1].tolist()
        out = []
        for rows in order.split(counts):
            out.append((tuple(tiles[rows[0]].tolist()), rows))
        return out

    def span(self, index: tuple[int, ...]) -> list[tuple[float, float]]:
        """[low, high) per tiled axis of a tile's span."""
        h = 0.5 * self.overlap
        shift = 0.5 if self.centred else 0.0
        return [((i - shift) * s - h, (i + 1 - shift) * s + h) for i, s in zip(index, self.sizes)]


def tile_key(index: tuple[int, ...]) -> str:
    """Module name of a tile: its integer index per axis joined by '_' (e.g. '3_-1')."""
    return "_".join(str(int(i)) for i in index)


def parse_tile_key(key: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in key.split("_"))
    except ValueError:
        raise ValueError(f"not a tile name: {key!r}") from None


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


class _Tile(nn.Module):
    """One tile: its engine and the hyperparameters (flattened) its posterior was last fitted under."""

    def __init__(self, engine: nn.Module, theta: torch.Tensor) -> None:
        super().__init__()
        self.engine = engine
        self.register_buffer("theta", theta.detach().clone())
        self.version = next(_VERSIONS)  # renewed whenever what the tile predicts may have changed


class TiledModel(Engine):
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
        self.register_buffer("num_seen_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("num_updates_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("target_count", torch.zeros(p, **f64))
        self.register_buffer("target_mean", torch.zeros(p, **f64))
        self.register_buffer("target_m2", torch.zeros(p, **f64))
        self.register_buffer("max_jitter", torch.tensor(float(config.jitter), **f64))
        # Hyperparameter steps taken by all tiles together: the age of the shared hyperparameters.
        self.register_buffer("hyper_steps_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("lattice_centred", torch.tensor(True))  # the layout saved with the tiles
        # The unit every tile standardises its targets in, and how often it was re-expressed.
        self.register_buffer("scale_offset", torch.zeros(p, **f64))
        self.register_buffer("scale_std", torch.ones(p, **f64))
        self.register_buffer("scale_set", torch.tensor(False))
        self.register_buffer("rescalings_t", torch.tensor(0, dtype=torch.int64))
        # sum_t n_t theta_t and sum_t n_t over the tiles: the consensus hyperparameters (see _consensus)
        self.register_buffer("consensus_sum", torch.zeros_like(self._theta()))
        self.register_buffer("consensus_weight", torch.tensor(0.0, **f64))
        self._journal: dict[str, Any] | None = None
        # Renewed whenever what the prior engine predicts (where no tile exists) may have changed.
        self._prior_version = next(_VERSIONS)
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

    # ------------------------------------------------------------------ shared hyperparameters
    def _shared_parameters(self) -> list[torch.Tensor]:
        # Looked up once (a walk over the modules costs more than the rest of _theta); a load or a move to
        # another device may replace the tensors, so both drop the list.
        if self._shared_list is None:
            out = []
            for name in self._shared_names:
                part = getattr(self.prior, name)
                out.extend(part.parameters() if isinstance(part, nn.Module) else [part])
            self._shared_list = out
        return self._shared_list

    def _apply(self, fn, *args, **kwargs):
        self._shared_list = None
        out = super()._apply(fn, *args, **kwargs)
        self._renew_versions()  # another device or dtype predicts in other round-off
        return out

    def _theta(self) -> torch.Tensor:
        params = self._shared_parameters()
        if not params:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.cat([q.detach().reshape(-1).to(torch.float64) for q in params])

    def _set_theta(self, theta: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for q in self._shared_parameters():
                n = q.numel()
                q.copy_(theta[offset:offset + n].reshape(q.shape).to(q.dtype))
                offset += n

    @contextlib.contextmanager
    def _hyperparameters(self, theta: torch.Tensor) -> Iterator[None]:
        """The shared hyperparameters set to ``theta`` inside the block (restored bit for bit after it)."""
        current = self._theta()
        if torch.equal(current, theta):
            yield
            return
        self._set_theta(theta)
        try:
            yield
        finally:
            self._set_theta(current)

    def _consensus(self, proposal: torch.Tensor) -> torch.Tensor:
        """The shared hyperparameters after a tile's ``proposal``: the tiles' latest proposals averaged, each
        weighted by the samples its tile has learned from (module docstring, 'Shared hyperparameters'), from the
        running sums sum_t n_t theta_t and sum_t n_t, so that it costs the same however many tiles exist. A lone
        tile's proposal is the consensus bit for bit (one tile maps as one engine). Parameters that no longer
        learn (continual_mogp's frozen mixing matrix) keep their value."""
        if len(self.tiles) == 1 or float(self.consensus_weight) <= 0.0:
            return proposal
        current = self._theta()
        learning = torch.cat([torch.full((q.numel(),), bool(q.requires_grad), device=current.device)
                              for q in self._shared_parameters()])
        return torch.where(learning, self.consensus_sum / self.consensus_weight, current)

    def _count_proposal(self, slot: _Tile, before: tuple[float, torch.Tensor]) -> None:
        """Replace a tile's term (samples, theta) ``before`` in the running sums by its current one."""
        n_before, theta_before = before
        n = float(slot.engine.num_seen)
        self.consensus_sum.add_(n * slot.theta - n_before * theta_before)
        self.consensus_weight.add_(n - n_before)

    def _recount_proposals(self) -> None:
        """The running sums from the tiles (a state saved before they were kept)."""
        self.consensus_sum.copy_(sum((float(slot.engine.num_seen) * slot.theta for slot in self.tiles.values()),
                                     torch.zeros_like(self.consensus_sum)))
        self.consensus_weight.fill_(sum(float(slot.engine.num_seen) for slot in self.tiles.values()))

    def _share(self, engine: nn.Module) -> None:
        for name in self._shared_names:
            part = getattr(self.prior, name)
            if isinstance(part, nn.Parameter):
                engine._parameters[name] = part
            else:
                setattr(engine, name, part)

    def _bring_up_to_date(self, slot: _Tile) -> None:
        """Carry a tile's posterior from the hyperparameters it was fitted under to the current ones."""
        current = self._theta()
        if torch.equal(slot.theta, current):
            return
        change = getattr(slot.engine, "hyperparameter_change", None)
        if change is not None:
            self._set_theta(slot.theta)
            try:
                with change():
                    self._set_theta(current)
            except BaseException:
                self._set_theta(current)
                raise
        slot.theta.copy_(current)

    # ------------------------------------------------------------------ target scaling
    def _scale(self, engine: nn.Module) -> None:
        """Give an engine the tiles' unit (engines without standardised targets keep theirs)."""
        if getattr(engine.likelihood, "standardise_targets", True):
            engine.set_standardisation(self.scale_offset, self.scale_std)

    def _follow_targets(self) -> None:
        """After the running target statistics took a batch: the first batch sets the tiles' unit; when they
        have drifted from it (base.scale_drifted, the rule of a single engine), every tile is re-expressed in
        the new unit (module docstring, 'Target scaling')."""
        mean, std = moments_scale(self.target_count, self.target_mean, self.target_m2)
        if not bool(self.scale_set):
            self.scale_offset.copy_(mean)
            self.scale_std.copy_(std)
            self.scale_set.fill_(True)
        elif scale_drifted(mean, std, self.scale_offset, self.scale_std):
            self.scale_offset.copy_(mean)
            self.scale_std.copy_(std)
            # A fixed order: a reloaded map (its tiles in the file's order) sums alike.
            for key in sorted(self.tiles.keys()):
                self._rescale_tile(key, self.tiles[key])
            self.rescalings_t += 1
        else:
            return
        self._journal_prior()
        shared = self._theta()
        self._scale(self.prior)
        self._set_theta(shared)  # the prior holds no data: re-expressing it must not move the shared parts

    def _rescale_tile(self, key: str, slot: _Tile) -> None:
        """Re-express a tile in the tiles' unit. Its engine re-expresses the data exactly and, once learned, the
        noise: a shared hyperparameter, so this is done under the tile's own hyperparameters, and the tile's
        re-expressed ones replace its term in the consensus."""
        if not getattr(slot.engine.likelihood, "standardise_targets", True):
            return
        self._journal_tile(key)
        consensus = self._theta()
        before = (float(slot.engine.num_seen), slot.theta.clone())
        self._set_theta(slot.theta)
        try:
            self._scale(slot.engine)
        except BaseException:
            self._set_theta(consensus)
            raise
        slot.theta.copy_(self._theta())
        slot.version = next(_VERSIONS)
        self._count_proposal(slot, before)
        self._set_theta(consensus if torch.equal(slot.theta, before[1]) else self._consensus(slot.theta))

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

    def _new_tile(self, index: tuple[int, ...]) -> _Tile:
        engine = self._factory(self._tile_config(index), self.input_dims, self.output_dims)
        engine.to(self.device)
        self._share(engine)
        self._scale(engine)
        return _Tile(engine, self._theta()).to(self.device)

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

    # ------------------------------------------------------------------ update
    def _check_y(self, y, n: int, name: str = "y") -> torch.Tensor:
        """Targets (N, P) with NaN kept where a channel is missing: the tiles' engines decide whether they
        take missing channels (continual_mogp does, dual_svgp refuses them)."""
        filled, mask = self._check_targets(y, n, name, allow_missing=True)
        return torch.where(mask, filled, torch.full_like(filled, math.nan))

    def update(self, x, y, mode: str | None = None) -> dict:
        """Condition on a batch: each sample goes to every tile whose span holds it (see the module docstring).
        ``mode`` is passed to every touched tile's engine (None: each follows its own full_update_every)."""
        start = time.perf_counter()
        if mode not in (None, "fast", "full"):
            raise ValueError(f"update mode must be 'fast', 'full' or None, got {mode!r}")
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
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
                self._update_tiles(xt, yt, mode, stats)
            except BaseException:
                if own:
                    self.rollback()
                raise
            if own:
                self._journal = None
        stats.update({"seconds": time.perf_counter() - start, "num_seen": self.num_seen, "tiles": self.num_tiles,
                      "jitter": self.jitter})
        return stats

    def _update_tiles(self, xt: torch.Tensor, yt: torch.Tensor, mode: str | None, stats: dict) -> None:
        prior_before = (self._theta(), self.scale_offset.clone(), self.scale_std.clone())
        with torch.no_grad():
            merge_moments(self.target_count, self.target_mean, self.target_m2, yt, ~torch.isnan(yt))
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
            out = slot.engine.update(xt[rows], yt[rows], mode=tile_mode)
            slot.version = next(_VERSIONS)
            proposal = self._theta()
            slot.theta.copy_(proposal)  # the tile's posterior is fitted under its own proposal
            self._count_proposal(slot, before)
            if not torch.equal(proposal, consensus):  # it learned (a fast update leaves theta as it was)
                self._set_theta(self._consensus(proposal))
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
            self._prior_version = next(_VERSIONS)  # what the prior predicts moved with the hyperparameters or unit
        with torch.no_grad():
            self.num_seen_t += xt.shape[0]
            self.num_updates_t += 1

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

    def _reading_moments(self, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, latent variance, noise variance) of the blend, targets' units: the noise is the tiles'
        noise variances weighted as their means are."""
        mean, var = self._latent(xt)
        noise = torch.zeros_like(var)
        for rows, engine, w in self._each_tile(xt):
            noise.index_add_(0, rows, w[:, None] * engine._noise_variance(xt[rows]) * engine.y_std ** 2)
        return mean, var, noise

    def _target_variance(self) -> torch.Tensor:
        return self.target_m2 / self.target_count.clamp_min(1.0)

    def _snapshot(self) -> "TiledModel":
        """The lagged copy of the map (Engine._keep_lagged) holds only the tiles within reach of where the map
        is now: it predicts the batches of the next two lags of path, which cannot leave that reach, and a copy
        of every tile would cost as much as the map (2.4x the CPU of a 36-tile drive)."""
        reach = 2.0 * float(self.config.calibration_lag) + self.layout.overlap
        here = self.calibration.last_x.detach().cpu().tolist()
        near = {}
        for key, slot in self.tiles.items():
            span = self.layout.span(parse_tile_key(key))
            gap = math.sqrt(sum(max(lo - p, 0.0, p - hi) ** 2 for (lo, hi), p in zip(span, here)))
            if gap <= reach:
                near[key] = slot
        everything = self.tiles
        self.tiles = nn.ModuleDict(near)
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
        """The summary of a map of one tile (a room) for merging maps (gp/recyclable.py): its engine's, under
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
    def _summary_of(slot: _Tile) -> dict:
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
        self._prior_version = next(_VERSIONS)
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
        if "scale_set" not in state_dict:  # saved by version 0.1: each tile kept the scale it was made with
            offset, std = moments_scale(state_dict["target_count"], state_dict["target_mean"],
                                        state_dict["target_m2"])
            state_dict = {**state_dict, "scale_offset": offset, "scale_std": std,
                          "scale_set": torch.as_tensor(bool((state_dict["target_count"] > 0).any())),
                          "rescalings_t": torch.tensor(0, dtype=torch.int64)}
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
        self._journal = None
        return result

    def _loaded(self) -> None:  # Engine: called once a state is loaded (and by rollback)
        self._freeze_after_first_update()
        self._renew_versions()

    # ------------------------------------------------------------------ what changed (incremental maps)
    def _renew_versions(self) -> None:
        for slot in self.tiles.values():
            slot.version = next(_VERSIONS)
        self._prior_version = next(_VERSIONS)

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


# ---------------------------------------------------------------------------------------------- merging maps
@dataclasses.dataclass
class TiledMergeResult:
    """What a tile-by-tile merge did: tiles made, samples merged, the largest tile's inducing points, the sum of
    the tiles' ensemble bounds and Adam steps, seconds, and the tiles taken from the cache unchanged."""

    tiles: int
    num_data: int
    num_inducing: int
    bound: float
    steps: int
    seconds: float
    reused: int = 0


def moved_tile(layout: TileLayout, index: tuple[int, ...], input_dims: int,
               transform: RigidTransform | None) -> tuple[int, ...]:
    """The tile of ``layout`` that tile ``index`` becomes when its map is moved by ``transform``; a MergeError
    unless the move carries the lattice onto itself (quarter turns, and shifts by whole tiles along the
    tiled axes), since only then is a moved tile's span, and so its data, one tile's span."""
    if transform is None:
        return tuple(index)
    d, n = int(input_dims), layout.dims
    rot = transform.rotation[:d, :d]
    perm = rot.round()
    whole = bool((rot - perm).abs().max() <= 1e-9)
    for a in range(n):
        b = int(perm[:, a].abs().argmax())
        whole = whole and b < n and layout.sizes[b] == layout.sizes[a]
    shift = 0.0 if layout.centred else 0.5
    centre = torch.zeros(1, d, dtype=torch.float64)
    centre[0, :n] = torch.tensor([(i + shift) * size for i, size in zip(index, layout.sizes)], dtype=torch.float64)
    moved = transform.apply_inputs(centre)[0, :n]
    sizes = torch.tensor(layout.sizes, dtype=torch.float64)
    target = torch.round(moved / sizes - shift)
    if not whole or float(((target + shift) * sizes - moved).abs().max()) > 1e-6 * float(sizes.min()):
        raise MergeError(f"a tiled map merges tile by tile, so its frame transform must carry its tiles onto "
                         f"tiles: quarter turns and shifts by whole tiles ({', '.join(f'{s:g}' for s in layout.sizes)}"
                         " m); give maps in one frame, or make them with model.tile_size 0")
    return tuple(int(i) for i in target.tolist())


def _merged_statistics(summaries: Sequence[TiledSummary], transforms: Sequence[RigidTransform | None],
                       unit: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The sources' running target statistics pooled (a vector target's moved by each frame's rotation, its
    channels' cross terms dropped as in recyclable.Source.transformed), and the merged map's unit: ``unit`` (the
    last merge's, live) or else the first source's, while the pooled statistics have not drifted from it
    (base.scale_drifted, the rule a map applies to its own unit), else theirs."""
    p = summaries[0].output_dims

    def moved(transform, centre: torch.Tensor, spread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if transform is None or p != 3:
            return centre.clone(), spread.clone()
        return transform.rotation @ centre, (transform.rotation ** 2) @ spread

    count = torch.zeros(p, dtype=torch.float64)
    mean = torch.zeros(p, dtype=torch.float64)
    m2 = torch.zeros(p, dtype=torch.float64)
    for summary, transform in zip(summaries, transforms):
        pool_moments(count, mean, m2, summary.target_count, *moved(transform, summary.target_mean, summary.target_m2))
    offset, std = moments_scale(count, mean, m2)
    if unit is not None and not scale_drifted(offset, std, *unit):
        return count, mean, m2, unit[0].clone(), unit[1].clone()
    first_offset, first_var = moved(transforms[0], summaries[0].scale_offset, summaries[0].scale_std ** 2)
    if not scale_drifted(offset, std, first_offset, first_var.sqrt()):
        offset, std = first_offset, first_var.sqrt()
    return count, mean, m2, offset, std


def _tile_merge_key(local: Sequence[tuple[str, tuple[int, ...], dict, RigidTransform | None]], *settings) -> str:
    """What a merged tile is a function of: each source tile's name, index, content (a digest of its summary's
    tensors and kernel state) and transform, and the merge's settings (its M, steps, rate, target unit, config)."""
    digest = hashlib.blake2b(digest_size=20)
    for name, index, summary, transform in local:
        digest.update(repr((name, index)).encode())
        tensors = {k: v for k, v in summary.items() if isinstance(v, torch.Tensor)}
        kernel = summary.get("kernel")
        if kernel is not None:
            tensors.update({f"kernel/{k}": v for k, v in kernel.state_dict().items()})
        for key in sorted(tensors):
            digest.update(key.encode())
            digest.update(tensors[key].detach().cpu().contiguous().numpy().tobytes())
        digest.update(repr(summary.get("num_seen")).encode())
        if transform is not None:
            digest.update(transform.rotation.detach().cpu().numpy().tobytes())
            digest.update(transform.translation.detach().cpu().numpy().tobytes())
    for value in settings:
        digest.update(value.detach().cpu().numpy().tobytes() if isinstance(value, torch.Tensor)
                      else repr(value).encode())
    return digest.hexdigest()


def merge_tiled(sources: Sequence[tuple[str, TiledSummary, RigidTransform | None]], model_config: ModelConfig, *,
                steps: int = 0, lr: float = 0.02, num_inducing: int | None = None, cache: dict | None = None
                ) -> tuple[TiledModel, TiledMergeResult]:
    """Merge tiled maps (name, summary, transform into the merged frame) tile by tile into one tiled map.

    Sources tiled alike (the same lattice) hold, in their tiles of one index, the data of one span: merging
    those tiles (gp/recyclable.py: the ensemble bound, each source's tile a pseudo-likelihood; its closed-form
    posterior, and ``steps`` Adam steps on the tile's inducing inputs and kernel) gives the tile of a map of all
    their data. Tiles of one source are never merged with each other, so the data of a band
    (held by both neighbouring tiles) are counted once per tile, as in a map that took them all. Each tile
    gets ``num_inducing`` inducing points (default: as many as its largest source tile, or
    ``model_config.num_inducing`` if larger: a tile covers the same ground however many maps it merges, so the
    merged map keeps the per-tile cost of the maps it came from; the bench section ``merge`` compares the
    two), its own
    hyperparameters from its merge, and the map a consensus as while mapping. The merged tiles are dual SVGPs
    (the form of a merged posterior) in one target unit.

    ``cache`` (a dict the caller keeps between merges, e.g. the merger node's): a tile whose inputs (source tiles,
    transforms, unit, settings) are those of the cached merge takes that merge again instead of recomputing it,
    so a live merge costs the tiles that changed; the merged unit stays the last merge's until the data drift
    from it.
    """
    start = time.perf_counter()
    sources = list(sources)
    if not sources:
        raise MergeError("nothing to merge: no maps given")
    first_name, first, _ = sources[0]
    for name, summary, _ in sources[1:]:
        if summary.layout != first.layout:
            raise MergeError(f"{name} is tiled as {summary.layout} but {first_name} as {first.layout}; tiled maps "
                             "merge tile by tile and must share model.tile_size, tile_overlap and tile_height")
        if (summary.input_dims, summary.output_dims) != (first.input_dims, first.output_dims):
            raise MergeError(f"{name} has {summary.input_dims}-D inputs and {summary.output_dims} outputs, "
                             f"{first_name} {first.input_dims} and {first.output_dims}")
    layout = first.layout
    d, p = first.input_dims, first.output_dims
    # Live (with a cache) the last merge's unit stays while the data have not drifted from it, as a map keeps its
    # own: a new unit would re-express, and so re-merge, every tile.
    count, mean, m2, offset, std = _merged_statistics([s for _, s, _ in sources], [t for _, _, t in sources],
                                                      unit=cache.get("unit") if cache is not None else None)
    by_tile: dict[tuple[int, ...], list[Source]] = {}
    inputs: dict[tuple[int, ...], list] = {}  # what each merged tile is made of, for the cache's key
    for name, summary, transform in sources:
        for index, tile_summary in summary.tiles.items():
            target = moved_tile(layout, index, d, transform)
            by_tile.setdefault(target, []).append(
                Source.from_summary(tile_summary, name=f"{name}, tile {tile_key(index)}", transform=transform))
            inputs.setdefault(target, []).append((name, index, tile_summary, transform))
    cfg = dataclasses.replace(model_config, engine="dual_svgp", tile_size=float(layout.sizes[0]),
                              tile_overlap=float(layout.overlap),
                              tile_height=float(layout.sizes[2]) if layout.dims == 3 else 0.0,
                              inducing="pivoted_cholesky" if model_config.inducing == "grid"
                              else model_config.inducing)
    results: dict[tuple[int, ...], MergeResult] = {}
    reused = 0
    if cache is not None:
        cache["unit"] = (offset.clone(), std.clone())
        for index in [i for i in cache if isinstance(i, tuple) and i not in by_tile]:
            del cache[index]
    for index in sorted(by_tile):
        local = by_tile[index]
        m = num_inducing if num_inducing is not None else min(sum(s.num_inducing for s in local),
                                                             max(int(cfg.num_inducing),
                                                                 max(s.num_inducing for s in local)))
        key = _tile_merge_key(inputs[index], m, steps, lr, offset, std, cfg) if cache is not None else None
        # A result is only read (load_merged copies it into the tile), so the cache and the map can share it.
        if cache is not None and index in cache and cache[index][0] == key:
            results[index] = cache[index][1]
            reused += 1
            continue
        results[index] = merge(local, cfg, num_inducing=m, steps=steps, lr=lr, target_mean=offset,
                               target_scale=std)
        if cache is not None:
            cache[index] = (key, results[index])
    largest = max((r.num_inducing for r in results.values()), default=int(cfg.num_inducing))
    cfg = dataclasses.replace(cfg, num_inducing=max(int(cfg.num_inducing), largest))
    model = TiledModel(cfg, d, p, DualSVGP)
    model.layout = layout
    pooled = dataclasses.replace(first, target_count=count, target_mean=mean, target_m2=m2, scale_offset=offset,
                                 scale_std=std, num_seen=sum(s.num_seen for _, s, _ in sources),
                                 hyper_steps=max(s.hyper_steps for _, s, _ in sources))
    model.set_merged_tiles(results, pooled)
    return model, TiledMergeResult(tiles=len(results), num_data=pooled.num_seen, num_inducing=largest,
                                   bound=float(sum(r.bound for r in results.values())),
                                   steps=int(sum(r.steps for r in results.values())),
                                   seconds=time.perf_counter() - start, reused=reused)


__all__ = ["TileLayout", "TiledMergeResult", "TiledModel", "TiledSummary", "can_tile", "merge_tiled", "moved_tile",
           "parse_tile_key", "smootherstep", "tile_key"]
