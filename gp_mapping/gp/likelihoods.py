"""Observation models p(y | f) for P independent outputs, with what the dual (BLR) updates need.

For each likelihood:
  * ``expected_log_lik(y, mu, var)``: e(mu, var) = E_{N(f|mu,var)}[log p(y|f)], closed form for the Gaussian,
    Gauss-Hermite quadrature otherwise;
  * ``dual_sites(y, mu, var)``: the site natural parameters (lambda1, lambda2) = (beta*ytilde, beta) of the
    dual form, from the gradients of e: lambda2 = -2 de/dvar and lambda1 = de/dmu - 2 (de/dvar) mu, with
    de/dvar clamped to <= -1e-8 so that every site has positive precision (non-log-concave likelihoods such as
    the Student-t can have positive curvature);
  * ``log_predictive_density(y, mu, var)``: log integral p(y|f) N(f|mu, var) df (for NLPD).

All tensors are (N, P); per-output likelihood parameters are (P,).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from .kernels import PositiveParameter

# The largest allowed de/dvar: every site keeps a precision of at least 2e-8.
CURVATURE_CLAMP = -1e-8
# Latent variances below this are treated as this (sqrt(var) has an infinite derivative at 0).
VAR_FLOOR = 1e-12


class Likelihood(nn.Module):
    """p(y|f) for ``num_outputs`` independent outputs; the generic paths use Gauss-Hermite quadrature."""

    #: whether targets are standardised (running mean/std of the data seen) before they reach the likelihood
    standardise_targets: bool = True
    #: whether :meth:`dual_sites` ignores q (a conjugate likelihood: one undamped step is the exact fixed point)
    conjugate: bool = False

    def __init__(self, num_outputs: int, quadrature_points: int = 20) -> None:
        super().__init__()
        self.num_outputs = int(num_outputs)
        nodes, weights = np.polynomial.hermite.hermgauss(int(quadrature_points))
        self.register_buffer("gh_nodes", torch.as_tensor(nodes, dtype=torch.float64), persistent=False)
        self.register_buffer("gh_log_weights", torch.as_tensor(np.log(weights) - 0.5 * math.log(math.pi),
                                                                 dtype=torch.float64), persistent=False)

    def validate_targets(self, y: torch.Tensor) -> str | None:
        """None when the targets are valid for this likelihood, else a message saying what is wrong."""
        return None

    def initialise_noise(self, variance: torch.Tensor) -> None:
        """Start the noise scale (P,) at a data-based estimate (standardised units). No-op without one."""

    def take_reading_noise(self, variance: torch.Tensor) -> None:
        """Make a reading's whole noise variance (P,; standardised) what another map of the same readings stated,
        as a merged map takes its sources' (gp/merging). Without parts to split it into, :meth:`initialise_noise`."""
        self.initialise_noise(variance)

    def rescale_targets(self, factor: torch.Tensor) -> None:
        """The targets' unit changes so that y_new = factor * y_old + c (per output): re-express the noise
        exactly (its scale is the sensor's, which data at rest measure well). No-op without a noise scale."""

    def log_prob(self, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """log p(y|f) elementwise; y and f are (N, P) or (N, P, S) with S quadrature points."""
        raise NotImplementedError

    def _per_output(self, param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        # (P,) -> (P, 1, ..., 1) so that it broadcasts over (N, P, ...) tensors.
        return param.reshape((-1,) + (1,) * (like.dim() - 2))

    def _quadrature_points(self, mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        std = torch.sqrt(2.0 * var.clamp_min(VAR_FLOOR))
        return mu[..., None] + std[..., None] * self.gh_nodes

    def expected_log_lik(self, y: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        logp = self.log_prob(y[..., None], self._quadrature_points(mu, var))
        return (logp * torch.exp(self.gh_log_weights)).sum(-1)

    def log_predictive_density(self, y: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        logp = self.log_prob(y[..., None], self._quadrature_points(mu, var))
        return torch.logsumexp(logp + self.gh_log_weights, dim=-1)

    def dual_sites(self, y: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lambda1, lambda2) = (beta*ytilde, beta) at q(f) = N(mu, var), by autograd of e(mu, var)."""
        with torch.enable_grad():
            mu_ = mu.detach().clone().requires_grad_(True)
            var_ = var.detach().clamp_min(VAR_FLOOR).requires_grad_(True)
            e = self.expected_log_lik(y, mu_, var_).sum()
            g_m, g_v = torch.autograd.grad(e, (mu_, var_))
        g_v = g_v.clamp_max(CURVATURE_CLAMP)
        lam2 = -2.0 * g_v
        lam1 = g_m + lam2 * mu_.detach()
        return lam1.detach(), lam2.detach()


class _CorrelatedGaussianTerm(torch.autograd.Function):
    """GaussianLikelihood.correlated_expected_log_lik with its gradient written out. Autograd through the Cholesky
    factor and two triangular solves of N columns made a hyperparameter step ten times the white-noise engine's
    on batches of 1500 readings (Solin protocol 1 in six batches); by hand it is Sigma^{-1} and two products:
        dl/dr = -Sigma^{-1} r,  dl/dcov = -Sigma^{-1} / 2,
        dl/dSigma = -(Sigma^{-1} - a a^T - Sigma^{-1} cov Sigma^{-1}) / 2,  a = Sigma^{-1} r."""

    @staticmethod
    def forward(ctx, residual, cov, sigma, chol, sigma_inv):  # (P, N, 1), then (P, N, N) each
        if sigma_inv is None:
            sigma_inv = torch.cholesky_inverse(chol)
        alpha = torch.cholesky_solve(residual, chol)  # Sigma^{-1} r
        log_det = 2.0 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum()
        ctx.save_for_backward(sigma_inv, alpha, cov)
        return -0.5 * (residual.numel() * math.log(2 * math.pi) + log_det + (residual * alpha).sum()
                       + (sigma_inv * cov).sum())

    @staticmethod
    def backward(ctx, grad):
        sigma_inv, alpha, cov = ctx.saved_tensors
        g_residual = -grad * alpha if ctx.needs_input_grad[0] else None
        g_cov = -0.5 * grad * sigma_inv if ctx.needs_input_grad[1] else None
        g_sigma = None
        if ctx.needs_input_grad[2]:
            g_sigma = -0.5 * grad * (sigma_inv - alpha @ alpha.transpose(-1, -2) - sigma_inv @ cov @ sigma_inv)
        return g_residual, g_cov, g_sigma, None, None


class GaussianLikelihood(Likelihood):
    """y = f + eps, eps ~ N(0, sigma_p^2), one learned noise variance per output. Everything in closed form.

    ``noise_floor`` (targets' units, a variance): sigma_p^2 = floor + a learned part, so no reading is taken as
    more exact than the sensor can be. The learned part is in standardised units; the floor is brought to them
    with the owning engine's target scale at each use (:meth:`measure_with`), so a change of scale never
    moves it. Why: the likelihood treats a pass's readings as independent, and a dense hand-held track whose
    readings share their pose and sensor errors learns a noise of 0.0035 uT^2 (OptiTrack |B|); the map then
    interpolates those errors as field detail, maps 10 cm off the track at 0.63 uT and states a fifth of that
    (docs/calibration.md, "Noise floor")."""

    conjugate = True

    def __init__(self, num_outputs: int, noise_variance: float = 0.01, noise_floor: float = 0.0,
                 time_error: tuple[float, float] | None = None, **kw) -> None:
        super().__init__(num_outputs, **kw)
        self.noise_param = PositiveParameter(noise_variance, (self.num_outputs,))
        self.noise_floor = float(noise_floor)
        if time_error is not None:  # (initial variance [standardised], initial timescale [s]): TimeError
            self.time_error = TimeError(num_outputs, *time_error)
        object.__setattr__(self, "_scale_owner", None)  # a plain reference, not a submodule (no cycle in the tree)

    def measure_with(self, owner: nn.Module) -> None:
        """Take the floor to standardised units with ``owner.y_std`` (P,), read at each use."""
        object.__setattr__(self, "_scale_owner", owner)

    def _floor(self) -> torch.Tensor | float:
        owner = self._scale_owner
        if self.noise_floor <= 0.0 or owner is None:
            return 0.0
        return self.noise_floor / owner.y_std.detach() ** 2

    @property
    def white_variance(self) -> torch.Tensor:
        """The variance (P,) of the error that is a reading's own: the floor plus the learned part."""
        return self.noise_param.value + self._floor()

    @property
    def noise_variance(self) -> torch.Tensor:
        """The variance (P,) of one reading's error as that reading alone sees it: its own (white) error and, with
        a time error, the error it shares with its neighbours in time (whose variance adds to each reading's)."""
        error = getattr(self, "time_error", None)
        return self.white_variance if error is None else self.white_variance + error.variance

    def initialise_noise(self, variance: torch.Tensor) -> None:
        # ``variance`` estimates the whole noise: the learned part starts at what the floor leaves of it (a
        # learned part started at the whole estimate stayed above it: sim_revisit learned 0.32 for 0.25 uT^2).
        # With a time error the estimate (from successive differences) is of the white part: e(t) cancels there.
        variance = torch.as_tensor(variance, dtype=torch.float64)
        self.noise_param.set(torch.clamp(variance - self._floor(), min=1e-3 * variance))

    def take_reading_noise(self, variance: torch.Tensor) -> None:
        # ``variance`` is the whole: white noise plus, with a time error, e's variance. e starts where a new map's
        # does but takes no more than the whole leaves above the floor, and the white noise is the rest (the
        # other map's own split is not known). Taken as the white noise beside a new e, the whole was counted
        # twice: a merged Solin room covered 1.000 of a held-out sequence, z-std 0.32.
        variance = torch.as_tensor(variance, dtype=torch.float64)
        error = getattr(self, "time_error", None)
        if error is not None:
            above_floor = (variance - self._floor()).clamp_min(0.0)
            error.variance_param.set(torch.minimum(error.variance_param.value.detach(), above_floor).clamp_min(1e-12))
            variance = variance - error.variance_param.value.detach()
        self.initialise_noise(variance)

    def rescale_targets(self, factor: torch.Tensor) -> None:
        # only the learned parts: the floor is the same in the targets' units whatever their scale
        self.noise_param.set(self.noise_param.value.detach() * factor ** 2)
        if hasattr(self, "time_error"):
            error = self.time_error
            error.variance_param.set(error.variance_param.value.detach() * factor ** 2)
            error.variance_cap.mul_(factor ** 2)

    def correlated_covariance(self, t: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """(P, N, N) covariance of the errors of readings at the times ``t`` (N,) [s]: the white noise (plus each
        reading's ``extra`` (N, P)) on the diagonal and e(t)'s covariance."""
        white = self.white_variance[:, None].expand(-1, t.shape[0])  # (P, N)
        if extra is not None:
            white = white + extra.T
        return self.time_error.covariance(t) + torch.diag_embed(white)

    @staticmethod
    def correlated_expected_log_lik(y: torch.Tensor, mu: torch.Tensor, cov: torch.Tensor, sigma: torch.Tensor,
                                    chol: torch.Tensor, sigma_inv: torch.Tensor | None = None) -> torch.Tensor:
        """E_q[log N(y | f, Sigma_p)] summed over readings and outputs, for readings whose errors are correlated in
        time: ``sigma`` (P, N, N) is their error covariance (:meth:`correlated_covariance`, differentiated) and
        ``chol`` its Cholesky factor (factorised by the caller with jittered_cholesky, which also needs it; a
        constant here), and ``sigma_inv`` its inverse where the caller has it. q(f) has mean ``mu`` (N, P) and
        covariance ``cov`` (P, N, N). Per output:
            -1/2 [N log 2 pi + log|Sigma| + r^T Sigma^{-1} r + tr(Sigma^{-1} cov)],  r = y - mu."""
        residual = (y - mu).T[..., None]  # (P, N, 1)
        return _CorrelatedGaussianTerm.apply(residual, cov, sigma, chol, sigma_inv)

    def log_prob(self, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        s2 = self._per_output(self.noise_variance, f)
        return -0.5 * (math.log(2 * math.pi) + torch.log(s2) + (y - f) ** 2 / s2)

    def expected_log_lik(self, y, mu, var, extra=None):
        """``extra`` (N, P), optional: each reading's own noise variance on top of the learned one (a noisy
        input's, dual_svgp's position_noise)."""
        s2 = self.noise_variance if extra is None else self.noise_variance + extra
        return -0.5 * (math.log(2 * math.pi) + torch.log(s2) + ((y - mu) ** 2 + var) / s2)

    def log_predictive_density(self, y, mu, var):
        v = var.clamp_min(0.0) + self.noise_variance
        return -0.5 * (math.log(2 * math.pi) + torch.log(v) + (y - mu) ** 2 / v)

    def dual_sites(self, y, mu, var):
        # beta = 1/sigma^2 and ytilde = y, whatever q is: the conjugate (exact) sites.
        beta = (1.0 / self.noise_variance).detach().expand_as(y)
        return (y * beta).detach(), beta.clone()


class TimeError(nn.Module):
    """An error that neighbouring readings share, e(t): per output a zero-mean Ornstein-Uhlenbeck process in the
    reading's time, cov(e(t), e(t')) = variance exp(-|t - t'| / timescale), both learned (docs/calibration.md,
    "Errors that neighbouring readings share"). A track's pose error, an attitude error read through a 3-D field,
    a sensor's drift: each reading of a pass carries it, so a white-noise model explains it as field detail and
    learns lengthscales that do not carry to the next pass."""

    def __init__(self, num_outputs: int, variance: float, timescale: float) -> None:
        super().__init__()
        self.variance_param = PositiveParameter(variance, (num_outputs,))
        self.timescale_param = PositiveParameter(timescale, (num_outputs,))
        # the most variance that revisits show (gp/revisits.py; set by the engine at each update, inf until they
        # show it): above it the learned value is field detail along a pass. The parameter itself is kept, so e
        # follows when the bound rises, and a step's gradient reaches it only while it is below the bound.
        self.register_buffer("variance_cap", torch.full((num_outputs,), float("inf"), dtype=torch.float64))

    @property
    def variance(self) -> torch.Tensor:
        return torch.minimum(self.variance_param.value, self.variance_cap)

    @property
    def timescale(self) -> torch.Tensor:
        return self.timescale_param.value

    def covariance(self, t: torch.Tensor) -> torch.Tensor:
        """(P, N, N) covariance of e at the times ``t`` (N,) [s]."""
        gap = (t[:, None] - t[None, :]).abs()
        return self.variance[:, None, None] * torch.exp(-gap / self.timescale[:, None, None])


class StudentTLikelihood(Likelihood):
    """y = f + scale * t_nu: heavy tails make the map robust to magnetometer spikes. Learned scale per output."""

    def __init__(self, num_outputs: int, dof: float = 4.0, scale_variance: float = 0.01, **kw) -> None:
        super().__init__(num_outputs, **kw)
        if not dof > 0:
            raise ValueError(f"Student-t degrees of freedom must be positive, got {dof}")
        self.register_buffer("dof", torch.tensor(float(dof), dtype=torch.float64))
        self.scale_param = PositiveParameter(scale_variance, (self.num_outputs,))

    @property
    def scale_variance(self) -> torch.Tensor:
        return self.scale_param.value

    def initialise_noise(self, variance: torch.Tensor) -> None:
        self.scale_param.set(variance)

    def rescale_targets(self, factor: torch.Tensor) -> None:
        self.scale_param.set(self.scale_variance.detach() * factor ** 2)

    def log_prob(self, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        nu = self.dof
        s2 = self._per_output(self.scale_variance, f)
        const = torch.lgamma((nu + 1) / 2) - torch.lgamma(nu / 2) - 0.5 * torch.log(nu * math.pi * s2)
        return const - (nu + 1) / 2 * torch.log1p((y - f) ** 2 / (nu * s2))


class BernoulliLikelihood(Likelihood):
    """Binary y in {0, 1}: p(y=1|f) = Phi(f) (probit) or sigmoid(f) (logit). Targets are not standardised."""

    standardise_targets = False

    def __init__(self, num_outputs: int, link: str = "probit", **kw) -> None:
        super().__init__(num_outputs, **kw)
        if link not in ("probit", "logit"):
            raise ValueError(f"Bernoulli link must be 'probit' or 'logit', got {link!r}")
        self.link = link

    def validate_targets(self, y: torch.Tensor) -> str | None:
        if not bool(((y == 0) | (y == 1)).all()):
            return "Bernoulli targets must be 0 or 1"
        return None

    def log_prob(self, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        sf = (2.0 * y - 1.0) * f
        if self.link == "probit":
            return torch.special.log_ndtr(sf)
        return -torch.nn.functional.softplus(-sf)

    def log_predictive_density(self, y, mu, var):
        if self.link == "probit":
            # Closed form: P(y=1) = Phi(mu / sqrt(1 + var)).
            return torch.special.log_ndtr((2.0 * y - 1.0) * mu / torch.sqrt(1.0 + var.clamp_min(0.0)))
        return super().log_predictive_density(y, mu, var)


def build_likelihood(model_config, num_outputs: int, with_time_error: bool = False) -> Likelihood:
    """The likelihood a ModelConfig names (Bernoulli uses the probit link); ``with_time_error``: a Gaussian
    likelihood with an error shared in time (:class:`TimeError`, model.time_error; the engine that asks for it
    learns it from its batches' times)."""
    name = model_config.likelihood
    if name == "gaussian":
        time_error = (model_config.error_variance, model_config.error_timescale) if with_time_error else None
        return GaussianLikelihood(num_outputs, noise_variance=model_config.noise_variance,
                                  noise_floor=model_config.noise_floor, time_error=time_error)
    if name == "student_t":
        return StudentTLikelihood(num_outputs, dof=model_config.student_t_dof,
                                  scale_variance=model_config.noise_variance)
    if name == "bernoulli":
        return BernoulliLikelihood(num_outputs, link="probit")
    raise ValueError(f"unknown likelihood {name!r}; known: gaussian, student_t, bernoulli")
