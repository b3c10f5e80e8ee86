"""Building blocks of the sequential Monte Carlo mixture of GP experts, batched over particles and experts.

* Normal-inverse-Wishart (NIW) running statistics of the gating inputs and their Student-t posterior
  predictive (Zhang, Dumitrascu, Williamson & Engelhardt, "Sequential Gaussian processes for online learning
  of nonstationary functions", eqs. 2-3).
* The Escobar & West (1995) update of a Dirichlet-process concentration alpha under a Gamma(a0, b0) prior.
* Gamma and Beta draws from an explicit ``torch.Generator`` (Marsaglia & Tsang 2000), so a seeded engine is
  reproducible and its random state can be saved with it.
* Elliptical slice sampling (Murray, Adams & MacKay 2010) of many chains at once.
* Effective sample size and multinomial / systematic resampling of particle weights.

Everything here is pure torch on float64 tensors with leading batch dimensions; nothing knows about GPs.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

LOG_PI = math.log(math.pi)


# --------------------------------------------------------------------------------------------- NIW gating


def niw_add(count: torch.Tensor, mean: torch.Tensor, scatter: torch.Tensor, x: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add one input ``x`` (..., D) to running statistics: count (...), mean (..., D) and scatter
    S = sum (x - mean)(x - mean)^T (..., D, D) (Welford). Returns the new triple."""
    n1 = count + 1.0
    delta = x - mean
    new_mean = mean + delta / n1[..., None]
    new_scatter = scatter + (count / n1)[..., None, None] * delta[..., :, None] * delta[..., None, :]
    return n1, new_mean, new_scatter


def niw_predictive(count: torch.Tensor, mean: torch.Tensor, scatter: torch.Tensor, mu0: torch.Tensor,
                   lambda0: float, nu0: float, psi0: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student-t posterior predictive of the next input of a NIW cluster (eq. 3).

    With n = count, xbar = mean, S = scatter and the prior (mu0, lambda0, nu0, Psi0):
    lambda' = lambda0 + n, mu' = (lambda0 mu0 + n xbar) / lambda', nu' = nu0 + n - D + 1 (degrees of freedom)
    and Psi' = (lambda' + 1) / (lambda' nu') (Psi0 + S + lambda0 n / lambda' (xbar - mu0)(xbar - mu0)^T).
    Returns (mu' (..., D), Psi' (..., D, D), nu' (...)). An empty cluster (n = 0) gives the prior predictive.
    """
    d = mean.shape[-1]
    lam = lambda0 + count
    mu = (lambda0 * mu0 + count[..., None] * mean) / lam[..., None]
    nu = nu0 + count - d + 1.0
    diff = mean - mu0
    psi = psi0 + scatter + (lambda0 * count / lam)[..., None, None] * diff[..., :, None] * diff[..., None, :]
    psi = psi * ((lam + 1.0) / (lam * nu))[..., None, None]
    return mu, psi, nu


def student_t_logpdf(x: torch.Tensor, mu: torch.Tensor, psi: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
    """log of the multivariate Student-t density t_nu(x; mu, Psi), broadcasting x (..., D) against the
    parameters mu (..., D), Psi (..., D, D) and nu (...)."""
    d = x.shape[-1]
    diff = x - mu
    batch = torch.broadcast_shapes(diff.shape[:-1], psi.shape[:-2])
    L = torch.linalg.cholesky(psi).expand(*batch, d, d)
    sol = torch.linalg.solve_triangular(L, diff.expand(*batch, d)[..., None], upper=False)[..., 0]
    maha = (sol * sol).sum(-1)
    logdet = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
    return (torch.lgamma(0.5 * (nu + d)) - torch.lgamma(0.5 * nu) - 0.5 * d * (torch.log(nu) + LOG_PI)
            - 0.5 * logdet - 0.5 * (nu + d) * torch.log1p(maha / nu))


def niw_log_evidence(x: torch.Tensor, mu0: torch.Tensor, lambda0: float, nu0: float, psi0: torch.Tensor
                     ) -> torch.Tensor:
    """log p(x_1..x_n) of a NIW cluster in closed form (Murphy 2007, eq. 266): the product of the sequential
    predictives equals it, which is what the tests check ``niw_predictive`` against. x: (n, D)."""
    n, d = x.shape
    xbar = x.mean(0) if n else torch.zeros(d, dtype=x.dtype)
    scatter = (x - xbar).T @ (x - xbar)
    lam_n = lambda0 + n
    nu_n = nu0 + n
    diff = xbar - mu0
    psi_n = psi0 + scatter + lambda0 * n / lam_n * torch.outer(diff, diff)
    nu0_t = torch.tensor(float(nu0), dtype=x.dtype)
    nu_n_t = torch.tensor(float(nu_n), dtype=x.dtype)
    return (-0.5 * n * d * LOG_PI + torch.special.multigammaln(0.5 * nu_n_t, d)
            - torch.special.multigammaln(0.5 * nu0_t, d) + 0.5 * nu0 * torch.logdet(psi0)
            - 0.5 * nu_n * torch.logdet(psi_n) + 0.5 * d * (math.log(lambda0) - math.log(lam_n)))


# --------------------------------------------------------------------------------------------- random draws


def gamma_sample(shape: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gamma(shape, rate 1) draws, one per entry of ``shape`` (float64, CPU), Marsaglia & Tsang (2000);
    shape < 1 uses Gamma(shape + 1) * U^(1/shape)."""
    shape = shape.detach().to("cpu", torch.float64)
    boost = shape < 1.0
    a = torch.where(boost, shape + 1.0, shape)
    d = a - 1.0 / 3.0
    c = 1.0 / torch.sqrt(9.0 * d)
    out = torch.empty_like(a)
    todo = torch.ones_like(a, dtype=torch.bool)
    for _ in range(1000):  # acceptance >= 95 % per round: 1000 rounds never run out in practice
        idx = torch.nonzero(todo).flatten()
        if idx.numel() == 0:
            break
        z = torch.randn(idx.numel(), generator=generator, dtype=torch.float64)
        u = torch.rand(idx.numel(), generator=generator, dtype=torch.float64)
        v = (1.0 + c[idx] * z) ** 3
        ok = (v > 0) & (torch.log(u.clamp_min(1e-300)) < 0.5 * z * z + d[idx] - d[idx] * v
                        + d[idx] * torch.log(v.clamp_min(1e-300)))
        out[idx[ok]] = (d[idx] * v)[ok]
        todo[idx[ok]] = False
    if bool(todo.any()):  # pragma: no cover - probability ~ 0.05 ** 1000
        out[todo] = a[todo]
    if bool(boost.any()):
        u = torch.rand(int(boost.sum()), generator=generator, dtype=torch.float64).clamp_min(1e-300)
        out[boost] = out[boost] * u ** (1.0 / shape[boost])
    return out


def beta_sample(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Beta(a, b) draws (float64, CPU) as Ga / (Ga + Gb)."""
    ga = gamma_sample(a, generator)
    gb = gamma_sample(b, generator)
    return ga / (ga + gb).clamp_min(1e-300)


def escobar_west(alpha: torch.Tensor, num_clusters: torch.Tensor, n: float, a0: float, b0: float,
                 generator: torch.Generator) -> torch.Tensor:
    """One Escobar & West (1995) update of DP concentrations ``alpha`` (J,) given K clusters (J,) among n
    observations, prior alpha ~ Gamma(a0, rate b0):

        rho | alpha ~ Beta(alpha + 1, n)
        pi / (1 - pi) = (a0 + K - 1) / (n (b0 - log rho))
        alpha | rho ~ pi Gamma(a0 + K, b0 - log rho) + (1 - pi) Gamma(a0 + K - 1, b0 - log rho)

    Its stationary law is p(alpha | K, n) ∝ Gamma(alpha; a0, b0) alpha^(K-1) (alpha + n) B(alpha + 1, n).
    With n = 0 (no data) alpha is drawn from the prior."""
    device = alpha.device
    alpha = alpha.detach().to("cpu", torch.float64)
    k = num_clusters.detach().to("cpu", torch.float64)
    if n <= 0:
        return (gamma_sample(torch.full_like(alpha, a0), generator) / b0).to(device)
    rho = beta_sample(alpha + 1.0, torch.full_like(alpha, float(n)), generator).clamp(1e-300, 1.0)
    rate = b0 - torch.log(rho)
    shape_lo = (a0 + k - 1.0).clamp_min(1e-12)
    odds = shape_lo / (n * rate)
    pi = odds / (1.0 + odds)
    pick_hi = torch.rand(alpha.shape, generator=generator, dtype=torch.float64) < pi
    shape = torch.where(pick_hi, a0 + k, shape_lo)
    return (gamma_sample(shape, generator) / rate).to(device)


# --------------------------------------------------------------------------------------------- slice sampling


def elliptical_slice(theta: torch.Tensor, log_lik: Callable[[torch.Tensor], torch.Tensor], prior_mean: torch.Tensor,
                     prior_std: torch.Tensor, generator: torch.Generator, current_ll: torch.Tensor | None = None,
                     max_shrink: int = 50) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One elliptical slice sampling transition for B independent chains at once.

    theta: (B, H) states with prior N(prior_mean, diag(prior_std^2)) (broadcast to (B, H));
    ``log_lik(proposals (b, H), chains (b,))`` gives the log-likelihood (b,) of those chains at those
    proposals (-inf where undefined). The ellipse through theta and a prior draw is searched by the
    bracket-shrinking rule of Murray et al. (2010); all chains are evaluated together, each round only
    changing the chains not yet accepted. A chain whose bracket has not closed after ``max_shrink`` rounds
    keeps its state (the bracket shrinks towards it, so that is the limit of the procedure).
    Returns (new theta, its log-likelihood, number of likelihood evaluations per chain).
    """
    b = theta.shape[0]
    device, dtype = theta.device, theta.dtype
    mean = prior_mean.expand_as(theta)
    std = prior_std.expand_as(theta)
    f = theta - mean
    if current_ll is None:
        current_ll = log_lik(theta, torch.arange(b, device=device))
    nu = torch.randn(theta.shape, generator=generator, dtype=torch.float64).to(device, dtype) * std
    log_y = current_ll + torch.log(torch.rand(b, generator=generator, dtype=torch.float64)
                                   .clamp_min(1e-300)).to(device, dtype)
    angle = (torch.rand(b, generator=generator, dtype=torch.float64) * 2.0 * math.pi).to(device, dtype)
    lo, hi = angle - 2.0 * math.pi, angle.clone()
    new_theta, new_ll = theta.clone(), current_ll.clone()
    todo = torch.ones(b, dtype=torch.bool, device=device)
    evals = torch.zeros(b, dtype=torch.int64, device=device)
    for _ in range(max_shrink):
        idx = torch.nonzero(todo).flatten()
        if idx.numel() == 0:
            break
        a = angle[idx, None]
        prop = mean[idx] + f[idx] * torch.cos(a) + nu[idx] * torch.sin(a)
        ll = log_lik(prop, idx)
        evals[idx] += 1
        ok = torch.isfinite(ll) & (ll > log_y[idx])
        acc = idx[ok]
        new_theta[acc], new_ll[acc] = prop[ok], ll[ok]
        todo[acc] = False
        rej = idx[~ok]
        if rej.numel():
            neg = angle[rej] < 0
            lo[rej] = torch.where(neg, angle[rej], lo[rej])
            hi[rej] = torch.where(neg, hi[rej], angle[rej])
            u = torch.rand(rej.numel(), generator=generator, dtype=torch.float64).to(device, dtype)
            angle[rej] = lo[rej] + u * (hi[rej] - lo[rej])
    return new_theta, new_ll, evals


# --------------------------------------------------------------------------------------------- resampling


def normalise_log_weights(log_w: torch.Tensor) -> torch.Tensor:
    """log weights shifted so that they sum to one in the linear domain (J,)."""
    return log_w - torch.logsumexp(log_w, dim=0)


def effective_sample_size(log_w: torch.Tensor) -> float:
    """N_eff = 1 / sum w_j^2 of normalised log weights."""
    w = torch.exp(normalise_log_weights(log_w))
    return float(1.0 / (w * w).sum())


def resample_indices(log_w: torch.Tensor, generator: torch.Generator, method: str = "systematic") -> torch.Tensor:
    """J ancestor indices drawn with probabilities exp(log_w) (normalised): 'multinomial' (as in the paper) or
    'systematic' (one uniform, lower variance). Returned on the CPU, sorted."""
    w = torch.exp(normalise_log_weights(log_w.detach().to("cpu", torch.float64)))
    j = w.shape[0]
    if method == "multinomial":
        idx = torch.multinomial(w, j, replacement=True, generator=generator)
        return torch.sort(idx).values
    if method != "systematic":
        raise ValueError(f"unknown resampling method {method!r}; known: multinomial, systematic")
    u = (torch.rand(1, generator=generator, dtype=torch.float64) + torch.arange(j, dtype=torch.float64)) / j
    cdf = torch.cumsum(w, 0)
    cdf[-1] = 1.0
    return torch.searchsorted(cdf, u).clamp_max(j - 1)
