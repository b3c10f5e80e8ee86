"""The dual SVGP's posterior for a merge of maps without data (the merge itself: ``gp/merging/``): its summary as a
pseudo-likelihood on u = f(Z), and a merged posterior set into an engine (:mod:`.model`)."""
from __future__ import annotations

import copy

import torch

from ..base import counted_as_moving
from ..linalg import symmetrise


class RecyclableDual:
    """Mixin of :class:`~.model.DualSVGP`: the recyclable summary and the recycled posterior (``gp/merging/``)."""

    # ------------------------------------------------------------------ recyclable merge (gp/merging/)
    def recyclable_summary(self) -> dict:
        """q(u) as a pseudo-likelihood on u = f(Z) in the original target units, for merging maps without data.

        Keys: ``z`` (M, D); ``target_mean``, ``target_scale`` (P,): f = target_mean + target_scale * f_std;
        ``prior_cov`` (P, M, M): prior covariance of f(Z) in original units (jitter included); ``site_a`` (P, M),
        ``site_W`` (P, M, M): q(u) / p(u) = exp(site_a^T v - v^T site_W v / 2) up to a constant, v =
        chol(prior_cov)^{-1} (f(Z) - target_mean); ``noise`` (P,): noise variance in original units (NaN for a
        likelihood without one); ``kernel``: a copy of the kernel (standardised units); ``num_seen``.
        """
        with torch.no_grad():
            noise = getattr(self.likelihood, "noise_variance", getattr(self.likelihood, "scale_variance", None))
            noise = (torch.full((self.output_dims,), float("nan"), dtype=torch.float64) if noise is None
                     else noise.detach().cpu() * self.y_std.cpu() ** 2)
            L = self._chol_K() if self.num_inducing else self.W[0].clone()
            scale = self.y_std.cpu()
            K = (L @ L.T).cpu()
            return {"z": self.Z.detach().cpu().clone(), "target_mean": self.y_mean.detach().cpu().clone(),
                    "target_scale": scale.clone(), "prior_cov": K[None] * (scale ** 2)[:, None, None],
                    "site_a": self.a_w.T.detach().cpu().clone(), "site_W": self.W.detach().cpu().clone(),
                    "noise": noise, "kernel": copy.deepcopy(self.kernel).cpu(), "num_seen": self.num_seen}

    def set_recycled_posterior(self, z, site_a, site_W, target_mean, target_scale, jitter: float,
                               num_seen: int) -> None:
        """Make this model the merged map: inducing inputs ``z`` (M, D), whitened sites ``site_a`` (P, M) and
        ``site_W`` (P, M, M) relative to chol(K(z, z) + jitter I) of the current kernel (standardised units),
        the targets' offset and scale (P,); everything becomes the old part (no memory, nothing pending)."""
        with torch.no_grad():
            dev = self.device
            zt = self._check_x(z, "z")
            m, p = zt.shape[0], self.output_dims
            self.Z = zt.clone()
            self.jitter_t.fill_(float(jitter))
            self.a_w_old = torch.as_tensor(site_a, dtype=torch.float64, device=dev).reshape(p, m).T.clone()
            self.W_old = symmetrise(torch.as_tensor(site_W, dtype=torch.float64, device=dev).reshape(p, m, m).clone())
            self.a_w, self.W = self.a_w_old.clone(), self.W_old.clone()
            for prefix in ("mem", "pend"):
                for name in ("x", "y", "lam1", "lam2", "in_session"):
                    setattr(self, f"{prefix}_{name}", getattr(self, f"{prefix}_{name}")[:0])
            self.mem_logkey = self.mem_logkey[:0]
            self.mem_t, self.pend_t = self.mem_t[:0], self.pend_t[:0]
            self.y_mean.copy_(torch.as_tensor(target_mean, dtype=torch.float64).reshape(p))
            self.y_std.copy_(torch.as_tensor(target_scale, dtype=torch.float64).reshape(p))
            self.standardised.fill_(True)
            self.num_seen_t.fill_(int(num_seen))
            self.seen_at_full_t.fill_(int(num_seen))
            # The merged sites are a pseudo-likelihood on u: a shift of the targets' origin moves them along
            # B K^{-1} 1 (whitened: W L^{-1} 1), and the running statistics start at the merged scale.
            self._drop_caches()
            e_w = torch.linalg.solve_triangular(self._chol_K(), torch.ones(m, 1, dtype=torch.float64, device=dev),
                                                upper=False)[:, 0]
            self.b_w_old = (self.W_old @ e_w).T.clone()
            self.b_w_session = torch.zeros_like(self.b_w_old)  # a merged map starts a session of its own
            self.y_count.fill_(float(num_seen))
            self.y_run_mean.copy_(self.y_mean)
            self.y_run_m2.copy_(self.y_std ** 2 * float(num_seen))
            # the merged statistics stand for the sources' (moving) data
            self.y_moved.copy_(counted_as_moving(self.y_count))
            self.hyper_learned.fill_(True)
        self._refresh_cache()


__all__ = ["RecyclableDual"]
