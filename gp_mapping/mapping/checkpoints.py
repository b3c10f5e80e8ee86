"""The Mapper's state in a file: the part of the :class:`~gp_mapping.mapping.mapper.Mapper` (:class:`Checkpoints`)
that writes its whole state (:meth:`~Checkpoints.save`, :meth:`~Checkpoints.checkpoint`, atomically, through
:mod:`gp_mapping.mapping.state`) and restores a Mapper from one (:meth:`~Checkpoints.load`), so that a mapper
loaded from a file continues exactly as the one that wrote it. Files written before a field was saved load with
its default."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gp_mapping.config import ConfigError, MapperConfig, config_from_dict, to_dict
from gp_mapping.mapping.measurements import Measurements
from gp_mapping.mapping.state import MapState, MapStateError, check_model, check_state, read_state, write_state
from gp_mapping.mapping.sync import REJECTION_REASONS

if TYPE_CHECKING:
    from typing import Self

# Config keys that decide what the saved model means; a state file refuses a config that changes them.
STATE_DEFINING_KEYS = (("model", "engine"), ("model", "kernel"), ("model", "likelihood"), ("model", "lengthscales"),
                       ("model", "constant_kernel"), ("model", "kernel_scales"), ("sync", "target"),
                       ("sync", "input_dims"), ("sync", "field_unit"), ("model", "tile_size"),
                       ("model", "tile_overlap"), ("model", "tile_height"), ("model", "time_error"))


class Checkpoints:
    """Mixin of :class:`~gp_mapping.mapping.mapper.Mapper`: its state written to a file, and read back."""

    def save(self, path: str | Path) -> None:
        """Write the model, coverage, trajectory, pending samples, the sync's pose buffer and samples waiting
        for a pose, and the counters to ``path`` (atomic): a mapper loaded from it continues exactly as this one.
        """
        write_state(path, self.snapshot())

    def checkpoint(self, path: str | Path) -> Path:
        """A periodic checkpoint: :meth:`save` without running any update (batches stay as they would be cut
        without it), counted in ``checkpoints``. Atomic (temporary file, fsync, rename), so a crash at any
        moment leaves the previous checkpoint or this one, never a partial file. Returns ``path``."""
        self.checkpoints += 1  # counted first, so the file records itself
        try:
            self.save(path)
        except Exception:
            self.checkpoints -= 1
            raise
        return Path(path)

    def snapshot(self) -> MapState:
        """The whole state as a :class:`MapState` of private copies (safe to write while mapping goes on)."""
        self._collect()
        pending = (Measurements.concatenate(list(self._pending)) if self._pending
                   else Measurements.empty(self.input_dims, self.output_dims))
        arrays = {
            "coverage_cells": self._coverage.cells,
            "trajectory": self.trajectory,
            "update_seconds": np.array(self._update_seconds, dtype=np.float64),
            "pending_x": pending.x, "pending_y": pending.y, "pending_t": pending.t,
            "pending_position": pending.position,
        }
        info = {
            "accepted": self._sync.accepted,
            "poses_accepted": self._sync.poses_accepted,
            "rejected": dict(self._sync.rejected),
            "dropped": self.dropped,
            "dropped_overflow": self.dropped_overflow,
            "dropped_failed_update": self.dropped_failed_update,
            "dropped_spikes": self.dropped_spikes,
            "teleports": self._sync.teleports,
            "reanchors": self._sync.reanchors,
            "pauses": self._sync.pauses,
            "frame_relatches": self._sync.frame_relatches,
            "updates": self.updates,
            "failed_updates": self.failed_updates,
            "jitter_escalations": self.jitter_escalations,
            "checkpoints": self.checkpoints,
            "catch_up_updates": self.catch_up_updates,
            "catch_up_samples": self.catch_up_samples,
            "largest_batch": self.largest_batch,
            "last_stamp": self.last_stamp if math.isfinite(self.last_stamp) else None,
            "coverage_resolution": self._coverage.resolution,
            "trajectory_spacing": self._trajectory.spacing,
            "last_position": None if self._last_xy is None else [float(v) for v in self._last_xy],
            "source_id": self.source_id,
            "lineage": list(self.lineage),
        }
        sync_arrays, sync_info = self._sync.export_state()
        arrays.update({f"sync_{k}": v for k, v in sync_arrays.items()})
        info["sync"] = sync_info
        model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return MapState(config=to_dict(self.config), model_state=model_state, arrays=arrays, info=info)

    @classmethod
    def load(cls, path: str | Path, config: MapperConfig | None = None, model=None, new_session: bool = False
             ) -> Self:
        """A Mapper restored from ``path``. With ``config``, that config is used (grid, batching, node settings
        may differ) but it must agree with the saved one on STATE_DEFINING_KEYS; otherwise the saved config.
        ``model`` (optional) is a fresh model to load the saved state into instead of one built from the config.
        ``new_session``: the readings given from now on are a new session (another node run, bag, day or sensor;
        ``node.new_session_on_load``): the file's pending samples are conditioned in their own session, then the
        new session's constant offset to the loaded map is learned (Mapper.start_session). A map with no data
        has nothing to be offset from and starts none.
        """
        state = read_state(path)
        try:
            saved = config_from_dict(state.config)
        except ConfigError as err:
            raise MapStateError(f"map state file {path} holds an invalid config: {err}", "metadata") from err
        if config is not None:
            for section, key in STATE_DEFINING_KEYS:
                a, b = getattr(getattr(saved, section), key), getattr(getattr(config, section), key)
                if a != b:
                    raise MapStateError(f"map state file {path} was made with {section}.{key} = {a!r}, but the "
                                        f"config asks for {b!r}; they must agree to reuse the map",
                                        "unit_mismatch" if key == "field_unit" else "config_mismatch")
        mapper = cls(config if config is not None else saved, model=model)
        check_state(state, path, template=mapper.model.state_dict(), input_dims=mapper.input_dims,
                    output_dims=mapper.output_dims, saved=saved, reference=config)
        try:
            mapper.model.load_state_dict(state.model_state)
        except (RuntimeError, KeyError, ValueError) as err:
            differs = ""
            if config is not None:
                changed = [f"model.{k} = {v!r} (saved {getattr(saved.model, k)!r})"
                           for k, v in to_dict(config)["model"].items() if getattr(saved.model, k) != v]
                differs = f"; the config differs from the saved one in {', '.join(changed)}" if changed else ""
            raise MapStateError(f"map state file {path} does not fit the model built from the config{differs}: "
                                f"{err}", "model_mismatch") from err
        try:
            mapper._restore(state)
        except (KeyError, TypeError, ValueError) as err:
            raise MapStateError(f"map state file {path} has missing or malformed mapper data: {err}",
                                "shape") from err
        xy = mapper.trajectory[::max(1, len(mapper.trajectory) // 16)][:16]
        xy = xy if len(xy) else np.zeros((1, 2))
        probe = np.column_stack([xy, np.full(len(xy), mapper.config.grid.height)])[:, :mapper.input_dims]
        check_model(mapper.model, path, probe, mapper.output_dims)  # a loaded model must predict (state.py)
        if new_session and int(mapper.model.num_seen) + mapper.num_pending > 0:
            mapper.start_session()
        return mapper

    def _restore(self, state: MapState) -> None:
        a, info = state.arrays, state.info
        self.mark_changed()  # a loaded map is published at the first opportunity
        if float(info["coverage_resolution"]) == self._coverage.resolution:
            self._coverage.set_cells(a["coverage_cells"])
        else:
            # Another grid resolution: re-bin the saved visited cells by their centres.
            old = float(info["coverage_resolution"])
            self._coverage.add((np.asarray(a["coverage_cells"], dtype=np.float64) + 0.5) * old)
        self._trajectory.points = [tuple(p) for p in np.asarray(a["trajectory"], dtype=np.float64).tolist()]
        self._trajectory.spacing = max(float(info["trajectory_spacing"]), self._trajectory.base_spacing)
        last = info.get("last_position")
        if last is not None:
            self._last_xy = np.asarray(last, dtype=np.float64).reshape(2)
        elif self._trajectory.points:  # files written before the position was saved
            self._last_xy = np.asarray(self._trajectory.points[-1], dtype=np.float64)
        self._update_seconds.extend(np.asarray(a["update_seconds"], dtype=np.float64).tolist())
        pending = Measurements(*(np.asarray(a[k], dtype=np.float64) for k in
                                 ("pending_x", "pending_y", "pending_t", "pending_position")))
        if pending.x.shape[1:] != (self.input_dims,) or pending.y.shape[1:] != (self.output_dims,):
            raise ValueError(f"pending samples have shapes {pending.x.shape}, {pending.y.shape}")
        if len(pending):
            self._pending.append(pending)
            self._pending_count = len(pending)
        rejected = {reason: int(info["rejected"].get(reason, 0)) for reason in REJECTION_REASONS}
        self._sync.rejected = rejected
        self._sync.accepted = int(info["accepted"])
        self._sync.poses_accepted = int(info["poses_accepted"])
        self.dropped = int(info["dropped"])
        self.dropped_overflow = int(info.get("dropped_overflow", 0))
        self.dropped_failed_update = int(info.get("dropped_failed_update", 0))
        self.dropped_spikes = int(info.get("dropped_spikes", 0))
        self._sync.teleports = int(info.get("teleports", 0))
        self._sync.reanchors = int(info.get("reanchors", 0))
        self._sync.pauses = int(info.get("pauses", 0))
        self._sync.frame_relatches = int(info.get("frame_relatches", 0))
        self.updates = int(info["updates"])
        self.failed_updates = int(info.get("failed_updates", 0))
        self.jitter_escalations = int(info.get("jitter_escalations", 0))
        self.checkpoints = int(info.get("checkpoints", 0))
        self.catch_up_updates = int(info.get("catch_up_updates", 0))
        self.catch_up_samples = int(info.get("catch_up_samples", 0))
        self.largest_batch = int(info.get("largest_batch", 0))
        if "source_id" in info:
            self.set_lineage(str(info["source_id"]), [str(i) for i in info.get("lineage", [])])
        else:  # a file from before source ids: named by its model, so two copies of it are still one source
            digest = hashlib.sha256()
            for name in sorted(state.model_state):
                digest.update(name.encode())
                digest.update(state.model_state[name].detach().cpu().contiguous().numpy().tobytes())
            self.set_lineage("legacy-" + digest.hexdigest()[:32], [])
        self.last_stamp = -math.inf if info["last_stamp"] is None else float(info["last_stamp"])
        if "sync" in info:  # files written before the sync state was saved start with empty buffers
            self._sync.import_state({k[len("sync_"):]: v for k, v in a.items() if k.startswith("sync_")},
                                    info["sync"])
