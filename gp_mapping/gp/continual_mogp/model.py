"""Continual multi-output GP (Moreno-Munoz, Artes-Rodriguez, Alvarez, "Continual Multi-task Gaussian Processes",
arXiv 1911.00002), for maps of the three field components.

Model (linear model of coregionalisation, rank one per latent):
    f_d(x) = sum_q A[d, q] u_q(x),   u_q ~ GP(0, k_q) independent, q = 1..Q,   y_d = f_d + eps_d.
Each latent has its own kernel hyperparameters (built from the model config) and its own inducing inputs Z_q.
The coregionalisation matrix is B = sum_q sigma_q^2 a_q a_q^T (sigma_q^2 the variance of latent q's stationary
kernel); A alone is not identifiable (scale of a_q against sigma_q, and rotations among latents that share a
kernel). One likelihood per output channel (GaussianLikelihood: one noise variance per channel).

Mixing weights. p(y_old | u) ~ q_old(u) / p(u) (paper eq. 4) holds for the A the old data were fitted with:
moving a row of A after its channel has been fitted moves that channel's old map with no data to say so (the
KL terms only hold u in place). So by default ('first') row d of A is learned only in updates where channel d
is seen for the first time; the latent kernels (including their variances, hence B) keep learning in every
update, their changes being what the psi_old / psi_new KL pair accounts for. 'always' re-learns A in every
update as the paper does; 'never' keeps the initial A. The first full update starts A at the principal
directions of the batch's standardised channels and each latent's variance at the matching eigenvalue.

Variational posterior, per latent: q(u_q) = N(m_q, S_q) on u_q = u_q(Z_q), S_q = L_q L_q^T with L_q lower
triangular and a softplus on its diagonal (unwhitened, so q does not move when the hyperparameters do).

The bounds (first and continual) and their closed-form E-step are in :mod:`.bound`; the choice of inducing inputs in
:mod:`.placement`; the memo that serves an update's repeated factorisations in :mod:`.memo`.

Variational EM per update (paper: "several steps of variational EM within each sequential update"):
  * E-step over q(u). Gaussian likelihood: closed form. The bound is E_q of a quadratic in u plus the entropy,
    so its maximiser over the mean-field family prod_q q(u_q) has the joint Gaussian's mean Lambda^-1 eta and
    per-latent covariance (Lambda_qq)^-1, where Lambda (sum_q M_q square, coupled through A) collects the
    data, the new prior and the continual pseudo-likelihood q~/p_old. It is solved whitened by chol(K_new),
    where Lambda >= I. Other likelihoods: Adam steps on (m_q, L_q) from the warm start q = q~.
  * M-step: Adam steps on the kernel hyperparameters, the mixing weights and the noise variances. With the
    closed-form E-step, q(u) inside the objective is the exact optimum for the current hyperparameters, so each
    step climbs the bound maximised over q; its gradient is taken at that q held fixed, which is the same
    gradient (envelope theorem: dL/dq = 0 at the optimum). Otherwise q is held at the last E-step's.
  After each M-step Z is re-placed (above), then the E-step runs, so q is optimal for the final hyperparameters
  and inducing inputs.
Update modes: 'full' runs the VEM iterations; 'fast' only moves Z and runs the E-step (hyperparameters fixed).

Asynchronous channels: NaN entries of y are missing observations; only observed entries enter the expected
log-likelihood (the continual KLs live on the latent layer, so a batch may carry any subset of channels).
Targets are standardised per channel from the first batch that observes the channel.
"""
from __future__ import annotations

import copy
import math
import time

import torch
from torch import nn

from ..base import (Engine, difference_noise_estimate, fold_moving_targets, moments_scale, resolve_device,
                    spans_space)
from ..config import MIXING_LEARNING_CHOICES, ModelConfig
from ..errors import GPNumericalError, ModelInputError
from ..inducing import DEFAULT_REL_TOL
from ..kernels import Kernel, build_kernel, spread_lengthscales, stationary_part
from ..likelihoods import GaussianLikelihood, Likelihood, build_likelihood
from ..linalg import jittered_cholesky, symmetrise, tril_solve
from .bound import ContinualBound, LatentPosterior
from .memo import UpdateMemo
from .placement import InducingPlacement

# The engine's own settings are the model section's num_latents, latent_lengthscale_ratio, vem_iterations,
# mixing_learning, variational_steps and variational_lr (config.py documents them); keyword arguments of
# ContinualMOGP override them. latent_lengthscale_ratio: latent q starts at lengthscale * ratio ** (q - (Q-1)/2),
# so the latents can specialise in different scales (a magnetic map has a smooth large-scale trend and
# short-scale anomalies near iron).
MIXING_LEARNING = MIXING_LEARNING_CHOICES
# Smallest diagonal entry of a Cholesky factor of S written back through the inverse softplus.
_MIN_CHOL_DIAG = 1e-150


def _softplus_inverse(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp_min(_MIN_CHOL_DIAG)
    # log(expm1(x)) loses everything for large x; x + log(1 - exp(-x)) is exact there.
    return torch.where(x > 20.0, x + torch.log(-torch.expm1(-x)), torch.log(torch.expm1(x)))


class ContinualMOGP(ContinualBound, InducingPlacement, UpdateMemo, Engine):
    """Continual multi-output sparse GP with an LMC prior. See the module docstring for the method."""

    def __init__(self, config: ModelConfig, input_dims: int, output_dims: int, *, num_latents: int | None = None,
                 vem_iterations: int | None = None, variational_steps: int | None = None,
                 variational_lr: float | None = None, latent_lengthscale_ratio: float | None = None,
                 mixing_learning: str | None = None, analytic_e_step: bool = True,
                 inducing_rel_tol: float = DEFAULT_REL_TOL) -> None:
        super().__init__(config, input_dims, output_dims)
        d, p = self.input_dims, self.output_dims

        def setting(name: str, given, low: float, kind=int):
            value = given if given is not None else getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low \
                    or not math.isfinite(value) or (kind is int and int(value) != value):
                raise ValueError(f"continual_mogp: {name} must be {'an integer' if kind is int else 'a number'} "
                                 f">= {low}, got {value!r}")
            return kind(value)

        self.num_latents = setting("num_latents", num_latents, 1)
        self.vem_iterations = setting("vem_iterations", vem_iterations, 1)
        self.variational_steps = setting("variational_steps", variational_steps, 1)
        self.variational_lr = setting("variational_lr", variational_lr, 1e-300, float)
        ratio = setting("latent_lengthscale_ratio", latent_lengthscale_ratio, 1.0, float)
        if config.inducing != "pivoted_cholesky":
            raise ValueError(f"continual_mogp: inducing policy {config.inducing!r} is not supported; "
                             "use 'pivoted_cholesky' (inducing sets grow and move with the data)")
        self.inducing_rel_tol = float(inducing_rel_tol)
        self.analytic_e_step = bool(analytic_e_step)
        self.mixing_learning = mixing_learning if mixing_learning is not None else config.mixing_learning
        if self.mixing_learning not in MIXING_LEARNING:
            raise ValueError(f"continual_mogp: mixing_learning must be one of {', '.join(MIXING_LEARNING)}, "
                             f"got {self.mixing_learning!r}")
        device = resolve_device(config.device)
        qn = self.num_latents
        self.kernels = nn.ModuleList()
        # The latents are this engine's several scales: each one kernel (model.kernel_scales is dual_svgp's way
        # to the same end), started at spread lengthscales.
        for lengthscale in spread_lengthscales(config.lengthscale, qn, ratio):
            kernel = build_kernel(config, d, scales=1)
            main = stationary_part(kernel)
            if main is not None:
                main.lengthscale_param.set(lengthscale)
            self.kernels.append(kernel)
        self.likelihood: Likelihood = self._own_likelihood(build_likelihood(config, p))
        gen = torch.Generator().manual_seed(int(config.seed))
        mix = 0.1 * torch.randn(p, qn, generator=gen, dtype=torch.float64)
        k = min(p, qn)
        mix[:k, :k] = mix[:k, :k] * (1.0 - torch.eye(k, dtype=torch.float64)) + torch.eye(k, dtype=torch.float64)
        if qn > p:  # latents beyond the channel count start as random directions, not as near-zero columns
            mix[:, p:] = torch.randn(p, qn - p, generator=gen, dtype=torch.float64)
        self.mixing_raw = nn.Parameter(mix)
        f64 = dict(dtype=torch.float64)
        for q in range(qn):
            self.register_buffer(f"z_{q}", torch.zeros(0, d, **f64))
            self.register_parameter(f"q_mean_{q}", nn.Parameter(torch.zeros(0, **f64)))
            self.register_parameter(f"q_chol_{q}", nn.Parameter(torch.zeros(0, 0, **f64)))
        self._register_target_statistics(p, count_per_output=True)  # a channel can be missing from a row
        self.register_buffer("channel_seen", torch.zeros(p, dtype=torch.bool))
        # whether the scale was fixed by set_standardisation (then it never adapts)
        self.register_buffer("scale_fixed", torch.tensor(False))
        self.register_buffer("rescalings_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("hyper_learned", torch.tensor(False))  # learned from a batch that spans space
        self.register_buffer("rows_fitted", torch.zeros(p, dtype=torch.bool))  # mixing rows learned (see 'first')
        self.register_buffer("rows_since_learning", torch.tensor(0, dtype=torch.int64))
        self._register_adam_state()
        self.register_buffer("num_observed_t", torch.zeros(p, dtype=torch.int64))
        self._cache: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._memo: dict | None = None  # see _memoised: a dict only while update() runs
        self._capped_kernels: dict[int, Kernel] = {}  # see _placement_kernel
        self.to(device)

    # ------------------------------------------------------------------ properties
    # num_seen (Engine) counts rows (positions) seen with at least one observed channel.
    @property
    def num_inducing(self) -> list[int]:
        """Inducing points per latent."""
        return [int(self.z(q).shape[0]) for q in range(self.num_latents)]

    @property
    def jitter(self) -> float:
        return float(self.config.jitter)

    @property
    def mixing(self) -> torch.Tensor:
        """A (P, Q). Its column scale and the latent variance are one degree of freedom (only
        sigma_q^2 a_q a_q^T is identifiable); both are learned, the coregionalisation B is what to read."""
        return self.mixing_raw

    def z(self, q: int) -> torch.Tensor:
        return getattr(self, f"z_{q}")

    def _q_mean(self, q: int) -> nn.Parameter:
        return getattr(self, f"q_mean_{q}")

    def _q_chol_raw(self, q: int) -> nn.Parameter:
        return getattr(self, f"q_chol_{q}")

    def latent_variance(self) -> torch.Tensor:
        """(Q,) prior variance k_q(x, x) of each latent (stationary plus constant part)."""
        x0 = torch.zeros(1, self.input_dims, dtype=torch.float64, device=self.device)
        return torch.stack([k.diag(x0)[0] for k in self.kernels])

    def coregionalisation(self, original_units: bool = True) -> torch.Tensor:
        """B = sum_q sigma_q^2 a_q a_q^T (P, P): Cov(f(x)) at one point under the prior, the stationary parts'
        variances only (a constant kernel part is an offset, not coregionalisation); in the target units when
        ``original_units``, else in standardised units."""
        with torch.no_grad():
            var = []
            for k in self.kernels:
                main = stationary_part(k)
                var.append(main.variance if main is not None else k.diag(torch.zeros(1, self.input_dims,
                           dtype=torch.float64, device=self.device))[0])
            A = self.mixing
            B = (A * torch.stack(var)) @ A.T
            if original_units:
                B = B * self.y_std[:, None] * self.y_std[None, :]
            return B

    # ------------------------------------------------------------------ torch.nn.Module plumbing
    def resizable_names(self) -> list[str]:
        # Inducing sets and q(u) change size with the data.
        return [f"{name}_{q}" for q in range(self.num_latents) for name in ("z", "q_mean", "q_chol")] + \
            ["adam_avg", "adam_avg_sq"]

    # ------------------------------------------------------------------ standardisation
    def set_standardisation(self, mean, std) -> None:
        """Standardise with this offset and scale (P,) from now on and never adapt them (a caller that keeps
        several engines in one unit, e.g. tiles sharing hyperparameters). A channel already seen is re-expressed
        in the new scale exactly, as in an adaptive re-scaling, and keeps its offset (the constant kernel absorbs
        the difference; moving it would not be exact)."""
        m, s = self._standardisation_args(mean, std)
        with torch.no_grad():
            seen = self.channel_seen.clone()
            if bool(seen.any()) and not torch.equal(s[seen], self.y_std[seen]):
                self._rescale_targets(torch.where(seen, s, self.y_std), adaptation=False)
            self.y_mean.copy_(torch.where(seen, self.y_mean, m))
            self.y_std.copy_(s)
            self.channel_seen.fill_(True)
            self.scale_fixed.fill_(True)

    @property
    def rescalings(self) -> int:
        """How many times the target scale has been re-expressed (see :meth:`_update_standardisation`)."""
        return int(self.rescalings_t)

    def _update_standardisation(self, y: torch.Tensor, mask: torch.Tensor, moving: bool) -> None:
        """Running per-channel statistics, of moving data once there are some (base.fold_moving_targets; ``moving``:
        the batch spans space); a channel's offset and scale are set when it is first seen, and the scale follows
        the running std from then on (re-expressed when it leaves [1/2, 2] x the current one).

        A scale frozen on the first batch fails on a robot that stands still for its first second (the batch's
        spread is the sensor noise, the field's a thousand times more). The offset (the prior mean) stays where
        the channel was first seen: the constant kernel absorbs any difference, and keeping it makes the
        re-expression exact.
        """
        if not self.likelihood.standardise_targets:
            self.channel_seen |= mask.any(0)
            return
        fold_moving_targets(self.y_count, self.y_run_mean, self.y_run_m2, self.y_moved, y, moving, mask)
        _, std = moments_scale(self.y_count, self.y_run_mean, self.y_run_m2)
        first = mask.any(0) & ~self.channel_seen
        self.y_mean.copy_(torch.where(first, self.y_run_mean, self.y_mean))
        self.y_std.copy_(torch.where(first, std, self.y_std))
        self.channel_seen |= first
        if bool(self.scale_fixed):
            return
        ratio = std / self.y_std
        # (a channel the moments have restarted without, at the first moving batch, has no spread to follow yet)
        drift = self.channel_seen & ~first & (self.y_count > 1) & ((ratio > 2.0) | (ratio < 0.5))
        if bool(drift.any()):
            self._rescale_targets(torch.where(self.channel_seen & ~first, std, self.y_std))

    def _rescale_targets(self, std: torch.Tensor, adaptation: bool = True) -> None:
        """Standardise with ``std`` (P,) from now on: y_new = alpha_d y_old with alpha_d = y_std_d / std_d.

        Exact in the data: f_d = sum_q A_dq u_q becomes sum_q (alpha_d / c) A_dq (c u_q) with c the geometric
        mean of the alpha_d, and the noise variances scale by alpha_d^2. The common factor c goes into the
        latents with the kernels kept in standardised units (the prior's scale follows the data's spread): q(u_q)
        is taken as prior times a Gaussian pseudo-likelihood of the data, whose precision scales by 1/c^2 and
        natural mean by 1/c (see :meth:`_rescale_latent`).
        """
        alpha = self.y_std / std
        common = torch.exp(torch.log(alpha).mean())
        with torch.no_grad():
            self.mixing_raw.mul_((alpha / common)[:, None])
            for q in range(self.num_latents):
                self._rescale_latent(q, float(common))
            if bool(self.hyper_learned):  # a learned noise is the sensor's; an initial guess stays standardised
                self.likelihood.rescale_targets(alpha)
            self.y_std.copy_(std)
            if adaptation:  # (a scale set from outside is not counted in ``rescalings``)
                self.rescalings_t += 1
        self._cache = None

    def _rescale_latent(self, q: int, c: float) -> None:
        """q(u_q) = p(u_q) t(u_q) with t Gaussian: whitened by L = chol(K), t has precision D = S_w^{-1} - I and
        natural mean eta = S_w^{-1} m_w; re-expressed for targets scaled by c, they become D / c^2 and eta / c,
        and q(u_q) is rebuilt with the same prior. Directions where D < 0 (q wider than the prior, possible after
        hyperparameter changes) carry no data and are clipped to 0."""
        z = self.z(q)
        if z.shape[0] == 0:
            return
        L = self._chol_K(self.kernels[q], z)
        m_w = tril_solve(L, self._q_mean(q).detach()[:, None])[:, 0]
        L_w = tril_solve(L, self._chol_S(q, detach=True))
        precision = torch.cholesky_inverse(L_w)
        eta = precision @ m_w
        eye = torch.eye(z.shape[0], dtype=L.dtype, device=L.device)
        evals, evecs = torch.linalg.eigh(symmetrise(precision) - eye)
        new_evals = evals.clamp_min(0.0) / c ** 2 + 1.0
        cov_w = (evecs / new_evals) @ evecs.T
        mean_w = cov_w @ (eta / c)
        chol_w = torch.linalg.cholesky(symmetrise(cov_w))
        self._set_q(q, None, L @ mean_w, L @ chol_w)

    def _standardise(self, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, (y - self.y_mean) / self.y_std, torch.zeros_like(y))

    # ------------------------------------------------------------------ variational distribution
    def _chol_S(self, q: int, detach: bool = False) -> torch.Tensor:
        raw = self._q_chol_raw(q)
        if detach:
            raw = raw.detach()
        chol = torch.tril(raw, -1)
        chol.diagonal().copy_(nn.functional.softplus(raw.diagonal()))  # (not a dense diagonal matrix added)
        return chol

    def latent_posterior(self, q: int) -> LatentPosterior:
        """Detached copy of q(u_q) and of its kernel."""
        return LatentPosterior(self.z(q).detach().clone(), self._q_mean(q).detach().clone(),
                               self._chol_S(q, detach=True).clone(), copy.deepcopy(self.kernels[q]))

    def variational(self, q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Z_q, m_q, S_q) of latent q, standardised units."""
        with torch.no_grad():
            L = self._chol_S(q)
            return self.z(q).clone(), self._q_mean(q).detach().clone(), L @ L.T

    def _set_q(self, q: int, z: torch.Tensor | None, mean: torch.Tensor, chol: torch.Tensor) -> None:
        with torch.no_grad():
            if z is not None:
                setattr(self, f"z_{q}", z.detach().clone())
            raw = torch.tril(chol, -1) + torch.diag_embed(_softplus_inverse(torch.diagonal(chol).abs()))
            if self._q_mean(q).shape == mean.shape:
                self._q_mean(q).copy_(mean)
                self._q_chol_raw(q).copy_(raw)
            else:
                self._parameters[f"q_mean_{q}"] = nn.Parameter(mean.detach().clone())
                self._parameters[f"q_chol_{q}"] = nn.Parameter(raw.detach().clone())
        self._cache = None

    def set_variational(self, q: int, z, mean, cov) -> None:
        """Set latent q's inducing inputs z (M, D) and q(u_q) = N(mean, cov) in standardised units."""
        if not 0 <= int(q) < self.num_latents:
            raise ValueError(f"latent index must be in [0, {self.num_latents}), got {q}")
        zt = self._check_x(z, "z")
        mt = self._to_tensor(mean, "mean").reshape(-1)
        ct = self._to_tensor(cov, "cov")
        m = zt.shape[0]
        if mt.shape[0] != m or tuple(ct.shape) != (m, m):
            raise ModelInputError(f"mean must be ({m},) and cov ({m}, {m}) for {m} inducing points, "
                                  f"got {tuple(mt.shape)} and {tuple(ct.shape)}")
        if not bool(torch.isfinite(mt).all() and torch.isfinite(ct).all()):
            raise ModelInputError("mean and cov must be finite")
        chol, _ = jittered_cholesky(symmetrise(ct), 0.0)
        self._set_q(int(q), zt, mt, chol)

    def _adam(self, params: list[nn.Parameter], objective, steps: int, lr: float,
              grad_masks: dict[int, torch.Tensor] | None = None, persistent: bool = False,
              tol: float = 0.0) -> tuple[int, float]:
        """Adam ascent on objective(); stops at the last parameters that evaluated cleanly on trouble.
        ``grad_masks``: {index in params: 0/1 mask}, entries with mask 0 never move (zero gradient from a
        fresh Adam state is a zero step). ``persistent``: the moments carry over between calls (the
        hyperparameters' optimiser, kept in the state). ``tol``: stop once a step gained less than this."""
        if not params or steps <= 0:
            return 0, float("nan")
        optimiser = torch.optim.Adam(params, lr=lr)
        if persistent:
            self._restore_adam(optimiser, params)
        good = [p.detach().clone() for p in params]
        taken, value = 0, float("nan")
        with torch.enable_grad():
            for _ in range(steps):
                optimiser.zero_grad(set_to_none=True)
                try:
                    obj = objective()
                except GPNumericalError:
                    obj = None
                if obj is None or not bool(torch.isfinite(obj)):
                    break
                if taken and tol > 0 and float(obj.detach()) - value < tol:
                    break
                grads = torch.autograd.grad(-obj, params, allow_unused=True)
                if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                    break
                with torch.no_grad():
                    good = [p.detach().clone() for p in params]
                for i, (p, g) in enumerate(zip(params, grads)):
                    p.grad = g if g is None or not grad_masks or i not in grad_masks else g * grad_masks[i]
                value = float(obj.detach())
                optimiser.step()
                taken += 1
        if persistent:
            self._store_adam(optimiser, params)
        with torch.no_grad():
            try:  # the last step itself must leave a usable state
                obj = objective()
                ok = bool(torch.isfinite(obj))
            except GPNumericalError:
                ok = False
            if not ok:
                for p, g in zip(params, good):
                    p.copy_(g)
            for p in params:
                p.grad = None
        return taken, value

    def _uses_analytic_e_step(self) -> bool:
        return self.analytic_e_step and isinstance(self.likelihood, GaussianLikelihood)

    def _e_step(self, x, ys, mask, priors, scale: float) -> int:
        if self._uses_analytic_e_step():
            self._analytic_e_step(x, ys, mask, priors)
            return 0
        params = [self._q_mean(q) for q in range(self.num_latents)] + \
                 [self._q_chol_raw(q) for q in range(self.num_latents)]
        steps, _ = self._adam(params, lambda: self._bound(x, ys, mask, priors)[0] * scale,
                              self.variational_steps, self.variational_lr)
        self._cache = None
        return steps

    def _mixing_rows_learned(self) -> torch.Tensor:
        """(P, 1) 1 where row d of A is learned in this update. 'first': only channels with no observation in
        earlier updates (num_observed_t grows at the end of an update). The old data's information is held in
        q(u) for the old A (p(y_old | u) ~ q_old(u) / p(u) assumes A_old), so moving the row of a channel already
        seen would move its old map with no data to say so: the forgetting that 'always' (the paper) allows."""
        p = self.output_dims
        if not self.mixing_raw.requires_grad or self.mixing_learning == "never":
            return torch.zeros(p, 1, dtype=torch.float64, device=self.device)
        if self.mixing_learning == "always":
            return torch.ones(p, 1, dtype=torch.float64, device=self.device)
        return (~self.rows_fitted).to(torch.float64)[:, None]

    def _hyper_parameters(self) -> tuple[list[nn.Parameter], dict[int, torch.Tensor]]:
        params = [p for p in self.kernels.parameters() if p.requires_grad]  # a shared kernel counts once
        masks = {}
        rows = self._mixing_rows_learned()
        if bool(rows.any()):
            masks[len(params)] = rows.expand_as(self.mixing_raw)
            params.append(self.mixing_raw)
        params += [p for p in self.likelihood.parameters() if p.requires_grad]
        return params, masks

    def _initialise_mixing(self, ys: torch.Tensor, mask: torch.Tensor) -> None:
        """Start A at the principal directions of the first batch's (standardised) channels and each latent's
        variance at its eigenvalue, so that B starts at the best rank-Q fit of the empirical channel covariance
        (gradient steps from an arbitrary A often stall in a poor local optimum of the LMC)."""
        full = mask.all(1)
        if int(full.sum()) <= self.output_dims:
            return
        with torch.no_grad():
            yc = ys[full] - ys[full].mean(0)
            evals, evecs = torch.linalg.eigh(yc.T @ yc / yc.shape[0])
            k = min(self.num_latents, self.output_dims)
            order = torch.argsort(evals, descending=True)[:k]
            self.mixing_raw[:, :k] = evecs[:, order]
            for q in range(k):
                main = stationary_part(self.kernels[q])
                if main is not None:
                    main.variance_param.set(evals[order[q]].clamp_min(1e-3 * float(evals.max())))

    # ------------------------------------------------------------------ update
    def update(self, x, y, mode: str | None = None) -> dict:
        """Condition on a batch: x (N, D), y (N, P) with NaN for missing channels. mode: 'full' (variational
        EM with hyperparameter learning), 'fast' (E-step only) or None (every full_update_every-th is full)."""
        self._memo = {}
        try:
            return self._update(x, y, mode)
        finally:
            self._memo = None

    def _update(self, x, y, mode: str | None) -> dict:
        start = time.perf_counter()
        if mode not in (None, "fast", "full"):
            raise ValueError(f"update mode must be 'fast', 'full' or None, got {mode!r}")
        xt = self._check_x(x)
        yt, mask = self._check_targets(y, xt.shape[0], allow_missing=True)
        if mode is None:
            mode = "full" if self.num_updates % self.config.full_update_every == 0 else "fast"
        rows = mask.any(1)
        xt, yt, mask = xt[rows], yt[rows], mask[rows]
        stats: dict = {"mode": mode, "n_batch": int(rows.shape[0]), "n_rows": int(xt.shape[0]),
                       "n_observed": [int(c) for c in mask.sum(0)], "z_moved": 0, "hyper_steps": 0,
                       "variational_steps": 0, "bound": float("nan"), "continual": False}
        if xt.shape[0] > 0:
            yt = self._calibrate_on(xt, yt, mask)
            moving = spans_space(xt, self.config.lengthscale)
            with torch.no_grad():
                self._update_standardisation(yt, mask, moving)
            ys = self._standardise(yt, mask)
            first = self.num_updates == 0
            # Nothing is learned from a batch at rest (see spans_space); the first batch that can teach
            # hyperparameters starts the mixing and the noise from the data.
            learn = (mode == "full" and self.config.learn_hyperparameters and self.config.hyper_steps > 0
                     and moving)
            if learn and not bool(self.hyper_learned):
                if bool(self._mixing_rows_learned().all()):
                    self._initialise_mixing(ys, mask)
                rows = mask.all(1)
                if int(rows.sum()) > 2:
                    self.likelihood.initialise_noise(difference_noise_estimate(ys[rows]).clamp(1e-6, 1.0))
            old = None if first else [self.latent_posterior(q) for q in range(self.num_latents)]
            z_old = [self.z(q) for q in range(self.num_latents)]
            priors = self._place_inducing(xt, z_old, old)
            scale = 1.0 / float(mask.sum())
            stats["variational_steps"] += self._e_step(xt, ys, mask, priors, scale)
            if learn:
                hyper, masks = self._hyper_parameters()
                # No warm-up here: with its own E-step re-run after every M-step, a warm-up of many steps per
                # batch makes the rest-then-drive map worse (test/unit/test_target_scaling.py).
                # the rows conditioned on since the last M-step (fast updates learn nothing)
                budget = self._hyper_budget(int(self.rows_since_learning) + xt.shape[0], warmup=False)

                if self._uses_analytic_e_step():
                    # The M-step climbs the bound maximised over q, not a slice of it at a stale q: q(u) is
                    # re-solved exactly at every step's hyperparameters. It is held fixed inside the step (no
                    # graph through the (sum M_q)^2 factorisation): at the optimum dL/dq = 0, so the gradient
                    # in the hyperparameters at fixed q* is the gradient of the maximised bound (envelope
                    # theorem), at a sixth of the cost of differentiating through the solve.
                    def objective() -> torch.Tensor:
                        with torch.no_grad():
                            best = self._optimal_q(xt, ys, mask, priors)
                        return self._bound(xt, ys, mask, priors, given=best)[0] * scale
                else:
                    def objective() -> torch.Tensor:
                        return self._bound(xt, ys, mask, priors, detach_q=True)[0] * scale
                for _ in range(self.vem_iterations):
                    taken, _ = self._adam(hyper, objective, budget, self.config.hyper_lr, masks, persistent=True,
                                          tol=self.config.hyper_tol)
                    stats["hyper_steps"] += taken
                    # Z_new is chosen under the kernel just learned: a set picked under the initial kernel
                    # (before the first batch has taught the lengthscales) is too sparse for a shorter one.
                    priors[:] = self._place_inducing(xt, z_old, old, current=priors)
                    stats["variational_steps"] += self._e_step(xt, ys, mask, priors, scale)
                if stats["hyper_steps"]:
                    self.hyper_learned.fill_(True)
                    self.rows_fitted |= mask.any(0) & (self._mixing_rows_learned()[:, 0] > 0)
            stats["z_moved"] = sum(not torch.equal(self.z(q), z_old[q]) for q in range(self.num_latents))
            with torch.no_grad():
                # at q* (the last E-step's, memoised: no solve) or at the stored q of the Adam E-step
                best = self._optimal_q(xt, ys, mask, priors) if self._uses_analytic_e_step() else None
                value, _ = self._bound(xt, ys, mask, priors, given=best)
                stats["bound"] = float(value - self._jacobian(mask))
                self.num_seen_t += int(xt.shape[0])
                self.num_observed_t += mask.sum(0)
                self.num_updates_t += 1
                self.rows_since_learning.fill_(0 if learn else int(self.rows_since_learning) + int(xt.shape[0]))
            stats["continual"] = not first
            self._refresh_cache()
        stats.update({"seconds": time.perf_counter() - start, "num_seen": self.num_seen,
                      "num_inducing": self.num_inducing})
        return stats

    # ------------------------------------------------------------------ prediction
    def _refresh_cache(self) -> None:
        with torch.no_grad():
            cache = []
            for q in range(self.num_latents):
                z = self.z(q)
                if z.shape[0] == 0:
                    cache.append(None)
                    continue
                L_K = self._chol_K(self.kernels[q], z)
                m_w = tril_solve(L_K, self._q_mean(q).detach()[:, None])[:, 0]
                L_w = tril_solve(L_K, self._chol_S(q, detach=True))
                cache.append((L_K, m_w, L_w))
            self._cache = cache

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Standardised mean and variance (N, P) of f at checked inputs."""
        if self._cache is None:
            self._refresh_cache()
        means, variances = [], []
        for q in range(self.num_latents):
            kernel = self.kernels[q]
            kxx = kernel.diag(x)
            entry = self._cache[q]
            if entry is None:
                means.append(torch.zeros_like(kxx))
                variances.append(kxx)
                continue
            L_K, m_w, L_w = entry
            V = tril_solve(L_K, kernel(self.z(q), x))
            LtV = L_w.T @ V
            means.append(V.T @ m_w)
            variances.append((kxx - (V * V).sum(0) + (LtV * LtV).sum(0)).clamp_min(0.0))
        A = self.mixing
        return torch.stack(means, 1) @ A.T, torch.stack(variances, 1) @ (A * A).T

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, num_latents={self.num_latents}, "
                f"num_inducing={self.num_inducing}/{self.config.num_inducing}")

    # ------------------------------------------------------------------ recyclable merge (gp/merging/)
    def recyclable_summary(self) -> dict:
        """q of each output channel at the union Z of the latents' inducing inputs, in the original units, for
        merging maps without data (per channel: the cross-channel correlations of q are dropped).

        Keys: ``z`` (M, D); ``target_mean``, ``target_scale`` (P,); ``prior_cov`` (P, M, M): prior covariance of
        f_d(Z) = sum_q A[d, q] u_q(Z) in original units; ``mean`` (P, M), ``cov`` (P, M, M): q(f_d(Z)) in original
        units; ``noise`` (P,) noise variances in original units (NaN without); ``kernel``: None (one per latent);
        ``num_seen``.
        """
        with torch.no_grad():
            zs = [self.z(q) for q in range(self.num_latents) if self.z(q).shape[0]]
            d, p = self.input_dims, self.output_dims
            z = torch.unique(torch.cat(zs), dim=0) if zs else torch.zeros(0, d, dtype=torch.float64)
            m = z.shape[0]
            A = self.mixing.detach()
            mean = torch.zeros(p, m, dtype=torch.float64, device=self.device)
            cov = torch.zeros(p, m, m, dtype=torch.float64, device=self.device)
            prior = torch.zeros(p, m, m, dtype=torch.float64, device=self.device)
            for q in range(self.num_latents):
                kernel = self.kernels[q]
                kzz = kernel(z, z) + self.jitter * torch.eye(m, dtype=torch.float64, device=self.device)
                w2 = (A[:, q] ** 2)[:, None, None]
                prior = prior + w2 * kzz
                if self.z(q).shape[0] == 0:
                    cov = cov + w2 * kzz
                    continue
                L_K = self._chol_K(kernel, self.z(q))
                V = tril_solve(L_K, self._cross(kernel, self.z(q), z))          # L_q^-1 K_q(Z_q, Z)
                m_w = tril_solve(L_K, self._q_mean(q).detach()[:, None])[:, 0]
                LtV = tril_solve(L_K, self._chol_S(q, detach=True)).T @ V
                mean = mean + A[:, q, None] * (V.T @ m_w)[None, :]
                cov = cov + w2 * (kzz - V.T @ V + LtV.T @ LtV)
            s = self.y_std
            noise = getattr(self.likelihood, "noise_variance", None)
            noise = torch.full((p,), float("nan"), dtype=torch.float64) if noise is None else noise.detach() * s ** 2
            return {"z": z.cpu().clone(), "target_mean": self.y_mean.cpu().clone(), "target_scale": s.cpu().clone(),
                    "prior_cov": (prior * (s ** 2)[:, None, None]).cpu(),
                    "mean": (mean * s[:, None] + self.y_mean[:, None]).cpu(),
                    "cov": (cov * (s ** 2)[:, None, None]).cpu(), "noise": noise.cpu(), "kernel": None,
                    "num_seen": self.num_seen}
