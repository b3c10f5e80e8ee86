"""The tile lattice of a tiled map (:mod:`.model`): which tiles hold a point, and their blending weights.

Square tiles (cubes when ``model.tile_height`` > 0 and the inputs are 3-D) of side ``s = model.tile_size``;
neighbouring tiles overlap by a band of width ``o = model.tile_overlap`` centred on their common border. Tile 0
is centred on the map origin. For brevity, coordinates are taken shifted by s/2 so that tile ``i`` (per axis)
spans ``[i s - o/2, (i + 1) s + o/2)`` (states saved by version 0.1 used that lattice unshifted, and keep it).

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
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import ConfigError


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


__all__ = ["TileLayout", "parse_tile_key", "smootherstep", "tile_key"]
