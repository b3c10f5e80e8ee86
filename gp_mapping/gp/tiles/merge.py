"""Merging tiled maps tile by tile (:func:`merge_tiled`): the tiles of one index of maps tiled alike hold the data
of one span, and merge as any maps do (:mod:`gp_mapping.gp.merging`) into the tile of a map of all their data."""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING, Sequence

import torch

from ..base import moments_scale, pool_moments, scale_drifted
from ..config import ModelConfig
from ..dual_svgp import DualSVGP
from ..merging import MergeError, MergeResult, RigidTransform, Source, merge
from .layout import TileLayout, tile_key
from .model import TiledModel, TiledSummary

if TYPE_CHECKING:
    from ..merging.levels import Levels


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
    #: the sources' offsets removed before the merge (gp/merging/levels.py; set by mapping/merge.py merge_maps)
    levels: "Levels | None" = None


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
    channels' cross terms dropped as in merging.Source.transformed), and the merged map's unit: ``unit`` (the
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
    those tiles (gp/merging/: the ensemble bound, each source's tile a pseudo-likelihood; its closed-form
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


__all__ = ["TiledMergeResult", "merge_tiled", "moved_tile"]
