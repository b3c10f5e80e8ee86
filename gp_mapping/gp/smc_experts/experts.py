"""The experts of the SMC mixture (:mod:`.model`): each an exact GP, on its memory of pseudo-observations, with its
own hyperparameters theta_k (moved by elliptical slice sampling after each batch); their caches for prediction."""
from __future__ import annotations

import math

import torch

from ..linalg import jittered_cholesky
from .dp_mixture import elliptical_slice

LOG_2PI = math.log(2.0 * math.pi)
#: smallest noise variance an expert may have, relative to its own prior variance k(x, x)
NOISE_FLOOR = 1e-6


class ExpertGPs:
    """Mixin of :class:`~.model.SMCExperts`: the experts' kernels, marginal likelihoods, factor caches and
    predictions, and the moves of their hyperparameters."""

    # ------------------------------------------------------------------ kernels and expert GPs
    def _kernel(self, x1: torch.Tensor, x2: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """k(x1, x2) (..., N1, N2) for inputs (..., N1, D), (..., N2, D) and log-hyperparameters (..., H)."""
        ls = torch.exp(theta[..., :self.num_ls])[..., None, self.axis_group]
        r2 = squared_distances(x1 / ls, x2 / ls)
        k = torch.exp(theta[..., self.num_ls])[..., None, None] * self._profile(torch.sqrt(r2.clamp_min(1e-36)))
        if self.has_constant:
            k = k + torch.exp(theta[..., -1])[..., None, None]
        return k

    def _prior_var(self, theta: torch.Tensor) -> torch.Tensor:
        """k(x, x) (...)."""
        v = torch.exp(theta[..., self.num_ls])
        return v + torch.exp(theta[..., -1]) if self.has_constant else v

    def _noise(self, theta: torch.Tensor) -> torch.Tensor:
        # A function of theta alone: the cached factors of an expert stay valid when the running scale changes.
        return torch.maximum(torch.exp(theta[..., self.num_ls + 1]), NOISE_FLOOR * self._prior_var(theta))

    def _gram(self, mx: torch.Tensor, mc: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """K + diag(noise / c) on the valid entries, identity on free ones (..., M, M)."""
        valid = mc > 0
        vf = valid.to(mx.dtype)
        k = self._kernel(mx, mx, theta) * vf[..., :, None] * vf[..., None, :]
        diag = torch.where(valid, self._noise(theta)[..., None] / mc.clamp_min(1.0), torch.ones_like(mc))
        k = k + torch.diag_embed(diag)
        return k + self.config.jitter * self._prior_var(theta)[..., None, None] * torch.eye(
            mx.shape[-2], dtype=mx.dtype, device=mx.device) * vf[..., None, :]

    def _log_marginal(self, theta: torch.Tensor, mx, my, mc, ms) -> torch.Tensor:
        """log p(memory readings | theta) (B,) in standardised units for B experts (exact for merged repeats);
        -inf where K cannot be factorised."""
        mean, ratio, _ = self._work_scale()
        valid = mc > 0
        vf = valid.to(mx.dtype)
        yt = (my - mean) * ratio * vf[..., None]
        L, info = torch.linalg.cholesky_ex(self._gram(mx, mc, theta))
        ok = info == 0
        L = torch.where(ok[:, None, None], L, torch.eye(L.shape[-1], dtype=L.dtype, device=L.device))
        w = torch.linalg.solve_triangular(L, yt, upper=False)
        p = my.shape[-1]
        logdet = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
        ll = -0.5 * ((w * w).sum((-2, -1)) + p * logdet + p * LOG_2PI * vf.sum(-1))
        noise = self._noise(theta)
        c = mc.clamp_min(1.0)
        within = (-(0.5 * (c - 1.0))[..., None] * (LOG_2PI + torch.log(noise))[:, None, None]
                  - 0.5 * torch.log(c)[..., None] - 0.5 * (ms * ratio ** 2) / noise[:, None, None])
        ll = ll + (within * vf[..., None]).sum((-2, -1))
        return torch.where(ok & torch.isfinite(ll), ll, torch.full_like(ll, -math.inf))

    def _used_memory(self, mc: torch.Tensor) -> int:
        """Entries in use are a prefix of each memory (free slots are filled in order and only emptied with
        their expert): the largest prefix among ``mc`` (..., M) bounds every computation."""
        return max(1, int((mc > 0).sum(-1).max())) if mc.numel() else 1

    def _refresh(self, jj: torch.Tensor | None = None, kk: torch.Tensor | None = None) -> None:
        """Recompute the cached factors of experts (jj, kk) (all when None, or when the memories in use have
        outgrown the cache). The cache covers the used prefix of the memories (U entries), free entries with
        identity rows, so its size follows the data, not smc_expert_memory."""
        u = self._used_memory(self.mem_c)
        if jj is None or not self._cache_ok or self._chol.shape[-1] < u:
            j, k = self.num_particles, self.max_experts
            jj, kk = [t.flatten() for t in torch.meshgrid(torch.arange(j, device=self.device),
                                                          torch.arange(k, device=self.device), indexing="ij")]
            self._chol = torch.eye(u, dtype=torch.float64, device=self.device).repeat(j, k, 1, 1)
            self._ly = torch.zeros(j, k, u, self.output_dims, dtype=torch.float64, device=self.device)
            self._l1 = torch.zeros(j, k, u, dtype=torch.float64, device=self.device)
            self._cache_ok = True
        if jj.numel() == 0:
            return
        u = self._chol.shape[-1]
        inverse, rj, rk = self._distinct(jj, kk)
        mx, mc = self.mem_x[rj, rk, :u], self.mem_c[rj, rk, :u]
        L, _ = jittered_cholesky(self._gram(mx, mc, self.theta[rj, rk]), 0.0)
        vf = (mc > 0).to(mx.dtype)
        self._chol[jj, kk] = L[inverse]
        self._ly[jj, kk] = torch.linalg.solve_triangular(L, self.mem_y[rj, rk, :u] * vf[..., None],
                                                         upper=False)[inverse]
        self._l1[jj, kk] = torch.linalg.solve_triangular(L, vf[..., None], upper=False)[..., 0][inverse]

    def _distinct(self, jj: torch.Tensor, kk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Distinct experts among (jj, kk) by id: (inverse (n,) into the distinct ones, and their particle and
        expert indices (r,), the first of each id)."""
        _, inverse = torch.unique(self.expert_id[jj, kk], return_inverse=True)
        n_rep = int(inverse.max()) + 1 if inverse.numel() else 0
        first = torch.full((n_rep,), jj.numel(), dtype=torch.int64, device=jj.device)
        first = first.scatter_reduce(0, inverse, torch.arange(jj.numel(), device=jj.device), "amin")
        return inverse, jj[first], kk[first]

    def _ensure_cache(self) -> None:
        if not self._cache_ok:
            self._refresh()

    def _expert_predict(self, x: torch.Tensor, active: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent mean and variance (work units) of the experts at inputs x (G, D): (J, K, G, P), (J, K, G).
        With ``active`` (J, K) only those experts are computed; the others get mean 0 and their prior variance
        (the caller gives them no weight)."""
        mean_y, ratio, _ = self._work_scale()
        u = self._used_memory(self.mem_c)
        if active is None:  # every expert, each distinct one computed once
            active = torch.ones_like(self.count, dtype=torch.bool)
        jj, kk = torch.nonzero(active, as_tuple=True)
        inverse, rj, rk = self._distinct(jj, kk)
        sel = (rj, rk)
        th = self.theta[sel]
        mx = self.mem_x[sel][..., :u, :]
        ks = self._kernel(mx, x.expand(*mx.shape[:-2], *x.shape), th)                   # (..., u, G)
        ks = ks * (self.mem_c[sel][..., :u] > 0).to(ks.dtype)[..., None]
        v = torch.linalg.solve_triangular(self._chol[sel][..., :u, :u], ks, upper=False)
        wy = (self._ly[sel][..., :u, :] - mean_y * self._l1[sel][..., :u, None]) * ratio  # (..., u, P)
        mean = torch.einsum("...mg,...mp->...gp", v, wy)
        var = (self._prior_var(th)[..., None] - (v * v).sum(-2)).clamp_min(0.0)
        j, k, g = active.shape[0], active.shape[1], x.shape[0]
        full_mean = torch.zeros(j, k, g, self.output_dims, dtype=mean.dtype, device=mean.device)
        full_var = self._prior_var(self.theta)[..., None].expand(j, k, g).clone()
        full_mean[jj, kk], full_var[jj, kk] = mean[inverse], var[inverse]
        return full_mean, full_var

    def _ensure_pred_cache(self) -> None:
        """The prediction cache: the distinct experts (resampling copies experts into several particles, and a
        copy stays identical until it takes a reading: on a mapping drive 510 experts in use were 53 distinct),
        each with L^-1 and K^-1 (y - mean) r in work units, so that predicting at G points is one kernel
        evaluation and two batched matrix products per group of distinct experts (no triangular solve per map):
        mean = k*^T K^-1 y and var = k** - |L^-1 k*|^2. ``_rep`` (J, K) gives each expert's distinct index (-1:
        free slot). Rebuilt after every update (hyperparameters, memories and the running target scale change
        there), once per map at most."""
        if self._pred_ok:
            return
        self._ensure_cache()
        mean_y, ratio, _ = self._work_scale()
        u = self._chol.shape[-1]
        used = self.count > 0
        jj, kk = torch.nonzero(used, as_tuple=True)
        inverse, rj, rk = self._distinct(jj, kk)
        self._rep = torch.full(used.shape, -1, dtype=torch.int64, device=self.device)
        self._rep[jj, kk] = inverse
        self._rep_jk = (rj, rk)
        eye = torch.eye(u, dtype=torch.float64, device=self.device)
        chol = self._chol[rj, rk]
        self._linv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
        wy = (self._ly[rj, rk] - mean_y * self._l1[rj, rk][..., None]) * ratio              # L^-1 y (R, U, P)
        self._kiy = self._linv.transpose(-1, -2) @ wy
        self._pred_ok = True

    def _predict_selected(self, reps: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent mean (A, G, P) and variance (A, G) in work units of the distinct experts ``reps`` (A,) at x
        (G, D), from the prediction cache: one kernel evaluation and two batched GEMMs for the whole group."""
        u = self._linv.shape[-1]
        jj, kk = self._rep_jk[0][reps], self._rep_jk[1][reps]
        th = self.theta[jj, kk]
        mx = self.mem_x[jj, kk, :u]
        ks = self._kernel(mx, x, th) * (self.mem_c[jj, kk, :u] > 0).to(x.dtype)[..., None]  # (A, U, G)
        mean = ks.transpose(-1, -2) @ self._kiy[reps]                                     # (A, G, P)
        v = self._linv[reps] @ ks                                                         # (A, U, G)
        var = (self._prior_var(th)[:, None] - (v * v).sum(-2)).clamp_min(0.0)
        return mean, var

    def _move_hyperparameters(self, touched: torch.Tensor) -> int:
        """Elliptical slice sampling of the hyperparameters of the experts that received data, at most
        smc_slice_experts per particle (those that received the most); returns likelihood evaluations."""
        cfg = self.config
        n_move = min(int(cfg.smc_slice_experts), self.max_experts)
        if cfg.smc_slice_steps == 0 or n_move == 0:
            return 0
        # A stable sort, not topk: experts tied on readings are taken lowest slot first on every device (CUDA's
        # topk breaks ties its own way, and which experts move decides the random draws that follow).
        top = torch.argsort(touched, dim=1, descending=True, stable=True)[:, :n_move]
        sel = torch.gather(touched, 1, top) > 0
        jj = torch.arange(self.num_particles, device=self.device)[:, None].expand(-1, n_move)[sel]
        kk = top[sel]
        if jj.numel() == 0:
            return 0
        u = self._used_memory(self.mem_c[jj, kk])
        mx, my, mc, ms = (self.mem_x[jj, kk, :u], self.mem_y[jj, kk, :u], self.mem_c[jj, kk, :u],
                          self.mem_s[jj, kk, :u])

        def log_lik(th: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return self._log_marginal(th, mx[idx], my[idx], mc[idx], ms[idx])

        theta = self.theta[jj, kk]
        std = torch.full_like(self.prior_mean, float(cfg.smc_hyper_prior_std))
        ll, evals = None, 0
        for _ in range(int(cfg.smc_slice_steps)):
            theta, ll, n_eval = elliptical_slice(theta, log_lik, self._prior_now(), std, self._generator,
                                                 current_ll=ll)
            evals += int(n_eval.sum())
        self.theta[jj, kk] = theta
        self._fresh_ids(jj, kk)
        self._refresh(jj, kk)
        return evals


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a_i - b_j|^2 (..., N1, N2) for (..., N1, D) and (..., N2, D), one input dimension at a time (exact zeros
    for equal points, no (..., N1, N2, D) temporary)."""
    r2 = None
    for d in range(a.shape[-1]):
        diff = a[..., :, None, d] - b[..., None, :, d]
        r2 = diff * diff if r2 is None else r2 + diff * diff
    return r2

