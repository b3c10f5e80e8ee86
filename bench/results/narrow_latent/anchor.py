"""Imported by patch.py with $ANCHOR set: PrequentialCalibration may narrow the latent variance (a < 1) near data
only. A reading's latent part is a v + (1 - a) v r with r = v / prior (the map's no-data latent variance now,
clamped to [0, 1]), so far from data the map states its prior variance whatever a is. A refit fits a >= 1 (the
shipped fit) and this form with a in [0.1, 1], and keeps the one of the larger likelihood. |B| recordings only
(one output). A record of a run (docs/calibration.md, Tried: narrowing the latent variance), not package code."""
import gp_mapping.gp.calibration as K

PC = K.PrequentialCalibration
_fit = PC._fit.__func__
_refit = PC.refit
_reading_variance = PC.reading_variance


def _fit_between(cls, low, high, *args):
    """The shipped fit with a in [low, high]."""
    kept = K.SCALE_BOUNDS
    K.SCALE_BOUNDS = (low, high)
    try:
        return _fit(cls, *args)
    finally:
        K.SCALE_BOUNDS = kept


def _nll(e2, total) -> float:
    return float((total.log() + e2 / total).mean())


def fit(cls, e2, v, s, g, unit, floor=0.0):
    plain = _fit_between(cls, 1.0, 1000.0, e2, v, s, g, unit, floor)
    prior = getattr(PC, "prior_now", None)
    key = "reported" if bool((g > 0).any()) else "exact"
    PC.anchored_now[key] = False
    if prior is None:
        return plain
    r = (v / prior).clamp(0.0, 1.0)
    # a v (1 - r) + v r: a multiplies v (1 - r), and v r joins the noise the engine learned above its floor
    near = _fit_between(cls, 0.1, 1.0, e2, v * (1 - r), s + v * r, g, unit, floor)

    def total(f, anchored):
        a, t, b, c, w = f
        learned, part = PC._noise_parts(s, floor)
        latent = a * v * (1 - r) + v * r if anchored else a * v
        return w * (latent + learned + c * part + b * g + t)

    if near[0] < 1.0 and _nll(e2, total(near, True)) < _nll(e2, total(plain, False)):
        PC.anchored_now[key] = True
        return near
    return plain


def refit(self, target_var, prior_var, force=False, shared_var=None):
    before = int(self.fitted_at)
    PC.prior_now, PC.anchored_now = float(prior_var.flatten()[0]), {}
    _refit(self, target_var, prior_var, force, shared_var)
    if int(self.fitted_at) != before or force:
        self.anchored = dict(PC.anchored_now)
        self.anchored.setdefault("reported", self.anchored.get("exact", False))
        self.prior_now = PC.prior_now


def reading_variance(self, latent_var, noise_var, slope2=None, full_floor=False):
    if getattr(self, "anchored", {}).get("exact" if slope2 is None else "reported"):
        a = self.scale if slope2 is None else self.reported_scale
        r = (latent_var / self.prior_now).clamp(0.0, 1.0)
        latent_var = latent_var * (1 - r) + latent_var * r / a  # a times it: a v (1 - r) + v r
    return _reading_variance(self, latent_var, noise_var, slope2, full_floor)


PC._fit = classmethod(fit)
PC.refit = refit
PC.reading_variance = reading_variance
