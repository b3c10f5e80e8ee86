"""Inducing inputs of the continual multi-output GP (:mod:`.model`).

Inducing inputs (per latent, under the latent's current kernel): while model.num_inducing allows, every old
point is kept and batch points are added greedily (pivoted Cholesky on the residual kernel given Z_old) while
a candidate's residual prior variance exceeds 1e-4 of the largest prior variance: the set grows as new ground
is covered and nothing of q_old is lost. When more points are needed than the budget holds, the set moves:
pivoted Cholesky over [Z_old; X_batch] re-covers the union, dropping old points where the cover is densest.
A new point never coincides with a kept one (its residual variance would be zero), so K_nn and q~ stay
positive definite. Z is chosen again (from Z_old and the batch, q~ rebuilt there) after every M-step, under the
kernel just learned, with its lengthscales capped at model.lengthscale for the choice only: a set chosen under
a lengthscale that one batch has stretched is too sparse for any shorter one, and the sparse bound then keeps
the lengthscale long in every later update, the channel's noise inflating update after update (what was
measured on a real recording is in bench/README.md, "Inducing placement of the continual multi-output GP").
"""
from __future__ import annotations

import copy

import torch

from ..inducing import pivoted_cholesky
from ..kernels import Kernel, stationary_part
from ..linalg import tril_solve
from .bound import ContinualPrior, LatentPosterior


class InducingPlacement:
    """Mixin of :class:`~.model.ContinualMOGP`: where each latent's inducing inputs go."""

    # ------------------------------------------------------------------ inducing inputs
    def _placement_kernel(self, q: int) -> Kernel:
        """Latent q's kernel with its lengthscales capped at model.lengthscale, for choosing Z only. Placed under
        a lengthscale that one batch has stretched, Z would be too sparse for any shorter one, and the sparse
        bound (its trace term) would then keep the lengthscale long in every later update: a trap."""
        kernel = self.kernels[q]
        main = stationary_part(kernel)
        cap = float(self.config.lengthscale)
        if main is None or bool((main.lengthscale <= cap).all()):
            return kernel
        # One copy per latent, kept and refreshed from the kernel (a deep copy per placement cost ~1 ms).
        capped = self._capped_kernels.get(q)
        if capped is None or stationary_part(capped).lengthscale_param.raw.device != main.lengthscale_param.raw.device:
            capped = copy.deepcopy(kernel)
            self._capped_kernels[q] = capped
        with torch.no_grad():
            for mine, theirs in zip(capped.parameters(), kernel.parameters()):
                mine.copy_(theirs)
        stationary_part(capped).lengthscale_param.set(main.lengthscale_param.value.detach().clamp_max(cap))
        return capped

    def _select_inducing(self, q: int, x: torch.Tensor, z_old: torch.Tensor) -> torch.Tensor:
        """New Z_q under latent q's current kernel. While the budget allows, every old point is kept (first, in
        order: nothing of q_old is lost) and batch points are added greedily by their residual variance given
        Z_old; when more are needed than the budget holds, the set moves: pivoted Cholesky over [Z_old; X] (old
        points listed first keep ties)."""
        kernel = self._placement_kernel(q)
        budget = int(self.config.num_inducing)
        with torch.no_grad():
            prior_diag = kernel.diag(x)
            if z_old.shape[0] == 0:
                idx, _ = pivoted_cholesky(kernel, prior_diag, x, budget, self.inducing_rel_tol)
                return x[torch.sort(idx).values]
            L = self._chol_K(kernel, z_old)
            V = tril_solve(L, kernel(z_old, x))
            residual = (prior_diag - (V * V).sum(0)).clamp_min(0.0)
            scale = float(prior_diag.max().clamp_min(1e-300))
            room = budget - z_old.shape[0]
            if not float(residual.max()) > self.inducing_rel_tol * scale:
                return z_old.clone()  # the batch is covered
            if room > 0:
                def conditional(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                    va = tril_solve(L, kernel(z_old, a))
                    vb = tril_solve(L, kernel(z_old, b))
                    return kernel(a, b) - va.T @ vb
                # Same absolute threshold as the plain selection: rel_tol times the largest prior variance.
                rel = self.inducing_rel_tol * scale / float(residual.max())
                idx, _ = pivoted_cholesky(conditional, residual, x, room + 1, rel)
                if idx.numel() <= room:
                    return torch.cat([z_old, x[torch.sort(idx).values]])
            # More points are needed than the budget holds (a full set: any one), so the set moves.
            cand = torch.cat([z_old, x])
            idx, _ = pivoted_cholesky(kernel, kernel.diag(cand), cand, budget, self.inducing_rel_tol)
            return cand[torch.sort(idx).values]

    def _place_inducing(self, x: torch.Tensor, z_old: list[torch.Tensor], old: list[LatentPosterior] | None,
                        current: list[ContinualPrior | None] | None = None) -> list[ContinualPrior | None]:
        """Choose every latent's Z_new from its Z_old and the batch, build q~ there (continual updates) and
        warm-start q(u) at the prior (first update) or at q~; returns the continual priors (None: first).
        ``current``: the priors of the placement before in this update; a latent whose Z does not move keeps its
        prior and q(u)."""
        priors: list[ContinualPrior | None] = []
        for q in range(self.num_latents):
            z_new = self._select_inducing(q, x, z_old[q])
            if current is not None and torch.equal(z_new, self.z(q)):
                priors.append(current[q])  # Z_q stays: q~ is the same, and q(u_q) is kept as it is
                continue
            if old is None:
                priors.append(None)
                self._set_q(q, z_new, z_new.new_zeros(z_new.shape[0]), self._chol_K(self.kernels[q], z_new))
            else:
                prior = self._continual_prior(old[q], z_new)
                priors.append(prior)
                self._set_q(q, z_new, prior.chol_old @ prior.mean_w, prior.chol_old @ prior.cov_chol_w)
        return priors
