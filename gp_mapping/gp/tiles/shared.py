"""What the tiles of a tiled map (:mod:`.model`) share: their hyperparameters and their target unit.

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

Target scaling. Shared hyperparameters live in standardised units, so all tiles standardise in one unit
(``scale_offset``, ``scale_std``), which adapts as a single engine's does (base.Engine._track_targets): the
wrapper keeps running per-output means and variances of every sample it has seen, the first batch sets the
unit, and when the statistics drift from it (base.scale_drifted) every tile is re-expressed in the new unit by
its engine's set_standardisation (exact in the data; the noise once learned), under its own hyperparameters.
A unit fixed at the first batch failed on a robot that stands still for its first second: the batch's spread is
the sensor noise, a thousandth of the field's. The engines' own adaptive re-scaling is off in tiles (it would put
each tile in its own unit). Re-expressions are rare (logarithmic in how far the first unit was off) and cost one
re-expression per tile. With one tile this is the single engine's rule on the same data, bit for bit.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch
from torch import nn

from ..base import moments_scale, scale_drifted

#: the hyperparameter attributes tiles share, by engine class name (an engine may declare its own with a
#: class attribute ``SHARED_HYPERPARAMETERS``); one that an engine's configuration leaves out (dual_svgp's
#: position_param without position noise) is skipped
_SHARED_BY_ENGINE = {"DualSVGP": ("kernel", "likelihood", "position_param"),
                     "ContinualMOGP": ("kernels", "likelihood", "mixing_raw")}
#: prediction versions (TiledModel.prediction_versions): drawn from one counter for every model in the process,
#: so a number is never reused (not after a tile is removed, a state loaded, or another model built)
VERSIONS = itertools.count(1)


def shared_hyperparameter_names(engine_class) -> tuple[str, ...]:
    """The parts of an engine class that its tiles share (its ``SHARED_HYPERPARAMETERS``, or the table above)."""
    return tuple(getattr(engine_class, "SHARED_HYPERPARAMETERS",
                         _SHARED_BY_ENGINE.get(getattr(engine_class, "__name__", ""), ())))


def can_tile(engine_class) -> bool:
    """Whether an engine class says which of its parts are the hyperparameters its tiles share. smc_experts and
    var_gp do not: they cover a growing map their own way (experts opened anywhere; region blocks)."""
    return bool(shared_hyperparameter_names(engine_class))


class Tile(nn.Module):
    """One tile: its engine and the hyperparameters (flattened) its posterior was last fitted under."""

    def __init__(self, engine: nn.Module, theta: torch.Tensor) -> None:
        super().__init__()
        self.engine = engine
        self.register_buffer("theta", theta.detach().clone())
        self.version = next(VERSIONS)  # renewed whenever what the tile predicts may have changed


class SharedHyperparameters:
    """Mixin of :class:`~.model.TiledModel`: the shared hyperparameters (the consensus theta, each tile's theta_t)
    and the tiles' target unit."""

    # ------------------------------------------------------------------ shared hyperparameters
    def _shared_parameters(self) -> list[torch.Tensor]:
        # Looked up once (a walk over the modules costs more than the rest of _theta); a load or a move to
        # another device may replace the tensors, so both drop the list.
        if self._shared_list is None:
            out = []
            for name in self._shared_names:
                part = getattr(self.prior, name, None)
                if part is None:
                    continue
                out.extend(part.parameters() if isinstance(part, nn.Module) else [part])
            self._shared_list = out
        return self._shared_list

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

    def _consensus(self, proposal: torch.Tensor, samples: float) -> torch.Tensor:
        """The shared hyperparameters after a tile that has learned from ``samples`` samples proposed
        ``proposal``: the tiles' latest proposals averaged, each weighted by the samples its tile has learned
        from (module docstring, 'Shared hyperparameters'), from the running sums sum_t n_t theta_t and sum_t n_t,
        so that it costs the same however many tiles exist. A lone tile's proposal is the consensus bit for bit
        (one tile maps as one engine). Parameters that no longer learn (continual_mogp's frozen mixing matrix)
        keep their value.

        model.tile_consensus_step moves it from that average towards the proposal: the average alone moves by
        about one tile's steps per lap over many tiles, so revisits teach the shared hyperparameters slowly
        (docs/calibration.md, Tile consensus). The step is scaled by the tile's samples over a typical tile's
        (sum_t n_t over the tiles with samples), at most 1: a new tile's first 20 steps on its first 15 readings
        fit them with a noise at the floor, and an unscaled step of 0.5 took the shared noise of a simulated world
        read with 0.25 uT^2 down to 0.10 (the average, and one engine, learn 0.27-0.28)."""
        if len(self.tiles) == 1 or float(self.consensus_weight) <= 0.0:
            return proposal
        current = self._theta()
        learning = torch.cat([torch.full((q.numel(),), bool(q.requires_grad), device=current.device)
                              for q in self._shared_parameters()])
        average = self.consensus_sum / self.consensus_weight
        typical = float(self.consensus_weight) / max(1.0, float(self.consensus_tiles))
        step = float(self.config.tile_consensus_step) * min(1.0, float(samples) / typical)
        return torch.where(learning, average + step * (proposal - average) if step else average, current)

    def _count_proposal(self, slot: Tile, before: tuple[float, torch.Tensor]) -> None:
        """Replace a tile's term (samples, theta) ``before`` in the running sums by its current one."""
        n_before, theta_before = before
        n = float(slot.engine.num_seen)
        self.consensus_sum.add_(n * slot.theta - n_before * theta_before)
        self.consensus_weight.add_(n - n_before)
        self.consensus_tiles.add_(float(n > 0) - float(n_before > 0))

    def _recount_proposals(self) -> None:
        """The running sums from the tiles (a state saved before they were kept)."""
        self.consensus_sum.copy_(sum((float(slot.engine.num_seen) * slot.theta for slot in self.tiles.values()),
                                     torch.zeros_like(self.consensus_sum)))
        self.consensus_weight.fill_(sum(float(slot.engine.num_seen) for slot in self.tiles.values()))
        self._count_tiles()

    def _count_tiles(self) -> None:
        """The tiles with samples, from the tiles (a state saved before they were counted)."""
        self.consensus_tiles.fill_(sum(1.0 for slot in self.tiles.values() if slot.engine.num_seen > 0))

    def _share(self, engine: nn.Module) -> None:
        for name in self._shared_names:
            part = getattr(self.prior, name, None)
            if part is None:
                continue
            if isinstance(part, nn.Parameter):
                engine._parameters[name] = part
            else:
                setattr(engine, name, part)

    def _bring_up_to_date(self, slot: Tile) -> None:
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

    def _rescale_tile(self, key: str, slot: Tile) -> None:
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
        slot.version = next(VERSIONS)
        self._count_proposal(slot, before)
        self._set_theta(consensus if torch.equal(slot.theta, before[1])
                        else self._consensus(slot.theta, float(slot.engine.num_seen)))


__all__ = ["SharedHyperparameters", "Tile", "VERSIONS", "can_tile", "shared_hyperparameter_names"]
