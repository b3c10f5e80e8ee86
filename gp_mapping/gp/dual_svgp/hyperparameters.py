"""The dual SVGP's hyperparameter steps (:mod:`.model`) and, with learn_inducing, its inducing-input steps: the
two objectives theta can follow, their hand-written gradient with Z fixed, the Adam loop, the samples a step sees.

Hyperparameters (full mode) take Adam steps on one of two objectives (model.hyper_objective):

streaming (the default): the streaming ELBO of Bui, Nguyen and Turner (2017, "Streaming sparse Gaussian process
approximations", NeurIPS), with the old data's approximate likelihood t_old(u) held fixed on u = f(Z):
    l(theta) = sum_{held} E_q[log p(y|f)] + E_q[log t_old(u)] - KL[q || p_theta]
Each held datum (memory, pending, batch) counts once and every other datum speaks through t_old, so the bound
is that of all data seen under the old data's Gaussian approximation. With the paper's objective below, a large
move of theta could gain by lowering the KL of q, which holds all the old data's information, while only the
memory's scaled term spoke for those data: on Solin protocol 1 under a lower noise floor, two updates of 20
steps moved both lengthscales by 30-45 % and the map of the streamed readings went from 0.37 to 1.23 uT
(docs/calibration.md, Hyperparameter objective).

memory: the dual-fixed objective (Chang et al. 2023, sec. 3.4)
    l(theta) = sum_{batch} E_q[log p(y|f)] + (N_old / |memory|) sum_{memory} E_q[log p(y|f)] - KL[q || p_theta]
with N_old the number of data seen before this batch: reservoir sampling makes the memory a uniform sample of
the old data, so each member stands for N_old/|memory| of them (unbiased for a uniform memory; the reference
code's num_seen/num_mem_per_batch over-weights a memory that has grown). With learned Z, theta follows this one.

The optimiser's moments carry over between updates. Sites stay fixed during the steps. When theta changes, held
data's contributions are recomputed with the new k_i (their sites are per datum), while the old part is kept
fixed as a pseudo-likelihood on u = f(Z): its natural parameters K^{-1} a_old and K^{-1} B_old K^{-1} (eqs.
14-17: ytilde_u, Sigma_u) do not depend on theta, so a_old <- K_new K_old^{-1} a_old and B_old <- K_new
K_old^{-1} B_old K_old^{-1} K_new, the same A_p transport as a move of Z (A_p = K_old^{-1} Cov(u_old, u_new)).
This is exact for a change of signal variance (k_i and K scale together), where keeping (a_old, B_old) fixed, as
the reference code does, is not. After the steps the held sites are refitted under the new hyperparameters
(n_steps BLR steps) before any is folded. With Z fixed a step's gradient is worked out by hand down to the kernel
matrices (_fixed_z_bound, ~13 M^3 against autograd's ~37 through the factorisations); with learned Z, autograd
differentiates the general objective.

With learn_inducing (full mode), Z also takes Adam steps (inducing_lr) alongside theta, on l_Z: the ELBO with
the held data unweighted and the old data seen through their pseudo-likelihood t_old(u0), u0 = f(Z0), under
q(u0) = int p(u0|u) q(u) du (Bui et al. 2017 do the same for their old inducing points). The conditional
variance of u0 given u charges each move for the old information the new Z cannot represent: on the paper's
objective alone, a move of Z that projects old information away lowers the KL by more than the scaled memory
term notices, so Z drifts away from the old data and the map diverges. The paper says pivoted Cholesky
suffices; on real magnetometer data gradient-trained Z maps markedly better at the same M, but the gain
depends on the recording and on inducing_lr, so learn_inducing is off by default (the measurements are in
bench/README.md, "Inducing-input learning").
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import GPNumericalError
from ..linalg import jittered_cholesky, symmetrise
from .sites import site_sums


class HyperparameterSteps:
    """Mixin of :class:`~.model.DualSVGP`: learning theta (and Z) on the streaming or the dual-fixed objective."""

    # ------------------------------------------------------------------ hyperparameters
    def _observation_parameters(self) -> list[nn.Parameter]:
        """What a reading's likelihood depends on besides f: the likelihood's and, where learned, the position
        noise's variance."""
        position = getattr(self, "position_param", None)
        learned = [position.raw] if position is not None and position.raw.requires_grad else []
        return list(self.likelihood.parameters()) + learned

    def _hyper_parameters(self) -> list[nn.Parameter]:
        return list(self.kernel.parameters()) + self._observation_parameters()

    def _held_log_lik(self, y, mean, var, slope2: torch.Tensor | None) -> torch.Tensor:
        """E_q[log p(y_i|f_i)] (N, P) of held data; ``slope2`` (N, P): their squared slopes, whose product with
        the position variance is each one's own noise (model._slope_noise)."""
        if slope2 is None:
            return self.likelihood.expected_log_lik(y, mean, var)
        return self.likelihood.expected_log_lik(y, mean, var, extra=self._slope_noise(slope2))

    def _hyper_objective(self, L0, z0, z, hx, hy, lam1, lam2, weights,
                         fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
                         slope2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dual-fixed objectives at (theta, Z) for autograd, used when Z is learned (with Z fixed, _fixed_z_bound
        gives l_theta and its gradient at a third of the cost); held sites fixed, the old part fixed as a
        pseudo-likelihood t_old on v0 = L0^{-1} f(Z0), carried to u = f(Z) by A_p (whitened: G = L0^{-1} Cov(u0, u)
        L^{-T}).

        Returns (l_theta, l_Z):
          l_theta = sum_held w_i E_q[log p(y_i|f_i)] - KL[q || p]   (the paper's objective, memory scaled)
          l_Z     = sum_held E_q[log p(y_i|f_i)] + E_q[log t_old(v0)] - KL[q || p]
        l_Z is an evidence lower bound in which the old data speak through t_old, evaluated under q(v0) =
        int p(v0|u) q(u) du: Cov[v0] = I - G G^T + G Sigma G^T. The conditional term I - G G^T charges a move
        of Z for the old information it can no longer represent, so Z cannot gain by forgetting (with l_theta
        alone, moving Z to project the old part away lowers the KL more than the memory term notices).
        """
        L = self._chol_K(z)
        G = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L0, self._cross(z0, z), upper=False).T,
                                          upper=False).T
        V = torch.linalg.solve_triangular(L, self.kernel(z, hx), upper=False)
        a_h, W_h = site_sums(V, lam1, lam2)
        a_fixed, W_fixed = fixed if fixed is not None else (self.a_w_old, self.W_old)
        a_old = G.T @ a_fixed
        W_old = symmetrise(G.T @ W_fixed @ G)
        R, c = self._posterior(a_old + a_h, W_old + W_h)
        mean, var, _ = self._marginals(V, R, c, self.kernel.diag(hx))
        ell = self._held_log_lik(hy, mean, var, slope2)
        eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
        R_inv = torch.linalg.solve_triangular(R, eye.expand_as(R), upper=False)
        mean_w = torch.linalg.solve_triangular(R.transpose(-1, -2), c[..., None], upper=True)[..., 0]
        # KL[q || p] = 1/2 [log|K+B|/|K| + tr((K+B)^{-1} K) - M + a^T (K+B)^{-1} K (K+B)^{-1} a]
        kl = (torch.log(torch.diagonal(R, dim1=-2, dim2=-1)).sum()
              + 0.5 * ((R_inv * R_inv).sum() - R.shape[0] * R.shape[-1] + (mean_w * mean_w).sum()))
        l_theta = (ell * weights[:, None]).sum() - kl
        # E_q[log t_old(v0)] = a_old^T E[v0] - 1/2 tr(W_old (Cov[v0] + E[v0] E[v0]^T)), per output, with
        # G^T W_old G (= W_old above) carrying the projected part; Sigma = R^{-T} R^{-1}.
        sigma = R_inv.transpose(-1, -2) @ R_inv
        lost = torch.diagonal(self.W_old, dim1=-2, dim2=-1).sum() - torch.diagonal(W_old, dim1=-2, dim2=-1).sum()
        old_term = ((a_old * mean_w.T).sum()
                    - 0.5 * (lost + (W_old * sigma).sum()
                             + torch.einsum("pm,pmn,pn->", mean_w, W_old, mean_w)))
        return l_theta, ell.sum() + old_term - kl

    def _old_part_on_u(self, L0: torch.Tensor, fixed: tuple[torch.Tensor, torch.Tensor] | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The old part as a pseudo-likelihood on u = f(Z) (natural parameters a_u = L0^{-T} a_w, (M, P), and
        W_u = L0^{-T} W L0^{-1}, (P, M, M)): with Z fixed it does not depend on theta, and under a new prior
        factor L its whitened form is (L^T a_u, L^T W_u L), the same carriage as G = L0^{-1} L."""
        a_fixed, W_fixed = fixed if fixed is not None else (self.a_w_old, self.W_old)
        a_u = torch.linalg.solve_triangular(L0.T, a_fixed, upper=True)
        half = torch.linalg.solve_triangular(L0.T, W_fixed, upper=True)  # L0^{-T} W
        W_u = torch.linalg.solve_triangular(L0.T, half.transpose(-1, -2), upper=True)
        return a_u, symmetrise(W_u)

    def _fixed_z_bound(self, a_u: torch.Tensor, W_u: torch.Tensor, hx, hy, lam1, lam2, weights,
                       with_old_term: bool = False, slope2: torch.Tensor | None = None,
                       times: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable[[float], None]]:
        """l_theta of _hyper_objective with Z fixed, and a function that sets the hyperparameters' .grad to the
        gradient of -scale * l_theta.

        The gradient is worked out by hand down to the kernel matrices (K_ZZ, K_ZX, k(x, x)) and the likelihood's
        inputs, and only the kernel and the likelihood are differentiated by autograd: autograd through the
        Cholesky factors and triangular solves costs ~26 M^3 per step, these adjoints ~8 M^3.
        Forward, per output p (whitened by L = chol(K)): V = L^{-1} K_ZX, A = I + L^T W_u L + V diag(lam2) V^T,
        a = L^T a_u + V lam1, S = A^{-1}, m = S a; mean_i = v_i^T m, var_i = k_ii - v_i^T v_i + v_i^T S v_i;
        l = sum_i w_i E[log p(y_i | f_i)] - KL, KL = (log|A| + tr S - M + m^T m) / 2.
        Backward: with gm, gv = dl/dmean, dl/dvar, dl/dm = V gm - m and dl/dS = V diag(gv) V^T - I/2, so
        dl/da = S dl/dm and dl/dA = -(dl/da) m^T - S (dl/dS) S - S/2; then through A and a to L and V,
        through V = L^{-1} K_ZX to K_ZX and L, and from L to K_ZZ.
        with_old_term (the streaming ELBO): l also holds E_q[log t_old(u)] = a_o^T m - tr(W_o (S + m m^T)) / 2,
        with a_o = L^T a_u and W_o = L^T W_u L, which adds a_o - W_o m to dl/dm and -W_o / 2 to dl/dS, and
        directly a_u m^T - X (S + m m^T) to dl/dL.
        times (model.time_error): the held data's stamps, NaN for a reading whose shared error is independent of
        every other's (the memory's). The stamped readings' term is E_q[log N(y_b | f_b, Sigma)] with Sigma the
        white noise plus e(t)'s covariance (GaussianLikelihood.correlated_expected_log_lik), which needs q's full
        covariance C = K_bb - V_b^T V_b + V_b^T S V_b of f_b: with G = dl/dC it adds V_b G V_b^T to dl/dS, and
        2 (S V_b G - V_b G) to dl/dV_b, and G itself to dl/dK_bb. Their site is one for all of them,
        (V_b Pi y_b, V_b Pi V_b^T) with Pi = Sigma^{-1} held as sites are, which adds a_bar (Pi y_b)^T and
        2 A_bar V_b Pi to dl/dV_b.
        """
        z = self.Z
        corr = self._correlated_rows(times)
        with torch.enable_grad():
            kzz, kzx, kxx = self.kernel(z, z), self.kernel(z, hx), self.kernel.diag(hx)
            kbb = sigma = sigma_chol = None
            if corr is not None:
                kbb = self.kernel(hx[corr], hx[corr])
                # Sigma of the stamped readings' errors (the data term differentiates it) and its Cholesky
                # factor, once, as a constant: the data term's gradient is written out with it, the site takes it
                extra = None if slope2 is None else self._slope_noise(slope2[corr])
                sigma = self.likelihood.correlated_covariance(times[corr], extra)
                sigma_chol, _ = jittered_cholesky(sigma.detach(), 0.0)
        with torch.no_grad():
            L = self._factorise(kzz.detach())
            V = torch.linalg.solve_triangular(L, kzx.detach(), upper=False)  # (M, N)
            X = W_u @ L  # (P, M, M)
            if corr is not None:
                # the stamped readings' site is one for all of them, V_b Sigma^{-1} (y_b, V_b^T), at the current
                # theta: q is then the optimal one for their correlated likelihood, as the conjugate per-reading
                # sites are for the others (held fixed through a step, like every site)
                V_b = V[:, corr]
                Pi = torch.cholesky_inverse(sigma_chol)  # (P, Nb, Nb)
                pi = (Pi @ hy[corr].T[..., None])[..., 0]  # (P, Nb)
                lam1, lam2 = lam1.clone(), lam2.clone()
                lam1[corr], lam2[corr] = 0.0, 0.0
            a_h, W_h = site_sums(V, lam1, lam2)
            if corr is not None:
                a_h = a_h + V_b @ pi.T
                W_h = symmetrise(W_h + V_b @ Pi @ V_b.T)
            R, c = self._posterior(L.T @ a_u + a_h, L.T @ X + W_h)  # Cholesky reads the lower triangle only
            S = torch.cholesky_inverse(R)  # (P, M, M)
            m = torch.linalg.solve_triangular(R.transpose(-1, -2), c[..., None], upper=True)[..., 0]  # (P, M): S a
            SV = (V.T @ S).transpose(-1, -2)  # (P, M, N) S V, in V's column-major layout (S is symmetric)
            mean = V.T @ m.T  # (N, P)
            var = kxx.detach()[:, None] - (V * V).sum(0)[:, None] + (V * SV).sum(1).T
            kl = (torch.log(torch.diagonal(R, dim1=-2, dim2=-1)).sum()
                  + 0.5 * (torch.diagonal(S, dim1=-2, dim2=-1).sum() - S.shape[0] * S.shape[-1] + (m * m).sum()))
            # what the bound subtracts from the data term: the KL, less E_q[log t_old(u)] in the streaming ELBO
            penalty = kl
            if with_old_term:
                a_o = (L.T @ a_u).T  # (P, M)
                W_o = L.T @ X  # (P, M, M)
                W_o_m = (W_o @ m[..., None])[..., 0]
                penalty = kl - ((a_o * m).sum() - 0.5 * ((W_o * S).sum() + (m * W_o_m).sum()))
        mean_in = mean.requires_grad_(True)
        var_in = var.clamp_min(0.0).requires_grad_(True)
        cov_in = None
        if corr is not None:
            with torch.no_grad():
                SV_b = SV[:, :, corr]
                cov_in = symmetrise(kbb.detach() - V_b.T @ V_b + V_b.T @ SV_b).requires_grad_(True)  # (P, Nb, Nb)
        with torch.enable_grad():
            per_reading = self._held_log_lik(hy, mean_in, var_in, slope2) * weights[:, None]
            if corr is None:
                ell = per_reading.sum()
            else:
                independent = torch.ones_like(weights, dtype=torch.bool)
                independent[corr] = False
                # the stamped readings are one group (the batch), weighted alike (_hyper_sample)
                correlated = self.likelihood.correlated_expected_log_lik(hy[corr], mean_in[corr], cov_in, sigma,
                                                                         sigma_chol, Pi)
                ell = per_reading[independent].sum() + weights[corr].mean() * correlated
        value = ell.detach() - penalty

        def gradients(scale: float) -> None:
            lik_params = [p for p in self._observation_parameters() if p.requires_grad]
            kernel_params = [p for p in self.kernel.parameters() if p.requires_grad]
            inputs = [mean_in, var_in] + ([cov_in] if cov_in is not None else [])
            gm, gv, *g_rest = torch.autograd.grad(ell, inputs + lik_params, allow_unused=True)
            g_cov, g_lik = (symmetrise(g_rest[0]), g_rest[1:]) if cov_in is not None else (None, g_rest)
            with torch.no_grad():
                gv = gv * (var >= 0)  # clamp_min(0)'s gradient
                m_bar = (V @ gm).T - m + (a_o - W_o_m if with_old_term else 0.0)
                a_bar = (S @ m_bar[..., None])[..., 0]  # (P, M): S dl/dm
                SVg = SV * gv.T[:, None, :]
                # dl/dA, symmetric: S S / 2 - S / 2 - S V diag(gv) V^T S - sym(a_bar m^T). (S is exactly symmetric
                # and column-major, so S.mT is S in the row-major layout of S @ S.)
                A_bar = torch.baddbmm(0.5 * (S @ S - S.mT), SVg, SV.transpose(-1, -2), alpha=-1.0)
                A_bar.baddbmm_(a_bar[:, :, None], m[:, None, :], alpha=-0.5)
                A_bar.baddbmm_(m[:, :, None], a_bar[:, None, :], alpha=-0.5)
                if with_old_term:  # dl/dS's -W_o / 2, through S = A^{-1}
                    A_bar.add_(S @ W_o @ S, alpha=0.5)
                if g_cov is not None:  # dl/dS's V_b G V_b^T
                    SVG_b = SV_b @ g_cov  # (P, M, Nb)
                    A_bar.baddbmm_(SVG_b, SV_b.transpose(-1, -2), alpha=-1.0)
                # dl/dV = a_bar lam1^T + m gm^T + 2 (S V diag(gv) - V diag(gv) + sum_p A_bar_p V diag(lam2_p)), every
                # term in V's column-major layout (A_bar V as (V^T A_bar)^T, A_bar symmetric)
                V_bar = (torch.cat([lam1, gm], 1) @ torch.cat([a_bar, m])).T
                V_bar.add_(SVg.sum(0) - V * gv.sum(1) + sum((V.T @ A_bar[p]).T * lam2[:, p]
                                                            for p in range(A_bar.shape[0])), alpha=2.0)
                if g_cov is not None:  # the covariance of f_b, and the stamped readings' site
                    V_bar[:, corr] += 2.0 * (SVG_b.sum(0) - V_b @ g_cov.sum(0) + (A_bar @ V_b @ Pi).sum(0))
                    V_bar[:, corr] += a_bar.T @ pi
                kzx_bar = torch.linalg.solve_triangular(L.T, V_bar, upper=True)
                L_bar = a_u @ a_bar + 2.0 * (X @ A_bar).sum(0) - kzx_bar @ V.T
                if with_old_term:  # a_o and W_o's own dependence on L
                    L_bar.add_(a_u @ m - (X @ (S + m[:, :, None] * m[:, None, :])).sum(0))
                # The bound depends on K alone, not on which square root L of it whitens (L -> L U, U orthogonal,
                # leaves it unchanged), so dl/dL = 2 K_bar L and K_bar = L_bar L^{-1} / 2 (one solve; the general
                # Cholesky adjoint L^{-T} Phi(L^T L_bar) L^{-1} takes two and equals it here).
                kzz_bar = 0.5 * torch.linalg.solve_triangular(L, L_bar, upper=False, left=False)
            pairs = [(kzz, kzz_bar), (kzx, kzx_bar), (kxx, gv.sum(1))] + \
                ([(kbb, g_cov.sum(0))] if g_cov is not None else [])
            outputs = [(t, g) for t, g in pairs if t.requires_grad]
            g_kernel = torch.autograd.grad([t for t, _ in outputs], kernel_params,
                                           grad_outputs=[g for _, g in outputs],
                                           allow_unused=True) if outputs and kernel_params else ()
            for p, g in zip(kernel_params + lik_params, list(g_kernel) + g_lik):
                p.grad = None if g is None else -scale * g

        return value, gradients

    def _correlated_rows(self, times: torch.Tensor | None) -> torch.Tensor | None:
        """Indices of the held readings whose shared errors are correlated (stamped, with model.time_error), or
        None when fewer than two are."""
        if times is None or not hasattr(self.likelihood, "time_error"):
            return None
        rows = torch.nonzero(torch.isfinite(times)).reshape(-1)
        return rows if rows.numel() > 1 else None

    def _learn_hyperparameters(self, hx, hy, lam1, lam2, weights, budget: int,
                               fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
                               slope2: torch.Tensor | None = None,
                               times: torch.Tensor | None = None) -> tuple[int, float]:
        """Adam steps on theta (l_theta) and, if configured, on Z (l_Z); returns (steps, final l_theta per
        datum). ``fixed``: the whitened pseudo-likelihood held fixed during the steps (default the old part);
        ``slope2`` (N, P): the held data's squared slopes (position noise), held fixed; ``times`` (N,): their
        stamps with model.time_error (_fixed_z_bound; with learned Z every error counts as independent).
        At the end the old part is carried to the new prior and Z; held contributions are the caller's."""
        cfg = self.config
        params = self._hyper_parameters() if cfg.learn_hyperparameters else []
        learn_z = cfg.learn_inducing and not bool(self.z_fixed) and self.num_inducing > 1
        if (not params and not learn_z) or budget <= 0:
            return 0, 0.0
        z0 = self.Z
        L0 = self._chol_K()
        z = nn.Parameter(z0.clone(), requires_grad=learn_z)
        groups = ([{"params": params, "lr": cfg.hyper_lr}] if params else []) + \
            ([{"params": [z], "lr": cfg.inducing_lr}] if learn_z else [])
        optimiser = torch.optim.Adam(groups)
        self._restore_adam(optimiser, params)
        scale = 1.0 / max(1.0, float(weights.sum()))
        scale_z = 1.0 / max(1.0, float(self.num_seen))
        good = [p.detach().clone() for p in params]
        good_z = z0.clone()
        steps, value = 0, 0.0
        old_part_on_u = None if learn_z else self._old_part_on_u(L0, fixed)
        # the streaming ELBO: every held datum counts once and the old data speak through t_old (with learned Z,
        # l_theta stays the memory-scaled objective)
        streaming = cfg.hyper_objective == "streaming" and not learn_z
        ell_weights = torch.ones_like(weights) if streaming else weights
        with torch.enable_grad():
            for _ in range(budget):
                optimiser.zero_grad()
                try:
                    if learn_z:
                        l_theta, l_z = self._hyper_objective(L0, z0, z, hx, hy, lam1, lam2, weights, fixed,
                                                             slope2)
                    else:
                        l_theta, theta_gradients = self._fixed_z_bound(*old_part_on_u, hx, hy, lam1, lam2,
                                                                       ell_weights, with_old_term=streaming,
                                                                       slope2=slope2, times=times)
                        l_z = None
                    finite = bool(torch.isfinite(l_theta)) and (l_z is None or bool(torch.isfinite(l_z)))
                    # Converged: the last step gained less than hyper_tol per datum, so stop where this value
                    # was measured (with learned Z, l_theta alone does not tell convergence).
                    if finite and steps and not learn_z and cfg.hyper_tol > 0 \
                            and float(l_theta.detach()) * scale - value < cfg.hyper_tol:
                        value = float(l_theta.detach()) * scale
                        break
                    if finite and learn_z:
                        # Each objective drives its own variables (a datum's scaled memory weight stands for
                        # old data in l_theta; in l_Z they speak through t_old instead).
                        if params:
                            grads = torch.autograd.grad(-l_theta * scale, params, retain_graph=True,
                                                        allow_unused=True)
                            for p, g in zip(params, grads):
                                p.grad = g
                        z.grad, = torch.autograd.grad(-l_z * scale_z, [z])
                    elif finite:
                        theta_gradients(scale)
                except GPNumericalError:
                    finite = False
                grads_ok = finite and all(bool(torch.isfinite(p.grad).all())
                                          for p in params + ([z] if learn_z else []) if p.grad is not None)
                if not grads_ok:
                    with torch.no_grad():  # back to the last variables that evaluated cleanly
                        for p, g in zip(params, good):
                            p.copy_(g)
                        z.copy_(good_z)
                    break
                with torch.no_grad():
                    good = [p.detach().clone() for p in params]
                    good_z = z.detach().clone()
                value = float(l_theta.detach()) * scale
                optimiser.step()
                steps += 1
        self._store_adam(optimiser, params)
        with torch.no_grad():
            z_new = z.detach().clone()
            try:
                L_new = self._chol_K(z_new)
            except GPNumericalError:
                for p, g in zip(params, good):
                    p.copy_(g)
                z_new = good_z
                L_new = self._chol_K(z_new)
            self.Z = z_new
            self._transport_old_part(L0, self._cross(z0, z_new), L_new)
        return steps, value

    def _hyper_sample(self, V, hx, hy, lam1, lam2, weights, n_mem: int, slope2: torch.Tensor | None = None,
                      times: torch.Tensor | None = None) -> tuple:
        """What the hyperparameter steps see: at most model.hyper_points held samples, drawn uniformly within
        the memory and within the batch and weighted to stand for their group (an unbiased estimate of the
        data term, as minibatches are in SVGP training); the others' sites join the old part as the fixed
        pseudo-likelihood on u, so q keeps their information. Each step then costs O(hyper_points M^2)
        however many samples a full update holds. With learned Z (l_Z needs the old part alone) everything is
        seen. Returns the arguments (hx, hy, lam1, lam2, weights, fixed, slope2, times) of _learn_hyperparameters
        (``slope2``, the held data's squared slopes, and ``times``, their stamps, for the samples kept)."""
        n = hx.shape[0]
        cap = self.config.hyper_points
        if n <= cap or self.config.learn_inducing:
            return hx, hy, lam1, lam2, weights, None, slope2, times
        groups = [torch.arange(0, n_mem, device=self.device), torch.arange(n_mem, n, device=self.device)]
        quota = [round(cap * len(g) / n) for g in groups]
        chosen, w = [], weights.clone()
        for g, k in zip(groups, quota):
            if len(g) == 0 or k == 0:
                continue
            pick = g[torch.randperm(len(g), generator=self._generator)[:k].to(self.device)]
            w[pick] = w[pick] * (len(g) / k)
            chosen.append(pick)
        keep = torch.zeros(n, dtype=torch.bool, device=self.device)
        keep[torch.cat(chosen)] = True
        a_r, W_r = site_sums(V[:, ~keep], lam1[~keep], lam2[~keep])
        return (hx[keep], hy[keep], lam1[keep], lam2[keep], w[keep],
                (self.a_w_old + a_r, self.W_old + W_r), None if slope2 is None else slope2[keep],
                None if times is None else times[keep])


__all__ = ["HyperparameterSteps"]
