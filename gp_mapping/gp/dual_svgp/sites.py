"""The data's sites and the posterior they give (:mod:`.model`): whitened site sums, the posterior factors and the
marginals from the whitened duals, the damped BLR steps on held data's sites.

New data's first BLR step is undamped (rho = 1): the new site is the site evaluated at the current posterior,
which for a Gaussian likelihood is already exact; damping towards the empty site would just under-count it.
Later steps are damped with rho.
"""
from __future__ import annotations

import torch

from ..linalg import jittered_cholesky, symmetrise

# readings folded as one correlated site at most (correlated_folds): an N^3 factorisation per stretch and output
FOLD_BLOCK = 512


def site_sums(V: torch.Tensor, lam1: torch.Tensor, lam2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitened site sums (V lambda1 (M, P), V diag(lambda2) V^T (P, M, M)) for V = L^{-1} K_ZX (M, N)."""
    a_w = V @ lam1
    if lam2.shape[1] == 1:  # one output: a plain matrix product (einsum's three-operand path is slower)
        W = ((V * lam2[:, 0]) @ V.T)[None]
    else:
        W = torch.einsum("mn,np,kn->pmk", V, lam2, V)
    return a_w, symmetrise(W)


def correlated_site_sums(V: torch.Tensor, lam1: torch.Tensor, lam2: torch.Tensor, shared: torch.Tensor,
                         columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whitened site sums of readings whose errors are correlated, as one site for the group. Each reading's own
    conjugate site (lambda1, lambda2) (N, P) states a pseudo-observation lambda1 / lambda2 with pseudo-noise
    1 / lambda2; ``shared`` (P, N, N) is the part of that noise the readings share (e(t)'s covariance, its
    diagonal inside 1 / lambda2). Per output the group's error covariance is then Sigma = diag(1 / lambda2 -
    diag shared) + shared, and its site on u is (V Sigma^{-1} ytilde, V Sigma^{-1} V^T): exact for a Gaussian
    likelihood with that covariance, and equal to :func:`site_sums` when nothing is shared.
    Returns a_w (M, P), W (P, M, M) and V Sigma^{-1} columns (M, P, K) for ``columns`` (N, K) (what a
    constant shift of the targets, or of some of them, moves a_w by)."""
    a_w, W, moved = [], [], []
    for p in range(lam2.shape[1]):
        own = (1.0 / lam2[:, p] - torch.diagonal(shared[p])).clamp_min(0.0)
        chol, _ = jittered_cholesky(shared[p] + torch.diag(own), 0.0)
        G = torch.linalg.solve_triangular(chol, V.T, upper=False)  # (N, M): Sigma^{-1/2} V^T
        rhs = torch.cat([(lam1[:, p] / lam2[:, p])[:, None], columns.to(V)], 1)
        white = torch.linalg.solve_triangular(chol, rhs, upper=False)  # (N, 1 + K)
        sums = G.T @ white
        a_w.append(sums[:, 0])
        moved.append(sums[:, 1:])
        W.append(G.T @ G)
    return torch.stack(a_w, 1), symmetrise(torch.stack(W)), torch.stack(moved, 1)


def residual_weighted_sites(lam1: torch.Tensor, lam2: torch.Tensor, extra: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sites (N, P) of readings with a noise variance of their own on top of the likelihood's: each site's
    pseudo-noise 1 / lambda2 grows by ``extra`` ((N,) or (N, P), clamped at 0), its pseudo-observation
    lambda1 / lambda2 kept. Two uses:

    * the residual prior variance given Z, k(x, x) - K_xZ K_ZZ^{-1} K_Zx, of a reading that Z represents only in
      part: the FITC site (Snelson and Ghahramani 2006; power EP with alpha = 1, Bui, Yan and Turner 2017, "A
      unifying framework for Gaussian process pseudo-point approximations using power expectation propagation").
      Why: a fast update conditions a batch on a Z that is full and may cover it only in part; the variational
      site puts all of a reading on u = f(Z), so a reading that Z can hardly reach moves u, and with it the map
      where Z *does* reach, as far as its small noise asks (a lawnmower's last row, 2 m past a full tile's
      points, pulled a quiet sensor's map 2 uT off on the rows before it). Where Z covers the reading (residual
      0) the site is the variational one;
    * the noise a reading's position error adds where the field is steep (position_noise^2 |grad m(x)|^2,
      DualSVGP._input_noise_variance)."""
    extra = extra.clamp_min(0.0)
    shrink = 1.0 + lam2 * (extra[:, None] if extra.dim() == 1 else extra)
    return lam1 / shrink, lam2 / shrink


class DualSites:
    """Mixin of :class:`~.model.DualSVGP`: the posterior from the whitened duals, the held data's sites."""

    # ------------------------------------------------------------------ posterior from the whitened duals
    @staticmethod
    def _posterior(a_w: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """R = chol(I + W) (P, M, M) and c = R^{-1} L^{-1} a (P, M) from the whitened duals."""
        m = W.shape[-1]
        eye = torch.eye(m, dtype=W.dtype, device=W.device)
        R, _ = jittered_cholesky(eye + W, 0.0)
        c = torch.linalg.solve_triangular(R, a_w.T[..., None], upper=False)[..., 0]
        return R, c

    @staticmethod
    def _marginals(V: torch.Tensor, R: torch.Tensor, c: torch.Tensor, kxx: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Latent mean, variance (N, P) and q_i = k_i^T K^{-1} S K^{-1} k_i (N, P), from V = L^{-1} K_ZX."""
        U = torch.linalg.solve_triangular(R, V.expand(R.shape[0], *V.shape), upper=False)  # (P, M, N)
        mean = torch.einsum("pmn,pm->np", U, c)
        explained = (U * U).sum(1).T
        var = kxx[:, None] - (V * V).sum(0)[:, None] + explained
        return mean, var.clamp_min(0.0), explained

    def _features(self, L: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """V = L^{-1} K_Zx (M, N)."""
        return torch.linalg.solve_triangular(L, self.kernel(self.Z, x), upper=False)

    # ------------------------------------------------------------------ site fitting
    def _fit_sites(self, V: torch.Tensor, kxx: torch.Tensor, y: torch.Tensor, lam1: torch.Tensor,
                   lam2: torch.Tensor, fresh: torch.Tensor, n_steps: int, rho: float,
                   extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Damped BLR steps (eq. 23) on the held data's sites, the old part fixed; V = L^{-1} K_ZH.

        ``fresh`` marks data without a site yet (lambda = 0): their first step is undamped. A conjugate
        likelihood's sites do not depend on q, so they are set to that fixed point at once (what the damped steps
        converge to, without the posterior each step needs); ``extra`` (N, P): each datum's own noise variance
        on top of the likelihood's (position noise; conjugate likelihoods only).
        """
        if self.likelihood.conjugate:
            sites = self.likelihood.dual_sites(y, None, None)
            return sites if extra is None else residual_weighted_sites(*sites, extra)
        for step in range(n_steps):
            a_h, W_h = site_sums(V, lam1, lam2)
            R, c = self._posterior(self.a_w_old + a_h, self.W_old + W_h)
            mean, var, _ = self._marginals(V, R, c, kxx)
            new1, new2 = self.likelihood.dual_sites(y, mean, var)
            r = torch.full((y.shape[0], 1), float(rho), dtype=y.dtype, device=y.device)
            if step == 0:
                r[fresh] = 1.0
            lam1 = (1.0 - r) * lam1 + r * new1
            lam2 = (1.0 - r) * lam2 + r * new2
        return lam1, lam2

    # ------------------------------------------------------------------ the old part
    def _fold_into_old_part(self, V: torch.Tensor, lam1: torch.Tensor, lam2: torch.Tensor,
                            in_session: torch.Tensor, times: torch.Tensor) -> None:
        """Add the sites of readings that leave the held data (V = L^{-1} K_ZX (M, N), sites (N, P), the session
        flags and stamps (N,)) to the old part: a_w_old, W_old, and b_w_old / b_w_session (what a constant shift of
        all targets / the session's moves a_w by). With model.correlated_folds (and an error in time) readings
        close in time are one site (correlated_site_sums), so an error a pass shares counts once, not once per
        reading; in stretches of FOLD_BLOCK readings in time order, each stretch's correlation with the next
        left out (e's timescale is seconds, a stretch tens of seconds)."""
        if not (self.config.correlated_folds and self.learns_time_error and self.likelihood.conjugate):
            a_f, W_f = site_sums(V, lam1, lam2)
            b_f, b_s = V @ lam2, V @ (lam2 * in_session[:, None])
        else:
            a_f, W_f = self.a_w_old.new_zeros(self.a_w_old.shape), self.W_old.new_zeros(self.W_old.shape)
            b_f, b_s = torch.zeros_like(a_f), torch.zeros_like(a_f)
            error = self.likelihood.time_error
            # only the part of e that revisits have shown (its cap; none before they show any) is shared: before
            # that a pass's detail and e cannot be told apart, and a fold is final (e learned from a lawnmower's
            # first lanes at 3x the white noise of a world that has none would lose their readings for good)
            confirmed = torch.where(torch.isfinite(error.variance_cap), error.variance, 0.0 * error.variance)
            ratio = (confirmed / error.variance.clamp_min(1e-300))[:, None, None]
            stamped = torch.isfinite(times)
            order = torch.argsort(torch.where(stamped, times, torch.inf))
            for block in torch.split(order, FOLD_BLOCK):
                t = times[block]
                known = stamped[block]
                shared = error.covariance(torch.where(known, t, 0.0)) * ratio
                # an unstamped reading's error is its own: e's variance on its diagonal, no covariance
                pair = (known[:, None] & known[None, :]) | torch.eye(t.shape[0], dtype=torch.bool, device=t.device)
                columns = torch.stack([torch.ones_like(t), in_session[block].to(t)], 1)
                a, W, moved = correlated_site_sums(V[:, block], lam1[block], lam2[block], shared * pair, columns)
                a_f, W_f = a_f + a, W_f + W
                b_f, b_s = b_f + moved[..., 0], b_s + moved[..., 1]
        self.a_w_old = self.a_w_old + a_f
        self.W_old = self.W_old + W_f
        self.b_w_old = self.b_w_old + b_f
        self.b_w_session = self.b_w_session + b_s

    # ------------------------------------------------------------------ totals
    def _recompute_totals(self, L: torch.Tensor) -> None:
        """Whitened totals = old part + held (memory and pending) contributions at the current Z and theta."""
        hx = torch.cat([self.mem_x, self.pend_x])
        a_h, W_h = site_sums(self._features(L, hx), torch.cat([self.mem_lam1, self.pend_lam1]),
                             torch.cat([self.mem_lam2, self.pend_lam2]))
        self.a_w = self.a_w_old + a_h
        self.W = self.W_old + W_h


__all__ = ["DualSites", "correlated_site_sums", "residual_weighted_sites", "site_sums"]
