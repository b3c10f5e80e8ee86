"""The gate of the SMC mixture (:mod:`.model`): P(z = k | x) over a particle's experts and a new one, by the NIW
input clusters (the paper's) or by the experts' kernels around their readings, optionally weighted by recency.

Gating on time (``gate_on_time``). The paper's gate uses inputs only. With this option each expert keeps the
time-decayed count c_k(t) = sum_{i in k} exp(-(t - t_i) / tau) (as in the time-sensitive DP of Zhu, Ghahramani
& Lafferty 2005), and its recency moves gate mass between the experts that cover x: expert k gets
n_k T_k(x) r_k(x) / rbar(x), rbar(x) the evidence-weighted mean recency at x, both for assigning new data and
for gating predictions at the newest stamp. With the kernel gate the recency is where x is: every memory entry
keeps the stamp of its readings (merged entries one that decays as they did, _merged_stamp), and r_k(x) is the
decayed density of k's entries at x over their density; the NIW gate has one per expert, r_k = c_k(t) / n_k.
A changed field then gets a new expert (its readings disagree with the old expert) and the map prefers it where
both cover, by e^(dt / tau) for readings dt apart. Recency by place matters because an expert is large: the old
expert of a changed spot also took new readings nearby, where nothing changed, and with one recency per expert
it looked as recent as the new one at the spot and kept getting its readings (the smc_bench ``change``
section measures the map where the field changed). The old experts' total stays sum_k n_k T_k(x): decaying it
(the time-sensitive DP as published) lets the new-expert term win everywhere not driven for a few tau, so a map
forgets every place but the last minutes'; decaying it for assignments only opens experts where nothing
changed. Appending t / tau to the NIW input fails the same way: a NIW cluster learns its own
spread in t, so at the present stamp every expert but the most recent has negligible density.
"""
from __future__ import annotations

import math

import torch

from .dp_mixture import niw_predictive

#: an expert whose gate is below this at every test point of a group is not predicted there: its gate weight
#: goes to its prior (mean 0, prior variance), which moves the mixture mean by at most this fraction of the
#: expert's deviation from the prior; the NIW gate's Student-t tails would otherwise make every expert of a
#: particle count everywhere (22 of 32 at 1e-10, 6 at 1e-4)
GATE_NEGLIGIBLE = 1e-4
#: kernel gate: an expert's kernel around each reading is this fraction of its lengthscale wide along each axis
#: (at most smc_gate_bandwidth), so a short-lengthscale expert claims only the places its readings determine.
#: With one width for all, a sharp expert holding a dip's readings shares the dip with a smooth neighbour whose
#: readings lie a track away, and the map misses the dip at the readings themselves. The smc_bench
#: ``nonstationary`` section reproduces the choice (docs/benchmarks.md: 0.285 uT with the kernel gate at 0.5,
#: 0.409 with the paper's NIW gate)
GATE_LENGTHSCALE_FRACTION = 0.5


class Gating:
    """Mixin of :class:`~.model.SMCExperts`: the gate's log-probabilities, its widths and time decay."""

    # ------------------------------------------------------------------ gating
    def _decayed(self, t: float) -> torch.Tensor:
        """CRP weights at stamp t (J, K)."""
        if not self.config.gate_on_time:
            return self.count
        dt = (t - self.crp_t).clamp_min(0.0)
        return self.crp_w * torch.exp(-dt / float(self.config.smc_time_scale))

    def _gate_params(self):
        cfg = self.config
        mu, psi, nu = niw_predictive(self.count, self.g_mean, self.g_scatter, self.g_mu0, cfg.smc_niw_prior_count,
                                     cfg.smc_niw_dof, self.psi0)
        L = torch.linalg.cholesky(psi)
        return mu, L, nu

    def _gate_log(self, x: torch.Tensor, t: float, params=None) -> torch.Tensor:
        """log of the unnormalised gate (J, K + 1, G) at inputs x (G, D): log c_k(t) + log T_k(x) for the
        experts in use, log alpha + log T_0(x) for a new one (-inf when none can be opened)."""
        cfg = self.config
        d = self.input_dims
        log_recent = None
        log_t_wide = None
        if cfg.smc_gate == "kernel":
            log_t, log_recent, log_t_wide = self._kernel_gate_log(x, t if cfg.gate_on_time else None)
        else:
            mu, L, nu = self._gate_params() if params is None else params
            diff = x[None, None, :, :] - mu[:, :, None, :]                               # (J, K, G, D)
            sol = torch.linalg.solve_triangular(L, diff.transpose(-1, -2), upper=False)  # (J, K, D, G)
            maha = (sol * sol).sum(-2)
            logdet = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
            const = (torch.lgamma(0.5 * (nu + d)) - torch.lgamma(0.5 * nu)
                     - 0.5 * d * (torch.log(nu) + math.log(math.pi)) - 0.5 * logdet)
            log_t = const[..., None] - 0.5 * (nu + d)[..., None] * torch.log1p(maha / nu[..., None])
        used = self.count > 0
        log_n = torch.log(self.count.clamp_min(1e-300))

        def count_weighted(log_density: torch.Tensor) -> torch.Tensor:
            """log n_k + log T_k(x) for the experts in use, -inf for free slots."""
            return torch.where(used[..., None], log_n[..., None] + log_density, torch.full_like(log_density, -math.inf))

        log_old = count_weighted(log_t)
        if log_t_wide is not None:
            # The experts' own widths decide which of them takes x; how much x belongs to the experts at all,
            # against the new-expert term, is decided at the configured width, about the spacing of the tracks.
            # With the experts' own widths alone, readings between the lanes of the bundled demo (1 m apart)
            # open new experts until every slot is used, and the map near the path gets worse than with one
            # width for all; the rule must hold for assignments as well as for the map's gate.
            shift = (torch.logsumexp(count_weighted(log_t_wide), 1, keepdim=True)
                     - torch.logsumexp(log_old, 1, keepdim=True)).nan_to_num(0.0, 0.0, 0.0)
            log_old = log_old + shift
        if cfg.gate_on_time:
            # Time moves gate mass between the experts that cover x (below), it never removes it: expert k's share is
            # scaled by its recency r_k over the evidence-weighted mean recency at x, so the total of the old
            # experts stays sum_k n_k T_k(x). The newer of two experts at one place is preferred by
            # r_new / r_old = e^(dt / tau), and a place nobody has driven since is still mapped. The kernel gate
            # measures recency where x is, r_k(x) = (decayed density of k's readings at x) / (their density):
            # an expert that took new readings elsewhere is not recent at a place it last saw long ago, so the
            # newer expert of a changed spot keeps it. The NIW gate has one recency per expert, c_k(t) / n_k.
            if log_recent is not None:
                log_r = torch.where(used[..., None], log_recent - log_t, torch.zeros_like(log_t))
            else:
                log_r = (torch.log(self._decayed(t).clamp_min(1e-300)) - log_n)[..., None]
            # Only the experts at the place (a gate at least GATE_NEGLIGIBLE of the largest at x) trade gate mass
            # by recency, and the mean recency is theirs: with every expert in the trade, a fresh expert 5 m away
            # (gate e^-168 of the local one's) took a place last driven 200 time scales ago, or (through the
            # mean) pushed the local expert below a new one's gate.
            present = used[..., None] & (log_old >= log_old.max(1, keepdim=True).values + math.log(GATE_NEGLIGIBLE))
            log_here = log_old.masked_fill(~present, -math.inf)
            log_mean_r = (torch.logsumexp(log_here + log_r, 1, keepdim=True)
                          - torch.logsumexp(log_here, 1, keepdim=True)).nan_to_num(0.0, 0.0, 0.0)
            log_old = torch.where(present, log_old + log_r - log_mean_r, log_old)
        log_new = torch.log(self.alpha)[:, None] + self._log_t0(x)[None, :]
        can_open = (~used).any(1) | bool(cfg.gate_on_time)
        log_new = torch.where(can_open[:, None], log_new, torch.full_like(log_new, -math.inf))
        return torch.cat([log_old, log_new[:, None, :]], dim=1)

    def _kernel_gate_log(self, x: torch.Tensor, t: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """log of an expert's input density at x (J, K, G) for ``smc_gate: kernel``: the count-weighted mean of
        Gaussian kernels N(x; x_i, diag(h_k^2)) over its memory entries (merged entries count their readings; h_k
        from the expert's lengthscales, _gate_width), so an
        expert's gate follows the readings it holds rather than a Gaussian blob around them (a distance-dependent
        CRP, Blei & Frazier 2011). On a lawnmower drive an expert's readings lie in lanes, its NIW blob spreads
        over the neighbouring experts' lanes and a test point between them was gated to an expert that holds no
        reading near it; the kernel gate gives it to the experts of the nearest readings. Free experts get -inf
        (the caller masks them anyway). With a stamp ``t``, also the same sum with each entry's count decayed to
        t, c_i e^(-(t - t_i) / tau), over the same normaliser (else None): their ratio is the expert's recency
        at x. Third: the density with every expert at the configured width smc_gate_bandwidth (the scale at which
        a place counts as mapped, see _gate_log)."""
        u = self._used_memory(self.mem_c)
        mx, mc, mt, theta = self.mem_x[..., :u, :], self.mem_c[..., :u], self.mem_t[..., :u], self.theta
        if self._pred_ok:  # a map: only the distinct experts (see _ensure_pred_cache)
            rj, rk = self._rep_jk
            mx, mc, mt, theta = mx[rj, rk], mc[rj, rk], mt[rj, rk], theta[rj, rk]
        h = self._gate_width(theta)                                                      # (..., D)
        wide = float(self.config.smc_gate_bandwidth)
        log_k = log_wide = None                                                          # (..., u, G)
        for d in range(self.input_dims):  # one axis at a time: no (..., u, G, D) temporary
            diff = mx[..., :, None, d] - x[:, d]
            own = diff / h[..., d, None, None]
            log_k = -0.5 * own * own if log_k is None else log_k - 0.5 * own * own
            log_wide = -0.5 * diff * diff if log_wide is None else log_wide - 0.5 * diff * diff
        logc = torch.log(mc.clamp_min(1e-300)).masked_fill(mc <= 0, -math.inf)
        log_total = torch.log(mc.sum(-1).clamp_min(1e-300))[..., None]
        norm = log_total + 0.5 * torch.log(2.0 * math.pi * h * h).sum(-1)[..., None]
        outs = [torch.logsumexp(logc[..., None] + log_k, -2) - norm,                  # (..., G)
                torch.logsumexp(logc[..., None] + log_wide / (wide * wide), -2) - log_total
                - 0.5 * self.input_dims * math.log(2.0 * math.pi * wide * wide)]
        if t is not None:
            decay = (t - mt).clamp_min(0.0) / float(self.config.smc_time_scale)
            outs.append(torch.logsumexp((logc - decay)[..., None] + log_k, -2) - norm)
        if self._pred_ok:
            rep = self._rep
            if outs[0].shape[0] == 0:  # no distinct expert yet (a map before its first reading): all free, -inf
                outs = [torch.full((*rep.shape, x.shape[0]), -math.inf, dtype=out.dtype, device=out.device)
                        for out in outs]
            else:
                outs = [torch.where((rep >= 0)[..., None], out[rep.clamp_min(0)],
                                    torch.full((), -math.inf, dtype=out.dtype, device=out.device)) for out in outs]
        return outs[0], (outs[2] if t is not None else None), outs[1]

    def _gate_width(self, theta: torch.Tensor) -> torch.Tensor:
        """Kernel-gate width of each expert along each input axis (theta (..., H) -> (..., D)):
        GATE_LENGTHSCALE_FRACTION of the axis's lengthscale, at most smc_gate_bandwidth (per axis, so a short
        height lengthscale of 3-D inputs does not narrow the gate in the plane). It moves with the expert's
        lengthscales (elliptical slice moves change the gate as they change the GP)."""
        ls = torch.exp(theta[..., :self.num_ls])[..., self.axis_group]
        return torch.clamp(GATE_LENGTHSCALE_FRACTION * ls, max=float(self.config.smc_gate_bandwidth))

    def _log_t0(self, x: torch.Tensor) -> torch.Tensor:
        """Prior predictive of a new expert's input (G,): at its centre with a local prior mean."""
        cfg = self.config
        d = self.input_dims
        zeros = torch.zeros((), dtype=torch.float64, device=self.device)
        mu, psi, nu = niw_predictive(zeros, torch.zeros(d, dtype=torch.float64, device=self.device),
                                     torch.zeros(d, d, dtype=torch.float64, device=self.device),
                                     torch.zeros(d, dtype=torch.float64, device=self.device),
                                     cfg.smc_niw_prior_count, cfg.smc_niw_dof, self.psi0)
        centre = x if cfg.smc_gate_prior_mean == "local" else torch.zeros_like(x)
        diff = x - centre - mu
        maha = (diff @ torch.linalg.inv(psi) * diff).sum(-1)
        return (torch.lgamma(0.5 * (nu + d)) - torch.lgamma(0.5 * nu) - 0.5 * d * (torch.log(nu) + math.log(math.pi))
                - 0.5 * torch.logdet(psi) - 0.5 * (nu + d) * torch.log1p(maha / nu))
