"""The experts' memories in the SMC mixture (:mod:`.model`): opening an expert, adding a reading, merging the
closest entries of a full memory, splitting a full expert, and freeing a slot.

Bounded cost. Each particle has at most ``smc_max_experts`` experts and each expert an exact GP on at most
``smc_expert_memory`` pseudo-observations. A memory entry (x, ybar, c, S) stands for c readings merged at the
count-weighted mean input with mean ybar and within-group sum of squares S; its GP noise is sigma^2 / c and its
marginal likelihood includes the within-group term, which is exact for repeated inputs. When an expert's memory
is full, the closest pair of [memory; new point] is merged. So an update costs
O(N J (K M^2 + M^3)) for N new points, whatever has been seen before. When every expert slot is used, no new
expert is opened (with ``gate_on_time``, the expert with the smallest decayed weight joins its neighbour to free
a slot: its readings stay in the map).
"""
from __future__ import annotations

import math

import torch

from .experts import LOG_2PI, squared_distances

#: quadrature of a new expert's predictive over its field log-variances: nodes per variance (odd: one at the
#: prior median) spanning this many prior standard deviations either side (a reading 40 running standard
#: deviations from the running mean needs a variance ~7 prior standard deviations above the median)
NEW_EXPERT_NODES = 33
NEW_EXPERT_SPAN = 10.0
#: a full expert whose closest memory entries are farther apart than this (in its shortest lengthscale) is split
#: in two when its particle has a free expert slot, instead of merging them
SPLIT_SPACING = 0.25
#: to split, a particle without a free slot frees that of its smallest expert if it holds at most
#: expert_memory / SMALL_EXPERT_FRACTION readings (they join their neighbour expert)
SMALL_EXPERT_FRACTION = 8


class ExpertMemory:
    """Mixin of :class:`~.model.SMCExperts`: what happens to an expert's memory as readings arrive."""

    def _new_expert(self, ys: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(ys | a new expert) (J,) and hyperparameters (J, H) for the particles that open one.

        Each particle draws a candidate theta from the prior, as in the paper, except for the variances of the
        field (signal[, constant]): over those the predictive is marginalised by quadrature under their
        log-normal prior, and an opened expert draws them from their posterior given ys (a node by its weight,
        spread uniformly over its cell), the fully adapted proposal for (z, variances). With a single prior
        draw, a reading far from the running mean almost never meets the variance it needs, so it was given to
        an existing expert 6 m away whose learned variance happened to be larger. Lengthscales do not enter one
        reading's density and the noise is the sensor's, not a property of the reading's level: both from the
        prior."""
        std = float(self.config.smc_hyper_prior_std)
        dims = self.field_dims
        prior = self._prior_now()
        theta = prior + std * torch.randn(j, self.theta.shape[-1], generator=self._generator,
                                          dtype=torch.float64).to(self.device)
        nodes = prior[dims] + std * self.quad_nodes                                      # (Q, V)
        field_var = torch.exp(nodes).sum(1)                                              # (Q,)
        total = field_var[None, :] + self._noise(theta)[:, None]                         # (J, Q)
        log_post = self.quad_log_w + (-0.5 * (LOG_2PI + torch.log(total))[..., None]
                                      - 0.5 * ys ** 2 / total[..., None]).sum(-1)
        log_marginal = torch.logsumexp(log_post, 1)                                      # (J,)
        pick = torch.multinomial(torch.exp(log_post - log_marginal[:, None]).cpu(), 1,
                                 generator=self._generator)[:, 0].to(self.device)
        cell = std * 2.0 * NEW_EXPERT_SPAN / (NEW_EXPERT_NODES - 1)
        jitter = (torch.rand(j, len(dims), generator=self._generator, dtype=torch.float64).to(self.device)
                  - 0.5) * cell
        theta[:, dims] = nodes[pick] + jitter
        return log_marginal, theta

    def _split_full(self, z: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor:
        """Before reading x joins expert z_j: where that expert's memory is full, its entries are farther apart
        than SPLIT_SPACING of its shortest lengthscale (merging the closest pair would blur detail the expert
        resolves) and the particle has a free slot, split the expert in two at the count-weighted median of its
        entries along their principal axis. Both halves keep the hyperparameters and are exact GPs on their
        entries; the gating statistics are recomputed from the entries (their within-entry spread is lost), the
        CRP weight is shared by count. x then joins the half holding the nearest entry. Returns the new z (J,).
        So memory goes where the field needs it: a smooth expert (long lengthscale) merges its readings and a
        short-lengthscale one grows into more experts instead of averaging neighbouring readings away. Only with
        ``smc_gate: kernel``: the NIW gate of a half rebuilt from merged entries misplaces it (measured worse)."""
        m = self.expert_memory
        ar = torch.arange(self.num_particles, device=self.device)
        zc = z.clamp_max(self.max_experts - 1)
        mc = self.mem_c[ar, zc]
        small = (self.count > 0) & (self.count <= max(1, m // SMALL_EXPERT_FRACTION))
        small[ar, zc] = False
        full = (mc > 0).all(1) & ((self.count == 0).any(1) | small.any(1))
        if not bool(full.any()):
            return z
        jb = ar[full]
        kb = zc[full]
        mx = self.mem_x[jb, kb]
        ls = torch.exp(self.theta[jb, kb, :self.num_ls].min(-1).values)
        d2 = squared_distances(mx, mx) / (ls * ls)[:, None, None]
        d2 = d2 + torch.diag_embed(torch.full(mx.shape[:2], math.inf, dtype=d2.dtype, device=d2.device))
        coarse = d2.flatten(1).min(1).values > SPLIT_SPACING ** 2
        if not bool(coarse.any()):
            return z
        z = z.clone()
        for j, k in zip(jb[coarse].tolist(), kb[coarse].tolist()):
            if bool((self.count[j] == 0).any()):
                f = int(torch.argmax((self.count[j] == 0).to(torch.int8)))
            else:
                f = int(torch.argmin(torch.where(small[j], self.count[j], torch.full_like(self.count[j], math.inf))))
                self._absorb(j, f, t)
            ex, ec = self.mem_x[j, k].clone(), self.mem_c[j, k].clone()
            w = ec / ec.sum()
            centre = (w[:, None] * ex).sum(0)
            dev = ex - centre
            cov = (w[:, None, None] * dev[:, :, None] * dev[:, None, :]).sum(0)
            axis = torch.linalg.eigh(cov)[1][:, -1]
            axis = axis * torch.sign(axis[torch.argmax(axis.abs())])  # the sign LAPACK and cuSOLVER leave open
            proj = dev @ axis
            order = torch.argsort(proj)
            cum = torch.cumsum(ec[order], 0)
            cut = int(torch.searchsorted(cum, 0.5 * cum[-1]).clamp(0, m - 2)) + 1
            a_idx, b_idx = order[:cut], order[cut:]
            for name in ("mem_x", "mem_y", "mem_c", "mem_s", "mem_t"):
                buf = getattr(self, name)
                old = buf[j, k].clone()
                buf[j, k] = 0.0
                buf[j, f] = 0.0
                buf[j, k, :cut] = old[a_idx]
                buf[j, f, :m - cut] = old[b_idx]
            total = float(self.count[j, k])
            for slot in (k, f):
                c = self.mem_c[j, slot]
                valid = c > 0
                cx = self.mem_x[j, slot][valid]
                cw = c[valid]
                share = float(cw.sum()) / float(ec.sum())
                mean = (cw[:, None] * cx).sum(0) / cw.sum()
                dx = cx - mean
                self.g_mean[j, slot] = mean
                self.g_scatter[j, slot] = (cw[:, None, None] * dx[:, :, None] * dx[:, None, :]).sum(0)
                self.count[j, slot] = total * share
                self.g_mu0[j, slot] = mean if self.config.smc_gate_prior_mean == "local" else 0.0
            w_old = float(self.crp_w[j, k])
            self.crp_w[j, f] = w_old * float(self.count[j, f]) / total
            self.crp_w[j, k] = w_old * float(self.count[j, k]) / total
            self.crp_t[j, f] = self.crp_t[j, k]
            self.theta[j, f] = self.theta[j, k]
            near = torch.argmin(((ex - x) ** 2).sum(-1))
            if bool((b_idx == near).any()):
                z[j] = f
            pair = (torch.tensor([j, j], device=self.device), torch.tensor([k, f], device=self.device))
            self._fresh_ids(*pair)
            self._refresh(*pair)
        return z

    def _absorb(self, j: int, r: int, t: float) -> None:
        """Free slot r of particle j by moving its entries into the expert whose gate is highest at their mean
        (a small expert when a full one splits, the most faded one when gate_on_time opens a new expert). The
        entries keep their counts and within-entry sums of squares, the gating statistics are pooled exactly
        and the CRP weight moves along; the receiving expert's hyperparameters stay."""
        valid = self.mem_c[j, r] > 0
        ex, ey, ec, es, et = (self.mem_x[j, r][valid], self.mem_y[j, r][valid], self.mem_c[j, r][valid],
                              self.mem_s[j, r][valid], self.mem_t[j, r][valid])
        centre = (ec[:, None] * ex).sum(0) / ec.sum()
        score = self._gate_log(centre[None], t)[j, :self.max_experts, 0]
        score[r] = -math.inf
        nb = int(torch.argmax(score))
        if not math.isfinite(float(score[nb])):
            nb = int(torch.argmax(torch.where(torch.arange(self.max_experts, device=self.device) == r,
                                              torch.zeros_like(self.count[j]), self.count[j])))
        jj, kk = torch.tensor([j], device=self.device), torch.tensor([nb], device=self.device)
        w_r = float(self._decayed(t)[j, r])
        for i in range(ex.shape[0]):
            self._insert(jj, kk, ex[i], ey[i], et[i], ec[i], es[i])
        n1, n2 = self.count[j, nb].clone(), self.count[j, r].clone()
        m1, m2 = self.g_mean[j, nb].clone(), self.g_mean[j, r].clone()
        n = n1 + n2
        self.count[j, nb], self.g_mean[j, nb] = n, (n1 * m1 + n2 * m2) / n
        self.g_scatter[j, nb] = (self.g_scatter[j, nb] + self.g_scatter[j, r]
                                 + (n1 * n2 / n) * torch.outer(m1 - m2, m1 - m2))
        if self.config.gate_on_time:
            self.crp_w[j, nb] = self._decayed(t)[j, nb] + w_r
            self.crp_t[j, nb] = t
        else:
            self.crp_w[j, nb] = self.count[j, nb]
        for buf in (self.count, self.crp_w, self.g_mean, self.g_scatter, self.mem_x, self.mem_y, self.mem_c,
                    self.mem_s, self.mem_t):
            buf[j, r] = 0.0
        self._fresh_ids(torch.tensor([j, j], device=self.device), torch.tensor([nb, r], device=self.device))
        self._refresh(jj, kk)

    def _insert(self, ar: torch.Tensor, z: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                stamp: torch.Tensor | float, count: torch.Tensor | float = 1.0,
                scatter: torch.Tensor | float = 0.0) -> None:
        """Put (x, y) taken at ``stamp`` into the memory of expert z_j of every particle j, merging the closest
        pair of [memory; new] (Euclidean) where the memory is full. The new entry stands for ``count`` readings
        with within-entry sum of squares ``scatter`` (one reading: 1 and 0)."""
        m = self.expert_memory
        mx, my, mc, ms, mt = (self.mem_x[ar, z], self.mem_y[ar, z], self.mem_c[ar, z], self.mem_s[ar, z],
                              self.mem_t[ar, z])
        j = ar.shape[0]
        rows = torch.arange(j, device=ar.device)
        ex = torch.cat([mx, x.expand(j, 1, -1)], 1)
        ey = torch.cat([my, y.expand(j, 1, -1)], 1)
        new_c = torch.as_tensor(count, dtype=mc.dtype, device=mc.device).expand(j)
        new_s = torch.as_tensor(scatter, dtype=ms.dtype, device=ms.device).expand(j, ms.shape[-1])
        new_t = torch.as_tensor(stamp, dtype=mt.dtype, device=mt.device).expand(j)
        ec = torch.cat([mc, new_c[:, None]], 1)
        es = torch.cat([ms, new_s[:, None, :]], 1)
        et = torch.cat([mt, new_t[:, None]], 1)
        free = mc == 0
        has_free = free.any(1)
        # Closest pair among the m + 1 entries (only needed where the memory is full).
        a = ex  # Euclidean: a learned long lengthscale must not license merging across a short feature
        d2 = squared_distances(a, a)
        d2 = d2 + torch.diag_embed(torch.full((j, m + 1), math.inf, dtype=d2.dtype, device=d2.device))
        flat = torch.argmin(d2.reshape(j, -1), 1)
        p, q = torch.minimum(flat // (m + 1), flat % (m + 1)), torch.maximum(flat // (m + 1), flat % (m + 1))
        ca, cb = ec[rows, p], ec[rows, q]
        c = ca + cb
        xm = (ca[:, None] * ex[rows, p] + cb[:, None] * ex[rows, q]) / c[:, None]
        ym = (ca[:, None] * ey[rows, p] + cb[:, None] * ey[rows, q]) / c[:, None]
        sm = es[rows, p] + es[rows, q] + (ca * cb / c)[:, None] * (ey[rows, p] - ey[rows, q]) ** 2
        tm = self._merged_stamp(et[rows, p], ca, et[rows, q], cb)
        # Full: merged pair into p, the new entry (index m) into q when q < m. Not full: new entry into a free slot.
        slot_free = torch.argmax(free.to(torch.int8), 1)
        tgt1 = torch.where(has_free, slot_free, p)
        v1x = torch.where(has_free[:, None], x.expand(j, -1), xm)
        v1y = torch.where(has_free[:, None], y.expand(j, -1), ym)
        v1c = torch.where(has_free, new_c, c)
        v1s = torch.where(has_free[:, None], new_s, sm)
        v1t = torch.where(has_free, new_t, tm)
        second = (~has_free) & (q < m)
        mx[rows, tgt1], my[rows, tgt1], mc[rows, tgt1], ms[rows, tgt1], mt[rows, tgt1] = v1x, v1y, v1c, v1s, v1t
        if bool(second.any()):
            js, qs = rows[second], q[second]
            mx[js, qs], my[js, qs], mc[js, qs], ms[js, qs], mt[js, qs] = x, y, new_c[second], new_s[second], \
                new_t[second]
        self.mem_x[ar, z], self.mem_y[ar, z], self.mem_c[ar, z], self.mem_s[ar, z], self.mem_t[ar, z] = \
            mx, my, mc, ms, mt

    def _merged_stamp(self, ta: torch.Tensor, ca: torch.Tensor, tb: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        """The stamp of an entry merging (ta, ca) and (tb, cb): the one at which ca + cb readings decay as the
        two did, (ca + cb) e^(-(t - tm) / tau) = ca e^(-(t - ta) / tau) + cb e^(-(t - tb) / tau) at every later t,
        so an entry's recency is exact however often it was merged (tau: smc_time_scale)."""
        tau = float(self.config.smc_time_scale)
        newest = torch.maximum(ta, tb)
        mix = (ca * torch.exp((ta - newest) / tau) + cb * torch.exp((tb - newest) / tau)) / (ca + cb)
        return newest + tau * torch.log(mix)
