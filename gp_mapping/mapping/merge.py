"""Merging maps (state files or live mappers) into one map without their data (recyclable GPs, gp/merging/).

A source is a :class:`~gp_mapping.mapping.mapper.Mapper` (loaded from a state file, or rebuilt from a model
summary received over DDS) with an optional rigid transform into the merged frame. The merged map is a Mapper
whose model is a dual SVGP holding the merged posterior, whose visited cells and trajectory are the sources'
(moved into the merged frame), and whose lineage is the union of the sources': so it saves, loads
(``node.initial_map``), publishes and keeps mapping like any map, and a later merge refuses to count its data
twice.

Tiled maps (``model.tile_size`` > 0, the shipped setting) merge tile by tile (gp/tiles/merge.py, ``merge_tiled``) when
every source is tiled alike: the merged map is then tiled the same way, each of its tiles the merge of the
sources' tiles of that place. A map of several tiles has no single summary (its tiles share their bands' data),
so it merges only with tiled maps; its summary over DDS carries every tile (:func:`encode_summary`). A building's
summary outgrows one message (about 1 MB per tile at M = 256): the mapper then sends it in parts
(:class:`TileRotation`: the tiles that changed first, then the rest in turn, each part within the size limit and
naming every tile the map has), and the merger puts the parts together (:func:`assemble_tiles`), merging once it
holds every tile; a tile merges as of its last part, which is what tile-by-tile merging allows, since each
merged tile depends only on the sources' tiles of that place. A summary (or a part) that still does not fit is
reduced: its model tensors in float32 (``encode_summary(precision="float32")``, read back as float64), and the
map-wide parts every part repeats coarsened (:func:`reduced`: visited cells at a coarser resolution, fewer
trajectory points).

Merging, from the math up: ``gp/merging/`` and ``gp/tiles/`` (posteriors), this module (maps), its two
drivers ``gp_mapping/merge_cli.py`` (``gp-mapping merge``: state files) and ``gp_mapping/ros/merger_node.py``
(model summaries over DDS), and the benchmark ``gp_mapping/evaluation/merge.py``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import uuid
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gp_mapping.config import ConfigError, MapperConfig, config_from_dict, to_dict
from gp_mapping.gp import merging
from gp_mapping.gp.merging import MergeError, MergeResult, RigidTransform, Source, merge, merged_engine
from gp_mapping.gp.base import MAX_SESSIONS, Recyclable
from gp_mapping.gp.calibration import RECORD_FIELDS, check_records, evenly_spaced, rotated_records
from gp_mapping.gp.merging.levels import Levels, pair_offsets, source_offsets
from gp_mapping.gp.tiles import TiledMergeResult, TiledModel, TiledSummary, merge_tiled, parse_tile_key, tile_key
from gp_mapping.mapping.mapper import Mapper

DEFAULT_MAX_INDUCING = 1024
# Adam steps on the merged inducing inputs and kernel by default when the merged map's inducing points cannot
# explain all the sources' (it must compress them: test_recyclable's two halves of 64 points merged into 64).
# While they explain them all, the closed form is the merge of the sources' summaries as they are and the
# default: the steps fit the summaries better and predict no better (the bench's merge section,
# docs/benchmarks.md: a real room's two sessions 2.138 uT in closed form against 3.410 with the steps; tile by
# tile, where the default is always the closed form, a building's two sessions 0.446 against 0.448).
DEFAULT_STEPS = merging.COMPRESSING_STEPS
DEFAULT_TILED_STEPS = 0
SUMMARY_FORMAT = "gp_mapping.model_summary"
SUMMARY_VERSION = "1"
#: precisions of a summary's model tensors (metadata "precision"; float32 halves a summary and is read as float64)
SUMMARY_PRECISIONS = ("float64", "float32")
# Summary tensors: name -> (dtype, number of dimensions); the sites or the moments form is required.
_SUMMARY_TENSORS = {"z": (torch.float64, 2), "target_mean": (torch.float64, 1), "target_scale": (torch.float64, 1),
                    "prior_cov": (torch.float64, 3), "noise": (torch.float64, 1), "site_a": (torch.float64, 2),
                    "site_W": (torch.float64, 3), "mean": (torch.float64, 2), "cov": (torch.float64, 3),
                    "coverage_cells": (torch.int64, 2), "trajectory": (torch.float64, 2)}
# An engine's summary tensors (the rest of _SUMMARY_TENSORS is the map's coverage and trajectory). A tiled map's
# summary holds them per tile as "tile/<key>/<name>", its running target statistics as "tiled/<name>".
_MODEL_TENSORS = tuple(k for k in _SUMMARY_TENSORS if k not in ("coverage_cells", "trajectory"))
_TILED_STATISTICS = ("target_count", "target_mean", "target_m2", "scale_offset", "scale_std")
# The map's calibration records (gp/calibration.py RECORD_FIELDS and "filled"), map-wide, as "calibration/<name>":
# a merged map's calibration is fitted on its sources' (merge_maps).
_CALIBRATION_TENSORS = {**{k: (torch.float64, 2) for k in RECORD_FIELDS}, "filled": (torch.bool, 2)}
# A map of several sessions: their offsets to its first (S, P), as "sessions/offsets" (MapSource.session_offsets)
_SESSION_OFFSETS = "sessions/offsets"
#: the most places at which the sources' maps are compared for their offsets (evenly spaced over the cells they
#: visited, or for 3-D inputs over their inducing inputs, which lie where each map's data are)
LEVEL_PROBES = 4000
#: a live merge (with a tile cache) keeps the sources' last offsets while the new ones differ from them by less
#: than this fraction of the readings' noise SD: a new offset re-merges every tile of its source
LEVEL_TOLERANCE = 0.1
# Config keys that every source of a merge must share (what the map's values mean and where they live).
MERGE_DEFINING_KEYS = (("sync", "target"), ("sync", "input_dims"), ("sync", "field_unit"), ("grid", "frame_id"))


class DuplicateSourceError(MergeError):
    """Two sources hold the same data (one map twice, or a map and one derived from it)."""


@dataclass
class MapSource:
    """One map to merge: its name (for messages), its model summary (an engine's ``recyclable_summary()``; None
    for a map of several tiles, which has none), the config it was made with, its identity (source id, lineage),
    its visited cells and trajectory (for the merged map's grid), its transform into the merged frame, and, for a
    tiled map, its tiles' summaries (merged tile by tile). A part of a tiled map (a summary that holds some of its
    tiles) has ``tile_index``: every tile of the map, with the samples it had taken; None when all are held.
    ``calibration``: the map's calibration records (Engine.calibration_records; None for a map that does not
    calibrate, or a summary sent before they were carried), which the merged map's calibration is fitted on.
    ``session_offsets``: (S, P) the offsets of the map's own sessions to its first (the first row 0, in the map's
    own frame; SessionOffsets.offsets), None for a map of one session: the merged map holds them beside the
    sources' offsets, so a merge of merged maps keeps every session's spread."""

    name: str
    summary: dict | None
    config: MapperConfig
    source_id: str
    lineage: list
    coverage_cells: np.ndarray
    coverage_resolution: float
    trajectory: np.ndarray
    last_stamp: float = -math.inf
    transform: RigidTransform | None = None
    tiles: TiledSummary | None = None
    tile_index: dict[tuple[int, ...], int] | None = None
    calibration: dict[str, torch.Tensor] | None = None
    session_offsets: torch.Tensor | None = None

    @property
    def missing_tiles(self) -> list[tuple[int, ...]]:
        """Tiles of the map that this (partial) source does not hold; empty when it is whole."""
        if self.tile_index is None or self.tiles is None:
            return []
        return sorted(i for i in self.tile_index if i not in self.tiles.tiles)

    @property
    def num_seen(self) -> int:
        if self.summary is None:
            return int(self.tiles.num_seen) if self.tiles is not None else 0
        return int(self.summary.get("num_seen", 0))

    @classmethod
    def from_mapper(cls, name: str, mapper: Mapper, transform: RigidTransform | None = None,
                    tiles=None) -> "MapSource":
        """The source of a Mapper's map; ``tiles``: for a tiled map, the indices of the tiles to hold (a part of
        the map, :class:`TileRotation`), None for all."""
        model = mapper.model
        index = None
        if isinstance(model, TiledModel):
            every = model.tile_samples()
            if tiles is not None and set(tiles) != set(every):
                index = every
            tiles = model.tile_summaries(tiles)
        else:
            tiles = None
        if tiles is not None:  # a map of one tile also merges as its engine: that tile's summary
            summary = next(iter(tiles.tiles.values())) if len(tiles.tiles) == 1 and index is None else None
        else:
            if not isinstance(model, Recyclable):
                raise MergeError(f"{name}: engine {type(model).__name__} cannot be summarised for a merge")
            summary = model.recyclable_summary()
        return cls(name=name, summary=summary, tiles=tiles, config=mapper.config, source_id=mapper.source_id,
                   lineage=list(mapper.lineage), coverage_cells=np.asarray(mapper.coverage.cells),
                   coverage_resolution=float(mapper.coverage.resolution),
                   trajectory=np.asarray(mapper.trajectory, dtype=np.float64).reshape(-1, 2),
                   last_stamp=float(mapper.last_stamp), transform=transform, tile_index=index,
                   calibration=model.calibration_records(), session_offsets=_own_sessions(model))


class SummaryError(MergeError):
    """A model summary (bytes from ~/model) that is malformed, oversized or not a gp_mapping summary."""


def tile_summary_bytes(model, precision: str = "float64") -> dict[tuple[int, ...], int] | None:
    """About how many bytes each tile's summary takes, by tile index (None for a map of one engine), known before
    it is computed: two M x M matrices per output (prior and sites, or moments; continual_mogp: M at most its
    latents' inducing points together) and the inducing inputs in ``precision`` (8 or 4 bytes a number), the
    kernel state and names (measured within a few per cent over, never under)."""
    if not isinstance(model, TiledModel):
        return None
    size = 8 if precision == "float64" else 4
    sizes = {}
    for index in model.tile_indices():
        m = model.tile(index).num_inducing
        m = int(sum(m) if isinstance(m, (list, tuple)) else m)
        sizes[index] = 2 * size * model.output_dims * m * m + size * m * (model.input_dims + 2 * model.output_dims) \
            + 2048
    return sizes


def reduced(source: MapSource, level: int) -> MapSource:
    """``source`` with its map-wide parts coarsened ``level`` times, for a summary that must shrink (every part of
    a tiled map repeats them): visited cells at 2**level times their resolution (the merged map's known cells
    come out coarser), every 2**level-th trajectory point and the last. Level 0: the source as it is."""
    if level <= 0:
        return source
    f = 2 ** int(level)
    cells = np.asarray(source.coverage_cells, dtype=np.int64).reshape(-1, 2)
    cells = np.unique(np.floor_divide(cells, f), axis=0) if len(cells) else cells
    trajectory = np.asarray(source.trajectory, dtype=np.float64).reshape(-1, 2)
    if len(trajectory) > 1:
        trajectory = np.vstack([trajectory[:-1:f], trajectory[-1:]])
    return dataclasses.replace(source, coverage_cells=cells, coverage_resolution=source.coverage_resolution * f,
                               trajectory=trajectory)


def summary_overhead_bytes(mapper: Mapper) -> int:
    """About how many bytes a summary takes besides its tiles: the visited cells and trajectory, the config and
    the other metadata (64 KiB is several times a shipped config's JSON), the tile list of a part."""
    tiles = mapper.model.num_tiles if isinstance(mapper.model, TiledModel) else 0
    records = mapper.model.calibration_records()
    calibration = 0 if records is None else sum(t.numel() * t.element_size() for t in records.values())
    return 16 * (len(mapper.coverage.cells) + len(mapper.trajectory)) + 65536 + 64 * tiles + calibration


class TileRotation:
    """Which tiles of a tiled map the next part of its summary carries when the whole one is over the size limit
    (the mapper node's ~/model): first the tiles that took data since they were last sent (or never were), then
    the others, each group longest unsent first, as many as fit in the byte budget. So new data reach the merger
    within a part or two, and every tile is sent again within a few parts: a merger that starts late, or loses
    a part, completes the map."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, ...], tuple[int, int]] = {}  # tile -> (its samples when sent, part number)
        self._parts = 0

    def choose(self, samples: dict[tuple[int, ...], int], sizes: dict[tuple[int, ...], int],
               budget: int) -> list[tuple[int, ...]]:
        """The tiles of the next part (empty when no tile fits ``budget`` bytes)."""
        def last_sent(i):
            return (self._sent.get(i, (None, -1))[1], i)

        changed = sorted((i for i in samples if self._sent.get(i, (None,))[0] != samples[i]), key=last_sent)
        unchanged = sorted((i for i in samples if self._sent.get(i, (None,))[0] == samples[i]), key=last_sent)
        chosen, used = [], 0
        for i in changed + unchanged:
            if used + sizes[i] <= budget:
                chosen.append(i)
                used += sizes[i]
        return chosen

    def sent(self, tiles, samples: dict[tuple[int, ...], int]) -> None:
        """Record that a part with ``tiles`` went out, the map's tiles having taken ``samples``."""
        self._parts += 1
        for i in tiles:
            self._sent[i] = (samples[i], self._parts)


def assemble_tiles(held: MapSource | None, part: MapSource) -> MapSource:
    """A received part of a tiled map put together with what the merger holds of that map (``held``, the result of
    the previous call, or None): the part's tiles replace the held ones, the held tiles that the part does not
    carry stay while the map still has them, and the map-wide parts (statistics, counts, visited cells,
    trajectory) are the part's, the newest. Held tiles are dropped when the part comes from another map (source
    id, lattice) or from the same map restarted (fewer samples than held). The result's ``missing_tiles`` says
    what it still lacks; a whole summary is returned as it is."""
    if part.tiles is None or part.tile_index is None:
        return part
    keep = {}
    if held is not None and held.tiles is not None and held.source_id == part.source_id \
            and held.tiles.layout == part.tiles.layout and held.num_seen <= part.num_seen:
        keep = {i: s for i, s in held.tiles.tiles.items() if i in part.tile_index}
    keep.update(part.tiles.tiles)
    tiles = dataclasses.replace(part.tiles, tiles=dict(sorted(keep.items())))
    whole = all(i in keep for i in part.tile_index)
    summary = next(iter(tiles.tiles.values())) if whole and len(tiles.tiles) == 1 else None
    return dataclasses.replace(part, tiles=tiles, summary=summary, tile_index=None if whole else part.tile_index)


def _in_precision(v, precision: str) -> torch.Tensor:
    """A summary tensor on the CPU, a float64 one in ``precision`` (float32: a reduced summary), copied."""
    v = torch.as_tensor(v).detach().cpu()
    return (v.to(torch.float32) if precision == "float32" and v.dtype == torch.float64 else v).contiguous().clone()


def _model_tensors(summary: dict, prefix: str = "", precision: str = "float64") -> dict[str, torch.Tensor]:
    """An engine summary's tensors (float64 ones in ``precision``) and kernel state, named with ``prefix``."""
    tensors = {prefix + k: _in_precision(v, precision) for k, v in summary.items() if k in _MODEL_TENSORS}
    kernel = summary.get("kernel")
    if kernel is not None:
        tensors.update({f"{prefix}kernel/{k}": v.detach().cpu().contiguous().clone()
                        for k, v in kernel.state_dict().items()})
    return tensors


def encode_summary(source: MapSource, precision: str = "float64") -> bytes:
    """A source as safetensors bytes (tensors and JSON metadata; nothing in it can execute when read). A tiled
    map is sent tile by tile (every tile's summary, the lattice and the target statistics), as it merges.
    ``precision`` float32: the model tensors and the trajectory in float32 (half the bytes; the kernel state and the
    target statistics stay float64), read back as float64 by :func:`decode_summary`."""
    from safetensors.torch import save

    if precision not in SUMMARY_PRECISIONS:
        raise ValueError(f"summary precision {precision!r}; choose from {', '.join(SUMMARY_PRECISIONS)}")
    metadata = {"precision": precision, "format": SUMMARY_FORMAT, "version": SUMMARY_VERSION,
                "source_id": source.source_id, "lineage": json.dumps(list(source.lineage)),
                "config": json.dumps(to_dict(source.config)),
                "info": json.dumps({"num_seen": source.num_seen, "coverage_resolution": source.coverage_resolution,
                                    "last_stamp": source.last_stamp if math.isfinite(source.last_stamp) else None})}
    tiles = source.tiles
    if tiles is not None:
        tensors = {}
        for index, summary in tiles.tiles.items():
            tensors.update(_model_tensors(summary, f"tile/{tile_key(index)}/", precision))
        tensors.update({f"tiled/{k}": getattr(tiles, k).detach().cpu().to(torch.float64).contiguous().clone()
                        for k in _TILED_STATISTICS})
        metadata["tiled"] = json.dumps({
            "sizes": list(tiles.layout.sizes), "overlap": tiles.layout.overlap, "centred": tiles.layout.centred,
            "input_dims": tiles.input_dims, "output_dims": tiles.output_dims, "hyper_steps": tiles.hyper_steps,
            "tiles": {tile_key(i): int(summary.get("num_seen", 0)) for i, summary in tiles.tiles.items()}})
        if source.tile_index is not None:  # a part: every tile the map has, so the merger knows what it lacks
            metadata["index"] = json.dumps({tile_key(i): int(n) for i, n in source.tile_index.items()})
    elif source.summary is None:
        raise SummaryError(f"{source.name} has no model summary to send")
    else:
        tensors = _model_tensors(source.summary, precision=precision)
    if source.calibration is not None:
        tensors.update({f"calibration/{k}": _in_precision(v, precision) for k, v in source.calibration.items()
                        if k in _CALIBRATION_TENSORS})
    if source.session_offsets is not None:  # a few numbers: float64 in either precision
        tensors[_SESSION_OFFSETS] = source.session_offsets.detach().cpu().to(torch.float64).contiguous().clone()
    tensors["coverage_cells"] = torch.as_tensor(np.asarray(source.coverage_cells, dtype=np.int64).reshape(-1, 2))
    tensors["trajectory"] = torch.as_tensor(np.asarray(source.trajectory, dtype=np.float64).reshape(-1, 2)).to(
        torch.float32 if precision == "float32" else torch.float64)
    return save(tensors, metadata=metadata)


def decode_summary(data: bytes, max_bytes: int, name: str = "summary") -> MapSource:
    """Check and read :func:`encode_summary` bytes; raises SummaryError saying what is wrong (size first, so an
    oversized message is never parsed)."""
    from safetensors.torch import load

    data = bytes(data)
    if len(data) > max_bytes:
        raise SummaryError(f"{name}: {len(data)} bytes, more than the limit of {max_bytes}")
    if len(data) < 8:
        raise SummaryError(f"{name}: {len(data)} bytes is not a model summary")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise SummaryError(f"{name}: truncated or not safetensors (header of {n} bytes in {len(data)})")
    try:
        header = json.loads(data[8:8 + n])
        meta = header["__metadata__"]
        if meta.get("format") != SUMMARY_FORMAT or meta.get("version") != SUMMARY_VERSION:
            raise SummaryError(f"{name}: not a gp_mapping model summary version {SUMMARY_VERSION} "
                               f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
        tensors = load(data)
        precision = meta.get("precision", "float64")
        if precision not in SUMMARY_PRECISIONS:
            raise SummaryError(f"{name}: summary precision {str(precision)[:40]!r}, expected one of "
                               f"{', '.join(SUMMARY_PRECISIONS)}")
        if precision == "float32":  # a reduced summary: its float32 tensors read as the float64 they stand for
            tensors = {k: v.to(torch.float64) if v.dtype == torch.float32 else v for k, v in tensors.items()}
        config = config_from_dict(json.loads(meta["config"]))
        lineage = json.loads(meta["lineage"])
        info = json.loads(meta["info"])
        source_id = str(meta["source_id"])
    except SummaryError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as err:
        raise SummaryError(f"{name}: malformed model summary: {type(err).__name__}: {err}") from None
    except Exception as err:  # safetensors raises its own error type for a malformed payload
        raise SummaryError(f"{name}: malformed model summary: {err}") from None
    if not source_id or not isinstance(lineage, list) or not all(isinstance(i, str) for i in lineage):
        raise SummaryError(f"{name}: source id or lineage missing or malformed")
    try:
        tiled = json.loads(meta["tiled"]) if "tiled" in meta else None
        tile_keys = [str(k) for k in tiled["tiles"]] if tiled is not None else []
        index = None
        if "index" in meta:
            index = {parse_tile_key(str(k)): int(v) for k, v in json.loads(meta["index"]).items()}
            part_ok = tiled is not None and all(parse_tile_key(k) in index for k in tile_keys) \
                and all(n >= 0 for n in index.values())
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SummaryError(f"{name}: malformed tiled summary: {type(err).__name__}: {err}") from None
    if index is not None and not part_ok:
        raise SummaryError(f"{name}: a part's tile list does not hold its own tiles, or belongs to no tiled map")
    for key, t in tensors.items():
        expected = _expected_tensor(key, tiled is not None, tile_keys)
        if expected is None:
            raise SummaryError(f"{name}: unexpected tensor {key!r}")
        if expected == "kernel":
            continue
        dtype, dims = expected
        if t.dtype != dtype or t.dim() != dims:
            raise SummaryError(f"{name}: tensor {key!r} is {t.dtype} with {t.dim()} dimensions, expected {dtype} "
                               f"with {dims}")
    try:
        if tiled is None:
            summary = _decoded_model(tensors, "", int(info["num_seen"]), config, name)
            tiles = None
        else:
            tiles = _decoded_tiles(tensors, tiled, tile_keys, int(info["num_seen"]), config, name)
            if index is not None and any(len(i) != tiles.layout.dims for i in index):
                raise SummaryError(f"{name}: a part's tile list does not fit a layout of {tiles.layout.dims} tiled "
                                   "axes")
            summary = next(iter(tiles.tiles.values())) if len(tiles.tiles) == 1 and index is None else None
        p = tiles.output_dims if tiles is not None else int(summary["target_mean"].shape[0])
        calibration, session_offsets = None, tensors.get(_SESSION_OFFSETS)
        try:
            if any(k.startswith("calibration/") for k in tensors):
                calibration = check_records({k[len("calibration/"):]: v for k, v in tensors.items()
                                             if k.startswith("calibration/")}, p)
            if session_offsets is not None:
                _check_session_offsets(session_offsets, p)
        except ValueError as err:
            raise SummaryError(f"{name}: {err}") from None
        cells = tensors.get("coverage_cells", torch.zeros(0, 2, dtype=torch.int64)).numpy()
        trajectory = tensors.get("trajectory", torch.zeros(0, 2, dtype=torch.float64)).numpy()
        resolution = float(info["coverage_resolution"])
        stamp = -math.inf if info.get("last_stamp") is None else float(info["last_stamp"])
    except SummaryError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise SummaryError(f"{name}: malformed model summary: {type(err).__name__}: {err}") from None
    if not (math.isfinite(resolution) and resolution > 0) or cells.shape[1:] != (2,) \
            or trajectory.shape[1:] != (2,) or not np.all(np.isfinite(trajectory)):
        raise SummaryError(f"{name}: malformed coverage or trajectory")
    return MapSource(name=name, summary=summary, config=config, source_id=source_id, lineage=lineage,
                     coverage_cells=cells, coverage_resolution=resolution, trajectory=trajectory, last_stamp=stamp,
                     tiles=tiles, tile_index=index, calibration=calibration, session_offsets=session_offsets)


def _expected_tensor(key: str, tiled: bool, tile_keys: list[str]):
    """(dtype, dimensions) that a summary's tensor ``key`` must have, "kernel" for a kernel's state (checked as it
    loads), None for a name that has no place in the summary."""
    if key in ("coverage_cells", "trajectory"):
        return _SUMMARY_TENSORS[key]
    if key.startswith("calibration/"):
        return _CALIBRATION_TENSORS.get(key[len("calibration/"):])
    if key == _SESSION_OFFSETS:
        return torch.float64, 2
    part = key
    if tiled:
        if key.startswith("tiled/"):
            return (torch.float64, 1) if key[len("tiled/"):] in _TILED_STATISTICS else None
        tile, sep, part = key[len("tile/"):].partition("/") if key.startswith("tile/") else ("", "", "")
        if not sep or tile not in tile_keys:
            return None
    if part.startswith("kernel/"):
        return "kernel"
    return _SUMMARY_TENSORS[part] if part in _MODEL_TENSORS else None


def _decoded_model(tensors: dict, prefix: str, num_seen: int, config: MapperConfig, name: str) -> dict:
    """An engine summary from the tensors named with ``prefix``, checked as a merge reads it (shapes,
    finiteness, a positive definite prior)."""
    from gp_mapping.gp.kernels import build_kernel, scales_in_state

    summary = {k: tensors[prefix + k] for k in _MODEL_TENSORS if prefix + k in tensors}
    summary["num_seen"] = int(num_seen)
    kernel_state = {k[len(prefix) + len("kernel/"):]: v for k, v in tensors.items()
                    if k.startswith(prefix + "kernel/")}
    summary["kernel"] = None
    if kernel_state:
        kernel = build_kernel(config.model, int(summary["z"].shape[1]), scales=scales_in_state(kernel_state))
        kernel.load_state_dict(kernel_state)
        summary["kernel"] = kernel
    try:
        Source.from_summary(summary, name=name)
    except MergeError as err:
        raise SummaryError(str(err)) from None
    return summary


def _decoded_tiles(tensors: dict, tiled: dict, tile_keys: list[str], num_seen: int, config: MapperConfig,
                   name: str) -> TiledSummary:
    """A tiled map's summary from its tensors and the "tiled" metadata (:func:`encode_summary`)."""
    from gp_mapping.gp.tiles import TileLayout

    try:
        layout = TileLayout(tuple(float(v) for v in tiled["sizes"]), float(tiled["overlap"]),
                            centred=bool(tiled["centred"]))
    except ConfigError as err:
        raise SummaryError(f"{name}: malformed tile layout: {err}") from None
    d, p = int(tiled["input_dims"]), int(tiled["output_dims"])
    if not tile_keys or d not in (2, 3) or layout.dims not in (2, d) or layout.sizes[0] != layout.sizes[1]:
        raise SummaryError(f"{name}: tiled summary of {len(tile_keys)} tiles, tile sizes {layout.sizes} for "
                           f"{d}-D inputs: no such tiled map")
    stats = {k: tensors.get(f"tiled/{k}") for k in _TILED_STATISTICS}
    if any(t is None or t.shape != (p,) or not bool(torch.isfinite(t).all()) for t in stats.values()):
        raise SummaryError(f"{name}: tiled summary's target statistics missing or malformed")
    tiles = {}
    for key in tile_keys:
        index = parse_tile_key(key)
        if len(index) != layout.dims:
            raise SummaryError(f"{name}: tile {key!r} does not fit a layout of {layout.dims} tiled axes")
        summary = _decoded_model(tensors, f"tile/{key}/", int(tiled["tiles"][key]), config, f"{name}, tile {key}")
        if summary["z"].shape[1] != d or summary["target_mean"].shape != (p,):
            raise SummaryError(f"{name}: tile {key!r} has other dimensions than its map's")
        tiles[index] = summary
    return TiledSummary(layout=layout, tiles=tiles, input_dims=d, output_dims=p,
                        num_seen=num_seen, hyper_steps=int(tiled["hyper_steps"]), **stats)


def parse_transform(text: str) -> RigidTransform:
    """``"x,y,yaw_deg"`` or ``"x,y,z,yaw_deg"`` (metres, degrees about the vertical axis)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise MergeError(f"frame transform {text!r} is not numbers: write x,y,yaw_deg or x,y,z,yaw_deg") from None
    if len(values) not in (3, 4) or not all(math.isfinite(v) for v in values):
        raise MergeError(f"frame transform {text!r}: write x,y,yaw_deg or x,y,z,yaw_deg (finite numbers)")
    x, y = values[0], values[1]
    z = values[2] if len(values) == 4 else 0.0
    return RigidTransform.planar(x=x, y=y, z=z, yaw=math.radians(values[-1]))


def check_lineage(sources: Sequence[MapSource]) -> None:
    """Refuse sources whose lineages overlap: their data would be counted twice."""
    for i, a in enumerate(sources):
        for b in sources[i + 1:]:
            shared = sorted(set(a.lineage) & set(b.lineage))
            if shared:
                what = ("the same map twice" if a.source_id == b.source_id
                        else "one map holds data of the other (a map derived from it, or an earlier save of it)")
                raise DuplicateSourceError(
                    f"{a.name} and {b.name} share data (source ids {', '.join(s[:12] for s in shared)}): {what}; "
                    "merging them would count those data twice. Merge only maps made from disjoint data")


def check_compatible(sources: Sequence[MapSource]) -> None:
    first = sources[0]
    for src in sources[1:]:
        for section, key in MERGE_DEFINING_KEYS:
            a = getattr(getattr(first.config, section), key)
            b = getattr(getattr(src.config, section), key)
            if a != b:
                raise MergeError(f"{src.name} has {section}.{key} = {b!r} but {first.name} has {a!r}; maps to "
                                 "merge must agree on it")
        if src.num_seen == 0:
            raise MergeError(f"{src.name} is an empty map (no data)")
    if first.num_seen == 0:
        raise MergeError(f"{first.name} is an empty map (no data)")


def merged_config(sources: Sequence[MapSource], config: MapperConfig | None = None) -> MapperConfig:
    """The merged map's config: ``config`` (or the first source's), with the engine a dual SVGP (the form the
    merged posterior takes), the frame-defining keys of the sources, and one engine (``merge_maps`` sets the
    sources' tiles when it merges tile by tile)."""
    cfg = copy.deepcopy(config if config is not None else sources[0].config)
    for section, key in MERGE_DEFINING_KEYS:
        setattr(getattr(cfg, section), key, getattr(getattr(sources[0].config, section), key))
    cfg.model.engine = "dual_svgp"
    cfg.model.tile_size = 0.0
    if cfg.model.inducing == "grid":
        cfg.model.inducing = "pivoted_cholesky"
    return cfg


def merge_maps(sources: Sequence[MapSource], config: MapperConfig | None = None, *, steps: int | None = None,
               tiled_steps: int = DEFAULT_TILED_STEPS, num_inducing: int | None = None, lr: float = 0.02,
               tile_cache: dict | None = None, levels: bool = True) -> tuple[Mapper, MergeResult | TiledMergeResult]:
    """Merge ``sources`` into a new Mapper (see the module docstring): tile by tile when every source is a tiled
    map (the merged map is tiled alike; ``tiled_steps`` Adam steps per tile), else as one engine (``steps``; None:
    the closed form when the merged inducing points explain every source's, else DEFAULT_STEPS, see
    merging.explains_sources). ``tile_cache``: a dict kept between merges of tiled maps, so that a merge
    recomputes only the tiles whose inputs changed (gp/tiles/merge.py ``merge_tiled``).
    ``num_inducing`` defaults to the sum of the sources' inducing points, capped at DEFAULT_MAX_INDUCING (or
    ``model.num_inducing`` if larger); per tile when tiled to the largest source tile's (or
    ``model.num_inducing`` if larger: gp/tiles/merge.py ``merge_tiled``).
    ``levels``: each source is a session, whose constant offset to the first source is measured where their maps
    overlap (:func:`source_levels`) and removed before the merge; the merged map holds the offsets as its
    sessions' (published at their median level, their spread added to a reading's variance). False: the sources
    read alike (one sensor), merged as they are. Up to MAX_SESSIONS sources are levelled; more merge as they are.
    Raises MergeError (DuplicateSourceError) with the reason when the sources cannot be merged."""
    sources = list(sources)
    if not sources:
        raise MergeError("nothing to merge: no maps given")
    for src in sources:
        if src.missing_tiles:
            raise MergeError(f"{src.name} is a part of a tiled map: it holds {len(src.tiles.tiles)} of its "
                             f"{len(src.tile_index)} tiles (assemble_tiles puts the parts together)")
    check_compatible(sources)
    check_lineage(sources)
    cfg = merged_config(sources, config)
    found = None
    if levels and 1 < len(sources) <= MAX_SESSIONS and (all(s.tiles is not None for s in sources)
                                                        or all(s.summary is not None for s in sources)):
        found = source_levels(sources, cfg.model, tile_cache)
        held = (tile_cache or {}).get("levels")
        if held is not None and held.offsets.shape == found.offsets.shape \
                and bool(((held.offsets - found.offsets).abs() <= LEVEL_TOLERANCE * found.noise_sd).all()):
            found = held  # a live merge: offsets that barely moved keep every tile's cached merge
        if tile_cache is not None:
            tile_cache["levels"] = found
        sources = [_shifted(s, -o) for s, o in zip(sources, found.offsets)]
    offsets = _held_sessions(sources, None if found is None else found.offsets)
    if all(s.tiles is not None for s in sources):
        model, result = merge_tiled([(s.name, s.tiles, s.transform) for s in sources], cfg.model,
                                    steps=tiled_steps, lr=lr, num_inducing=num_inducing, cache=tile_cache)
        cfg.model = model.config
        return _merged_mapper(sources, Mapper(cfg, model=model), offsets), dataclasses.replace(result, levels=found)
    several = [s for s in sources if s.summary is None]
    if several:
        one = next(s for s in sources if s.tiles is None)
        raise MergeError(f"{several[0].name} is a map of {len(several[0].tiles.tiles)} tiles and {one.name} is one "
                         "engine: a tiled map merges tile by tile, only with maps tiled alike (model.tile_size, "
                         "tile_overlap, tile_height)")
    local = [Source.from_summary(s.summary, name=s.name, transform=s.transform) for s in sources]
    # Default: room for every source's inducing points (pivoted Cholesky drops the redundant ones), up to
    # DEFAULT_MAX_INDUCING or the config's num_inducing if larger.
    m = num_inducing if num_inducing is not None else min(sum(src.num_inducing for src in local),
                                                          max(cfg.model.num_inducing, DEFAULT_MAX_INDUCING))
    result = merge(local, cfg.model, num_inducing=m, steps=steps, lr=lr)
    cfg.model.num_inducing = max(int(cfg.model.num_inducing), int(result.z.shape[0]))
    engine = merged_engine(result, cfg.model, local[0].output_dims)
    return _merged_mapper(sources, Mapper(cfg, model=engine), offsets), dataclasses.replace(result, levels=found)


def source_levels(sources: Sequence[MapSource], model_config, tile_cache: dict | None = None) -> Levels:
    """Each source's constant offset to the first, in the merged frame (gp/merging/levels.py). Each source's map
    alone is merged in closed form and asked at up to LEVEL_PROBES places: the centres of the cells the sources
    visited (2-D inputs), else (3-D inputs, or maps without visited cells) their inducing inputs. ``tile_cache``
    (merge_maps'): a tiled source's tiles alone are kept there too (under "alone/<name>"), so a live merge
    recomputes only those that changed."""
    maps, probes, cells = [], [], []
    for s in sources:
        if s.tiles is not None:
            cache = None if tile_cache is None else tile_cache.setdefault(f"alone/{s.name}", {})
            maps.append(merge_tiled([(s.name, s.tiles, s.transform)], model_config, steps=0, cache=cache)[0])
            z = [torch.as_tensor(t["z"], dtype=torch.float64) for t in s.tiles.tiles.values()]
        else:
            local = Source.from_summary(s.summary, name=s.name)
            result = merge([local.transformed(s.transform) if s.transform is not None else local], model_config,
                           num_inducing=local.num_inducing, steps=0)
            maps.append(merged_engine(result, model_config, local.output_dims))
            z = [local.z]
        z = torch.cat(z)
        probes.append(s.transform.apply_inputs(z) if s.transform is not None else z)
        centres = (np.asarray(s.coverage_cells, dtype=np.float64).reshape(-1, 2) + 0.5) * s.coverage_resolution
        cells.append(torch.as_tensor(_move(s.transform, centres) if s.transform is not None else centres))
    if probes[0].shape[1] == 2 and sum(c.shape[0] for c in cells) > 0:
        probes = cells
    x = torch.cat(probes)
    x = x[evenly_spaced(x.shape[0], LEVEL_PROBES)]
    moments = []
    with torch.no_grad():
        for m in maps:
            mean, var = (t.detach().cpu().to(torch.float64) for t in m.predict(x.numpy()))
            reading = m.predict_reading(x.numpy())[1].detach().cpu().to(torch.float64)
            moments.append((mean, var, (reading - var).clamp_min(0.0)))
    offsets, measured = source_offsets(len(sources), pair_offsets(moments), int(moments[0][0].shape[1]))
    noise_sd = torch.stack([n.median(0).values for _, _, n in moments]).min(0).values.sqrt()
    return Levels(offsets, measured, noise_sd)


def levels_text(names: Sequence[str], levels: Levels, unit: str) -> str:
    """What a merge removed, for people: each source's offset to the first (``names``: the sources', in order)."""
    def one(k: int) -> str:
        if not bool(levels.measured[k].any()):
            return "not measured (too little ground shared with the others), taken as 0"
        return ", ".join(f"{v:+.2f}" if ok else "not measured"
                         for v, ok in zip(levels.offsets[k].tolist(), levels.measured[k].tolist())) + f" {unit}"
    return f"offsets to {names[0]} (removed; the map is at their median level): " + "; ".join(
        f"{name} {one(k)}" for k, name in enumerate(names[1:], start=1))


def _own_sessions(model) -> torch.Tensor | None:
    """(S, P) the offsets of a map's own sessions to its first (MapSource.session_offsets); None for one."""
    sessions = getattr(model, "sessions", None)
    offsets = None if sessions is None else sessions.offsets().detach().cpu().to(torch.float64)
    return offsets.clone() if offsets is not None and offsets.shape[0] > 1 else None


def _check_session_offsets(offsets: torch.Tensor, outputs: int) -> None:
    """Raise ValueError saying why a summary's session offsets cannot be held (as check_records does)."""
    if offsets.dim() != 2 or offsets.shape[1] != outputs or not 2 <= offsets.shape[0] <= MAX_SESSIONS:
        raise ValueError(f"session offsets of shape {tuple(offsets.shape)}: expected (S, {outputs}) with 2 <= S <= "
                         f"{MAX_SESSIONS}")
    if not bool(torch.isfinite(offsets).all()) or bool((offsets[0] != 0).any()):
        raise ValueError("session offsets must be finite, the first session's 0")


def _held_sessions(sources: Sequence[MapSource], levels: torch.Tensor | None) -> torch.Tensor | None:
    """(S, P) the sessions a merged map holds, each to the first source's first session: per source its level
    (``levels``' row; None: every source at 0, merged as they are), plus its own sessions' offsets where it has
    several (MapSource.session_offsets, moved into the merged frame). ``levels`` as they are when no source has
    sessions of its own, or when the sessions would be more than a map keeps (MAX_SESSIONS)."""
    own = [src.session_offsets for src in sources]
    if all(o is None for o in own):
        return levels
    width = next(o.shape[1] for o in own if o is not None)
    rows = []
    for k, (src, offsets) in enumerate(zip(sources, own)):
        level = levels[k].to(torch.float64) if levels is not None else torch.zeros(width, dtype=torch.float64)
        if offsets is None:
            rows.append(level[None])
            continue
        offsets = offsets.to(torch.float64)
        if src.transform is not None and width == 3:  # into the merged frame, as a vector source's values are
            offsets = offsets @ src.transform.rotation.T.to(offsets)
        rows.append(level + offsets)
    held = torch.cat(rows)
    return levels if held.shape[0] > MAX_SESSIONS else held


def _shifted(source: MapSource, shift: torch.Tensor) -> MapSource:
    """``source`` with ``shift`` (P,), in the merged frame, added to every value its map states (its summaries'
    prior means and, in the moments form, posterior means; a tiled map's target statistics): the same sites
    about a moved mean are the same map moved by a constant."""
    if not bool((shift != 0).any()):
        return source
    if source.transform is not None and shift.shape[0] == 3:
        shift = source.transform.rotation.T @ shift  # into the source's own frame, where its summary lives

    def moved(summary: dict) -> dict:
        out = dict(summary, target_mean=torch.as_tensor(summary["target_mean"], dtype=torch.float64) + shift)
        if "mean" in summary:
            out["mean"] = torch.as_tensor(summary["mean"], dtype=torch.float64) + shift[:, None]
        return out

    if source.tiles is None:
        return dataclasses.replace(source, summary=moved(source.summary))
    tiles = dataclasses.replace(source.tiles, tiles={i: moved(t) for i, t in source.tiles.tiles.items()},
                                target_mean=source.tiles.target_mean + shift,
                                scale_offset=source.tiles.scale_offset + shift)
    summary = next(iter(tiles.tiles.values())) if source.summary is not None else None
    return dataclasses.replace(source, tiles=tiles, summary=summary)


def _merged_mapper(sources: Sequence[MapSource], mapper: Mapper, offsets: torch.Tensor | None = None) -> Mapper:
    """The merged model's Mapper given the sources' visited cells, trajectories (moved), last stamp, lineage, its
    calibration fitted on the sources' records (Engine.pool_calibration; a vector source's moved into the
    merged frame), and the sources' ``offsets`` (S, P) to the first as its sessions' (None: one level)."""
    if offsets is not None:
        mapper.model.sessions.hold(offsets)
    mapper.model.pool_calibration([s.calibration if s.transform is None else
                                   rotated_records(s.calibration, s.transform.rotation)
                                   for s in sources if s.calibration is not None])
    trajectory = []
    for src in sources:
        centres = (np.asarray(src.coverage_cells, dtype=np.float64).reshape(-1, 2) + 0.5) * src.coverage_resolution
        traj = np.asarray(src.trajectory, dtype=np.float64).reshape(-1, 2)
        if src.transform is not None:
            centres = _move(src.transform, centres)
            traj = _move(src.transform, traj)
        mapper.coverage.add(centres)
        trajectory.append(traj)
    mapper.add_trajectory(np.concatenate(trajectory))
    stamps = [s.last_stamp for s in sources if math.isfinite(s.last_stamp)]
    if stamps:
        mapper.last_stamp = max(stamps)
    lineage = set()
    for src in sources:
        lineage |= set(src.lineage)
    mapper.set_lineage(uuid.uuid4().hex, lineage)
    mapper.mark_changed()
    return mapper


def _move(transform: RigidTransform, xy: np.ndarray) -> np.ndarray:
    if xy.shape[0] == 0:
        return xy
    return transform.apply_inputs(torch.as_tensor(xy, dtype=torch.float64)).numpy()


__all__ = ["DuplicateSourceError", "MERGE_DEFINING_KEYS", "MapSource", "SummaryError", "TileRotation", "assemble_tiles",
           "check_lineage", "decode_summary", "encode_summary", "merge_maps", "merged_config", "parse_transform",
           "levels_text", "source_levels", "summary_overhead_bytes", "tile_summary_bytes"]
