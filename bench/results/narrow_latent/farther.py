"""Imported by patch.py with $FARTHER set: the calibration's widening of the latent variance may grow with how
little the map knows: a reading's latent part (a0 + a1 r) v with r = v / prior (the map's no-data latent variance
now, clamped to [0, 1]), a0 >= 1 and a1 >= 0, fitted with tau^2, b and c by the same likelihood (the shipped fit's
optimum, a1 = 0, is the start). It never narrows the latent variance; it lets records made far from data (new
ground) widen far from data without widening near it. |B| recordings only (one output). A record of a run, not
package code."""
import torch

import gp_mapping.gp.calibration as K

PC = K.PrequentialCalibration
_fit = PC._fit.__func__
_refit = PC.refit
_reading_variance = PC.reading_variance


def fit(cls, e2, v, s, g, unit, floor=0.0):
    a, t, b, c, _ = _fit(cls, e2, v, s, g, unit, floor)
    key = "reported" if bool((g > 0).any()) else "exact"
    prior = getattr(PC, "prior_now", None)
    PC.far_now[key] = 0.0
    if prior is None:
        return _fit(cls, e2, v, s, g, unit, floor)
    r = (v / prior).clamp(0.0, 1.0)
    learned, part = PC._noise_parts(s, floor)
    has_slope, has_floor = bool((g > 0).any()), bool((part > 0).any())
    names = ["a0", "t", "b", "c", "a1"]
    theta = torch.tensor([a, t, max(b, K.POSITION_BOUNDS[0]), c, 0.0], dtype=e2.dtype)
    lo = torch.tensor([K.SCALE_BOUNDS[0], K.EXTRA_BOUNDS[0] * unit, K.POSITION_BOUNDS[0], K.NOISE_BOUNDS[0], 0.0],
                      dtype=e2.dtype)
    hi = torch.tensor([K.SCALE_BOUNDS[1], K.EXTRA_BOUNDS[1] * unit, K.POSITION_BOUNDS[1], K.NOISE_BOUNDS[1], 1000.0],
                      dtype=e2.dtype)
    parts = torch.stack([v, torch.ones_like(v), g, part, v * r])
    free = torch.tensor([True, True, has_slope, has_floor, True])
    fixed = learned + theta[~free] @ parts[~free]
    theta[free] = PC._newton(theta[free], lo[free], hi[free], parts[free], fixed, e2)
    a0, t, b, c, a1 = (float(x) for x in theta)
    b = 0.0 if b <= K.POSITION_BOUNDS[0] * (1 + 1e-9) else b
    z2 = e2 / (a0 * v + a1 * v * r + learned + c * part + b * g + t)
    w = max(1.0, float(torch.quantile(z2, K.COVERED)) / K.COVERED_Z ** 2)
    PC.far_now[key] = a1
    del names
    return a0, t, b, c, w


def refit(self, target_var, prior_var, force=False, shared_var=None):
    before = int(self.fitted_at)
    PC.prior_now, PC.far_now = float(prior_var.flatten()[0]), {}
    _refit(self, target_var, prior_var, force, shared_var)
    if int(self.fitted_at) != before or force:
        self.far = dict(PC.far_now)
        self.far.setdefault("reported", self.far.get("exact", 0.0))
        self.prior_now = PC.prior_now


def reading_variance(self, latent_var, noise_var, slope2=None, full_floor=False):
    a1 = getattr(self, "far", {}).get("exact" if slope2 is None else "reported", 0.0)
    if a1 > 0.0:
        a0 = self.scale if slope2 is None else self.reported_scale
        r = (latent_var / self.prior_now).clamp(0.0, 1.0)
        latent_var = latent_var * (1.0 + a1 * r / a0)  # a0 times it: (a0 + a1 r) v
    return _reading_variance(self, latent_var, noise_var, slope2, full_floor)


PC._fit = classmethod(fit)
PC.refit = refit
PC.reading_variance = reading_variance
