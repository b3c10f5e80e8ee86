"""Prequential calibration of a reading's predictive variance.

Why: the marginal likelihood (and the ELBO that bounds it) treats the readings of one pass as independent
given the field. They are not: pose error, a heading-dependent sensor error and slow drifts are smooth along a
pass and the same for its neighbouring readings, so the likelihood explains them as field detail and learns a
noise variance of the sensor alone. A new pass over the same ground then misses the map by far more than its
predictive standard deviation says (on the OptiTrack hold-out, 38 % of held-out readings within +-2 SD).

What: every update first predicts its batch from the map *before* conditioning on it. Those predictions are
out of sample (Dawid's prequential principle, 1984): they score the model exactly as a user will, on data it
has not seen, and they cost one prediction per batch. Readings close to the track just driven (within
``calibration_radius`` of the last ``calibration_history`` inputs) are left out: they are predicted from the
same pass, whose errors they share, and would teach the continuation's confidence, not a revisit's. From the
rest, a bounded store keeps (squared error, latent variance, noise variance) per output, and a two-parameter
variance model of a reading

    s^2 = a * v_latent + sigma_noise^2 + tau^2

is fitted by maximum likelihood (a: how far the latent variance is off; tau^2: the error a new pass adds that
no part of the model sees). It is refitted after every update (a grid search, refined once: two parameters,
a few thousand records) and only after ``CALIBRATION_MIN_RECORDS`` records; until then a = 1, tau^2 = 0, the
model as it is. The same idea is conformal/recalibration of regression uncertainty (Kuleshov et al. 2018,
"Accurate uncertainties for deep learning using calibrated regression"), here with a parametric variance
model, fitted online on prequential residuals instead of a held-out set.

Everything is kept in the targets' own units, so a rescaling of the engine's standardisation leaves it valid.
This module is ROS-free and knows nothing of any engine: :class:`~gp_mapping.gp.base.Engine` owns one.
"""
from __future__ import annotations

import math

import torch
from torch import nn

#: records needed before the calibration replaces the raw variance (a few seconds of revisits)
CALIBRATION_MIN_RECORDS = 200
#: bounds of the latent-variance factor a and of tau^2 relative to the targets' variance
SCALE_BOUNDS = (0.1, 1000.0)
EXTRA_BOUNDS = (1e-8, 10.0)


class PrequentialCalibration(nn.Module):
    """Records out-of-sample residuals and fits (a, tau^2) per output; see the module docstring."""

    def __init__(self, input_dims: int, output_dims: int, records: int, history: int, radius: float) -> None:
        super().__init__()
        self.records = int(records)
        self.history = int(history)
        self.radius = float(radius)
        f64 = {"dtype": torch.float64}
        # Ring of the most recent conditioned inputs (the track just driven) and how many it holds.
        self.register_buffer("recent_x", torch.zeros(self.history, input_dims, **f64))
        self.register_buffer("recent_count", torch.zeros((), dtype=torch.int64))
        # Ring of records, per output: squared error, latent variance, noise variance (targets' units), and
        # whether the entry is filled (a vector output can miss a channel).
        self.register_buffer("err2", torch.zeros(self.records, output_dims, **f64))
        self.register_buffer("latent_var", torch.zeros(self.records, output_dims, **f64))
        self.register_buffer("noise_var", torch.zeros(self.records, output_dims, **f64))
        self.register_buffer("filled", torch.zeros(self.records, output_dims, dtype=torch.bool))
        self.register_buffer("record_count", torch.zeros((), dtype=torch.int64))
        # The fitted model: s^2 = scale * v + noise + extra (extra in the targets' squared units).
        self.register_buffer("scale", torch.ones(output_dims, **f64))
        self.register_buffer("extra", torch.zeros(output_dims, **f64))

    @property
    def active(self) -> bool:
        return self.records > 0

    def away_from_track(self, x: torch.Tensor) -> torch.Tensor:
        """(N,) bool: inputs farther than the radius from every recent input (a revisit or new ground)."""
        n = min(int(self.recent_count), self.history)
        if n == 0:
            return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        nearest = torch.cdist(x, self.recent_x[:n]).min(dim=1).values
        return nearest > self.radius

    def remember_inputs(self, x: torch.Tensor) -> None:
        """Push a conditioned batch's inputs into the ring of recent inputs."""
        x = x[-self.history:]
        start = int(self.recent_count) % self.history
        idx = (torch.arange(x.shape[0], device=x.device) + start) % self.history
        self.recent_x[idx] = x.to(self.recent_x.dtype)
        self.recent_count += x.shape[0]

    def record(self, err: torch.Tensor, latent_var: torch.Tensor, noise_var: torch.Tensor,
               observed: torch.Tensor) -> None:
        """Store (N, P) out-of-sample errors with their predicted variances; ``observed`` (N, P) masks channels."""
        if err.shape[0] == 0:
            return
        err, latent_var, noise_var, observed = (t[-self.records:] for t in (err, latent_var, noise_var, observed))
        start = int(self.record_count) % self.records
        idx = (torch.arange(err.shape[0], device=err.device) + start) % self.records
        self.err2[idx] = (err * err).to(self.err2.dtype)
        self.latent_var[idx] = latent_var.to(self.err2.dtype)
        self.noise_var[idx] = noise_var.to(self.err2.dtype)
        self.filled[idx] = observed
        self.record_count += err.shape[0]

    def refit(self, target_var: torch.Tensor) -> None:
        """Maximum-likelihood (a, tau^2) per output from the stored records; ``target_var`` (P,) sets the
        scale of the tau^2 grid. Outputs with fewer than CALIBRATION_MIN_RECORDS records stay uncalibrated."""
        for p in range(self.err2.shape[1]):
            keep = self.filled[:, p]
            if int(keep.sum()) < CALIBRATION_MIN_RECORDS:
                self.scale[p], self.extra[p] = 1.0, 0.0
                continue
            e2, v, s = self.err2[keep, p], self.latent_var[keep, p], self.noise_var[keep, p]
            unit = max(float(target_var[p]), 1e-12)
            log_a = torch.linspace(math.log(SCALE_BOUNDS[0]), math.log(SCALE_BOUNDS[1]), 25, dtype=e2.dtype,
                                   device=e2.device)
            log_t = torch.linspace(math.log(EXTRA_BOUNDS[0] * unit), math.log(EXTRA_BOUNDS[1] * unit), 25,
                                   dtype=e2.dtype, device=e2.device)
            for _ in range(3):  # coarse grid, then twice a finer one around the best cell
                best_a, best_t = self._best(e2, v, s, log_a, log_t)
                step_a, step_t = float(log_a[1] - log_a[0]), float(log_t[1] - log_t[0])
                log_a = torch.linspace(best_a - step_a, best_a + step_a, 9, dtype=e2.dtype, device=e2.device)
                log_t = torch.linspace(best_t - step_t, best_t + step_t, 9, dtype=e2.dtype, device=e2.device)
            self.scale[p] = math.exp(best_a)
            self.extra[p] = math.exp(best_t)

    @staticmethod
    def _best(e2, v, s, log_a, log_t) -> tuple[float, float]:
        """The grid cell (log a, log tau^2) of the smallest Gaussian negative log likelihood."""
        a = log_a.exp()[:, None, None]
        t = log_t.exp()[None, :, None]
        total = a * v[None, None, :] + s[None, None, :] + t
        nll = (total.log() + e2[None, None, :] / total).mean(-1)
        i = int(torch.argmin(nll))
        return float(log_a[i // log_t.shape[0]]), float(log_t[i % log_t.shape[0]])

    def reading_variance(self, latent_var: torch.Tensor, noise_var: torch.Tensor) -> torch.Tensor:
        """s^2 (N, P) of a reading from the latent and noise variances (targets' units)."""
        return self.scale * latent_var + noise_var + self.extra

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A state saved before calibration existed has none of these buffers: the map loads uncalibrated and
        # calibrates from its next batches on. A state saved with other store sizes brings its own shapes.
        for name, buf in list(self._buffers.items()):
            key = prefix + name
            if key in state_dict and state_dict[key].shape != buf.shape:
                self._buffers[name] = torch.zeros(state_dict[key].shape, dtype=buf.dtype, device=buf.device)
        before = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not any(key.startswith(prefix) for key in state_dict):
            del missing_keys[before:]
        self.history = self.recent_x.shape[0]
        self.records = self.err2.shape[0]
