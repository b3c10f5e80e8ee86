"""Prequential calibration of a reading's predictive variance.

Why: the marginal likelihood (and the ELBO that bounds it) treats the readings of one pass as independent
given the field. They are not: pose error, a heading-dependent sensor error and slow drifts are smooth along a
pass and the same for its neighbouring readings, so the likelihood explains them as field detail and learns a
noise variance of the sensor alone. A new pass over the same ground then misses the map by far more than its
predictive standard deviation says (on the OptiTrack hold-out, 38 % of held-out readings within +-2 SD).

What: every update first predicts its batch from the map as it was ``calibration_lag`` metres of path (between
one and two lags) earlier, *before* the batch and the track that led to it were conditioned on. Those
predictions are out of sample in the way a new pass is (Dawid's prequential principle, 1984, with a lag):
where older passes mapped the ground they test the map's confidence at a revisit, elsewhere its confidence
on new ground; the track just driven, whose errors the batch shares, is not in them. A bounded store keeps
(squared error, latent variance, noise variance, the map's squared slope) per output, and a variance model of a
reading

    s^2 = (a + a_far * r) * v_latent + c * sigma_noise^2 + b * |grad m(x)|^2 + tau^2,   r = v_latent / prior

is fitted by maximum likelihood (a: how far the latent variance is off; a_far >= 0: how much farther off it is where
the map knows little, r being the latent variance as a fraction of the map's no-data variance; tau^2: the error a
new pass adds that no part of the model sees; b, where the engine states its mean's slope (dual_svgp) and
model.calibration_slope is on: the variance of a position error [m^2], which reads as slope times that error, so a
steep place errs more than a flat one; 0 otherwise; c in [0.1, 1]: how much of the engine's noise the readings show,
below 1 for an error shared in time (model.time_error) whose variance, learned along the stream, is more than a new
pass meets, and, with model.calibration_noise_factor, for a sensor quieter than model.noise_floor, which the engine
learns its noise above: c scales the shared error's variance and, with that option, the floor's part, never the
white noise the engine learned above its floor).

Two fits. A position error is not in a reading taken exactly at x, only in one taken where the robot *thought*
it was. A new pass over mapped ground is the second kind: its variance is the fit with the slope term. A
localizer's particle, or a map file's cell, is the first: the fit without the term, (a, tau^2) on the same
records with b = 0. The joint fit's a and tau^2 are narrower, b having taken part of the error, so the first fit
is not the second with b dropped (the localizer, given that, lost track on Solin sequence 5). Both are refitted
together; ``predict_reading(x, with_slope=...)`` chooses.

The Gaussian fit matches the records' second moment, but their tails are heavier than a Gaussian's (a few passes'
pose errors, a wall not yet seen), so its +-1.96 SD holds fewer than 95 % of them (Solin protocol 1: 92 %, and 89 %
of the held-out readings). The fitted variance is therefore widened by the factor w >= 1 that makes +-1.96 SD hold
95 % of the records: the records' 95 % quantile of z^2 over 1.96^2, a split-conformal interval on out-of-sample
errors (Vovk, Gammerman and Shafer 2005, "Algorithmic learning in a random world"; Angelopoulos and Bates 2021, "A
gentle introduction to conformal prediction"). It never narrows the fit: records inside their interval more often
than 95 % (light tails, or a variance already too large) keep w = 1, as a variance model fitted to the second moment
is the better one for them. Nor does the fit narrow the latent variance (a >= 1): where records sit close to earlier
passes the latent variance is a small part of a reading's and a is poorly determined there (OptiTrack: records 9 cm
from older data, a = 0.72), while held-out readings farther off have more of it, and a < 1 narrowed them where they
were already too narrow (OptiTrack |B| 88 % within +-2 SD against 89 % with a >= 1; NLPD as good or better on all
six recordings of the calibration bench). One a for every distance from the data was the model before a_far, and the
records that fit it are mostly made where the lagged map knows little (a lawnmower's next lane): on the demo bag
a = 1.7 from records at a median r of 0.48, applied to a held-out circle at r = 0.014, whose errors do not grow with the
latent variance at all (0.07 uT^2 in each quarter of it). With a_far the widening that new ground shows stays on new
ground (docs/calibration.md, Widened where the map knows little). A record's latent variance was stated under the
hyperparameters of its time, and a map's first minutes state it on another scale (a signal variance of 35 uT^2 where
the map settles at 7): so each record keeps the prior variance its map stated where it had no data, and a refit
takes the record's latent variance as that fraction of the prior variance *now* (v * prior_now / prior_then).
Without it the early records, whose variance was 5x that of later maps for the same errors, made the latent variance
look uninformative (a = 0.07) and put the error into tau^2: 2.5 uT^2 on a field read with 0.25 uT^2 of noise, every
held-out reading of the simulated revisit (bench recording ``sim_revisit``) within +-2 SD and a z-std of 0.38. It is
refitted every ``REFIT_EVERY`` new records (a coarse grid over a, tau^2, c and, in the second fit, b, finds the
likelihood's basin; a bounded Newton method its optimum; at most ``FIT_RECORDS`` of the stored records, on the CPU)
and only after ``CALIBRATION_MIN_RECORDS`` records; until then a = 1, c = 1, tau^2 = 0, the model as it is. The
lagged map is a copy the engine keeps (``Engine._lagged``); it is not part of the saved state, so a loaded map
calibrates again after two lags. The same idea is conformal/recalibration of regression uncertainty (Kuleshov et al.
2018, "Accurate uncertainties for deep learning using calibrated regression"), here with a parametric variance
model, fitted online on prequential residuals instead of a held-out set.

Everything is kept in the targets' own units, so a rescaling of the engine's standardisation leaves it valid.
This module is ROS-free and knows nothing of any engine: :class:`~gp_mapping.gp.base.Engine` owns one.
"""
from __future__ import annotations

import math

import torch
from torch import nn

#: records needed before the calibration replaces the raw variance (a few seconds of readings)
CALIBRATION_MIN_RECORDS = 200
#: the most records one refit uses (evenly spaced over the store), so a refit costs a few milliseconds
FIT_RECORDS = 1024
#: records (evenly spaced) the coarse grid of a refit scores: it only has to find the likelihood's basin, whose
#: optimum the Newton steps then find on all FIT_RECORDS
COARSE_RECORDS = 256
#: coarse grid points of the latent-variance factor a and of tau^2 (log-spaced over their bounds)
SCALE_POINTS, EXTRA_POINTS = 7, 9
#: the most projected Newton steps of one fit (it converges in 3-10 on the recordings here)
NEWTON_STEPS = 50
#: new records between refits (about a batch: the last revisits must count at once)
REFIT_EVERY = 50
#: bounds of the latent-variance factor a and of tau^2 relative to the targets' variance; a >= 1: the
#: calibration widens the latent variance, never narrows it (module docstring)
SCALE_BOUNDS = (1.0, 1000.0)
#: bounds of a_far, the widening of the latent variance that grows with how little the map knows (a reading's latent
#: part (a + a_far r) v, r = v / prior in [0, 1]; module docstring): 0 (none, where the records show none) to the
#: largest a
FAR_BOUNDS = (0.0, SCALE_BOUNDS[1])
#: share of the records that +-COVERED_Z SD of the widened variance holds (module docstring)
COVERED = 0.95
COVERED_Z = 1.959964
EXTRA_BOUNDS = (1e-8, 10.0)
#: bounds of b, the variance of the positions' error that the slope term stands for [m^2]: 1 mm to 0.5 m. The
#: term is first order (m(x + delta) ~ m(x) + grad m . delta), which holds for errors well inside the field's
#: lengthscales (0.5-3 m on every recording here); and the first 150 s of a drive, mostly new ground, fit b at
#: any upper bound (1 m^2 on five of six simulated worlds), widening steep places to over-coverage
#: (docs/calibration.md, The slope term).
POSITION_BOUNDS = (1e-6, 10 ** -0.6)
#: coarse grid points of b over POSITION_BOUNDS (with the records' slopes; one, at the floor, without)
POSITION_POINTS = 6
#: bounds of c, the factor on the variance of the error shared in time (model.time_error) and, with
#: model.calibration_noise_factor, on the part of the engine's noise that is its floor (model.noise_floor): the floor holds
#: the noise the engine learns with, but a sensor quieter than the floor reads closer to the map than it says, and
#: its readings were over-covered (the demo bag: 1.000 within +-2 SD, z-std 0.50). The noise the engine learned
#: above the floor is the data's and stays. c <= 1: the fit never widens the noise (tau^2 does that); 0.1: the
#: floor's part at most ten times narrower (docs/calibration.md, The noise floor's part)
NOISE_BOUNDS = (0.1, 1.0)
#: coarse grid points of c over NOISE_BOUNDS
NOISE_POINTS = 4


def evenly_spaced(n: int, most: int, device=None) -> torch.Tensor:
    """Indices of at most ``most`` of ``n`` items, evenly spaced from the first to the last (all when n <= most)."""
    return torch.linspace(0, n - 1, min(n, most), device=device).round().long()


#: a record's values (besides ``filled``), each (N, P) in the targets' units: what a merge carries of a map's
#: calibration (PrequentialCalibration.records_summary)
RECORD_FIELDS = ("err2", "latent_var", "noise_var", "prior_var", "slope2")


class _OptionalState(nn.Module):
    """Buffers a state saved before they existed may lack: such a state loads with them at their initial values
    (the map loads uncalibrated, in its first session); a state saved with other store sizes brings its own
    shapes."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, buf in list(self._buffers.items()):
            key = prefix + name
            if key in state_dict and state_dict[key].shape != buf.shape:
                self._buffers[name] = torch.zeros(state_dict[key].shape, dtype=buf.dtype, device=buf.device)
        for name in self.RETIRED:
            state_dict.pop(prefix + name, None)
        before = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not any(key.startswith(prefix) for key in state_dict):
            del missing_keys[before:]
        else:  # buffers added in a later version keep their initial values
            missing_keys[before:] = [k for k in missing_keys[before:] if k[len(prefix):] not in self.ADDED_LATER]
        self._loaded()

    #: buffers a state of an earlier version lacks while it has the others
    ADDED_LATER: tuple[str, ...] = ()
    #: buffers a state of an earlier version has that are no longer kept (ignored on loading)
    RETIRED: tuple[str, ...] = ()

    def _loaded(self) -> None:
        """Restore what follows from the buffers' shapes."""


class PrequentialCalibration(_OptionalState):
    """Records out-of-sample residuals and fits (a, tau^2) per output; see the module docstring."""

    def __init__(self, input_dims: int, output_dims: int, records: int, noise_floor: float = 0.0,
                 noise_factor: bool = False) -> None:
        super().__init__()
        self.records = int(records)
        #: the engine's noise floor (targets' units, model.noise_floor): with shared_var, the part of a noise
        #: variance that the noise factor c scales (NOISE_BOUNDS)
        self.noise_floor = float(noise_floor)
        #: whether c is fitted (model.calibration_noise_factor); False: c = 1, the floor's part at full width
        self.noise_factor = bool(noise_factor)
        f64 = {"dtype": torch.float64}
        # the variance (P,) of the error the engine's readings share in time (model.time_error; 0 without it),
        # targets' units, as of the last refit: c scales it with the floor's part (refit)
        self.register_buffer("shared_var", torch.zeros(output_dims, **f64))
        # Ring of records, per output: squared error, latent variance, noise variance (targets' units), and
        # whether the entry is filled (a vector output can miss a channel).
        self.register_buffer("err2", torch.zeros(self.records, output_dims, **f64))
        self.register_buffer("latent_var", torch.zeros(self.records, output_dims, **f64))
        self.register_buffer("noise_var", torch.zeros(self.records, output_dims, **f64))
        # the prior (no-data) latent variance of the map that made each record; 0: unknown (a state saved
        # before it was kept), the record taken as it is
        self.register_buffer("prior_var", torch.zeros(self.records, output_dims, **f64))
        # the squared slope |grad m|^2 of the predicting map at the record (targets' units per m^2; 0 where the
        # engine states none)
        self.register_buffer("slope2", torch.zeros(self.records, output_dims, **f64))
        self.register_buffer("filled", torch.zeros(self.records, output_dims, dtype=torch.bool))
        self.register_buffer("record_count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("fitted_at", torch.zeros((), dtype=torch.int64))  # record_count at the last refit
        # The path driven so far (sum of steps between consecutive inputs) and its last input: the lag's clock.
        self.register_buffer("path", torch.zeros((), **f64))
        self.register_buffer("last_x", torch.zeros(input_dims, **f64))
        self.register_buffer("has_last_x", torch.zeros((), dtype=torch.bool))
        # Two fitted models (module docstring, "two fits"). For a reading taken exactly at x (a localizer's
        # particle, a map file's cell): s^2 = scale * v + noise_scale * noise + extra (extra in the targets' squared
        # units) ...
        self.register_buffer("scale", torch.ones(output_dims, **f64))
        self.register_buffer("extra", torch.zeros(output_dims, **f64))
        self.register_buffer("noise_scale", torch.ones(output_dims, **f64))
        # ... and the whole widened so that +-2 SD holds 95 % of the records (>= 1; module docstring).
        self.register_buffer("widen", torch.ones(output_dims, **f64))
        # ... and the latent variance widened by far_scale * r more where the map knows little, r = v / fit_prior,
        # the map's no-data latent variance at the last refit (targets' units; 0: never fitted)
        self.register_buffer("far_scale", torch.zeros(output_dims, **f64))
        self.register_buffer("fit_prior", torch.zeros(output_dims, **f64))
        # For a reading at a reported position (a new pass): the same with the slope term, fitted jointly,
        # s^2 = reported_widen * (reported_scale * v + reported_noise_scale * noise + position * slope^2
        # + reported_extra), position in m^2. Where the records hold no slope (or b fits at its floor) it equals the
        # first.
        self.register_buffer("reported_scale", torch.ones(output_dims, **f64))
        self.register_buffer("reported_extra", torch.zeros(output_dims, **f64))
        self.register_buffer("reported_noise_scale", torch.ones(output_dims, **f64))
        self.register_buffer("reported_widen", torch.ones(output_dims, **f64))
        self.register_buffer("reported_far_scale", torch.zeros(output_dims, **f64))
        self.register_buffer("position", torch.zeros(output_dims, **f64))

    ADDED_LATER = ("prior_var", "widen", "slope2", "position", "reported_scale", "reported_extra", "reported_widen",
                   "noise_scale", "reported_noise_scale", "shared_var", "far_scale", "reported_far_scale", "fit_prior")
    #: the reported-position fit's buffers and the exact-position ones a state without them loads them from
    REPORTED = {"reported_scale": "scale", "reported_extra": "extra", "reported_widen": "widen",
                "reported_noise_scale": "noise_scale", "reported_far_scale": "far_scale"}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for reported, exact in self.REPORTED.items():  # a state saved with one fit: both are that fit
            if prefix + reported not in state_dict and prefix + exact in state_dict:
                state_dict[prefix + reported] = state_dict[prefix + exact]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def active(self) -> bool:
        return self.records > 0

    def extend_path(self, x: torch.Tensor) -> None:
        """Add the steps of a batch of inputs (N, D), in order, to the path driven."""
        if x.shape[0] == 0:
            return
        x = x.to(self.path.dtype)
        steps = (x[1:] - x[:-1]).norm(dim=1).sum()
        if bool(self.has_last_x):
            steps = steps + (x[0] - self.last_x).norm()
        self.path += steps
        self.last_x.copy_(x[-1])
        self.has_last_x.fill_(True)

    def record(self, err: torch.Tensor, latent_var: torch.Tensor, noise_var: torch.Tensor,
               observed: torch.Tensor, prior_var: torch.Tensor, slope2: torch.Tensor | None = None) -> None:
        """Store (N, P) out-of-sample errors with their predicted variances; ``observed`` (N, P) masks channels;
        ``prior_var`` (P,): the latent variance the predicting map states where it has no data; ``slope2``
        (N, P): its squared slope there (None: the engine states none)."""
        if err.shape[0] == 0:
            return
        slope2 = torch.zeros_like(latent_var) if slope2 is None else slope2
        err, latent_var, noise_var, observed, slope2 = (t[-self.records:] for t in (err, latent_var, noise_var,
                                                                                   observed, slope2))
        start = int(self.record_count) % self.records
        idx = (torch.arange(err.shape[0], device=err.device) + start) % self.records
        self.err2[idx] = (err * err).to(self.err2.dtype)
        self.latent_var[idx] = latent_var.to(self.err2.dtype)
        self.noise_var[idx] = noise_var.to(self.err2.dtype)
        self.prior_var[idx] = prior_var.to(self.err2.dtype).reshape(1, -1).expand(idx.shape[0], -1)
        self.slope2[idx] = slope2.to(self.err2.dtype)
        self.filled[idx] = observed
        self.record_count += err.shape[0]

    def refit(self, target_var: torch.Tensor, prior_var: torch.Tensor, force: bool = False,
              shared_var: torch.Tensor | None = None) -> None:
        """Maximum-likelihood fits per output from the stored records (both of them: without the slope term and
        with it), once REFIT_EVERY records came since the last refit (or ``force``); ``target_var`` (P,) sets the
        scale of the tau^2 grid; ``prior_var`` (P,) is the map's no-data latent variance now, the scale each
        record's latent variance is brought to (module docstring); ``shared_var`` (P,): the variance of the error
        the engine's readings share in time now (None: as at the last refit), the part of each record's noise
        that c scales beside the floor's. Outputs with fewer than CALIBRATION_MIN_RECORDS records stay
        uncalibrated."""
        if not force and int(self.record_count) - int(self.fitted_at) < REFIT_EVERY:
            return
        self.fitted_at.copy_(self.record_count)
        if shared_var is not None:
            self.shared_var.copy_(shared_var.detach().to(self.shared_var))
        for p in range(self.err2.shape[1]):
            keep = self.filled[:, p]
            if int(keep.sum()) < CALIBRATION_MIN_RECORDS:
                exact = reported = (1.0, 0.0, 0.0, 1.0, 1.0, 0.0)
            else:
                e2, v, s = self.err2[keep, p], self.latent_var[keep, p], self.noise_var[keep, p]
                g = self.slope2[keep, p]
                then = self.prior_var[keep, p]
                if e2.shape[0] > FIT_RECORDS:
                    pick = evenly_spaced(e2.shape[0], FIT_RECORDS, e2.device)
                    e2, v, s, g, then = e2[pick], v[pick], s[pick], g[pick], then[pick]
                # on the CPU: a thousand records, and every Newton step reads its values on the host (on a GPU each
                # would wait for the device)
                e2, v, s, g, then = (t.cpu() for t in (e2, v, s, g, then))
                v = torch.where(then > 0, v * (float(prior_var[p]) / then.clamp_min(1e-300)), v)
                unit = max(float(target_var[p]), 1e-12)
                scalable = float(self._scaled_noise()[p])
                r = (v / max(float(prior_var[p]), 1e-300)).clamp(0.0, 1.0)
                exact = self._fit(e2, v, s, torch.zeros_like(g), unit, scalable, r)
                reported = self._fit(e2, v, s, g, unit, scalable, r) if bool((g > 0).any()) else exact
            self.fit_prior[p] = float(prior_var[p])
            self.scale[p], self.extra[p], _, self.noise_scale[p], self.widen[p], self.far_scale[p] = exact
            (self.reported_scale[p], self.reported_extra[p], self.position[p], self.reported_noise_scale[p],
             self.reported_widen[p], self.reported_far_scale[p]) = reported

    def _scaled_noise(self) -> torch.Tensor:
        """(P,) the part of a reading's noise variance that c scales: the error its readings share in time
        (model.time_error), whose variance learned batch by batch can exceed what a new pass meets, and with
        model.calibration_noise_factor the noise floor's part too."""
        return self.shared_var + (self.noise_floor if self.noise_factor else 0.0)

    @staticmethod
    def _noise_parts(s: torch.Tensor, floor) -> tuple[torch.Tensor, torch.Tensor]:
        """A noise variance split into the white noise the engine learned above its floor, and the part that c
        scales: the floor's, and the error shared in time (``floor``: the floor plus its variance)."""
        learned = (s - floor).clamp_min(0.0)
        return learned, s - learned

    @classmethod
    def _fit(cls, e2, v, s, g, unit: float, floor: float = 0.0, r: torch.Tensor | None = None
             ) -> tuple[float, float, float, float, float, float]:
        """(a, tau^2, b, c, w, a_far) of the records (squared errors e2, latent and noise variances v and s, squared
        slopes g: all 0 for the fit without the slope term); ``unit`` scales the tau^2 bounds; ``floor``: the
        engine's noise floor and the variance of its error shared in time, the part of s that c scales; ``r``: the
        records' latent variance relative to the map's prior variance, in [0, 1] (None: a_far = 0). A coarse grid
        over the log parameters finds the likelihood's basin without a_far; Newton steps within the bounds find its
        optimum (:meth:`_newton`), and from there, with a_far, the optimum of the whole model."""
        s, s_floor = cls._noise_parts(s, floor)
        # (lower, upper, coarse points) of a, tau^2, b, c; one that cannot act (no slopes, no floor) is held at
        # its only value: b at its floor (the term off), c at 1
        has_slope, has_floor = bool((g > 0).any()), bool((s_floor > 0).any())
        ranges = [SCALE_BOUNDS + (SCALE_POINTS,), (EXTRA_BOUNDS[0] * unit, EXTRA_BOUNDS[1] * unit, EXTRA_POINTS),
                  POSITION_BOUNDS + (POSITION_POINTS,) if has_slope else (POSITION_BOUNDS[0],) * 2 + (1,),
                  NOISE_BOUNDS + (NOISE_POINTS,) if has_floor else (1.0, 1.0, 1)]
        grids = [torch.linspace(math.log(lo), math.log(hi), n, dtype=e2.dtype) for lo, hi, n in ranges]
        coarse = evenly_spaced(e2.shape[0], COARSE_RECORDS)
        start = torch.tensor(cls._best(e2[coarse], v[coarse], s[coarse], s_floor[coarse], g[coarse], *grids),
                             dtype=e2.dtype).exp()
        parts = torch.stack([v, torch.ones_like(v), g, s_floor])  # what a, tau^2, b and c multiply
        free = torch.tensor([hi > lo for lo, hi, _ in ranges])
        lo, hi = (torch.tensor([r[k] for r in ranges], dtype=e2.dtype) for k in (0, 1))
        theta = start.clone()
        theta[free] = cls._newton(start[free], lo[free], hi[free], parts[free], s + start[~free] @ parts[~free], e2)
        far = torch.zeros_like(v) if r is None else v * r
        if r is not None:  # a_far from 0, the others from their optimum without it
            theta, parts = torch.cat([theta, theta.new_zeros(1)]), torch.cat([parts, far[None]])
            free = torch.cat([free, torch.tensor([True])])
            lo, hi = (torch.cat([x, x.new_tensor([bound])]) for x, bound in ((lo, FAR_BOUNDS[0]), (hi, FAR_BOUNDS[1])))
            theta[free] = cls._newton(theta[free], lo[free], hi[free], parts[free], s + theta[~free] @ parts[~free],
                                      e2)
        a, t, b, c = (float(x) for x in theta[:4])
        a_far = float(theta[4]) if r is not None else 0.0
        # at its low end (1 mm) the term is off: no slope, or none that the records show
        b = 0.0 if b <= POSITION_BOUNDS[0] * (1 + 1e-9) else b
        z2 = e2 / (a * v + a_far * far + s + c * s_floor + b * g + t)
        return a, t, b, c, max(1.0, float(torch.quantile(z2, COVERED)) / COVERED_Z ** 2), a_far

    @staticmethod
    def _newton(theta, lo, hi, parts, rest, e2) -> torch.Tensor:
        """The theta (k,) within [lo, hi] of the smallest Gaussian negative log likelihood of the squared errors e2
        (N,) under the variances rest + theta @ parts ((N,), (k, N)), from ``theta``: projected Newton steps
        (Bertsekas 1982, "Projected Newton methods for optimization problems with simple constraints": a parameter
        at a bound that its gradient pushes out of the box is held there, the others take the Newton step of their
        block) with a backtracking line search. Where the block's Hessian is not positive definite (far from the
        optimum the likelihood is not convex) the step is the gradient's, scaled by the Hessian's diagonal."""

        def nll(th):
            total = rest + th @ parts
            return float((total.log() + e2 / total).mean())

        theta = torch.minimum(torch.maximum(theta, lo), hi)
        # a parameter this close to a bound counts as at it (a grid's exp(log(bound)) is a rounding away)
        near = 1e-9 * (hi - lo)
        value = nll(theta)
        for _ in range(NEWTON_STEPS):
            inv = 1.0 / (rest + theta @ parts)
            ratio = e2 * inv
            grad = parts @ (inv * (1.0 - ratio)) / e2.shape[0]
            hess = (parts * (inv * inv * (2.0 * ratio - 1.0))) @ parts.T / e2.shape[0]
            move = ~(((theta <= lo + near) & (grad > 0)) | ((theta >= hi - near) & (grad < 0)))
            if not bool(move.any()):
                break
            g, h = grad[move], hess[move][:, move]
            chol, info = torch.linalg.cholesky_ex(h)
            scaled_gradient = -g / h.diagonal().abs().clamp_min(1e-300)
            steps = ([-torch.cholesky_solve(g[:, None], chol)[:, 0]] if int(info) == 0 else []) + [scaled_gradient]
            trial = None
            for step in steps:  # the Newton step, else (its projection climbs) the scaled gradient's
                length = 1.0
                for _ in range(40):  # halve the step until it lowers the likelihood enough (Armijo's rule)
                    candidate = theta.clone()
                    candidate[move] = torch.minimum(torch.maximum(theta[move] + length * step, lo[move]), hi[move])
                    candidate_value = nll(candidate)
                    if candidate_value <= value + 1e-4 * float(grad @ (candidate - theta)):
                        trial, trial_value = candidate, candidate_value
                        break
                    length /= 2.0
                if trial is not None:
                    break
            if trial is None:
                break
            done = value - trial_value <= 1e-12 * max(1.0, abs(value))
            theta, value = trial, trial_value
            if done:
                break
        return theta

    @staticmethod
    def _best(e2, v, s, s_floor, g, log_a, log_t, log_b, log_c) -> tuple[float, float, float, float]:
        """The grid cell (log a, log tau^2, log b, log c) of the smallest Gaussian negative log likelihood (``s``:
        the noise above the floor, ``s_floor``: the floor's part)."""
        a = log_a.exp()[:, None, None, None, None]
        t = log_t.exp()[None, :, None, None, None]
        b = log_b.exp()[None, None, :, None, None]
        c = log_c.exp()[None, None, None, :, None]
        total = (a * v + s + c * s_floor + b * g) + t
        nll = (total.log() + e2 / total).mean(-1)
        i = int(torch.argmin(nll))
        n_t, n_b, n_c = log_t.shape[0], log_b.shape[0], log_c.shape[0]
        return (float(log_a[i // (n_t * n_b * n_c)]), float(log_t[(i // (n_b * n_c)) % n_t]),
                float(log_b[(i // n_c) % n_b]), float(log_c[i % n_c]))

    def reading_variance(self, latent_var: torch.Tensor, noise_var: torch.Tensor,
                         slope2: torch.Tensor | None = None, full_floor: bool = False) -> torch.Tensor:
        """s^2 (N, P) of a reading from the latent and noise variances (targets' units): taken exactly where
        predicted (``slope2`` None), or at a reported position where the map's squared slope is ``slope2``
        (targets' units per m^2). ``full_floor``: the noise floor's part at its full width (c taken as 1)."""
        if slope2 is None:
            return self.widen * (self._latent_factor(latent_var, self.scale, self.far_scale) * latent_var
                                 + self.noise_part(noise_var, full_floor=full_floor) + self.extra)
        return self.reported_widen * (self._latent_factor(latent_var, self.reported_scale, self.reported_far_scale)
                                      * latent_var
                                      + self.noise_part(noise_var, reported=True, full_floor=full_floor)
                                      + self.position * slope2 + self.reported_extra)

    def _latent_factor(self, latent_var: torch.Tensor, scale: torch.Tensor, far_scale: torch.Tensor) -> torch.Tensor:
        """a + a_far r (N, P): the factor on a latent variance, r = latent_var / the prior at the last refit in
        [0, 1] (0 before any refit)."""
        prior = self.fit_prior.to(latent_var)
        r = torch.where(prior > 0, latent_var / prior.clamp_min(1e-300), torch.zeros_like(latent_var)).clamp(0.0, 1.0)
        return scale + far_scale * r

    def noise_part(self, noise_var: torch.Tensor, reported: bool = False, full_floor: bool = False) -> torch.Tensor:
        """The engine's noise variance (N, P) as a reading's variance counts it: the white noise it learned above
        its floor, and the floor's part and the error shared in time times c (of the fit for a reading taken
        exactly at x, or ``reported``: at a reported position; ``full_floor``: times 1)."""
        if full_floor:
            return noise_var
        learned, floor = self._noise_parts(noise_var, self._scaled_noise())
        return learned + (self.reported_noise_scale if reported else self.noise_scale) * floor

    def _loaded(self) -> None:
        self.records = self.err2.shape[0]

    # ------------------------------------------------------------------ carried through a merge
    def records_summary(self, most: int = FIT_RECORDS) -> dict[str, torch.Tensor]:
        """The stored records as a merge carries them (:data:`RECORD_FIELDS` and ``filled``, (N, P), targets'
        units, on the CPU): at most ``most`` of them, evenly spaced over the store, as many as a refit uses."""
        rows = torch.nonzero(self.filled.any(1)).reshape(-1)
        rows = rows[evenly_spaced(rows.numel(), most, rows.device)]
        return {k: getattr(self, k)[rows].detach().cpu().clone() for k in RECORD_FIELDS + ("filled",)}

    def pool(self, sources: list[dict[str, torch.Tensor]], target_var: torch.Tensor,
             prior_var: torch.Tensor, shared_var: torch.Tensor | None = None) -> int:
        """Make the store the records of ``sources`` (:meth:`records_summary` of other maps: a merge's sources)
        and refit, so a merged map states its readings' variance as its sources' out-of-sample errors say maps of
        that ground err. A record's latent variance is relative to the prior variance of the map that made it, so
        records of other maps refit as this map's own do (module docstring). Each source keeps an equal share of
        the store when all do not fit. ``target_var``, ``prior_var``, ``shared_var``: as :meth:`refit`. Returns
        the records kept (0: none, the store and the fit unchanged)."""
        sources = [r for r in sources if r["err2"].shape[0] > 0]
        if not sources or self.records == 0:
            return 0
        share = self.records // len(sources)
        picked = []
        for r in sources:
            rows = evenly_spaced(r["err2"].shape[0], share)
            picked.append({k: r[k][rows] for k in RECORD_FIELDS + ("filled",)})
        kept = sum(r["err2"].shape[0] for r in picked)
        dev = self.err2.device
        for k in RECORD_FIELDS + ("filled",):
            buf = getattr(self, k)
            buf.zero_()
            buf[:kept] = torch.cat([r[k] for r in picked]).to(device=dev, dtype=buf.dtype)
        self.record_count.fill_(kept)
        self.refit(target_var, prior_var, force=True, shared_var=shared_var)
        return kept

class SessionOffsets(_OptionalState):
    """A constant offset per session (a bag, a node run: another day or another sensor reads differently).

    The first session is the reference (offset 0) that the map is conditioned in; what the map predicts is
    shifted to the sessions' median level (a typical session), with their spread about it added to a reading's
    variance. A later session's offset b (P,) has a Gaussian prior N(0, prior_var) and a conjugate posterior from
    the session's readings on ground the earlier sessions know, predicted by the earlier sessions' map frozen at
    the session's start (Engine.start_session): y = m(x) + b + e with e ~ N(0, v + noise), where the latent
    variance v is below the noise. A batch counts as one observation (its readings share their errors). The map
    in use is not asked: next to this session's own data, which were conditioned with an estimate still
    moving, its errors carry that estimate back into the next one. Readings are then conditioned as y - b, so
    the map of several sessions is not smeared by their offsets.
    """

    def __init__(self, output_dims: int, sessions: int) -> None:
        super().__init__()
        f64 = {"dtype": torch.float64}
        self.register_buffer("session", torch.zeros((), dtype=torch.int64))
        # per session: posterior precision and precision-weighted mean; the first row is the reference
        self.register_buffer("precision", torch.zeros(sessions, output_dims, **f64))
        self.register_buffer("weighted", torch.zeros(sessions, output_dims, **f64))
        # the offset the current session's data were last conditioned with (Engine._calibrate_on)
        self.register_buffer("applied", torch.zeros(output_dims, **f64))

    ADDED_LATER = ("applied",)
    RETIRED = ("visited",)  # the cells a session had visited (before its offset was measured on a frozen map)

    @property
    def current(self) -> int:
        return int(self.session)

    def start(self) -> int:
        """Open the next session (the last slot is reused once all are taken); returns its index."""
        self.session.fill_(min(int(self.session) + 1, self.precision.shape[0] - 1))
        self.precision[int(self.session)] = 0.0
        self.weighted[int(self.session)] = 0.0
        self.applied.zero_()
        return int(self.session)

    def offset(self) -> torch.Tensor:
        """(P,) posterior mean offset of the current session (0 for the reference)."""
        s = int(self.session)
        return torch.where(self.precision[s] > 0, self.weighted[s] / self.precision[s].clamp_min(1e-300),
                           torch.zeros_like(self.weighted[s]))

    def observe(self, err: torch.Tensor, var: torch.Tensor, observed: torch.Tensor, prior_var: torch.Tensor) -> None:
        """Fold errors y - m(x) (N, P) with their variances into the current session's posterior."""
        s = int(self.session)
        if s == 0 or err.shape[0] == 0:
            return
        w = torch.where(observed, 1.0 / var.clamp_min(1e-300), torch.zeros_like(var))
        if bool((self.precision[s] == 0).any()):
            self.precision[s] = torch.where(self.precision[s] == 0, 1.0 / prior_var, self.precision[s])
        # A batch's readings share its pose and sensor errors: the batch is one observation of the offset, its
        # precision-weighted mean error with the variance of one reading (not 1/N of it: counting its
        # readings as independent made a first batch's local error the session's offset for good).
        total = w.sum(0)
        has = total > 0
        mean_err = (w * torch.where(observed, err, torch.zeros_like(err))).sum(0) / total.clamp_min(1e-300)
        batch_precision = total / observed.sum(0).clamp_min(1)
        self.precision[s] += torch.where(has, batch_precision, torch.zeros_like(total))
        self.weighted[s] += torch.where(has, batch_precision * mean_err, torch.zeros_like(total))

    #: the precision of offsets set by :meth:`hold`: taken as measured, a later session's data barely move them
    HELD_PRECISION = 1.0e12

    def hold(self, offsets: torch.Tensor) -> None:
        """Make the sessions a merge's sources (gp/merging/levels.py): ``offsets`` (S, P), each source's offset to
        the first (the reference, whose row is 0), as measured; the last source's is the current session, whose
        data the merged map holds at the reference's level (``applied``). One source: nothing changes."""
        n = offsets.shape[0]
        if n < 2:
            return
        if n > self.precision.shape[0]:
            raise ValueError(f"{n} sources are more sessions than a map keeps ({self.precision.shape[0]})")
        offsets = offsets.to(self.weighted)
        self.session.fill_(n - 1)
        self.precision.zero_()
        self.weighted.zero_()
        self.precision[1:n] = self.HELD_PRECISION
        self.weighted[1:n] = self.HELD_PRECISION * offsets[1:]
        self.applied.copy_(offsets[n - 1])

    def offsets(self) -> torch.Tensor:
        """(S, P) posterior mean offsets of the sessions so far (the reference's 0 first)."""
        n = int(self.session) + 1
        return torch.where(self.precision[:n] > 0, self.weighted[:n] / self.precision[:n].clamp_min(1e-300),
                           torch.zeros_like(self.weighted[:n]))

    def level(self) -> torch.Tensor:
        """(P,) the sessions' median offset to the reference: what a map predicts is shifted to it, the level of
        a typical session (0 while there is one session). The median, not the mean: with a few sessions, one
        miscalibrated sensor must not move the map off the level that the others agree on (four Solin sessions,
        one read 5 uT off: the mean put the map 1.4 uT off the other three and the held-out fifth)."""
        return torch.quantile(self.offsets(), 0.5, dim=0)

    def spread(self) -> torch.Tensor:
        """(P,) mean square of the session offsets about :meth:`level`: what a reading of a session not seen
        yet adds to its predictive variance (0 while there is one session)."""
        means = self.offsets()
        return ((means - self.level()) ** 2).mean(0)


def check_records(records: dict, output_dims: int) -> dict[str, torch.Tensor]:
    """``records`` (:meth:`PrequentialCalibration.records_summary`, e.g. read from a summary) checked: every
    field present, (N, P) with P = ``output_dims``, the values float64, finite and not negative, ``filled``
    boolean. Returns them as float64 / bool tensors; raises ValueError saying what is wrong."""
    out = {}
    n = None
    for k in RECORD_FIELDS + ("filled",):
        if k not in records:
            raise ValueError(f"calibration records lack {k!r}")
        t = torch.as_tensor(records[k])
        if t.dim() != 2 or t.shape[1] != output_dims or (n is not None and t.shape[0] != n):
            raise ValueError(f"calibration records' {k!r} has shape {tuple(t.shape)}, expected (N, {output_dims}) "
                             "like the others")
        n = t.shape[0]
        if k == "filled":
            if t.dtype != torch.bool:
                raise ValueError(f"calibration records' 'filled' is {t.dtype}, expected torch.bool")
        elif not t.is_floating_point() or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ValueError(f"calibration records' {k!r} must be finite numbers, none negative")
        out[k] = t if k == "filled" else t.to(torch.float64)
    return out


def rotated_records(records: dict[str, torch.Tensor], rotation: torch.Tensor) -> dict[str, torch.Tensor]:
    """Records of a vector map (P = 3) seen in a frame whose field is ``rotation`` (3, 3) times the source's: each
    channel's values become sum_j R_dj^2 of the source's channels' (as a merge moves a source's variances;
    cross-channel terms are dropped), on the rows that have all three channels. Other maps' records, and an
    identity rotation, come back as they are."""
    rotation = torch.as_tensor(rotation, dtype=torch.float64)
    if records["err2"].shape[1] != 3 or torch.allclose(rotation, torch.eye(3, dtype=torch.float64)):
        return records
    rows = records["filled"].all(1)
    r2 = rotation ** 2
    out = {k: records[k][rows] @ r2.T for k in RECORD_FIELDS}
    out["filled"] = records["filled"][rows]
    return out
