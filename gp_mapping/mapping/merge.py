"""Merging maps (state files or live mappers) into one map without their data (seed 001, gp/recyclable.py).

A source is a :class:`~gp_mapping.mapping.mapper.Mapper` (loaded from a state file, or rebuilt from a model
summary received over DDS) with an optional rigid transform into the merged frame. The merged map is a Mapper
whose model is a dual SVGP holding the merged posterior, whose visited cells and trajectory are the sources'
(moved into the merged frame), and whose lineage is the union of the sources': so it saves, loads
(``node.initial_map``), publishes and keeps mapping like any map, and a later merge refuses to count its data
twice.
"""
from __future__ import annotations

import copy
import math
import uuid
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gp_mapping.config import MapperConfig
from gp_mapping.gp.recyclable import MergeError, MergeResult, RigidTransform, merge, merged_engine, source_from_engine
from gp_mapping.mapping.mapper import Mapper

DEFAULT_MAX_INDUCING = 1024
# Config keys that every source of a merge must share (what the map's values mean and where they live).
MERGE_DEFINING_KEYS = (("sync", "target"), ("sync", "input_dims"), ("sync", "field_unit"), ("grid", "frame_id"))


class DuplicateSourceError(MergeError):
    """Two sources hold the same data (one map twice, or a map and one derived from it)."""


@dataclass
class MapSource:
    """One map to merge: its name (for messages), its Mapper, and its transform into the merged frame."""

    name: str
    mapper: Mapper
    transform: RigidTransform | None = None


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
            shared = sorted(set(a.mapper.lineage) & set(b.mapper.lineage))
            if shared:
                what = ("the same map twice" if a.mapper.source_id == b.mapper.source_id
                        else "one map holds data of the other (a map derived from it, or an earlier save of it)")
                raise DuplicateSourceError(
                    f"{a.name} and {b.name} share data (source ids {', '.join(s[:12] for s in shared)}): {what}; "
                    "merging them would count those data twice. Merge only maps made from disjoint data")


def check_compatible(sources: Sequence[MapSource]) -> None:
    first = sources[0]
    for src in sources[1:]:
        for section, key in MERGE_DEFINING_KEYS:
            a = getattr(getattr(first.mapper.config, section), key)
            b = getattr(getattr(src.mapper.config, section), key)
            if a != b:
                raise MergeError(f"{src.name} has {section}.{key} = {b!r} but {first.name} has {a!r}; maps to "
                                 "merge must agree on it")
        if int(src.mapper.model.num_seen) == 0:
            raise MergeError(f"{src.name} is an empty map (no data)")
    if int(first.mapper.model.num_seen) == 0:
        raise MergeError(f"{first.name} is an empty map (no data)")


def merged_config(sources: Sequence[MapSource], config: MapperConfig | None = None) -> MapperConfig:
    """The merged map's config: ``config`` (or the first source's), with the engine a dual SVGP (the form the
    merged posterior takes) and the frame-defining keys of the sources."""
    cfg = copy.deepcopy(config if config is not None else sources[0].mapper.config)
    for section, key in MERGE_DEFINING_KEYS:
        setattr(getattr(cfg, section), key, getattr(getattr(sources[0].mapper.config, section), key))
    cfg.model.engine = "dual_svgp"
    if cfg.model.inducing == "grid":
        cfg.model.inducing = "pivoted_cholesky"
    return cfg


def merge_maps(sources: Sequence[MapSource], config: MapperConfig | None = None, *, steps: int = 100,
               num_inducing: int | None = None, lr: float = 0.02) -> tuple[Mapper, MergeResult]:
    """Merge ``sources`` into a new Mapper (see the module docstring); ``num_inducing`` defaults to the config's
    sum of the sources' inducing points, capped at DEFAULT_MAX_INDUCING (or ``model.num_inducing`` if larger). Raises MergeError (DuplicateSourceError) with the
    reason when the sources cannot be merged."""
    sources = list(sources)
    if not sources:
        raise MergeError("nothing to merge: no maps given")
    check_compatible(sources)
    check_lineage(sources)
    cfg = merged_config(sources, config)
    local = [source_from_engine(s.mapper.model, name=s.name, transform=s.transform) for s in sources]
    # Default: room for every source's inducing points (pivoted Cholesky drops the redundant ones), up to
    # DEFAULT_MAX_INDUCING or the config's num_inducing if larger.
    m = num_inducing if num_inducing is not None else min(sum(src.num_inducing for src in local),
                                                          max(cfg.model.num_inducing, DEFAULT_MAX_INDUCING))
    result = merge(local, cfg.model, num_inducing=m, steps=steps, lr=lr)
    cfg.model.num_inducing = max(int(cfg.model.num_inducing), int(result.z.shape[0]))
    engine = merged_engine(result, cfg.model, local[0].output_dims)
    mapper = Mapper(cfg, model=engine)
    trajectory = []
    for src in sources:
        cells = src.mapper.coverage.cells
        res = src.mapper.coverage.resolution
        centres = (np.asarray(cells, dtype=np.float64).reshape(-1, 2) + 0.5) * res
        traj = np.asarray(src.mapper.trajectory, dtype=np.float64).reshape(-1, 2)
        if src.transform is not None:
            centres = _move(src.transform, centres)
            traj = _move(src.transform, traj)
        mapper.coverage.add(centres)
        trajectory.append(traj)
    mapper.add_trajectory(np.concatenate(trajectory))
    stamps = [s.mapper.last_stamp for s in sources if math.isfinite(s.mapper.last_stamp)]
    if stamps:
        mapper.last_stamp = max(stamps)
    lineage = set()
    for src in sources:
        lineage |= set(src.mapper.lineage)
    mapper.set_lineage(uuid.uuid4().hex, lineage)
    mapper.mark_changed()
    return mapper, result


def _move(transform: RigidTransform, xy: np.ndarray) -> np.ndarray:
    if xy.shape[0] == 0:
        return xy
    return transform.apply_inputs(torch.as_tensor(xy, dtype=torch.float64)).numpy()


__all__ = ["DuplicateSourceError", "MERGE_DEFINING_KEYS", "MapSource", "check_lineage", "merge_maps",
           "merged_config", "parse_transform"]
