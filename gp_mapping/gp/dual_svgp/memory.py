"""The dual SVGP's memory (:mod:`.model`): Bayesian leverage scores, the candidates drawn from a batch, the
weighted reservoir, and the memory a full update keeps (the rest folded into the old part).

Memory (bounded by memory_size): from each full update's batch, memory_per_batch candidates are drawn without
replacement, in proportion to their Bayesian leverage score (or uniformly). The candidates then compete in a
weighted reservoir (Efraimidis & Spirakis A-Res): each gets the key log(U)/w, U ~ Uniform(0, 1), with
w = batch size / number of candidates (the number of data it stands for), and the memory keeps the
memory_size largest keys among old members and new candidates. With equal weights this is exactly reservoir
sampling: the memory is a uniform sample of all candidates ever offered, so every stretch of the stream is
represented in proportion to its amount of data, however long the robot runs. Losers are folded into
(a_old, B_old).
"""
from __future__ import annotations

import torch

from .sites import site_sums


class DualMemory:
    """Mixin of :class:`~.model.DualSVGP`: which held data stay in memory."""

    # ------------------------------------------------------------------ leverage
    def leverage_scores(self, x, y) -> torch.Tensor:
        """Bayesian leverage scores (N,) of (x, y) under the current posterior (sites at the current q):
        beta_i k_i^T K^{-1} S K^{-1} k_i (eq. 30), summed over outputs."""
        xt = self._check_x(x)
        yt = self._standardise(self._check_y(y, xt.shape[0]))
        with torch.no_grad():
            if self.num_inducing == 0:
                return torch.zeros(xt.shape[0], dtype=xt.dtype, device=xt.device)
            self._refresh_cache()
            L, R, c = self._cache
            mean, var, explained = self._marginals(self._features(L, xt), R, c, self.kernel.diag(xt))
            _, lam2 = self.likelihood.dual_sites(yt, mean, var)
            return (lam2 * explained).sum(1)

    # ------------------------------------------------------------------ memory
    def _draw_candidates(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        n = scores.shape[0]
        if k >= n:
            return torch.arange(n)
        w = scores.detach().to("cpu", torch.float64).clamp_min(0.0)
        if self.config.memory_selection == "random" or not bool(torch.isfinite(w).all()) or float(w.sum()) <= 0:
            w = torch.ones(n, dtype=torch.float64)
        w = w + 1e-12 * float(w.max())  # every point keeps a chance, so k distinct picks always exist
        return torch.multinomial(w, k, replacement=False, generator=self._generator)

    def _reservoir(self, n_batch: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A-Res keys for k candidates standing for n_batch data; returns (their keys, indices into
        [memory; candidates] that stay)."""
        weight = n_batch / max(k, 1)
        u = torch.rand(k, generator=self._generator, dtype=torch.float64).clamp_min(1e-300)
        keys = (torch.log(u) / weight).to(self.device)
        all_keys = torch.cat([self.mem_logkey, keys])
        cap = self.config.memory_size
        if all_keys.shape[0] <= cap:
            keep = torch.arange(all_keys.shape[0], device=self.device)
        else:
            keep = torch.sort(torch.topk(all_keys, cap).indices).values
        return keys, keep

    def _renew_memory(self, V: torch.Tensor, kxx: torch.Tensor, hx: torch.Tensor, hy: torch.Tensor,
                      lam1: torch.Tensor, lam2: torch.Tensor, n_mem: int, in_session: torch.Tensor,
                      times: torch.Tensor) -> int:
        """The end of a full update: the held data are [memory (n_mem); batch] with V = L^{-1} K_ZH, prior
        variances kxx and fitted sites (lam1, lam2). Draws the batch's candidates, runs the reservoir over old
        members and candidates, folds every datum that leaves into the old part, empties the pending points and
        sets the totals; returns how many data were folded. ``in_session`` (bool, one per held datum) marks the
        current session's data; ``times`` their stamps [s]."""
        cfg = self.config
        n_b = hx.shape[0] - n_mem
        # Memory: candidates from the batch, then the reservoir over old members and candidates.
        k = min(cfg.memory_per_batch, n_b) if cfg.memory_size > 0 else 0
        if k > 0:
            if cfg.memory_selection == "leverage":
                a_h, W_h = site_sums(V, lam1, lam2)
                R, c = self._posterior(self.a_w_old + a_h, self.W_old + W_h)
                _, _, explained = self._marginals(V[:, n_mem:], R, c, kxx[n_mem:])
                scores = (lam2[n_mem:] * explained).sum(1)  # Bayesian leverage score, eq. 30
            else:
                scores = torch.ones(n_b, dtype=torch.float64, device=self.device)
            cand = self._draw_candidates(scores, k).to(self.device)
            keys, keep = self._reservoir(n_b, k)
        else:
            cand = torch.zeros(0, dtype=torch.long, device=self.device)
            keys = torch.zeros(0, dtype=torch.float64, device=self.device)
            keep = torch.arange(n_mem if cfg.memory_size > 0 else 0, device=self.device)
        # Positions in the held arrays: memory 0..n_mem-1, candidates n_mem + cand.
        pool = torch.cat([torch.arange(n_mem, device=self.device), n_mem + cand])
        pool_keys = torch.cat([self.mem_logkey, keys])
        kept = pool[keep]
        leave = torch.ones(hx.shape[0], dtype=torch.bool, device=self.device)
        leave[kept] = False
        self._fold_into_old_part(V[:, leave], lam1[leave], lam2[leave], in_session[leave], times[leave])
        self.mem_x, self.mem_y = hx[kept], hy[kept]
        self.mem_lam1, self.mem_lam2 = lam1[kept], lam2[kept]
        self.mem_logkey = pool_keys[keep]
        self.mem_in_session = in_session[kept]
        self.mem_t = times[kept]
        for name in ("pend_x", "pend_y", "pend_lam1", "pend_lam2", "pend_in_session", "pend_t"):
            setattr(self, name, getattr(self, name)[:0])
        a_m, W_m = site_sums(V[:, kept], self.mem_lam1, self.mem_lam2)
        self.a_w = self.a_w_old + a_m
        self.W = self.W_old + W_m
        return int(leave.sum())


__all__ = ["DualMemory"]
