"""The engine contract: what every GP engine in ``gp/`` is, and the plumbing they all share.

An engine is a ``torch.nn.Module`` built as ``Engine(config, input_dims, output_dims)`` from a
:class:`~gp_mapping.gp.config.ModelConfig` and looked up by name (``model.engine``) in
:func:`gp_mapping.gp.build_model`. The node, the replay and the benchmarks use nothing else:

* ``update(x, y, mode=None) -> dict``: condition on a batch, x (N, input_dims) positions, y (N, output_dims)
  targets; ``mode`` is ``'fast'``, ``'full'`` or None (the engine's schedule); returns timings and counts.
* ``predict(x) -> (mean, var)``: (G, output_dims) each, the latent f (not y), in the target units.
* ``log_predictive_density(x, y)``: log p(y*|x*) (N, output_dims) in the target units.
* ``num_seen``, ``num_updates``, ``device``; ``state_dict()`` / ``load_state_dict()`` hold tensors only and
  the whole posterior, so an engine rebuilt from the same config and loaded predicts identically.

What :class:`Engine` gives an engine: the checks of inputs and targets (raising
:class:`~gp_mapping.gp.errors.ModelInputError` with what is wrong), ``predict`` and ``log_predictive_density``
from the engine's ``_latent`` (standardised units), loading of buffers and parameters whose size follows the
data (:attr:`Engine.RESIZABLE` or :meth:`Engine.resizable_names`), and ``self._cache``: factors derived from the
state, dropped (:meth:`Engine._drop_caches`) whenever the module moves (``.to()``) or loads a state.

What an engine provides: ``update`` and ``_latent``; a ``likelihood`` (``validate_targets``,
``log_predictive_density``, ``standardise_targets``); the buffers ``y_mean`` and ``y_std`` (P,) that take its
standardised units to the targets' (y = y_mean + y_std * standardised); the int64 buffers ``num_seen_t`` and
``num_updates_t``. Its constructor calls ``super().__init__(config, input_dims, output_dims)`` first and
``self.to(resolve_device(config.device))`` last.
"""
from __future__ import annotations

import abc
import copy
import math
import re
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from .calibration import PrequentialCalibration, SessionOffsets
from .config import ModelConfig
from .errors import ConfigError, ModelInputError
from .linalg import symmetrise  # noqa: F401  (its home is linalg.py; importable from here too)


#: seconds between readings updated without stamps by an engine that learns from time (model.time_error): far
#: beyond any timescale it learns, so their shared errors are independent (and one with the white noise)
UNSTAMPED_GAP = 1e6


def to_float64_tensor(value, name: str, device: torch.device) -> torch.Tensor:
    """``value`` (tensor, array or nested list of real numbers) as a float64 tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise ModelInputError(f"{name} must hold real numbers, got dtype {value.dtype}")
        return value.detach().to(device=device, dtype=torch.float64)
    try:
        arr = np.asarray(value)
    except Exception as err:  # ragged lists and the like
        raise ModelInputError(f"{name} cannot be read as a numeric array: {err}") from err
    if arr.dtype.kind not in "fiu":
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError) as err:
            raise ModelInputError(f"{name} must hold real numbers, got dtype {arr.dtype}") from err
    return torch.as_tensor(np.ascontiguousarray(arr, dtype=np.float64), device=device)


def check_inputs(x, input_dims: int, device: torch.device, name: str = "x") -> torch.Tensor:
    """Model inputs as a finite (N, input_dims) float64 tensor, or ModelInputError saying what is wrong."""
    t = to_float64_tensor(x, name, device)
    if t.dim() == 1 and input_dims == 1:
        t = t[:, None]
    if t.dim() != 2 or t.shape[1] != input_dims:
        raise ModelInputError(f"{name} must have shape (N, {input_dims}), got {tuple(t.shape)}")
    bad = ~torch.isfinite(t).all(dim=1)
    if bool(bad.any()):
        raise ModelInputError(f"{name} holds NaN or Inf in {int(bad.sum())} of {t.shape[0]} rows")
    return t


_CUDA = re.compile(r"cuda(?::([0-9]+))?")


def resolve_device(name: str) -> torch.device:
    """The torch device a ``device`` setting names: 'cpu', 'cuda', 'cuda:N' (GPU N) or 'auto' (cuda when
    available). A CUDA device this machine lacks is a ConfigError, not a fall-back to the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = _CUDA.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ConfigError(f"{name!r} is not allowed; allowed: 'auto', 'cpu', 'cuda', 'cuda:N'", "device")
    if not torch.cuda.is_available():
        raise ConfigError(f"{name!r} was requested but CUDA is not available (use 'auto' or 'cpu')", "device")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise ConfigError(f"{name!r} was requested but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s), numbered from 0", "device")
    return torch.device(name)


#: sessions whose offsets a map tells apart (a later one shares the last slot)
MAX_SESSIONS = 64

#: A batch teaches hyperparameters only if its inputs spread over more than this fraction of model.lengthscale
#: (3 cm for 1 m: above the pose jitter of a robot at rest, below the 9 cm a slow walk covers in a second).
INFORMATIVE_SPREAD = 0.03


def spans_space(x: torch.Tensor, lengthscale: float) -> bool:
    """Whether a batch's inputs (N, D) spread over more than INFORMATIVE_SPREAD x ``lengthscale`` (farthest
    input from their centroid). A robot standing still (every input at one point) says nothing about
    lengthscales or the field's variance, and its reading spread is the sensor's at rest, not the noise a
    moving robot sees: engines learn no hyperparameters from such a batch."""
    if x.shape[0] < 2:
        return False
    return bool((x - x.mean(0)).norm(dim=1).max() > INFORMATIVE_SPREAD * float(lengthscale))


def difference_noise_estimate(y: torch.Tensor) -> torch.Tensor:
    """Noise variance per output (P,) from consecutive samples of a stream, y (N, P) in time order: half the
    mean squared successive difference (Rice 1984). Along a path sampled densely against the field's
    lengthscale the field barely changes between samples, so this measures the sensor (slightly high where the
    field is steep). Used to start the noise where the data are, not at a fixed guess that would take the
    optimiser minutes to leave."""
    d = y[1:] - y[:-1]
    return 0.5 * (d * d).mean(0)


def merge_moments(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, y: torch.Tensor,
                  mask: torch.Tensor | None = None) -> None:
    """Fold a batch y (N, P) into running moments in place: ``count`` (scalar or (P,)), ``mean`` and ``m2`` (sum
    of squared deviations) (P,). Chan et al.'s pairwise merge (1979), exact and stable for any batch sizes;
    with ``mask`` (N, P) only the True entries count (a missing channel; their values are never read)."""
    if mask is None:
        n_b = torch.full_like(count, float(y.shape[0]))
        mean_b = y.mean(0)
        m2_b = ((y - mean_b) ** 2).sum(0)
    else:
        n_b = mask.sum(0).to(count.dtype)
        mean_b = torch.where(mask, y, torch.zeros_like(y)).sum(0) / n_b.clamp_min(1.0)
        m2_b = (torch.where(mask, y - mean_b, torch.zeros_like(y)) ** 2).sum(0)
    pool_moments(count, mean, m2, n_b, mean_b, m2_b)


def fold_moving_targets(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, moved: torch.Tensor, y: torch.Tensor,
                        moving: bool, mask: torch.Tensor | None = None) -> None:
    """Fold a batch y (N, P) into the running moments that set the targets' unit (:func:`merge_moments`), counting
    moving data only. A robot at rest reads one place's field to the sensor's noise, which is not the field's
    spread; a stream that starts at rest (the OptiTrack recordings: 6 s on the floor, where the field also differs
    from the walk's) set the unit the first hyperparameters were learned in from that, and the whole map kept its
    mark (OptiTrack |B| 0.514 -> 0.489 uT and vector 0.438 -> 0.413 with moving data only; docs/calibration.md,
    "The targets' unit from moving data"). The first batch that spans space (``moving``: :func:`spans_space`)
    restarts the moments and sets ``moved`` (a bool tensor); until one comes, batches at rest are all there is."""
    if moving and not bool(moved):
        count.zero_()
        mean.zero_()
        m2.zero_()
        moved.fill_(True)
    if moving or not bool(moved):
        merge_moments(count, mean, m2, y, mask)


def counted_as_moving(count: torch.Tensor) -> torch.Tensor:
    """``moved`` for moments kept before :func:`fold_moving_targets` (a state saved earlier, a merge's pooled
    moments): whatever they counted stands for moving data."""
    return torch.as_tensor(bool((count > 0).any()))


def pool_moments(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, count_b: torch.Tensor,
                 mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
    """Fold the moments (count_b, mean_b, m2_b) of other data into (count, mean, m2) in place (Chan et al.)."""
    total = count + count_b
    share = torch.where(total > 0, count_b / total.clamp_min(1.0), torch.zeros_like(total))
    delta = mean_b - mean
    mean += delta * share
    m2 += m2_b + delta * delta * count * share
    count.copy_(total)


def moments_scale(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, scale) (P,) for standardising from running moments: the mean and the standard deviation; an
    output with no spread yet (one sample, or a constant) keeps scale 1, i.e. its original units."""
    std = torch.sqrt(m2 / count.clamp_min(1.0))
    ok = std > 1e-9 * mean.abs().clamp_min(1.0)
    return mean.clone(), torch.where(ok, std, torch.ones_like(std))


#: Running target statistics re-express a model in new units when their standard deviation leaves
#: [1/RESCALE_FACTOR, RESCALE_FACTOR] x the current scale or their mean moves by more than RESCALE_SHIFT scales.
RESCALE_FACTOR = 2.0
RESCALE_SHIFT = 0.5


def scale_drifted(mean: torch.Tensor, std: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether running moments (mean, std) (P,) have drifted from the standardisation in use (offset, scale) by
    the rule above, for any output."""
    ratio = std / scale
    return bool(((ratio > RESCALE_FACTOR) | (ratio < 1.0 / RESCALE_FACTOR)
                 | ((mean - offset).abs() > RESCALE_SHIFT * scale)).any())


@runtime_checkable
class IncrementalPrediction(Protocol):
    """An engine that says where an update changed what it predicts, so a redrawn grid reuses the rest.

    ``prediction_versions()`` returns a token of what the engine predicts now; ``changed_since(x, versions)``
    (x (N, D) checked inputs) -> (N,) bool: whether the prediction at x may differ from the one made when
    ``versions`` was taken. False only where it cannot have changed."""

    def prediction_versions(self): ...

    def changed_since(self, x: torch.Tensor, versions) -> torch.Tensor: ...


@runtime_checkable
class Recyclable(Protocol):
    """An engine whose posterior can be summarised for a merge of maps (gp/merging/):
    ``recyclable_summary() -> dict`` (read by :meth:`gp_mapping.gp.merging.Source.from_summary`; the merge itself:
    :func:`gp_mapping.gp.merging.merge`)."""

    def recyclable_summary(self) -> dict: ...


class Engine(nn.Module, abc.ABC):
    """Base class of the GP engines (see the module docstring for the contract).

    Declared capabilities (what callers may ask of any engine, with no probing): :meth:`begin_update` and
    :meth:`rollback` undo an update (by default from a copy of the state; an engine whose state grows with the
    area records only what changes); :attr:`wants_stamps` says whether ``update`` takes the samples' stamps
    ``t=`` (engines that gate on time); :attr:`reexpresses_sessions` whether a session's data follow its
    offset estimate; :class:`IncrementalPrediction` and :class:`Recyclable` are protocols
    an engine implements or not (``isinstance``)."""

    #: names of buffers or parameters whose shapes follow the data (taken from the saved state on load)
    RESIZABLE: tuple[str, ...] = ()
    #: whether update(x, y, t=stamps) wants the samples' stamps (an engine whose gate looks at time)
    wants_stamps: bool = False
    #: whether the engine can re-express the data of the current session when its offset estimate moves
    #: (:meth:`_reexpress_session`); otherwise they keep the offset they were conditioned with
    reexpresses_sessions: bool = False

    def __init__(self, config: ModelConfig, input_dims: int, output_dims: int) -> None:
        super().__init__()
        for name, value in (("input_dims", input_dims), ("output_dims", output_dims)):
            if isinstance(value, bool) or int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        self.config = copy.deepcopy(config)
        self.input_dims = int(input_dims)
        self.output_dims = int(output_dims)
        self._cache = None
        on = config.calibration == "prequential"  # without it the store is empty (a tile's, for one)
        self.calibration = PrequentialCalibration(self.input_dims, self.output_dims,
                                                  config.calibration_records if on else 0,
                                                  noise_floor=getattr(config, "noise_floor", 0.0),
                                                  noise_factor=getattr(config, "calibration_noise_factor", False))
        self.sessions = SessionOffsets(self.output_dims, MAX_SESSIONS)
        # every engine's counters (num_seen, num_updates), saved with its state
        self.register_buffer("num_seen_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("num_updates_t", torch.tensor(0, dtype=torch.int64))

    def _own_likelihood(self, likelihood):
        """The engine's likelihood, told to read this engine's target scale where it needs one (a noise floor
        given in the targets' units: GaussianLikelihood.measure_with)."""
        if hasattr(likelihood, "measure_with"):
            likelihood.measure_with(self)
        return likelihood

    def _register_target_statistics(self, outputs: int, count_per_output: bool = False) -> None:
        """The buffers of adaptive target scaling: the offset and scale in use (``y_mean``, ``y_std``, (P,)) and the
        running moments of every target seen (``y_count``, scalar or (P,) when outputs can be missing;
        ``y_run_mean``, ``y_run_m2``), folded in by :func:`merge_moments`."""
        f64 = {"dtype": torch.float64}
        self.register_buffer("y_mean", torch.zeros(outputs, **f64))
        self.register_buffer("y_std", torch.ones(outputs, **f64))
        self.register_buffer("y_count", torch.zeros(outputs if count_per_output else (), **f64))
        self.register_buffer("y_run_mean", torch.zeros(outputs, **f64))
        self.register_buffer("y_run_m2", torch.zeros(outputs, **f64))
        self.register_buffer("y_moved", torch.tensor(False))  # the moments count moving data (fold_moving_targets)

    def _track_targets(self, y: torch.Tensor, moving: bool) -> None:
        """Fold a batch's targets into the running statistics (moving data only once there are some:
        :func:`fold_moving_targets`; ``moving``: the batch spans space) and re-express the model in new units
        (``self._rescale_targets(mean, std)``, the engine's) when they have drifted (:func:`scale_drifted`).

        Standardising once from the first batch fails on a robot that stands still for its first second: the
        batch's spread is the sensor noise, the field's is a thousand times larger, and every hyperparameter
        is then learned in absurd units. The running statistics converge to the field's spread instead; the
        number of re-expressions is logarithmic in how far the first guess was off. Uses the buffers of
        :meth:`_register_target_statistics` and ``standardised`` (bool); a ``scale_fixed`` buffer, where the engine
        has one, keeps a scale set from outside.
        """
        if not self.likelihood.standardise_targets:
            self.standardised.fill_(True)
            return
        fold_moving_targets(self.y_count, self.y_run_mean, self.y_run_m2, self.y_moved, y, moving)
        if bool(getattr(self, "scale_fixed", False)):
            return
        mean, std = moments_scale(self.y_count, self.y_run_mean, self.y_run_m2)
        if not bool(self.standardised):
            self.y_mean.copy_(mean)
            self.y_std.copy_(std)
            self.standardised.fill_(True)
            return
        if scale_drifted(mean, std, self.y_mean, self.y_std):
            self._rescale_targets(mean, std)

    # ------------------------------------------------------------------ the contract
    @abc.abstractmethod
    def update(self, x, y, mode: str | None = None) -> dict:
        """Condition on a batch x (N, D), y (N, P); mode 'fast', 'full' or None (the engine's schedule)."""

    @abc.abstractmethod
    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (N, P) of the latent f at checked inputs, in standardised target units."""

    def predict(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (G, P) of the latent f at x, in the original target units."""
        xt = self._check_x(x)
        with torch.no_grad():
            mean, var = self._latent(xt)
            return mean * self.y_std + self.y_mean + self.sessions.level(), var * self.y_std ** 2

    # ------------------------------------------------------------------ undo
    def begin_update(self) -> None:
        """Remember the state, so that :meth:`rollback` can return to it (a failed update is undone)."""
        self.__dict__["_undo_state"] = {k: v.detach().clone() for k, v in self.state_dict().items()}

    def end_update(self) -> None:
        """The update since :meth:`begin_update` stands: forget what undoing it needed."""
        self.__dict__.pop("_undo_state", None)

    def rollback(self) -> None:
        """Return to the state at the last :meth:`begin_update`."""
        saved = self.__dict__.pop("_undo_state", None)
        if saved is None:
            raise RuntimeError("rollback() without begin_update()")
        self.load_state_dict(saved)

    # ------------------------------------------------------------------ the variance of a reading
    @property
    def calibrates(self) -> bool:
        """Whether this engine calibrates a reading's variance prequentially (gp/calibration.py): configured,
        and a Gaussian likelihood (whose predictive density the variance model replaces)."""
        return self.config.calibration == "prequential" and hasattr(self.likelihood, "noise_variance")

    def _noise_variance(self, x: torch.Tensor, reported: bool = True) -> torch.Tensor:
        """(N, P) variance a reading adds to the latent f at checked inputs, standardised units: the
        likelihood's (Gaussian noise; Student-t scale^2 dof / (dof - 2), its variance where it has one).
        Engines whose noise varies over space override it; ``reported=False``: of a reading taken exactly at x,
        without what a reported position's error adds (dual_svgp's position noise)."""
        lik = self.likelihood
        if hasattr(lik, "noise_variance"):
            noise = lik.noise_variance
        elif hasattr(lik, "scale_variance"):
            dof = float(self.config.student_t_dof)
            noise = lik.scale_variance * (dof / (dof - 2.0) if dof > 2.0 else 1.0)
        else:
            noise = torch.zeros(self.output_dims, dtype=torch.float64, device=x.device)
        return noise.detach().reshape(1, -1).expand(x.shape[0], self.output_dims)

    def _reading_moments(self, xt: torch.Tensor, reported: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, latent variance, noise variance) (N, P) at checked inputs, in the targets' units; the mean at
        the first session's level (the one the map is conditioned in). ``reported``: of a reading at a reported
        position (_noise_variance)."""
        mean, var = self._latent(xt)
        noise = self._noise_variance(xt, reported)
        scale2 = self.y_std ** 2
        return mean * self.y_std + self.y_mean, var * scale2, noise * scale2

    def predict_reading(self, x, with_slope: bool = True, full_floor: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (G, P) of a *reading* at x, in the original target units: the latent variance
        plus the noise, calibrated on the engine's own out-of-sample errors where it calibrates
        (:attr:`calibrates`; gp/calibration.py), plus the spread of the session offsets (a reading of a session
        not seen yet; 0 with one session). The mean is the reference session's level. What a localizer's
        measurement model and NLPD need. ``with_slope=False`` is a reading taken exactly at x: without the error
        a reported position adds where the map is steep (the calibration's slope term, and dual_svgp's position
        noise). A localizer's particle is such a reading; so are a reading's neighbours for the spike gate,
        since they share its position's error (a track's error is smooth). ``full_floor``: the noise floor's part
        of the noise at its full width, where the calibration narrowed it (its factor c, a sensor quieter than
        the floor): what the package's localizer weighs readings with (LocalizerConfig.keep_noise_floor)."""
        xt = self._check_x(x)
        with torch.no_grad():
            return self._reading(xt, with_slope, full_floor)

    def _reading(self, xt: torch.Tensor, with_slope: bool = True, full_floor: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`predict_reading` at checked inputs."""
        # The calibration fits a reported position's error itself (its slope term b) on records of the noise
        # without it, so a calibrated reading is given that noise too; uncalibrated, the engine's own term.
        mean, var, noise = self._reading_moments(xt, reported=with_slope and not self.calibrates)
        return mean + self.sessions.level(), self._reading_variance(var, noise, xt if with_slope else None,
                                                                    full_floor)

    def _reading_variance(self, var: torch.Tensor, noise: torch.Tensor, xt: torch.Tensor | None,
                          full_floor: bool = False) -> torch.Tensor:
        """A reading's variance from its latent and noise variances; ``xt``: where, for the calibration's slope
        term (None: without it); ``full_floor``: predict_reading's."""
        if not self.calibrates:
            return var + noise + self.sessions.spread()
        slope = xt is not None and bool((self.calibration.position > 0).any())
        slope2 = self._reading_slope2(xt) if slope else None
        return self.calibration.reading_variance(var, noise, slope2, full_floor) + self.sessions.spread()

    def _reading_slope2(self, xt: torch.Tensor) -> torch.Tensor | None:
        """(N, P) |grad m(x)|^2 of the map's mean at checked inputs, targets' units per m^2, for the calibration's
        slope term (gp/calibration.py); None where the engine does not state it."""
        return None

    def start_session(self) -> int:
        """The readings from now on come from a new session (another bag, node run or sensor) whose constant
        offset to the first session's is learned (gp/calibration.py, SessionOffsets); returns its index."""
        self._close_session()
        # The map of the sessions so far, frozen: the new session's offset is measured against it. Measured
        # against the map in use, the errors next to the session's own data carry the offset they were
        # conditioned with, and an early estimate feeds itself (a 5 uT offset on Solin was learned as 5.7). A
        # full copy (Engine._snapshot, also for a tiled map): the session may go anywhere.
        self.__dict__["_session_reference_map"] = Engine._snapshot(self) if self.num_seen > 0 else None
        return self.sessions.start()

    def _session_reference(self, device: torch.device) -> "Engine | None":
        """The map the current session's offset is measured against (:meth:`start_session`): the sessions
        before it, frozen. None where there is none: a session started on an empty map, or a map loaded from a
        state file (the copy is not saved; the offset then stays as it was learned)."""
        ref = self.__dict__.get("_session_reference_map")
        if ref is not None and ref.device != device:
            ref = self.__dict__["_session_reference_map"] = ref.to(device)
        return ref

    def _close_session(self) -> None:
        """Called as a new session starts: the data conditioned so far keep the offset they carry for good (an
        engine that re-expresses a session's data, :meth:`_reexpress_session`, forgets which were the last
        session's)."""

    def _reexpress_session(self, delta: torch.Tensor) -> None:
        """Re-express the data conditioned since the current session began as if their targets had been
        ``delta`` (P,) lower (targets' units), as conditioning them with the session's newest offset estimate
        would have: the estimate moves most over a session's first batches, and data conditioned with an early
        estimate would otherwise keep its error for good. Only where :attr:`reexpresses_sessions`."""
        raise NotImplementedError(f"{type(self).__name__} does not re-express a session's data")

    def _holds_session_data(self) -> bool:
        """Whether data of the current session are held in a form :meth:`_reexpress_session` would change."""
        return False

    def session_offset(self) -> torch.Tensor:
        """(P,) the current session's learned offset to the first session, in the targets' units."""
        return self.sessions.offset().clone()

    def _calibrate_on(self, xt: torch.Tensor, yt: torch.Tensor, observed: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Score a batch before the engine conditions on it (each engine's update calls this first and
        conditions on what it returns). The current session's offset learns from the map's errors on ground
        other sessions mapped; the variance model (gp/calibration.py) records the lagged map's errors and is
        refitted. Returns the targets less the session's offset (unobserved entries, ``observed`` (N, P)
        False, as given)."""
        cal, sessions = self.calibration, self.sessions
        if xt.shape[0] == 0 or not (self.calibrates or sessions.current > 0):
            return yt
        seen = torch.ones_like(yt, dtype=torch.bool) if observed is None else observed
        with torch.no_grad():
            reference = self._session_reference(xt.device) if sessions.current > 0 else None
            if reference is not None:
                # Readings on ground the earlier sessions know (latent variance below the noise) observe the
                # offset; their errors are against the earlier sessions' map alone, so this session's own data,
                # conditioned with an offset estimate that is still moving, never enter them.
                mean, var, noise = reference._reading_moments(xt)
                known = seen & (var <= noise)
                err = torch.where(seen, yt - mean, torch.zeros_like(mean))
                sessions.observe(err, var + noise, known, self._target_variance())
            offset = sessions.offset()
            if sessions.current > 0 and self.reexpresses_sessions and bool((offset != sessions.applied).any()):
                self._reexpress_session(offset - sessions.applied)
                sessions.applied.copy_(offset)
            if self.calibrates:
                lagged = self._lagged()
                # a lagged map of less than two lags of path is a map of the first seconds: its errors say how
                # a map that small errs, not the map in use
                if lagged is not None and float(lagged.calibration.path) >= 2.0 * self.config.calibration_lag:
                    mean, var, noise = lagged._reading_moments(xt, reported=False)
                    err = torch.where(seen, yt - offset - mean, torch.zeros_like(mean))
                    slope2 = lagged._reading_slope2(xt) if self.config.calibration_slope else None
                    cal.record(err, var, noise, seen, lagged._prior_latent_variance(), slope2)
                    cal.refit(self._target_variance(), self._prior_latent_variance(),
                              shared_var=self._shared_noise_variance())
                self._keep_lagged(xt)
            return torch.where(seen, yt - offset, yt)

    def calibration_records(self) -> dict[str, torch.Tensor] | None:
        """What a merge carries of this map's calibration: its out-of-sample records (gp/calibration.py,
        ``records_summary``); None when this engine does not calibrate."""
        return self.calibration.records_summary() if self.calibrates else None

    def pool_calibration(self, records: list[dict[str, torch.Tensor]]) -> int:
        """Fit this map's calibration on other maps' records (a merged map on its sources'; gp/calibration.py,
        ``pool``). A merged map has made no out-of-sample predictions of its own, and without its sources'
        it would state the latent variance and learned noise alone, 2-3.5x too narrow in SD on a real room
        (docs/merging.md). Returns the records kept (0 when this engine does not calibrate or none came)."""
        if not self.calibrates:
            return 0
        return self.calibration.pool(list(records), self._target_variance(), self._prior_latent_variance(),
                                     self._shared_noise_variance())

    def _lagged(self) -> "Engine | None":
        """The map as it was between one and two calibration lags of path ago (None until it exists)."""
        return (self.__dict__.get("_lag_copies") or (None, None, 0.0))[0]

    def _keep_lagged(self, xt: torch.Tensor) -> None:
        """Called before a batch x (N, D) is conditioned on: each time the path driven grows by
        model.calibration_lag, the copy taken the last time becomes the lagged map and a copy of the map as
        it is now is taken. The copies live outside the module's state (not saved, not moved by ``.to()``:
        they are taken again)."""
        ready, pending, mark = self.__dict__.get("_lag_copies") or (None, None, 0.0)
        if pending is None or float(self.calibration.path) - mark >= self.config.calibration_lag:
            self.__dict__["_lag_copies"] = (pending, self._snapshot(), float(self.calibration.path))
        self.calibration.extend_path(xt)

    #: bookkeeping of this engine's own updates that a frozen copy does not take: its lagged copies, the state
    #: an undo would return to (Engine.begin_update), the tiled model's journal (a copy of the touched tiles)
    #: and the map a session's offset is measured against (Engine.start_session)
    _UPDATE_BOOKKEEPING = ("_lag_copies", "_undo_state", "_journal", "_session_reference_map")

    def _snapshot(self) -> "Engine":
        """A frozen copy of this engine, without its update bookkeeping (copied as None where it was set)."""
        held = {key: self.__dict__.pop(key) for key in self._UPDATE_BOOKKEEPING if key in self.__dict__}
        try:
            snap = copy.deepcopy(self)
        finally:
            self.__dict__.update(held)
        for key in held:
            snap.__dict__[key] = None
        return snap

    def _target_variance(self) -> torch.Tensor:
        """(P,) variance of the targets seen so far (the scale of the calibration's tau^2 grid)."""
        return self.y_std.detach() ** 2

    def _shared_noise_variance(self) -> torch.Tensor:
        """(P,) the variance of the error a reading shares with its neighbours in time (model.time_error),
        targets' units; 0 without one. Part of each reading's noise variance; the calibration's factor c may
        narrow it (gp/calibration.py)."""
        error = getattr(getattr(self, "likelihood", None), "time_error", None)
        if error is None:
            return torch.zeros(self.output_dims, dtype=torch.float64, device=self.device)
        return error.variance.detach() * self.y_std.detach() ** 2

    #: an input farther from any datum than a map in metres reaches (every kernel's correlation 0 there)
    _NOWHERE = 1.0e7

    def _prior_latent_variance(self) -> torch.Tensor:
        """(P,) the latent variance the map states where it has no data, targets' units: the scale its latent
        variance is stated on under its hyperparameters now (the calibration brings its records to it)."""
        nowhere = torch.full((1, self.input_dims), self._NOWHERE, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            return self._reading_moments(nowhere)[1][0]

    def log_predictive_density(self, x, y) -> torch.Tensor:
        """log p(y*|x*) (N, P) in the original units (includes the Jacobian of the standardisation); with a
        calibrated reading variance (:meth:`predict_reading`) where the engine calibrates."""
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        with torch.no_grad():
            # a Gaussian reading's density is that of predict_reading's variance (which also holds a noise that
            # varies over space, such as dual_svgp's position noise)
            if self.calibrates or self.sessions.current > 0 or hasattr(self.likelihood, "noise_variance"):
                mean, s2 = self._reading(xt)
                return -0.5 * (math.log(2.0 * math.pi) + torch.log(s2) + (yt - mean) ** 2 / s2)
            mean, var = self._latent(xt)
            lpd = self.likelihood.log_predictive_density((yt - self.y_mean) / self.y_std, mean, var)
            if self.likelihood.standardise_targets:
                lpd = lpd - torch.log(self.y_std)
            return lpd

    @property
    def device(self) -> torch.device:
        for tensor in self.buffers():
            return tensor.device
        for tensor in self.parameters():
            return tensor.device
        return torch.device("cpu")

    @property
    def num_seen(self) -> int:
        """Data rows conditioned on so far."""
        return int(self.num_seen_t)

    @property
    def num_updates(self) -> int:
        return int(self.num_updates_t)

    # ------------------------------------------------------------------ torch.nn.Module plumbing
    def resizable_names(self) -> Iterable[str]:
        """Buffers and parameters whose shapes follow the data (default :attr:`RESIZABLE`)."""
        return self.RESIZABLE

    def _loaded(self) -> None:
        """Called after a state was loaded (restore what lives outside tensors, e.g. a generator)."""

    def _drop_caches(self) -> None:
        """Forget every factor derived from the state (recomputed on demand)."""
        self._cache = None

    def _apply(self, fn, *args, **kwargs):
        self._drop_caches()  # cached factors live on the old device
        self.__dict__.pop("_lag_copies", None)  # so do the lagged copies of the map (taken again later)
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        moved = prefix + "y_moved"  # absent from a state saved before fold_moving_targets
        if moved not in state_dict and prefix + "y_count" in state_dict and hasattr(self, "y_moved"):
            state_dict[moved] = counted_as_moving(state_dict[prefix + "y_count"])
        # Variable-size tensors take the saved shape before the copy.
        for name in self.resizable_names():
            key = prefix + name
            if key not in state_dict:
                continue
            store = self._parameters if name in self._parameters else self._buffers
            old = store[name]
            fresh = torch.zeros(state_dict[key].shape, dtype=old.dtype, device=old.device)
            store[name] = nn.Parameter(fresh, requires_grad=old.requires_grad) \
                if isinstance(old, nn.Parameter) else fresh
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._drop_caches()
        self.__dict__.pop("_lag_copies", None)  # copies of another state
        self._loaded()

    # ------------------------------------------------------------------ optimiser state
    # Engines that learn hyperparameters online call _register_adam_state in __init__ (and list adam_avg and
    # adam_avg_sq as resizable), and wrap each update's torch.optim.Adam in _restore_adam / _store_adam.
    def _register_adam_state(self) -> None:
        """Adam's moments kept across updates (flattened in parameter order) and its step count: online, a few
        steps per batch then add up to one long optimisation, and a checkpoint resumes it exactly."""
        self.register_buffer("adam_avg", torch.zeros(0, dtype=torch.float64))
        self.register_buffer("adam_avg_sq", torch.zeros(0, dtype=torch.float64))
        self.register_buffer("adam_step", torch.tensor(0.0, dtype=torch.float64))

    def _hyper_budget(self, n_new: int, warmup: bool = True) -> int:
        """Hyperparameter steps for an update of ``n_new`` new samples: up to model.hyper_steps while the
        optimiser is young (fewer than model.hyper_warmup steps in all: the map is small then and steps are
        cheap, and the hyperparameters are far from their optimum), then one step per model.hyper_batch new
        samples (at least one), so the cost per second of data stays flat while learning keeps pace."""
        cfg = self.config
        if warmup and float(self.adam_step) < cfg.hyper_warmup:
            return cfg.hyper_steps
        return min(cfg.hyper_steps, max(1, math.ceil(n_new / cfg.hyper_batch)))

    def _restore_adam(self, optimiser: torch.optim.Adam, params: list[nn.Parameter]) -> None:
        """Give the optimiser the moments saved by the last _store_adam (a fresh start if there are none or the
        parameters changed shape)."""
        sizes = [p.numel() for p in params]
        if not params or self.adam_avg.numel() != sum(sizes):
            return
        step = torch.tensor(float(self.adam_step))
        for p, avg, avg_sq in zip(params, self.adam_avg.split(sizes), self.adam_avg_sq.split(sizes)):
            optimiser.state[p] = {"step": step.clone(), "exp_avg": avg.view_as(p).clone(),
                                  "exp_avg_sq": avg_sq.view_as(p).clone()}

    def _store_adam(self, optimiser: torch.optim.Adam, params: list[nn.Parameter]) -> None:
        states = [optimiser.state.get(p) for p in params]
        held = [st for st in states if st]
        if not held:
            return
        # A parameter that had no gradient in any step of this update (dual_svgp's position noise before the map
        # has a slope) has no state: its moments are 0, and the others' moments and step count are still kept.
        with torch.no_grad():
            self.adam_avg = torch.cat([st["exp_avg"].reshape(-1) if st else torch.zeros_like(p).reshape(-1)
                                       for st, p in zip(states, params)]).detach().clone()
            self.adam_avg_sq = torch.cat([st["exp_avg_sq"].reshape(-1) if st else torch.zeros_like(p).reshape(-1)
                                          for st, p in zip(states, params)]).detach().clone()
            self.adam_step.fill_(float(held[0]["step"]))

    # ------------------------------------------------------------------ input checking
    def _to_tensor(self, value, name: str) -> torch.Tensor:
        return to_float64_tensor(value, name, self.device)

    def _standardisation_args(self, mean, std) -> tuple[torch.Tensor, torch.Tensor]:
        """``set_standardisation``'s arguments as (P,) tensors: finite offsets, finite positive scales."""
        m = self._to_tensor(mean, "mean").reshape(-1)
        sd = self._to_tensor(std, "std").reshape(-1)
        if m.shape[0] != self.output_dims or sd.shape[0] != self.output_dims:
            raise ModelInputError(f"mean and std must have {self.output_dims} entries, got {m.shape[0]}, {sd.shape[0]}")
        if not bool(torch.isfinite(m).all()) or not bool((torch.isfinite(sd) & (sd > 0)).all()):
            raise ModelInputError("standardisation mean must be finite and std finite and positive")
        return m, sd

    def _check_x(self, x, name: str = "x") -> torch.Tensor:
        return check_inputs(x, self.input_dims, self.device, name)

    def _check_targets(self, y, n: int, name: str = "y", allow_missing: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets (N, P) with missing entries set to 0, mask of observed entries), for n input rows.

        With ``allow_missing``, NaN marks a channel not observed in that row; otherwise every target is needed.
        Inf is never a valid reading. The likelihood checks the values (``validate_targets``)."""
        t = self._to_tensor(y, name)
        if t.dim() == 1 and self.output_dims == 1:
            t = t[:, None]
        if t.dim() != 2 or t.shape[1] != self.output_dims:
            raise ModelInputError(f"{name} must have shape (N, {self.output_dims}), got {tuple(t.shape)}")
        if t.shape[0] != n:
            raise ModelInputError(f"x has {n} rows but {name} has {t.shape[0]}")
        mask = ~torch.isnan(t)
        if allow_missing:
            if bool(torch.isinf(t).any()):
                raise ModelInputError(f"{name} holds +-Inf in {int(torch.isinf(t).any(1).sum())} rows "
                                      "(NaN marks a missing channel; Inf is never a valid reading)")
        else:
            bad = ~torch.isfinite(t).all(dim=1)
            if bool(bad.any()):
                raise ModelInputError(f"{name} holds NaN or Inf in {int(bad.sum())} of {t.shape[0]} rows; "
                                      "every target is needed here")
        filled = torch.where(mask, t, torch.zeros_like(t))
        why = self.likelihood.validate_targets(filled)
        if why is not None:
            raise ModelInputError(f"{name}: {why}")
        return filled, mask

    def _check_stamps(self, t, n: int, clock_step: float = 1.0) -> torch.Tensor:
        """Stamps (n,) [s] as float64 on the CPU; None gives a sample clock, ``clock_step`` apart from one sample to
        the next and counted on from num_seen."""
        if t is None:
            return (torch.arange(n, dtype=torch.float64) + float(self.num_seen)) * float(clock_step)
        tt = to_float64_tensor(t, "t", torch.device("cpu")).reshape(-1)
        if tt.shape[0] != n:
            raise ModelInputError(f"x has {n} rows but t has {tt.shape[0]} stamps")
        if not bool(torch.isfinite(tt).all()):
            raise ModelInputError("t holds NaN or Inf")
        return tt

    def _check_y(self, y, n: int, name: str = "y") -> torch.Tensor:
        """Targets (N, P) for n input rows, every entry observed and finite."""
        return self._check_targets(y, n, name)[0]


def reading_of(model, x, with_slope: bool = True, full_floor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.predict_reading(x)`` of any predictor that has one: an :class:`Engine` is asked ``with_slope``
    (False: a reading taken exactly at x, without the calibration's slope term) and ``full_floor``; a predictor
    from outside the package has neither and is asked as it is."""
    if isinstance(model, Engine):
        return model.predict_reading(x, with_slope=with_slope, full_floor=full_floor)
    return model.predict_reading(x)
