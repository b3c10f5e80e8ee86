"""How much error a pass shares, from what its revisits say: a method-of-moments bound on model.time_error's e.

Within one pass, an error shared along the pass (a track's pose error, an attitude error, a drift) and the field's
detail along the path look alike: both are smooth in the reading's time. A model that learns e(t) beside the field
from passes alone can therefore put field detail into e, and does: on a simulated world with white sensor noise
alone it learned a shared error four times the sensor's noise (docs/calibration.md, Both errors of a walk
together). What tells them apart is a revisit. Two readings at the same place, taken on different passes, differ
by the white noise of both and by both passes' shared errors, which are independent across passes; two
consecutive readings of one pass differ by white noise alone (e barely moves in a sample's time). So

    e's variance ~= nugget across passes - white noise within a pass,

with the nugget across passes the intercept at distance 0 of half the squared difference of readings taken on
different passes (more than ``min_gap`` seconds apart) at most ``radius`` apart, regressed on their squared
distance (the field's slope adds a term in d^2: Matheron's semivariogram near the origin, its nugget Cressie 1993,
"Statistics for spatial data", 2.3), and the white noise from second differences of consecutive readings (a linear
trend of the field along the path cancels; von Neumann et al. 1941 for first differences, which the field's slope
biases), taken as the median of each batch for robustness to an odd reading.

Measured on every recording of the calibration bench (the whole stream; docs/calibration.md): the simulated worlds
with white noise alone give 0 (nugget 0.23-0.25 uT^2 against white 0.25-0.28), the corridor with a shared track
error 0.76 uT^2, Solin protocols 1 and 2 1.6 and 2.4 uT^2. The engine caps e's learned variance at this estimate
once revisits give it. Before, nothing bounds e: held at 0 then, the white noise took e's variance in on the first
pass and kept it after (0.44 uT^2 learned for 0.04 beside e's 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: readings at most this far apart [m] count as taken at the same place (the d^2 regression absorbs the field's
#: slope within it; farther pairs would bring its curvature in)
RADIUS = 0.15
#: readings further apart in time than this [s] count as taken on different passes (many of e's timescales)
MIN_GAP = 30.0
#: consecutive readings further apart than this [s] are not of one pass (a pause, a gap between batches)
MAX_STEP = 1.0
#: pairs across passes and batches with a white-noise estimate before the estimate is trusted
MIN_PAIRS = 50
MIN_BATCHES = 3
#: the median of a chi-square variable with one degree of freedom (robust mean of a squared normal)
_CHI2_MEDIAN = 0.454936
#: var(y_i - (y_{i-1} + y_{i+1}) / 2) = 1.5 sigma^2 for white noise sigma^2
_SECOND_DIFFERENCE_GAIN = 1.5


class RevisitNugget(nn.Module):
    """Running moments of readings' disagreement across passes and within a pass, per output (P of them), in the
    targets' units: :meth:`observe` folds in a batch and the readings it can be compared with, and
    :meth:`shared_variance` returns the estimate of e's variance (inf, no bound, until revisits give it)."""

    def __init__(self, num_outputs: int) -> None:
        super().__init__()
        f64 = {"dtype": torch.float64}
        # sums of the across-pass regression g = c0 + c1 d^2: [count, sum d^2, sum d^4, sum g, sum g d^2] per output
        self.register_buffer("pair_sums", torch.zeros(5, num_outputs, **f64))
        # sum of each batch's within-pass white-noise estimate, and how many batches gave one
        self.register_buffer("white_sum", torch.zeros(num_outputs, **f64))
        self.register_buffer("white_batches", torch.tensor(0.0, **f64))

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, x_held: torch.Tensor, y_held: torch.Tensor,
                t_held: torch.Tensor) -> None:
        """Fold in a batch x (N, D), y (N, P), t (N,) [s] in time order, and the readings held before it (x_held,
        y_held, t_held), which pairs across passes are drawn from (a stamp of NaN pairs with nothing)."""
        self._observe_pass(y, t)
        if x.shape[0] == 0 or x_held.shape[0] == 0:
            return
        d2 = torch.cdist(x, x_held) ** 2  # (N, H)
        gap = (t[:, None] - t_held[None, :]).abs()
        i, j = torch.nonzero((d2 <= RADIUS ** 2) & (gap > MIN_GAP), as_tuple=True)  # NaN gaps compare False
        if i.numel() == 0:
            return
        d2 = d2[i, j][:, None]  # (K, 1)
        g = 0.5 * (y[i] - y_held[j]) ** 2  # (K, P)
        ones = torch.ones_like(g)
        self.pair_sums += torch.stack([ones.sum(0), (d2 * ones).sum(0), (d2 ** 2 * ones).sum(0), g.sum(0),
                                       (g * d2).sum(0)])

    def _observe_pass(self, y: torch.Tensor, t: torch.Tensor) -> None:
        if y.shape[0] < 3:
            return
        step = t[1:] - t[:-1]
        one_pass = (step[:-1].abs() <= MAX_STEP) & (step[1:].abs() <= MAX_STEP)
        if not bool(one_pass.any()):
            return
        second = y[1:-1] - 0.5 * (y[:-2] + y[2:])
        squared = second[one_pass] ** 2
        self.white_sum += squared.median(0).values / _CHI2_MEDIAN / _SECOND_DIFFERENCE_GAIN
        self.white_batches += 1.0

    def moments(self) -> Moments:
        """The running sums, for pooling several estimators' evidence (a tiled map's tiles)."""
        return Moments(self.pair_sums.detach(), self.white_sum.detach(), self.white_batches.detach())

    def shared_variance(self, elsewhere: Moments | None = None) -> torch.Tensor:
        """(P,) the estimate of e's variance, >= 0, from this estimator's sums and ``elsewhere``'s (the same error
        measured on other ground: the other tiles of a map). inf until MIN_PAIRS pairs across passes and
        MIN_BATCHES within-pass estimates are in (no revisit: nothing tells e from the field yet)."""
        total = self.moments() if elsewhere is None else self.moments() + elsewhere
        return total.shared_variance()


@dataclass(frozen=True)
class Moments:
    """The sums of :class:`RevisitNugget` (its buffers); they add."""

    pair_sums: torch.Tensor  # (5, P)
    white_sum: torch.Tensor  # (P,)
    white_batches: torch.Tensor  # ()

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.pair_sums + other.pair_sums, self.white_sum + other.white_sum,
                       self.white_batches + other.white_batches)

    def white_variance(self) -> torch.Tensor:
        """(P,) the white noise within a pass (0 before a batch gave an estimate)."""
        return self.white_sum / self.white_batches.clamp_min(1.0)

    def nugget(self) -> torch.Tensor | None:
        """(P,) the across-pass intercept, or None before MIN_PAIRS pairs (or when their distances do not vary)."""
        n, s1, s2, g0, g1 = self.pair_sums
        det = n * s2 - s1 ** 2
        if float(n.min()) < MIN_PAIRS or not bool((det > 1e-12 * n * n).all()):
            return None
        return (s2 * g0 - s1 * g1) / det

    def shared_variance(self) -> torch.Tensor:
        """(P,) nugget less white noise, >= 0; inf before there is evidence (RevisitNugget.shared_variance)."""
        nugget = self.nugget()
        if nugget is None or float(self.white_batches) < MIN_BATCHES:
            return torch.full_like(self.white_sum, float("inf"))
        return (nugget - self.white_variance()).clamp_min(0.0)


__all__ = ["Moments", "RevisitNugget"]
