"""The bounds of the continual multi-output GP and their exact E-step (see :mod:`.model` for the method).

First update: the standard (Hensman et al. 2015) bound
    L = sum_{d, n observed} E_q[log p(y_dn | f_dn)] - sum_q KL[q(u_q) || p(u_q | psi)].
Every later update: the continual bound (paper eq. 24), with phi_old = (Z_old, m_old, S_old) and psi_old the
kernel hyperparameters at the start of the update,
    L_C = sum E_q[log p(y|f)] - sum_q KL[q(u_q) || p(u_q | psi_new)] + sum_q KL[q(u_q) || p(u_q | psi_old)]
          - sum_q KL[q(u_q) || q~(u_q | phi_old)],
    q~(u_new) = N(K_no K_oo^-1 m_old, K_nn + K_no K_oo^-1 (S_old - K_oo) K_oo^-1 K_on)   (eqs. 5-7, 22)
where every K in q~ and in p(u | psi_old) uses the OLD hyperparameters. q~ is evaluated whitened by
chol(K_nn^old) = L_n: with W = L_n^-1 K_no L_o^-T and S^_old = L_o^-1 S_old L_o^-T,
    L_n^-1 q~ = N(W L_o^-1 m_old, I - W (I - S^_old) W^T),
which stays well conditioned however close the inducing points are. Inducing points kept from Z_old are
exact copies and their cross-covariance carries the same jitter as K_oo, so q~ restricted to them is exactly
q_old (no information is lost by keeping a point).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..kernels import Kernel
from ..linalg import KnownCholesky, KnownSolve, chol_inverse_factor, jittered_cholesky, symmetrise, tril_solve


def _kl_standard(mean_w: torch.Tensor, chol_w: torch.Tensor) -> torch.Tensor:
    """KL[N(mean_w, chol_w chol_w^T) || N(0, I)] (both whitened by the same factor)."""
    m = mean_w.shape[0]
    logdet = torch.log(torch.diagonal(chol_w).abs()).sum()
    return 0.5 * ((chol_w * chol_w).sum() + (mean_w * mean_w).sum() - m) - logdet


def _kl_gaussian(mean_w: torch.Tensor, chol_w: torch.Tensor, prior_mean_w: torch.Tensor,
                 prior_chol_w: torch.Tensor) -> torch.Tensor:
    """KL[N(mean_w, chol_w chol_w^T) || N(prior_mean_w, prior_chol_w prior_chol_w^T)]."""
    m = mean_w.shape[0]
    a = tril_solve(prior_chol_w, chol_w)
    b = tril_solve(prior_chol_w, (prior_mean_w - mean_w)[:, None])[:, 0]
    logdet_q = torch.log(torch.diagonal(chol_w).abs()).sum()
    logdet_p = torch.log(torch.diagonal(prior_chol_w).abs()).sum()
    return 0.5 * ((a * a).sum() + (b * b).sum() - m) + logdet_p - logdet_q


@dataclass
class LatentPosterior:
    """q(u_q) = N(mean, chol chol^T) at inducing inputs z under a kernel (a frozen copy for old posteriors)."""

    z: torch.Tensor
    mean: torch.Tensor
    chol: torch.Tensor
    kernel: Kernel


class OptimalQ(NamedTuple):
    """The E-step's q*(u_q) = N(mean, chol chol^T), and the same whitened by ``factor`` = chol(K_q) of the kernel it
    was solved under: mean = factor mean_w, chol = factor chol_w."""

    mean: torch.Tensor
    chol: torch.Tensor
    mean_w: torch.Tensor
    chol_w: torch.Tensor
    factor: torch.Tensor


@dataclass
class ContinualPrior:
    """q~(u_new | phi_old) and p(u_new | psi_old) for one latent at its new inducing inputs, whitened by
    chol_old = chol(K_nn under psi_old): q~ = N(chol_old mean_w, chol_old C C^T chol_old^T)."""

    chol_old: torch.Tensor     # (M, M) chol(K_old(Z_new, Z_new) + jitter I)
    mean_w: torch.Tensor       # (M,)   W L_o^-1 m_old
    cov_chol_w: torch.Tensor   # (M, M) chol(I - W (I - S^_old) W^T)
    precision_w: torch.Tensor  # (M, M) Sigma~_w^-1 - I: natural precision of the pseudo-likelihood q~ / p_old
    shift_w: torch.Tensor      # (M,)   Sigma~_w^-1 mean_w: its natural location


class ContinualBound:
    """Mixin of :class:`~.model.ContinualMOGP`: the prior factors, the continual prior q~, the bound and its terms,
    and the closed-form E-step."""

    # ------------------------------------------------------------------ linear algebra
    def _cross(self, kernel: Kernel, z_new: torch.Tensor, z_old: torch.Tensor) -> torch.Tensor:
        """Cov(u(z_new), u(z_old)); identical points carry the jitter of K_oo, so a kept point keeps q_old."""
        same = (z_new[:, None, :] == z_old[None, :, :]).all(-1)
        return kernel(z_new, z_old) + self.jitter * same.to(z_new.dtype)

    def _chol_K(self, kernel: Kernel, z: torch.Tensor) -> torch.Tensor:
        """chol(K(z, z) + jitter I)."""
        return self._prior_factor(kernel, z)[0]

    def _prior_factor(self, kernel: Kernel, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(chol(K(z, z) + jitter I), the memo's factor of that state or None). With gradients, a factor this
        update has already computed without them (the E-step's, the M-step's closing check) is not computed
        again: KnownCholesky gives it its graph."""
        versions = (z._version, self.jitter, *(p._version for p in self._parameters_of(kernel)))

        def factorise() -> torch.Tensor:
            return jittered_cholesky(kernel(z, z), self.jitter)[0]

        if torch.is_grad_enabled():
            known = self._memo_lookup("chol", (kernel, z), versions)
            if known is None:
                return factorise(), None
            return KnownCholesky.apply(kernel(z, z), known), known
        factor = self._memoised("chol", (kernel, z), versions, factorise)
        return factor, factor if self._memo is not None else None

    def _continual_prior(self, old: LatentPosterior, z_new: torch.Tensor) -> ContinualPrior:
        """q~(u_new | phi_old) at z_new with the old kernel, whitened by chol(K_old(z_new, z_new))."""
        with torch.no_grad():
            k_old = old.kernel
            L_n = self._chol_K(k_old, z_new)
            m = z_new.shape[0]
            eye = torch.eye(m, dtype=z_new.dtype, device=z_new.device)
            if old.z.shape[0] == 0:
                mean_w = z_new.new_zeros(m)
                cov_w = eye
            else:
                L_o = self._chol_K(k_old, old.z)
                W = tril_solve(L_n, tril_solve(L_o, self._cross(k_old, z_new, old.z).T).T)
                mean_w = W @ tril_solve(L_o, old.mean[:, None])[:, 0]
                R = W @ tril_solve(L_o, old.chol)  # W S^_old^{1/2}
                cov_w = eye - W @ W.T + R @ R.T
            C, _ = jittered_cholesky(symmetrise(cov_w), 0.0)
            Ci = tril_solve(C, eye)
            inv = Ci.T @ Ci
            return ContinualPrior(L_n, mean_w, C, symmetrise(inv) - eye, inv @ mean_w)


    # ------------------------------------------------------------------ bound
    def _latent_terms(self, q: int, x: torch.Tensor, given: tuple[torch.Tensor, torch.Tensor] | OptimalQ | None,
                      detach_q: bool = False):
        """(mean (N,), var (N,), KL[q||p_new], m, L_S) of latent q at x under the current kernel; q(u_q) is the
        stored one, or ``given`` = (m, L_S) or an OptimalQ."""
        kernel = self.kernels[q]
        z = self.z(q)
        kxx = kernel.diag(x)
        if given is not None:
            mean_u, L_S = given[0], given[1]
        else:
            mean_u = self._q_mean(q).detach() if detach_q else self._q_mean(q)
            L_S = self._chol_S(q, detach=detach_q)
        if z.shape[0] == 0:
            return x.new_zeros(x.shape[0]), kxx, x.new_zeros(()), mean_u, L_S
        L_K, known = self._prior_factor(kernel, z)
        if isinstance(given, OptimalQ) and known is not None and given.factor is known:
            # q* whitened by this very factor (the memo's: the same kernel and Z), so no solves to whiten it again;
            # with gradients KnownSolve gives the whitened q* its graph through L_K
            if torch.is_grad_enabled():
                m_w = KnownSolve.apply(L_K, mean_u[:, None], given.mean_w[:, None])[:, 0]
                L_w = KnownSolve.apply(L_K, L_S, given.chol_w)
            else:
                m_w, L_w = given.mean_w, given.chol_w
        else:
            m_w = tril_solve(L_K, mean_u[:, None])[:, 0]
            L_w = tril_solve(L_K, L_S)
        V = tril_solve(L_K, kernel(z, x))
        mean = V.T @ m_w
        LtV = L_w.T @ V
        var = kxx - (V * V).sum(0) + (LtV * LtV).sum(0)
        return mean, var.clamp_min(0.0), _kl_standard(m_w, L_w), mean_u, L_S

    def _continual_kls(self, prior: ContinualPrior, mean_u: torch.Tensor, L_S: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """KL[q(u_q) || p(u_q | psi_old)] and KL[q(u_q) || q~(u_q | phi_old)] (two M^3 solves). Neither depends on
        the current hyperparameters, so while the M-step holds q at q* they are computed once per q* (memoised)
        rather than at every evaluation of its objective."""
        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            m_w = tril_solve(prior.chol_old, mean_u[:, None])[:, 0]
            L_w = tril_solve(prior.chol_old, L_S)
            return _kl_standard(m_w, L_w), _kl_gaussian(m_w, L_w, prior.mean_w, prior.cov_chol_w)

        if mean_u.requires_grad or L_S.requires_grad:
            return compute()
        with torch.no_grad():
            return self._memoised("continual_kls", (prior, mean_u, L_S), (mean_u._version, L_S._version), compute)

    def _bound(self, x: torch.Tensor, ys: torch.Tensor, mask: torch.Tensor,
               priors: list[ContinualPrior | None] | None,
               given: list[tuple[torch.Tensor, torch.Tensor]] | list[OptimalQ] | None = None,
               detach_q: bool = False) -> tuple[torch.Tensor, dict]:
        """The standard bound (priors None) or the continual bound, standardised units; also its terms.
        ``given``: evaluate at these q(u_q) = (m, L_S) instead of the stored ones. ``detach_q``: the stored q is
        held fixed and the two terms that then depend only on q and phi_old are left out (the M-step objective
        with q fixed, equal to the bound up to a constant)."""
        means, variances = [], []
        kl_new, kl_old, kl_tilde = [], [], []
        for q in range(self.num_latents):
            mean, var, kl, mean_u, L_S = self._latent_terms(q, x, None if given is None else given[q], detach_q)
            means.append(mean)
            variances.append(var)
            kl_new.append(kl)
            prior = priors[q] if priors is not None else None
            if prior is not None and not detach_q:
                old, tilde = self._continual_kls(prior, mean_u, L_S)
                kl_old.append(old)
                kl_tilde.append(tilde)
        A = self.mixing
        mu = torch.stack(means, 1) @ A.T
        var = torch.stack(variances, 1) @ (A * A).T
        ell = (self.likelihood.expected_log_lik(ys, mu, var) * mask).sum()
        zero = x.new_zeros(())
        terms = {"ell": ell, "kl_new": sum(kl_new, zero), "kl_old": sum(kl_old, zero),
                 "kl_tilde": sum(kl_tilde, zero)}
        return ell - terms["kl_new"] + terms["kl_old"] - terms["kl_tilde"], terms

    def _jacobian(self, mask: torch.Tensor) -> torch.Tensor:
        if not self.likelihood.standardise_targets:
            return mask.new_zeros((), dtype=torch.float64)
        return (mask * torch.log(self.y_std)).sum()

    def elbo(self, x, y, old: list[LatentPosterior] | None = None) -> torch.Tensor:
        """The bound on log p(y) (original units) at the current q and hyperparameters: the standard bound, or,
        with ``old`` (a list of latent_posterior(q) taken before), the continual bound against that posterior.
        NaN targets are missing. Uses the current inducing inputs; the old posterior is carried onto them."""
        xt = self._check_x(x)
        yt, mask = self._check_targets(y, xt.shape[0], allow_missing=True)
        with torch.no_grad():
            priors = None if old is None else [self._continual_prior(o, self.z(q)) for q, o in enumerate(old)]
            value, _ = self._bound(xt, self._standardise(yt, mask), mask, priors)
            return value - self._jacobian(mask)

    def bound_terms(self, x, y, old: list[LatentPosterior] | None = None) -> dict[str, float]:
        """The bound's terms (standardised units): ell, kl_new, kl_old, kl_tilde and the total."""
        xt = self._check_x(x)
        yt, mask = self._check_targets(y, xt.shape[0], allow_missing=True)
        with torch.no_grad():
            priors = None if old is None else [self._continual_prior(o, self.z(q)) for q, o in enumerate(old)]
            value, terms = self._bound(xt, self._standardise(yt, mask), mask, priors)
        out = {k: float(v) for k, v in terms.items()}
        out["bound"] = float(value)
        return out

    # ------------------------------------------------------------------ E-step
    def _optimal_q(self, x: torch.Tensor, ys: torch.Tensor, mask: torch.Tensor,
                   priors: list[ContinualPrior | None]) -> list[OptimalQ]:
        """Exact maximiser (m_q, L_q) of the bound over prod_q q(u_q) for a Gaussian likelihood (see the module
        docstring), as a differentiable function of the hyperparameters, the mixing and the noise."""
        zs = [self.z(q) for q in range(self.num_latents)]
        params = [*self._parameters_of(self.kernels), self.mixing_raw, *self._parameters_of(self.likelihood)]
        return self._memoised("optimal_q", (x, ys, mask, *priors, *zs), tuple(t._version for t in zs + params),
                              lambda: self._solve_optimal_q(x, ys, mask, priors))

    def _solve_optimal_q(self, x: torch.Tensor, ys: torch.Tensor, mask: torch.Tensor,
                         priors: list[ContinualPrior | None]) -> list[OptimalQ]:
        A = self.mixing
        w = mask / self.likelihood.noise_variance            # (N, P) precision of each observed entry
        wy = w * ys
        Ls, Vs, sizes = [], [], []
        for q in range(self.num_latents):
            z = self.z(q)
            L_K = self._chol_K(self.kernels[q], z)
            Ls.append(L_K)
            Vs.append(tril_solve(L_K, self.kernels[q](z, x)))
            sizes.append(z.shape[0])
        nq = self.num_latents
        blocks: list[list[torch.Tensor | None]] = [[None] * nq for _ in range(nq)]
        etas = []
        for q in range(nq):
            eye = torch.eye(sizes[q], dtype=x.dtype, device=x.device)
            eta = Vs[q] @ (wy @ A[:, q])
            prior_block = eye
            prior = priors[q]
            if prior is not None:
                G = tril_solve(prior.chol_old, Ls[q])  # new-whitened -> old-whitened coordinates
                prior_block = eye + G.T @ prior.precision_w @ G
                eta = eta + G.T @ prior.shift_w
            etas.append(eta)
            for r in range(q, nq):
                c = w @ (A[:, q] * A[:, r])                  # (N,) data weight coupling latents q and r
                block = (Vs[q] * c) @ Vs[r].T
                if r == q:
                    block = block + prior_block
                    blocks[q][q] = symmetrise(block)
                else:
                    blocks[q][r] = block
                    blocks[r][q] = block.T
        Lam = torch.cat([torch.cat(row, 1) for row in blocks], 0)
        R, _ = jittered_cholesky(Lam, 0.0)                  # Lam >= I: never needs jitter in practice
        v = torch.cholesky_solve(torch.cat(etas)[:, None], R)[:, 0]
        out, offset = [], 0
        for q in range(nq):
            L_v = chol_inverse_factor(blocks[q][q])
            v_q = v[offset:offset + sizes[q]]
            out.append(OptimalQ(Ls[q] @ v_q, Ls[q] @ L_v, v_q, L_v, Ls[q]))
            offset += sizes[q]
        return out

    def _analytic_e_step(self, x: torch.Tensor, ys: torch.Tensor, mask: torch.Tensor,
                         priors: list[ContinualPrior | None]) -> None:
        with torch.no_grad():
            for q, best in enumerate(self._optimal_q(x, ys, mask, priors)):
                self._set_q(q, None, best.mean, best.chol)
