"""The Mapper: one object that the ROS node and the offline replay both drive, so equal messages give equal maps.

Flow: ``add_pose`` / ``add_magnetic_field`` (SI units, stamps in seconds) feed a :class:`MeasurementSync`;
``process`` moves matched samples into a pending queue, cuts it into batches (``batching.mode``) and runs one
``model.update`` per full batch; ``grid`` predicts the map over the grid on the model's device. Batches are cut
in *data* time (sample stamps), never wall-clock time, so a replay reproduces the live node's batches. How often
the map is published is the caller's business.

Reliability. A model update that fails numerically (a Cholesky factorisation that even the escalated jitter
cannot save, bad targets for the likelihood) or that leaves a non-finite prediction is rolled back: the model
returns to its state before the batch, the batch is dropped and counted (``failed_updates``,
``dropped_failed_update``), the reason is logged and kept in ``last_error``, and mapping goes on. Any other
exception from the model (a programming error) is rolled back and counted the same way, then propagates.
Jitter escalations reported by the model are counted and logged. :meth:`checkpoint` writes the whole state
atomically (see :mod:`gp_mapping.mapping.state`); :meth:`load` restores it.

Catching up. A caller that limits its updates (``process(max_updates=...)``: the node's update thread runs one per
step) can fall behind the stream; the replay, which runs every full batch at once, never does. Once
``batching.catch_up_after`` full batches are waiting, such a caller's update takes several full batches at once
(``k`` of them, k a power of two, at most ``batching.catch_up_max`` samples and what is waiting), so the backlog
stays bounded and nothing is dropped while the sensor rate is within what the engine can absorb. How many is
learned from the engine's own cost: the seconds per sample of each size taken so far (a running mean); the
largest size within 10 % of the cheapest is taken, and the next size up is tried while the largest tried is that
one, so an engine whose update costs about the same for a larger batch (a memory-bounded engine) takes larger
batches and one whose cost per sample grows with the batch stays where it is cheapest. Below the threshold the
batches are the replay's, so the node's map equals the replay's bit for bit.

Rules every driver (the node, the replay) shares live here too: a pose in another frame than ``grid.frame_id``
is refused and counted (:meth:`add_pose` with ``frame_id``; the Mapper does no tf lookup), and a map is
published only when it changed since the last publication (:attr:`map_changed`, :meth:`mark_published`).
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gp_mapping.config import ConfigError, MapperConfig, config_from_dict, to_dict
from gp_mapping.mapping.grid import (Coverage, GridSpec, GridTooLargeError, cell_inputs, check_grid_config,
                                     fixed_grid_spec, predict_grid, spec_from_bounds, window_bounds)
from gp_mapping.mapping.state import (MapState, MapStateError, check_model, check_state, read_state,
                                      write_state)
from gp_mapping.mapping.sync import REJECTION_REASONS, UNIT_SYMBOL, Measurements, MeasurementSync, output_dims

# Config keys that decide what the saved model means; a state file refuses a config that changes them.
STATE_DEFINING_KEYS = (("model", "engine"), ("model", "kernel"), ("model", "likelihood"), ("model", "lengthscales"),
                       ("model", "constant_kernel"), ("sync", "target"), ("sync", "input_dims"),
                       ("sync", "field_unit"), ("model", "tile_size"), ("model", "tile_overlap"),
                       ("model", "tile_height"))
TRAJECTORY_MAX_POINTS = 20_000
PREDICTION_CHECK_POINTS = 64  # batch points predicted after each update to catch a non-finite model
LOG = logging.getLogger("gp_mapping.mapper")
UPDATE_TIMES_KEPT = 100
CATCH_UP_TOLERANCE = 1.1  # a larger catch-up batch is preferred while its cost per sample is within 10 % of the best
CATCH_UP_SMOOTHING = 0.3  # weight of the newest update in the running mean of a batch size's cost per sample
MAX_REFUSED_FRAMES_KEPT = 16


@dataclass
class MapGrid:
    """A predicted map over a grid.

    ``layers[name] = (mean (H, W), var (H, W))`` in ``field_unit`` (variance in unit squared): the posterior of
    the latent field f, not of a noisy reading. Target 'magnitude' gives the layer ``'magnitude'``; target
    'vector' gives ``'x'``, ``'y'``, ``'z'`` (map-frame components) and ``'norm'``, whose variance is the delta
    method's ``sum_i (m_i / |m|)^2 var_i`` (first order in the per-component uncertainty, components taken
    as independent; where ``|m|`` is 0 it falls back to ``sum_i var_i``). ``known`` (H, W) is False for cells
    farther than ``grid.unknown_distance`` from every sample (layers hold NaN there when the grid was predicted
    on known cells only). ``stamp`` is the newest sample stamp in the
    model; ``height`` the z of the cells when the inputs are 3-D (else 0). ``extent`` says what the grid covers:
    ``"window"`` (what the node publishes: grow mode's ``grid.window`` around the robot, cut to the visited area
    plus margin, or the fixed grid) or ``"full"`` (the whole visited area plus margin, for files).
    """

    spec: GridSpec
    frame_id: str
    field_unit: str
    layers: dict[str, tuple[np.ndarray, np.ndarray]]
    known: np.ndarray
    stamp: float
    height: float = 0.0
    extent: str = "window"  # "window": grow mode's published window (or the fixed grid); "full": the whole map
    #: per layer, the variance (H, W) of a reading (latent + noise, calibrated: docs/calibration.md); files only
    reading_variance: dict[str, np.ndarray] | None = None

    @property
    def unit_symbol(self) -> str:
        return UNIT_SYMBOL[self.field_unit]


@dataclass
class _DrawnGrid:
    """The last incremental draw (Mapper.grid(incremental=True)): what the next one may reuse."""

    model: Any            # the model it was drawn from (compared by identity)
    map_version: int      # Mapper._map_version then
    versions: Any         # model.prediction_versions() then, or None when the model cannot say what changed
    spec: GridSpec
    mean: np.ndarray      # (H, W, P) latent mean and variance, NaN where not drawn
    var: np.ndarray


def vector_layers(mean: np.ndarray, var: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layers 'x', 'y', 'z', 'norm' from a vector prediction ``(H, W, 3)`` (see :class:`MapGrid`)."""
    norm = np.linalg.norm(mean, axis=-1)
    safe = np.where(norm > 0, norm, 1.0)
    var_norm = np.where(norm > 0, np.sum((mean / safe[..., None]) ** 2 * var, axis=-1), np.sum(var, axis=-1))
    layers = {name: (mean[..., k].copy(), var[..., k].copy()) for k, name in enumerate("xyz")}
    layers["norm"] = (norm, var_norm)
    return layers


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


def _lattice_overlap(old: GridSpec, new: GridSpec):
    """((rows, cols) slices of ``old``, (rows, cols) slices of ``new``) holding the cells the two grids share,
    or None when they share none or do not lie on one lattice (another resolution, an origin off by a part of
    a cell)."""
    if old.resolution != new.resolution:
        return None
    shift = []
    for a, b in ((new.origin_x, old.origin_x), (new.origin_y, old.origin_y)):
        cells = (a - b) / new.resolution
        if abs(cells - round(cells)) > 1e-6:
            return None
        shift.append(int(round(cells)))
    dx, dy = shift  # new cell (j, i) is old cell (j + dy, i + dx)
    old_rows, new_rows = _shared_range(old.height, new.height, dy)
    old_cols, new_cols = _shared_range(old.width, new.width, dx)
    if old_rows is None or old_cols is None:
        return None
    return (old_rows, old_cols), (new_rows, new_cols)


def _shared_range(old_size: int, new_size: int, shift: int) -> tuple[slice | None, slice | None]:
    """Index i of the new axis is index i + shift of the old one: the slices of both that overlap."""
    lo, hi = max(0, -shift), min(new_size, old_size - shift)
    if hi <= lo:
        return None, None
    return slice(lo + shift, hi + shift), slice(lo, hi)


class Mapper:
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
        self._pending: deque[Measurements] = deque()
        self._pending_count = 0
        self.dropped = 0
        self.dropped_overflow = 0       # pending samples dropped by the batching.max_pending bound
        self.dropped_failed_update = 0  # samples of batches whose update failed (rolled back)
        self.catch_up_updates = 0  # updates that took several full batches at once (a caller that fell behind)
        self.catch_up_samples = 0  # samples those updates took
        self.largest_batch = 0
        self._batch_cost: dict[int, float] = {}  # full batches per update -> running mean of seconds per sample
        self.updates = 0
        self.failed_updates = 0
        self.jitter_escalations = 0
        self.checkpoints = 0
        self.last_error = ""
        self._jitter = None  # the model's jitter after the last update (escalations are logged)
        self._update_seconds: deque[float] = deque(maxlen=UPDATE_TIMES_KEPT)
        self.last_stamp = -math.inf  # newest sample stamp used in an update
        # The map changed since the last publication while these differ (see map_changed).
        self._map_version = 0
        self._published_version = 0
        self._drawn: _DrawnGrid | None = None  # the last incremental draw (grid(incremental=True))

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

    @property
    def num_pending(self) -> int:
        """Matched samples waiting for their batch (including those not yet moved out of the sync)."""
        return self._pending_count + self._sync.num_ready

    def _collect(self) -> None:
        new = self._sync.pop_ready()
        if len(new):
            self._pending.append(new)
            self._pending_count += len(new)
            self._trajectory.add(new.position)
            self._last_xy = new.position[-1, :2].copy()

    def _enforce_bound(self) -> None:
        excess = self._pending_count - self.config.batching.max_pending
        while excess > 0:
            head = self._pending[0]
            k = min(excess, len(head))
            if k == len(head):
                self._pending.popleft()
            else:
                self._pending[0] = head.slice(k)
            self._pending_count -= k
            self.dropped += k
            self.dropped_overflow += k
            excess -= k

    def _take(self, n: int) -> Measurements:
        parts, need = [], n
        while need > 0:
            head = self._pending[0]
            if len(head) <= need:
                parts.append(self._pending.popleft())
                need -= len(head)
            else:
                parts.append(head.slice(0, need))
                self._pending[0] = head.slice(need)
                need = 0
        self._pending_count -= n
        return Measurements.concatenate(parts)

    def _full_batch_size(self) -> int:
        """Samples in the next full batch, or 0 while it is still filling."""
        b = self.config.batching
        if b.mode == "count":
            return b.size if self._pending_count >= b.size else 0
        if self._pending_count == 0:
            return 0
        # Time mode: a batch spans [t_first, t_first + period) of data time and is full once a later sample
        # has arrived; it is also cut at batching.max_pending samples, so that a bound smaller than a period's
        # worth of samples still lets batches close.
        t = np.concatenate([m.t for m in self._pending])
        n = int(np.searchsorted(t, t[0] + b.period, side="left"))
        if n < t.shape[0]:
            return min(n, b.max_pending)
        return b.max_pending if t.shape[0] >= b.max_pending else 0

    def _full_batch_ends(self, need: int, cap: int) -> list[int]:
        """Samples in the first 1, 2, ... full batches waiting (cumulative), at least ``need`` of them where so many
        are waiting, and on until one ends at ``cap`` samples or beyond: count mode, multiples of
        ``batching.size``; time mode, the ends of the full periods (each also cut at ``batching.max_pending``
        samples, as :meth:`_full_batch_size` cuts one)."""
        b = self.config.batching
        if b.mode == "count":
            return [b.size * (k + 1) for k in range(min(self._pending_count // b.size, max(need, -(-cap // b.size))))]
        if self._pending_count == 0:
            return []
        t = np.concatenate([m.t for m in self._pending])
        ends: list[int] = []
        start = 0
        while start < t.shape[0] and (len(ends) < need or ends[-1] < cap):
            n = int(np.searchsorted(t, t[start] + b.period, side="left"))
            if n < t.shape[0]:
                end = min(n, start + b.max_pending)
            elif t.shape[0] - start >= b.max_pending:
                end = start + b.max_pending
            else:
                break
            ends.append(end)
            start = end
        return ends

    def _catch_up_batches(self) -> tuple[int, int]:
        """(full batches, samples) the next update of a caller that limits its updates takes: one full batch, or
        several once ``batching.catch_up_after`` are waiting (see the module docstring); (0, 0) while none is
        full."""
        b = self.config.batching
        n = self._full_batch_size()
        if n == 0 or b.catch_up_after == 0:
            return (1, n) if n else (0, 0)
        if b.mode == "count" and self._pending_count < b.catch_up_after * b.size:
            return 1, n  # the common case, decided without looking at the stamps
        ends = self._full_batch_ends(b.catch_up_after, b.catch_up_max)
        if len(ends) < b.catch_up_after:
            return 1, n
        sizes, k = [], 1  # powers of two that fit what is waiting and batching.catch_up_max
        while k <= len(ends) and (k == 1 or ends[k - 1] <= b.catch_up_max):
            sizes.append(k)
            k *= 2
        tried = [k for k in sizes if k in self._batch_cost]
        if not tried:
            return 1, n
        cheapest = min(self._batch_cost[k] for k in tried)
        best = max(k for k in tried if self._batch_cost[k] <= CATCH_UP_TOLERANCE * cheapest)
        if best == max(tried) and best < sizes[-1]:  # no larger size has been worse yet: try the next one up
            best = sizes[sizes.index(best) + 1]
        return best, ends[best - 1]

    def _learn_cost(self, batches: int, stats: dict[str, Any]) -> None:
        """Fold an update's seconds per sample into the running mean of its size (``batches`` full batches)."""
        per_sample = float(stats["update_seconds"]) / max(1, int(stats["batch_size"]))
        old = self._batch_cost.get(batches)
        self._batch_cost[batches] = per_sample if old is None else \
            (1.0 - CATCH_UP_SMOOTHING) * old + CATCH_UP_SMOOTHING * per_sample

    def _fail(self, batch: Measurements, why: str) -> None:
        """Roll the model back to its state before the batch, count the batch as dropped and log why."""
        self.model.rollback()
        self.failed_updates += 1
        self.dropped += len(batch)
        self.dropped_failed_update += len(batch)
        self.last_error = why
        LOG.warning("model update %d failed and was rolled back (%d samples dropped): %s",
                    self.updates + self.failed_updates, len(batch), why)

    def _update(self, batch: Measurements) -> dict[str, Any] | None:
        """One model update; None when it failed numerically and was rolled back (see the module docstring)."""
        import torch

        from gp_mapping.gp import GPNumericalError, ModelInputError

        start = self._clock()
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
        batches once ``batching.catch_up_after`` full batches are waiting (see the module docstring); what is
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

    def grid_spec(self, full: bool = False) -> GridSpec | None:
        """The grid the next map is predicted on; None before data. Fixed mode: the fixed grid. Grow mode: the
        visited area plus margin, cut to ``grid.window`` centred on the newest accepted position (``full``: not
        cut). Raises GridTooLargeError when the full grid would exceed ``grid.max_cells`` (a window never does:
        the config check refuses one that could)."""
        if self._fixed_spec is not None:
            return self._fixed_spec
        self._collect()  # the map covers every sample decided so far
        g = self.config.grid
        bounds = self._coverage.grow_bounds(g)
        if bounds is None:
            return None
        lo, hi = bounds
        if full:
            return spec_from_bounds(lo, hi, g, "the whole map")
        centre = self._last_xy if self._last_xy is not None else (lo + hi) / 2.0 * g.resolution
        w_lo, w_hi = window_bounds(centre, g)
        c_lo, c_hi = np.maximum(lo, w_lo), np.minimum(hi, w_hi)
        if np.any(c_hi <= c_lo):  # the robot is away from everything mapped (nothing accepted there yet)
            c_lo, c_hi = w_lo, w_hi
        return spec_from_bounds(c_lo, c_hi, g, "the window")

    @property
    def map_changed(self) -> bool:
        """Whether the map changed (an update ran, a state was loaded, :meth:`mark_changed`) since the last
        :meth:`mark_published`: the node and the replay publish a map only then."""
        return self._map_version != self._published_version

    def mark_changed(self) -> None:
        """A setting the prediction reads changed (``grid.unknown_distance`` ...): the next map is due, and is
        drawn whole."""
        self._map_version += 1
        self._drawn = None

    def mark_published(self) -> None:
        """The current map was published (or its publication attempted): no map is due until it changes."""
        self._published_version = self._map_version

    def grid(self, full: bool = False, predict_unknown: bool = True, incremental: bool = False) -> MapGrid | None:
        """Predict the map (tiled, on the model's device); None before the first update.

        The grid is :meth:`grid_spec` (``full``: the whole visited area, which raises GridTooLargeError beyond
        ``grid.max_cells``). ``model.predict`` is called on that grid's cells only, ``grid.tile_size`` at a time,
        so the cost of a map follows the window, not the explored area. ``predict_unknown`` False: only the
        known cells (within ``grid.unknown_distance`` of a sample) are predicted and the others hold NaN, which
        is all a publication shows (the node and the replay's map bag use it: same messages, a fraction of the
        cost).

        ``incremental`` (publications): re-predict only the cells whose prediction may have changed since the
        previous incremental draw, and take the others from it: all of them after no update; after an update of
        a tiled model (``model.changed_since``), the cells outside the tiles it touched; otherwise every cell. Cells
        keep their place as the window rolls, so those the window newly covers are predicted and the rest
        reused. The result equals a whole draw up to round-off (the same state on the same inputs, predicted in
        other groupings). Files (``export_grid``) are drawn whole.
        """
        if int(self.model.num_seen) == 0:
            return None
        spec = self.grid_spec(full=full)
        if spec is None:
            return None
        g = self.config.grid
        known = self._coverage.known_mask(spec, g.unknown_distance)
        wanted = None if predict_unknown else known
        if incremental:
            mean, var = self._draw_incremental(spec, wanted)
        else:
            mean, var = predict_grid(self.model, spec, g.tile_size, height=g.height, input_dims=self.input_dims,
                                     only=wanted)
        if self.output_dims == 1:
            layers = {"magnitude": (mean[..., 0], var[..., 0])}
        else:
            layers = vector_layers(mean, var)
        return MapGrid(spec=spec, frame_id=g.frame_id, field_unit=self.config.sync.field_unit, layers=layers,
                       known=known,
                       stamp=float(self.last_stamp) if math.isfinite(self.last_stamp) else 0.0,
                       height=float(g.height) if self.input_dims == 3 else 0.0,
                       extent="full" if full or self._fixed_spec is not None else "window")

    def _draw_incremental(self, spec: GridSpec, wanted: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance (H, W, P) of the cells ``wanted`` (None: all; NaN elsewhere), reusing the last
        incremental draw where the model says nothing there changed (see :meth:`grid`)."""
        import torch

        g = self.config.grid
        h, w = spec.shape
        want = np.ones((h, w), dtype=bool) if wanted is None else wanted
        reuse = np.zeros((h, w), dtype=bool)
        mean = var = None
        prev = self._drawn
        from gp_mapping.gp.base import IncrementalPrediction

        changed_since = self.model.changed_since if isinstance(self.model, IncrementalPrediction) else None
        # Reusable: the same model, and either no update since or a model that says where an update changed it.
        reusable = prev is not None and prev.model is self.model and (
            prev.map_version == self._map_version or (prev.versions is not None and changed_since is not None))
        overlap = _lattice_overlap(prev.spec, spec) if reusable else None
        if overlap is not None:
            (old_rows, old_cols), (new_rows, new_cols) = overlap
            p = prev.mean.shape[2]
            mean, var = np.full((h, w, p), np.nan), np.full((h, w, p), np.nan)
            mean[new_rows, new_cols] = prev.mean[old_rows, old_cols]
            var[new_rows, new_cols] = prev.var[old_rows, old_cols]
            reuse = want & np.isfinite(mean[..., 0])
            if prev.map_version != self._map_version and reuse.any():
                cells = np.flatnonzero(reuse)
                device = torch.device(self.model.device)
                x = cell_inputs(spec, torch.as_tensor(cells, device=device), g.height, self.input_dims)
                with torch.no_grad():
                    stale = changed_since(x, prev.versions).to("cpu").numpy()
                reuse.flat[cells[stale]] = False
        todo = want & ~reuse
        if todo.any() or mean is None:
            fresh_mean, fresh_var = predict_grid(self.model, spec, g.tile_size, height=g.height,
                                                 input_dims=self.input_dims, only=None if todo.all() else todo)
            if mean is None:
                mean, var = fresh_mean, fresh_var
            else:
                mean[todo], var[todo] = fresh_mean[todo], fresh_var[todo]
        mean[~want], var[~want] = np.nan, np.nan
        versions = self.model.prediction_versions if isinstance(self.model, IncrementalPrediction) else None
        self._drawn = _DrawnGrid(self.model, self._map_version, versions() if versions is not None else None, spec,
                                 mean.copy(), var.copy())
        return mean, var

    def export_grid(self) -> MapGrid | None:
        """The map for a file (replay's map.npz, ``gp-mapping export``): the whole visited area when it fits
        ``grid.max_cells``, else the window around the newest position (``extent`` says which; logged)."""
        try:
            grid = self.grid(full=True)
        except GridTooLargeError as err:
            LOG.warning("the whole map does not fit grid.max_cells (%s); the file holds the %s m window around "
                        "the newest position instead (the model still holds everything)", err,
                        self.config.grid.window)
            grid = self.grid()
        if grid is not None:  # a file also holds the variance of a reading (MapGrid.reading_variance)
            g = self.config.grid
            mean, var = predict_grid(self.model, grid.spec, g.tile_size, height=g.height, input_dims=self.input_dims,
                                     only=grid.known, reading=True)
            layers = {"magnitude": (mean[..., 0], var[..., 0])} if self.output_dims == 1 else vector_layers(mean, var)
            grid.reading_variance = {name: v for name, (_, v) in layers.items()}
        return grid

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
        }

    # ------------------------------------------------------------------------------------------------ state

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
    def load(cls, path: str | Path, config: MapperConfig | None = None, model=None) -> "Mapper":
        """A Mapper restored from ``path``. With ``config``, that config is used (grid, batching, node settings
        may differ) but it must agree with the saved one on STATE_DEFINING_KEYS; otherwise the saved config.
        ``model`` (optional) is a fresh model to load the saved state into instead of one built from the config.
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

