"""The Mapper: one object that the ROS node and the offline replay both drive, so equal messages give equal maps.

Flow: ``add_pose`` / ``add_magnetic_field`` (SI units, stamps in seconds) feed a :class:`MeasurementSync`;
``process`` moves matched samples into a pending queue, cuts it into batches (``batching.mode``) and runs one
``model.update`` per full batch; ``grid`` predicts the map over the grid on the model's device. Batches are cut
in *data* time (sample stamps), never wall-clock time, so a replay reproduces the live node's batches. How often
the map is published is the caller's business.

Reliability. A model update that fails numerically (a Cholesky factorisation that even the escalated jitter
cannot save, bad targets for the likelihood) or that leaves a non-finite prediction is rolled back: the model
returns to its state before the batch, the batch is dropped and counted (``failed_updates``,
``dropped_failed_update``), the reason is logged and kept in ``last_error``, and mapping goes on. Readings
that the spike gate (gp/outliers.py, ``model.spike_gate``) finds are left out of their batch, counted
(``dropped_spikes``) and logged. Any other
exception from the model (a programming error) is rolled back and counted the same way, then propagates.
Jitter escalations reported by the model are counted and logged. :meth:`checkpoint` writes the whole state
atomically (see :mod:`gp_mapping.mapping.state`); :meth:`load` restores it.

Catching up. A caller that limits its updates (``process(max_updates=...)``: the node's update thread runs one per
step) and falls behind the stream takes several full batches in one update once ``batching.catch_up_after`` of
them are waiting, as many as the engine's own cost says (:mod:`gp_mapping.mapping.batching`). Below the threshold
the batches are the replay's, so the node's map equals the replay's bit for bit.

Rules every driver (the node, the replay) shares live here too: a pose in another frame than ``grid.frame_id``
is refused and counted (:meth:`add_pose` with ``frame_id``; the Mapper does no tf lookup), and a map is
published only when it changed since the last publication (:attr:`map_changed`, :meth:`mark_published`).

The Mapper's parts are mixins in the modules beside this one: :class:`~gp_mapping.mapping.batching.Batching` (the
pending queue and the batches cut from it), :class:`~gp_mapping.mapping.drawing.MapDrawing` (the map drawn from the
model, and when one is due), :class:`~gp_mapping.mapping.checkpoints.Checkpoints` (its state in a file).
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque
from typing import Any

import numpy as np

from gp_mapping.config import ConfigError, MapperConfig
from gp_mapping.mapping.batching import Batching
from gp_mapping.mapping.checkpoints import Checkpoints
from gp_mapping.mapping.drawing import MapDrawing, MapGrid, vector_layers
from gp_mapping.mapping.grid import Coverage, check_grid_config, fixed_grid_spec
from gp_mapping.mapping.measurements import Measurements, output_dims
from gp_mapping.mapping.sync import MeasurementSync

# The Mapper, and the drawn map's names that were defined here before drawing.py (the package's documented API).
__all__ = ["MapGrid", "Mapper", "vector_layers"]

TRAJECTORY_MAX_POINTS = 20_000
PREDICTION_CHECK_POINTS = 64  # batch points predicted after each update to catch a non-finite model
LOG = logging.getLogger("gp_mapping.mapper")
UPDATE_TIMES_KEPT = 100
MAX_REFUSED_FRAMES_KEPT = 16


class _Trajectory:
    """Accepted 2-D positions for plots: a point is kept when it is ``spacing`` from the last kept one; past
    TRAJECTORY_MAX_POINTS every other point is dropped and the spacing doubles (bounded memory)."""

    def __init__(self, spacing: float) -> None:
        self.base_spacing = spacing
        self.clear()

    def clear(self) -> None:
        self.spacing = self.base_spacing
        self.points: list[tuple[float, float]] = []

    def add(self, xy: np.ndarray) -> None:
        for x, y in np.asarray(xy, dtype=np.float64)[:, :2].tolist():
            if self.points:
                lx, ly = self.points[-1]
                if math.hypot(x - lx, y - ly) < self.spacing:
                    continue
            self.points.append((x, y))
            if len(self.points) > TRAJECTORY_MAX_POINTS:
                self.points = self.points[::2]
                self.spacing *= 2

    def array(self) -> np.ndarray:
        return np.array(self.points, dtype=np.float64).reshape(-1, 2)


class Mapper(Batching, MapDrawing, Checkpoints):
    """Online GP map of the magnetic field from pose and magnetometer streams (see the module docstring)."""

    _clock = staticmethod(time.perf_counter)  # times the updates (tests emulate it)

    def __init__(self, config: MapperConfig | None = None, model=None) -> None:
        self.config = config if config is not None else MapperConfig()
        cfg = self.config
        self.input_dims = int(cfg.sync.input_dims)
        self.output_dims = output_dims(cfg.sync.target)
        if cfg.batching.mode == "count" and cfg.batching.size > cfg.batching.max_pending:
            raise ConfigError(f"config key 'batching.size': {cfg.batching.size} is larger than batching.max_pending "
                              f"= {cfg.batching.max_pending}, so no batch could ever fill")
        # A fixed grid and the window are checked (max_cells, unknown_distance) here, before any data, rather than at
        # the first publication.
        check_grid_config(cfg.grid)
        self._fixed_spec = fixed_grid_spec(cfg.grid) if cfg.grid.mode == "fixed" else None
        if model is None:
            from gp_mapping.gp import build_model
            try:
                model = build_model(cfg.model, input_dims=self.input_dims, output_dims=self.output_dims)
            except ConfigError as err:  # the engine names its setting; here it is the YAML's model section
                raise err.under("model.") from None
        self.model = model
        # reset() returns the model to exactly this state (whether built here or passed in).
        self._initial_model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._sync = MeasurementSync(cfg.sync, max_pending=cfg.batching.max_pending)
        self._coverage = Coverage(cfg.grid.resolution)
        self._trajectory = _Trajectory(spacing=cfg.grid.resolution / 2)
        self._last_xy: np.ndarray | None = None  # newest accepted sensor position: the window's centre
        self._clear()
        self._clear_pose_frames()
        self.new_source()

    def new_source(self) -> None:
        """Give this map a fresh source id whose lineage is itself alone: the data it will see from now on are
        nobody else's. A merge refuses two maps whose lineages share an id (the same data counted twice)."""
        self.source_id = uuid.uuid4().hex
        self.lineage = [self.source_id]

    def set_lineage(self, source_id: str, lineage) -> None:
        """This map holds the data of every id in ``lineage`` (a merged map: the union of its sources')."""
        ids = sorted({str(i) for i in lineage} | {str(source_id)})
        self.source_id, self.lineage = str(source_id), ids

    # ------------------------------------------------------------------------------------------------ input

    def _clear(self) -> None:
        self.dropped = 0
        self.dropped_overflow = 0       # pending samples dropped by the batching.max_pending bound
        self.dropped_failed_update = 0  # samples of batches whose update failed (rolled back)
        self.dropped_spikes = 0  # readings the spike gate left out (gp/outliers.py)
        self.catch_up_updates = 0  # updates that took several full batches at once (a caller that fell behind)
        self.catch_up_samples = 0  # samples those updates took
        self.largest_batch = 0
        self.updates = 0
        self.failed_updates = 0
        self.jitter_escalations = 0
        self.checkpoints = 0
        self.last_error = ""
        self._jitter = None  # the model's jitter after the last update (escalations are logged)
        self._update_seconds: deque[float] = deque(maxlen=UPDATE_TIMES_KEPT)
        self.last_stamp = -math.inf  # newest sample stamp used in an update
        self._clear_pending()
        self._clear_drawing()

    def _clear_pose_frames(self) -> None:
        self.pose_frame_mismatch = 0  # poses refused for their frame (add_pose with frame_id)
        self.refused_pose_frames: set[str] = set()  # their frames (the first MAX_REFUSED_FRAMES_KEPT names)

    def add_pose(self, stamp: float, position, orientation_xyzw, receive_time: float | None = None,
                 frame_id: str | None = None) -> bool:
        """Body pose in the map frame (metres, quaternion [x, y, z, w]); False when rejected (counted).
        ``receive_time``: when it arrived, on the stamps' clock (enables ``sync.max_stamp_skew``). ``frame_id``:
        the pose's frame (a message header's); a pose in another frame than ``grid.frame_id`` is refused and
        counted in :attr:`pose_frame_mismatch` (no tf lookup here: a driver that looks up tf passes poses
        already in the map frame, without ``frame_id``)."""
        if frame_id is not None and frame_id != self.config.grid.frame_id:
            self.pose_frame_mismatch += 1
            if len(self.refused_pose_frames) < MAX_REFUSED_FRAMES_KEPT:
                self.refused_pose_frames.add(frame_id)
            return False
        return self._sync.add_pose(stamp, position, orientation_xyzw, receive_time=receive_time)

    def add_magnetic_field(self, stamp: float, field_tesla, frame_id: str = "",
                           receive_time: float | None = None) -> None:
        """Magnetometer reading in the sensor frame, tesla (``sensor_msgs/MagneticField.magnetic_field``);
        ``frame_id`` and ``receive_time`` as in :meth:`MeasurementSync.add_field`."""
        self._sync.add_field(stamp, field_tesla, frame_id=frame_id, receive_time=receive_time)

    # ------------------------------------------------------------------------------------------------ updates

    def _collect(self) -> None:
        new = self._sync.pop_ready()
        if len(new):
            self._pending.append(new)
            self._pending_count += len(new)
            self._trajectory.add(new.position)
            self._last_xy = new.position[-1, :2].copy()

    def _fail(self, batch: Measurements, why: str) -> None:
        """Roll the model back to its state before the batch, count the batch as dropped and log why."""
        self.model.rollback()
        self.failed_updates += 1
        self.dropped += len(batch)
        self.dropped_failed_update += len(batch)
        self.last_error = why
        LOG.warning("model update %d failed and was rolled back (%d samples dropped): %s",
                    self.updates + self.failed_updates, len(batch), why)

    def _drop_spikes(self, batch: Measurements) -> Measurements:
        """The batch less the readings the spike gate finds (gp/outliers.py), counted and logged."""
        from gp_mapping.gp.outliers import isolated_spikes

        spikes = isolated_spikes(self.model, batch.x, batch.y, self.config.model.spike_gate)
        n = int(spikes.sum())
        if n == 0:
            return batch
        self.dropped += n
        self.dropped_spikes += n
        LOG.info("%d reading(s) dropped as spikes (more than %g predictive SDs from their neighbours), %d in all",
                 n, self.config.model.spike_gate, self.dropped_spikes)
        keep = ~spikes
        return Measurements(x=batch.x[keep], y=batch.y[keep], t=batch.t[keep], position=batch.position[keep])

    def _update(self, batch: Measurements) -> dict[str, Any] | None:
        """One model update; None when it failed numerically and was rolled back (see the module docstring)."""
        import torch

        from gp_mapping.gp import GPNumericalError, ModelInputError

        start = self._clock()
        batch = self._drop_spikes(batch)
        # Every engine can undo an update (Engine.begin_update / rollback; the tiled model records only what
        # changes, its state grows with the area).
        self.model.begin_update()
        try:
            if self.model.wants_stamps:  # engines that gate on time take the stamps
                stats = self.model.update(batch.x, batch.y, t=batch.t)
            else:
                stats = self.model.update(batch.x, batch.y)
            check = batch.x[:PREDICTION_CHECK_POINTS]
            mean, var = self.model.predict(check)
            finite = bool(torch.isfinite(torch.as_tensor(mean)).all() and torch.isfinite(torch.as_tensor(var)).all())
        except (GPNumericalError, ModelInputError, torch.linalg.LinAlgError) as err:
            self._fail(batch, f"{type(err).__name__}: {err}")
            return None
        except Exception as err:
            self._fail(batch, f"{type(err).__name__}: {err}")
            raise
        if not finite:
            self._fail(batch, "the update left a non-finite prediction")
            return None
        self.model.end_update()
        device = torch.device(self.model.device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # honest timing: wait for the queued kernels
        seconds = self._clock() - start
        jitter = (stats or {}).get("jitter")
        if jitter is not None:
            if self._jitter is not None and jitter > self._jitter:
                self.jitter_escalations += 1
                LOG.info("Cholesky needed more jitter: %.3g (was %.3g)", jitter, self._jitter)
            self._jitter = jitter
        self._coverage.add(batch.position)
        self.updates += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        self._map_version += 1
        self._update_seconds.append(seconds)
        self.last_stamp = max(self.last_stamp, float(batch.t[-1]))
        out = dict(stats or {})
        out.update({"update": self.updates, "batch_size": len(batch), "update_seconds": seconds,
                    "stamp": float(batch.t[-1]), "num_seen": int(self.model.num_seen)})
        return out

    def process(self, max_updates: int | None = None) -> list[dict[str, Any]]:
        """Move matched samples into the pending queue and run one model update per full batch, at most
        ``max_updates`` of them (None: all). A caller that limits its updates and falls behind gets larger
        batches once ``batching.catch_up_after`` full batches are waiting (:mod:`~gp_mapping.mapping.batching`); what is
        left pending beyond ``batching.max_pending`` afterwards is dropped, oldest first, and counted as
        ``dropped``.

        Returns the update statistics (the model's plus ``update``, ``batch_size``, ``update_seconds``,
        ``stamp``, ``num_seen``), one dict per successful update, oldest first; a failed update counts against
        ``max_updates`` and is handled as the module docstring says.
        """
        b = self.config.batching
        # In count mode nothing can be updated before a batch's worth of samples is held: deciding them one
        # message at a time (a replay calls this after every message) would cost more than the model.
        if b.mode != "count" or self._pending_count + self._sync.num_held >= b.size:
            self._collect()
        out: list[dict[str, Any]] = []
        attempts = 0
        while max_updates is None or attempts < max_updates:
            # A caller that runs every full batch is never behind: its batches are always the replay's.
            batches, n = self._catch_up_batches() if max_updates is not None else (1, self._full_batch_size())
            if n == 0:
                break
            attempts += 1
            stats = self._update(self._take(n))
            if stats is not None:
                self._learn_cost(batches, stats)
                stats["full_batches"] = batches
                if batches > 1:
                    self.catch_up_updates += 1
                    self.catch_up_samples += int(stats["batch_size"])
                out.append(stats)
        self._enforce_bound()
        return out

    def flush(self, end_of_stream: bool = True) -> list[dict[str, Any]]:
        """Run every full batch and then the partial one. With ``end_of_stream``, samples still waiting for a
        following pose can never be matched and are counted as ``no_pose_after``; pass False to flush
        mid-stream (before saving, say) and keep them waiting."""
        if end_of_stream:
            self._sync.finish()
        self._collect()
        out = self.process()
        if self._pending_count:
            stats = self._update(self._take(self._pending_count))
            if stats is not None:
                out.append(stats)
        return out

    # ------------------------------------------------------------------------------------------------ outputs

    @property
    def trajectory(self) -> np.ndarray:
        """``(K, 2)`` accepted sensor positions, decimated (bounded), for plots."""
        self._collect()
        return self._trajectory.array()

    def add_trajectory(self, xy) -> None:
        """Append positions ``(K, 2)`` to the plotted trajectory (a merged map takes its sources')."""
        self._trajectory.add(np.asarray(xy, dtype=np.float64).reshape(-1, 2))

    @property
    def coverage(self) -> Coverage:
        return self._coverage

    def diagnostics(self) -> dict[str, Any]:
        """Counters and timings as plain numbers (``rejected`` is a dict by reason; times are 0.0 before the
        first update). Field samples balance: ``accepted + samples_rejected + waiting`` = samples given, and
        ``accepted = num_seen + pending + dropped`` (for a mapper that was not loaded from a file)."""
        times = list(self._update_seconds)
        sync = self._sync.counters()
        return {
            "accepted": sync["accepted"],
            "poses_accepted": sync["poses_accepted"],
            "rejected": sync["rejected"],
            "rejected_total": sum(sync["rejected"].values()),
            "samples_rejected": sync["samples_rejected"],
            "poses_rejected": sync["poses_rejected"],
            "dropped": self.dropped,
            "dropped_overflow": self.dropped_overflow,
            "dropped_failed_update": self.dropped_failed_update,
            "dropped_spikes": self.dropped_spikes,
            "catch_up_updates": self.catch_up_updates,
            "catch_up_samples": self.catch_up_samples,
            "largest_batch": self.largest_batch,
            "waiting": self._sync.num_waiting,
            "pending": self.num_pending,
            "teleports": sync["teleports"],
            "reanchors": sync["reanchors"],
            "pauses": sync["pauses"],
            "field_frame": self._sync.field_frame,
            "field_frame_relatches": sync["frame_relatches"],
            "updates": self.updates,
            "failed_updates": self.failed_updates,
            "jitter_escalations": self.jitter_escalations,
            "checkpoints": self.checkpoints,
            "last_error": self.last_error,
            "last_update_seconds": times[-1] if times else 0.0,
            "median_update_seconds": float(np.median(times)) if times else 0.0,
            "num_seen": int(self.model.num_seen),
            "coverage_cells": len(self._coverage),
            "last_stamp": float(self.last_stamp) if math.isfinite(self.last_stamp) else 0.0,
            "device": str(self.model.device),
            "session": self.session,
            "session_offset": [float(v) for v in self.model.session_offset().cpu()],
        }

    # ------------------------------------------------------------------------------------------------ state

    @property
    def session(self) -> int:
        """Index of the session the readings now go to (0: the first; :meth:`start_session`)."""
        return int(self.model.sessions.current)

    def start_session(self) -> int:
        """The readings from now on are a new session (another node run on a loaded map, another sensor or
        day): pending samples are conditioned first, then the model learns the new session's constant offset
        (Engine.start_session, docs/calibration.md). Returns the session's index."""
        self.flush(end_of_stream=False)
        return int(self.model.start_session())

    def reset(self) -> None:
        """Forget everything: the model returns to its initial state; poses, samples, coverage and counters clear."""
        self.model.load_state_dict(self._initial_model_state)
        self._sync.reset()
        self._sync.reset_counters()
        self._coverage.clear()
        self._trajectory.clear()
        self._last_xy = None
        self._clear()
        self._clear_pose_frames()
        self.new_source()
