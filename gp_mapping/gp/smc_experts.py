"""Sequential Monte Carlo mixture of GP experts (Zhang, Dumitrascu, Williamson & Engelhardt, "Sequential
Gaussian processes for online learning of nonstationary functions").

Model. Each of J particles holds a Dirichlet-process (Chinese restaurant) partition of the data by input
location. Inputs of expert k follow a Normal-inverse-Wishart cluster, so the next input's density under it is
a Student-t (eqs. 2-3, from running statistics). Each expert is a zero-mean GP with its own hyperparameters
theta_k = log(lengthscale(s), signal variance, noise variance[, constant variance]) under a log-normal prior;
the concentration alpha has a Gamma(a0, b0) prior. Per observation (x_i, y_i), vectorised over particles:

1. assign z_i: from the gating prior P(z = k | x_i) ∝ c_k T_k(x_i), new expert ∝ alpha T_0(x_i) (the paper's
   proposal, ``smc_proposal: prior``), or from its product with the expert's one-step predictive density of
   y_i (``adapted``, the locally optimal proposal: data that disagree with an expert start a new one);
2. reweight by the incremental importance weight: p(x_i | past) p(y_i | z_i, past) for the prior proposal,
   sum_k P(z = k, x_i | past) p(y_i | k, past) for the adapted one (Carvalho et al. 2010 for the x part;
   eq. 6's GP ratio p(y_k)/p(y'_k) is the one-step predictive of y_i under expert z_i);
3. add x_i to the expert's NIW statistics and (x_i, y_i) to its memory; update alpha (Escobar & West, eq. 4);
4. normalise the weights; when N_eff < smc_ess_threshold * J, resample (multinomial or systematic).

After each batch, the hyperparameters of the experts that received data are moved by elliptical slice
sampling on their marginal likelihood (Murray et al. 2010). The paper moves theta before weighting; here the
weights use theta before the move and the move follows (a resample-move step), so the importance weights stay
valid with the move as an MCMC kernel. Prediction is the mixture over particles (weights) and, within each,
over the test point's gate (existing experts and a new one, the GP prior): its mean, and its variance by the
law of total variance; ``log_predictive_density`` is the mixture density itself.

Bounded cost. Each particle has at most ``smc_max_experts`` experts and each expert an exact GP on at most
``smc_expert_memory`` pseudo-observations. A memory entry (x, ybar, c, S) stands for c readings merged at the
count-weighted mean input with mean ybar and within-group sum of squares S; its GP noise is sigma^2 / c and its
marginal likelihood includes the within-group term, which is exact for repeated inputs. When an expert's memory
is full, the closest pair of [memory; new point] is merged. So an update costs
O(N J (K M^2 + M^3)) for N new points, whatever has been seen before. When every expert slot is used, no new
expert is opened (with ``gate_on_time``, the expert with the smallest decayed weight joins its neighbour to free
a slot: its readings stay in the map).

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

Targets are scaled by running statistics (mean and standard deviation of every reading so far, updated per
reading), never frozen on a first batch: the memories hold raw readings and are standardised when used, so the
scale can change at any time. Vector targets: the components share the partition and the hyperparameters (one
Cholesky factor per expert serves all components; the three field components near one source share their
lengthscale), with independent GP values per component.
"""
from __future__ import annotations

import math
import time

import torch

from .base import Engine, resolve_device, to_float64_tensor
from .dp_mixture import (elliptical_slice, escobar_west, effective_sample_size, niw_add, niw_predictive,
                         normalise_log_weights, resample_indices)
from .errors import ConfigError, ModelInputError
from .kernels import STATIONARY_KERNELS, jittered_cholesky, lengthscale_groups
from .likelihoods import GaussianLikelihood

LOG_2PI = math.log(2.0 * math.pi)
#: smallest noise variance an expert may have, relative to its own prior variance k(x, x)
NOISE_FLOOR = 1e-6
#: an expert whose gate is below this at every test point of a group is not predicted there: its gate weight
#: goes to its prior (mean 0, prior variance), which moves the mixture mean by at most this fraction of the
#: expert's deviation from the prior; the NIW gate's Student-t tails would otherwise make every expert of a
#: particle count everywhere (22 of 32 at 1e-10, 6 at 1e-4)
GATE_NEGLIGIBLE = 1e-4
#: test points per group of one prediction GEMM: smaller groups need fewer experts each (their union over the
#: group), larger ones fewer calls
PREDICT_GROUP = 128
#: prediction works on chunks of test points whose (J, K, M, G, D) temporaries hold about this many numbers
PREDICT_CHUNK_ELEMENTS = 1 << 22
#: quadrature of a new expert's predictive over its field log-variances: nodes per variance (odd: one at the
#: prior median) spanning this many prior standard deviations either side (a reading 40 running standard
#: deviations from the running mean needs a variance ~7 prior standard deviations above the median)
NEW_EXPERT_NODES = 33
NEW_EXPERT_SPAN = 10.0
#: a full expert whose closest memory entries are farther apart than this (in its shortest lengthscale) is split
#: in two when its particle has a free expert slot, instead of merging them
SPLIT_SPACING = 0.25
#: kernel gate: an expert's kernel around each reading is this fraction of its lengthscale wide along each axis
#: (at most smc_gate_bandwidth), so a short-lengthscale expert claims only the places its readings determine.
#: With one width for all, a sharp expert holding a dip's readings shares the dip with a smooth neighbour whose
#: readings lie a track away, and the map misses the dip at the readings themselves. The smc_bench
#: ``nonstationary`` section reproduces the choice (docs/benchmarks.md: 0.285 uT with the kernel gate at 0.5,
#: 0.409 with the paper's NIW gate)
GATE_LENGTHSCALE_FRACTION = 0.5
#: to split, a particle without a free slot frees that of its smallest expert if it holds at most
#: expert_memory / SMALL_EXPERT_FRACTION readings (they join their neighbour expert)
SMALL_EXPERT_FRACTION = 8


class SMCExperts(Engine):
    """Online SMC mixture of GP experts; see the module docstring. Interface as every engine in ``gp``."""

    #: buffers whose size follows the data or the particle count (resized on load_state_dict)
    RESIZABLE = ("log_w", "alpha", "count", "expert_id", "crp_w", "crp_t", "g_mean", "g_scatter", "g_mu0", "theta",
                 "mem_x", "mem_y", "mem_c", "mem_s", "mem_t", "rng_state")
    #: update() and predict() take the sample stamps ``t`` (the Mapper passes them)
    wants_stamps = True  # Engine.wants_stamps: the gate looks at time

    def __init__(self, config, input_dims: int, output_dims: int) -> None:
        super().__init__(config, input_dims, output_dims)
        cfg = self.config
        d, p = self.input_dims, self.output_dims
        if cfg.likelihood != "gaussian":
            raise ConfigError(f"smc_experts supports the gaussian likelihood only, got {cfg.likelihood!r}",
                              "likelihood")
        if not cfg.smc_niw_dof > d - 1:
            raise ConfigError(f"{cfg.smc_niw_dof} must exceed input_dims - 1 = {d - 1}", "smc_niw_dof")
        # Only for checking targets (the experts' noise variances are their own hyperparameters).
        self.likelihood = GaussianLikelihood(p)
        self.likelihood.requires_grad_(False)
        j, k, m = int(cfg.smc_particles), int(cfg.smc_max_experts), int(cfg.smc_expert_memory)
        groups = lengthscale_groups(cfg.lengthscales, d)
        self.num_ls = max(groups) + 1
        self.register_buffer("axis_group", torch.tensor(groups), persistent=False)  # each input axis's lengthscale
        self.has_constant = bool(cfg.constant_kernel)
        h = self.num_ls + 2 + int(self.has_constant)
        self._profile = STATIONARY_KERNELS[cfg.kernel](1).profile
        f64 = dict(dtype=torch.float64)
        prior = [math.log(cfg.lengthscale)] * self.num_ls + [math.log(cfg.signal_variance),
                                                             math.log(cfg.noise_variance)]
        if self.has_constant:
            prior.append(math.log(cfg.constant_variance))
        self.register_buffer("prior_mean", torch.tensor(prior, **f64), persistent=False)
        # A new expert's field variances (signal[, constant]) in theta, and the quadrature over their prior in
        # standard units (see _new_expert): nodes (Q, V) and normalised log weights (Q,), fixed for the engine.
        self.field_dims = [self.num_ls] + ([h - 1] if self.has_constant else [])
        g = torch.linspace(-NEW_EXPERT_SPAN, NEW_EXPERT_SPAN, NEW_EXPERT_NODES, **f64)
        grid = torch.cartesian_prod(*[g] * len(self.field_dims)).reshape(-1, len(self.field_dims))
        log_w = -0.5 * (grid * grid).sum(1)
        self.register_buffer("quad_nodes", grid, persistent=False)
        self.register_buffer("quad_log_w", log_w - torch.logsumexp(log_w, 0), persistent=False)
        self.register_buffer("psi0", float(cfg.smc_niw_psi) * torch.eye(d, **f64), persistent=False)
        # particles
        self.register_buffer("log_w", torch.full((j,), -math.log(j), **f64))
        self.register_buffer("alpha", torch.full((j,), float(cfg.smc_alpha_shape / cfg.smc_alpha_rate), **f64))
        self.register_buffer("count", torch.zeros(j, k, **f64))         # readings per expert (0: free slot)
        self.register_buffer("crp_w", torch.zeros(j, k, **f64))         # CRP weight (decayed count with time)
        self.register_buffer("crp_t", torch.zeros(j, k, **f64))         # stamp at which crp_w was last set
        self.register_buffer("g_mean", torch.zeros(j, k, d, **f64))     # NIW running mean of inputs
        self.register_buffer("g_scatter", torch.zeros(j, k, d, d, **f64))
        self.register_buffer("g_mu0", torch.zeros(j, k, d, **f64))      # NIW prior mean of each expert
        self.register_buffer("theta", self.prior_mean.expand(j, k, h).clone())
        self.register_buffer("mem_x", torch.zeros(j, k, m, d, **f64))
        self.register_buffer("mem_y", torch.zeros(j, k, m, p, **f64))   # raw (unscaled) mean readings
        self.register_buffer("mem_c", torch.zeros(j, k, m, **f64))      # readings merged in an entry (0: free)
        self.register_buffer("mem_s", torch.zeros(j, k, m, p, **f64))   # within-entry sum of squares (raw)
        self.register_buffer("mem_t", torch.zeros(j, k, m, **f64))      # entry stamp (merged: see _merged_stamp)
        # target scaling (running), bookkeeping, random state
        self.register_buffer("y_count", torch.zeros((), **f64))
        self.register_buffer("y_mean", torch.zeros(p, **f64))
        self.register_buffer("y_std", torch.ones(p, **f64))
        self.register_buffer("y_m2", torch.zeros(p, **f64))
        self.register_buffer("last_t", torch.tensor(-math.inf, **f64))
        self.register_buffer("num_seen_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("num_updates_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("resamples_t", torch.tensor(0, dtype=torch.int64))
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(int(cfg.seed))
        self.register_buffer("rng_state", self._generator.get_state())
        self.alpha = escobar_west(self.alpha, torch.zeros(j), 0, cfg.smc_alpha_shape, cfg.smc_alpha_rate,
                                  self._generator)
        self.rng_state = self._generator.get_state()
        # caches (recomputed from the state): chol of each expert's K, L^-1 y_raw, L^-1 mask
        self._chol = torch.zeros(0)
        self._ly = torch.zeros(0)
        self._l1 = torch.zeros(0)
        self._cache_ok = False
        # prediction cache (rebuilt after any change): L^-1 (J, K, U, U) and K^-1 y (J, K, U, P) per expert
        self._linv = torch.zeros(0)
        self._kiy = torch.zeros(0)
        self._pred_ok = False
        # Identity of each expert's GP (hyperparameters and memory): resampling copies experts into several
        # particles, and copies that take the same reading stay equal, so factors and predictions are computed
        # once per distinct id. A change that is not the same for every copy (a new expert, a split, a
        # hyperparameter move) gives a fresh id.
        self.register_buffer("expert_id", torch.arange(j * k).view(j, k))
        self.register_buffer("next_expert_id", torch.tensor(j * k, dtype=torch.int64))
        self.to(resolve_device(cfg.device))

    # ------------------------------------------------------------------ properties
    @property
    def num_particles(self) -> int:
        return int(self.log_w.shape[0])

    @property
    def max_experts(self) -> int:
        return int(self.count.shape[1])

    @property
    def expert_memory(self) -> int:
        return int(self.mem_c.shape[2])

    @property
    def weights(self) -> torch.Tensor:
        """Normalised particle weights (J,)."""
        return torch.exp(normalise_log_weights(self.log_w))

    @property
    def num_experts(self) -> torch.Tensor:
        """Experts in use per particle (J,)."""
        return (self.count > 0).sum(1)

    def _work_scale(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean (P,), ratio r (P,), scale sbar ()): the experts work on (y - mean) * r with r = sbar / std,
        sbar the geometric mean of the running standard deviations (r = 1 for one output). Their variance
        hyperparameters are in these units, so a later change of the running scale does not rescale a learned
        expert; only the prior of new and moved hyperparameters follows the scale."""
        sbar = torch.exp(torch.log(self.y_std).mean())
        return self.y_mean, sbar / self.y_std, sbar

    def _prior_now(self) -> torch.Tensor:
        """Prior mean of theta in work units: the configured (standardised) variances times sbar^2."""
        shift = torch.zeros_like(self.prior_mean)
        shift[self.num_ls:] = 2.0 * torch.log(self._work_scale()[2])
        return self.prior_mean + shift

    # ------------------------------------------------------------------ Engine plumbing
    def _drop_caches(self) -> None:
        super()._drop_caches()
        self._cache_ok = False
        self._pred_ok = False

    def _fresh_ids(self, jj: torch.Tensor, kk: torch.Tensor, same_as: torch.Tensor | None = None) -> None:
        """New ids for experts (jj, kk): equal where ``same_as`` (their ids before a change that is the same
        for equal experts) is equal, else all distinct."""
        if jj.numel() == 0:
            return
        if same_as is None:
            inverse = torch.arange(jj.numel(), device=jj.device)
        else:
            inverse = torch.unique(same_as, return_inverse=True)[1]
        self.expert_id[jj, kk] = self.next_expert_id + inverse
        self.next_expert_id = self.next_expert_id + int(inverse.max()) + 1

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # states saved before expert ids existed: every expert distinct
        if prefix + "expert_id" not in state_dict and prefix + "count" in state_dict:
            j, k = state_dict[prefix + "count"].shape
            state_dict[prefix + "expert_id"] = torch.arange(j * k).view(j, k)
            state_dict[prefix + "next_expert_id"] = torch.tensor(j * k, dtype=torch.int64)
        # states saved before entries had stamps: each entry gets its expert's last stamp
        if prefix + "mem_t" not in state_dict and prefix + "mem_c" in state_dict and prefix + "crp_t" in state_dict:
            state_dict[prefix + "mem_t"] = state_dict[prefix + "crp_t"][..., None].expand_as(
                state_dict[prefix + "mem_c"]).clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _loaded(self) -> None:
        self._generator.set_state(self.rng_state.detach().to("cpu", torch.uint8))

    # ------------------------------------------------------------------ input checks
    def _check_t(self, t, n: int) -> torch.Tensor:
        """Stamps (n,) as float64 on the CPU; None gives a sample clock (num_seen, num_seen + 1, ...)."""
        if t is None:
            return torch.arange(n, dtype=torch.float64) + float(self.num_seen)
        tt = to_float64_tensor(t, "t", torch.device("cpu")).reshape(-1)
        if tt.shape[0] != n:
            raise ModelInputError(f"x has {n} rows but t has {tt.shape[0]} stamps")
        if not bool(torch.isfinite(tt).all()):
            raise ModelInputError("t holds NaN or Inf")
        return tt

    # ------------------------------------------------------------------ kernels and expert GPs
    def _kernel(self, x1: torch.Tensor, x2: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """k(x1, x2) (..., N1, N2) for inputs (..., N1, D), (..., N2, D) and log-hyperparameters (..., H)."""
        ls = torch.exp(theta[..., :self.num_ls])[..., None, self.axis_group]
        r2 = _squared_distances(x1 / ls, x2 / ls)
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

    # ------------------------------------------------------------------ updates
    def update(self, x, y, mode: str | None = None, t=None) -> dict:
        """Condition on a batch: x (N, D), y (N, P), stamps t (N,) [s] (None: a sample clock). ``mode`` is
        accepted for the common interface; every update is the same here."""
        start = time.perf_counter()
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        tt = self._check_t(t, xt.shape[0])
        if mode not in (None, "fast", "full"):
            raise ValueError(f"update mode must be 'fast', 'full' or None, got {mode!r}")
        stats = {"mode": "smc", "n_batch": int(xt.shape[0]), "resampled": 0, "new_experts": 0,
                 "slice_evaluations": 0}
        if xt.shape[0]:
            self._pred_ok = False
            with torch.no_grad():
                self._ensure_cache()
                touched = torch.zeros(self.num_particles, self.max_experts, dtype=torch.float64,
                                      device=self.device)
                log_evidence = 0.0
                for i in range(xt.shape[0]):
                    touched, inc, resampled, opened = self._step(xt[i], yt[i], float(tt[i]), touched)
                    log_evidence += inc
                    stats["resampled"] += resampled
                    stats["new_experts"] += opened
                stats["slice_evaluations"] = self._move_hyperparameters(touched)
                self.num_updates_t += 1
                self.rng_state = self._generator.get_state()
            stats["log_evidence"] = log_evidence
        ess = effective_sample_size(self.log_w)
        stats.update({"seconds": time.perf_counter() - start, "num_seen": self.num_seen, "ess": ess,
                      "experts_mean": float(self.num_experts.double().mean()),
                      "alpha_mean": float(self.alpha.mean())})
        return stats

    def _step(self, x: torch.Tensor, y: torch.Tensor, t: float, touched: torch.Tensor):
        """One reading through every particle (steps 1-4 of the module docstring)."""
        cfg = self.config
        j, k = self.num_particles, self.max_experts
        ar = torch.arange(j, device=self.device)
        mean_y, ratio, _ = self._work_scale()
        ys = (y - mean_y) * ratio
        log_gate = self._gate_log(x[None, :], t)[..., 0]                          # (J, K + 1)
        log_px = torch.logsumexp(log_gate, 1) - torch.log(self.count.sum(1) + self.alpha)
        # One-step predictive of y under every expert and under a new one (work units, with the noise).
        mu, var = self._expert_predict(x[None, :])
        var_y = var[..., 0] + self._noise(self.theta)                                # (J, K)
        log_py = (-0.5 * (LOG_2PI + torch.log(var_y))[..., None]
                  - 0.5 * (ys - mu[:, :, 0, :]) ** 2 / var_y[..., None]).sum(-1)
        log_py_new, theta_new = self._new_expert(ys, j)
        log_py_all = torch.cat([log_py, log_py_new[:, None]], 1)                      # (J, K + 1)
        log_q = log_gate - torch.logsumexp(log_gate, 1, keepdim=True)
        if cfg.smc_proposal == "adapted":
            joint = log_q + log_py_all
            norm = torch.logsumexp(joint, 1)
            probs = torch.exp(joint - norm[:, None])
            inc = log_px + norm
        else:
            probs = torch.exp(log_q)
            inc = None
        u = torch.rand(j, generator=self._generator, dtype=torch.float64).to(self.device)
        z = torch.searchsorted(torch.cumsum(probs, 1), u[:, None]).squeeze(1).clamp_max(k)
        z = torch.where(torch.isfinite(log_gate[ar, z]), z, torch.argmax(log_gate, 1))  # round-off at the edge
        if inc is None:
            inc = log_px + log_py_all[ar, z]
        # Open new experts where chosen.
        is_new = z == k
        opened = int(is_new.sum())
        if opened:
            free = self.count == 0
            slot = torch.where(free.any(1), torch.argmax(free.to(torch.int8), 1),
                               torch.argmin(torch.where(self.count > 0, self._decayed(t),
                                                        torch.full_like(self.count, math.inf)), 1))
            # No free slot (only with gate_on_time): the most faded expert's readings join its neighbour, so the
            # place it mapped stays mapped (deleting it lost every region not driven within a few time scales).
            for jf in ar[is_new & ~free.any(1)].tolist():
                self._absorb(jf, int(slot[jf]), t)
            z = torch.where(is_new, slot, z)
            jn, kn = ar[is_new], z[is_new]
            for buf in (self.count, self.crp_w, self.g_mean, self.g_scatter, self.mem_x, self.mem_y, self.mem_c,
                        self.mem_s, self.mem_t):
                buf[jn, kn] = 0.0
            self.crp_t[jn, kn] = t
            self.theta[jn, kn] = theta_new[is_new]
            self._fresh_ids(jn, kn)
            self.g_mu0[jn, kn] = x if cfg.smc_gate_prior_mean == "local" else 0.0
        if cfg.smc_gate == "kernel":
            z = self._split_full(z, x, t)
        # Gating statistics and CRP weights.
        self.count[ar, z], self.g_mean[ar, z], self.g_scatter[ar, z] = niw_add(
            self.count[ar, z], self.g_mean[ar, z], self.g_scatter[ar, z], x.expand(j, -1))
        if cfg.gate_on_time:
            self.crp_w[ar, z] = self._decayed(t)[ar, z] + 1.0
            self.crp_t[ar, z] = t
        else:
            self.crp_w[ar, z] = self.count[ar, z]
        self._insert(ar, z, x, y, t)
        self._fresh_ids(ar, z, same_as=self.expert_id[ar, z])  # equal experts took the same reading
        self._refresh(ar, z)
        touched[ar, z] += 1.0
        log_evidence = float(torch.logsumexp(self.log_w + inc, 0))
        self.log_w = normalise_log_weights(self.log_w + inc)
        # Running target scale (after the reading was predicted), alpha, resampling.
        self._add_to_scale(y)
        self.num_seen_t += 1
        self.last_t = torch.maximum(self.last_t, torch.tensor(t, dtype=torch.float64, device=self.device))
        self.alpha = escobar_west(self.alpha, self.num_experts, float(self.num_seen), cfg.smc_alpha_shape,
                                  cfg.smc_alpha_rate, self._generator)
        resampled = 0
        if effective_sample_size(self.log_w) < cfg.smc_ess_threshold * j:
            idx = resample_indices(self.log_w, self._generator, cfg.smc_resampling).to(self.device)
            self._select_particles(idx)
            touched = touched[idx]
            resampled = 1
        return touched, log_evidence, resampled, opened

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

    def _add_to_scale(self, y: torch.Tensor) -> None:
        """Welford update of the running target mean and spread; the scale is their standard deviation (1 until
        two readings differ). With ``smc_target_scaling: none`` the targets are used as given (mean 0, scale 1)."""
        if self.config.smc_target_scaling == "none":
            return
        n = self.y_count + 1.0
        delta = y - self.y_mean
        self.y_mean = self.y_mean + delta / n
        self.y_m2 = self.y_m2 + delta * (y - self.y_mean)
        self.y_count = n
        std = torch.sqrt(self.y_m2 / n)
        ok = std > 1e-12 * torch.clamp(self.y_mean.abs(), min=1.0)
        self.y_std = torch.where(ok, std, torch.ones_like(std))

    def _select_particles(self, idx: torch.Tensor) -> None:
        for name in ("alpha", "count", "expert_id", "crp_w", "crp_t", "g_mean", "g_scatter", "g_mu0", "theta",
                     "mem_x", "mem_y", "mem_c", "mem_s", "mem_t"):
            setattr(self, name, getattr(self, name)[idx].clone())
        self._chol, self._ly, self._l1 = self._chol[idx].clone(), self._ly[idx].clone(), self._l1[idx].clone()
        self.log_w = torch.full_like(self.log_w, -math.log(self.num_particles))
        self.resamples_t += 1

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
        d2 = _squared_distances(mx, mx) / (ls * ls)[:, None, None]
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
        d2 = _squared_distances(a, a)
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

    # ------------------------------------------------------------------ prediction
    def _mixture(self, x: torch.Tensor, t: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, torch.Tensor]:
        """Per-component pieces of the predictive at x (G, D): weights w (J,), gates g (J, K + 1, G), expert
        means (J, K + 1, G, P), latent variances (J, K + 1, G) and noise variances (J, K + 1), in work units."""
        self._ensure_cache()
        t = float(self.last_t) if t is None else float(t)
        if not math.isfinite(t):
            t = 0.0
        self._ensure_pred_cache()
        log_gate = self._gate_log(x, t)
        g = torch.exp(log_gate - torch.logsumexp(log_gate, 1, keepdim=True))
        # Only experts with a say somewhere in a group of points are predicted there (gates are local: a few per
        # particle); groups are as large as PREDICT_CHUNK_ELEMENTS allows for the experts they need.
        self._ensure_pred_cache()
        j, k, n, p = self.num_particles, self.max_experts, x.shape[0], self.output_dims
        u = self._linv.shape[-1]
        mean = torch.zeros(j, k, n, p, dtype=torch.float64, device=self.device)
        var = self._prior_var(self.theta)[..., None].expand(j, k, n).clone()
        used = self.count > 0
        start, step = 0, min(n, PREDICT_GROUP)
        while start < n:
            stop = min(n, start + step)
            active = (g[:, :-1, start:stop] > GATE_NEGLIGIBLE).any(-1) & used
            size = int(torch.unique(self._rep[active]).numel()) * u * (stop - start)
            if size > PREDICT_CHUNK_ELEMENTS and stop - start > 1:
                step = max(1, (stop - start) // 2)
                continue
            if size:
                jj, kk = torch.nonzero(active, as_tuple=True)
                reps, inverse = torch.unique(self._rep[jj, kk], return_inverse=True)
                m_a, v_a = self._predict_selected(reps, x[start:stop])
                mean[jj, kk, start:stop] = m_a[inverse]
                var[jj, kk, start:stop] = v_a[inverse]
            start = stop
        std = self.config.smc_hyper_prior_std
        pm = self._prior_now()
        prior_var = math.exp(float(pm[self.num_ls]) + 0.5 * std ** 2)
        noise_new = math.exp(float(pm[self.num_ls + 1]) + 0.5 * std ** 2)
        if self.has_constant:
            prior_var += math.exp(float(pm[-1]) + 0.5 * std ** 2)
        mean = torch.cat([mean, torch.zeros(j, 1, n, p, dtype=mean.dtype, device=mean.device)], 1)
        var = torch.cat([var, torch.full((j, 1, n), prior_var, dtype=var.dtype, device=var.device)], 1)
        noise = torch.cat([self._noise(self.theta), torch.full((j, 1), noise_new, dtype=var.dtype,
                                                                device=var.device)], 1)
        return self.weights, g, mean, var, noise

    def _chunks(self, n: int) -> int:
        """Test points per chunk: the gates' temporaries (J, K, U, G) for the kernel gate, (J, K, D, G) and the
        per-component outputs (J, K, G, P) otherwise, hold about PREDICT_CHUNK_ELEMENTS numbers."""
        width = self._used_memory(self.mem_c) if self.config.smc_gate == "kernel" else self.input_dims
        per_point = self.num_particles * (self.max_experts + 1) * max(width, self.output_dims + 2)
        return max(1, min(n, PREDICT_CHUNK_ELEMENTS // max(per_point, 1)))

    def _latent(self, x: torch.Tensor, t=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixture mean and variance (law of total variance) of f at checked inputs, standardised units."""
        sbar = self._work_scale()[2]
        out_m, out_v = [], []
        order = _spatial_order(x)
        x = x[order]
        with torch.no_grad():
            step = self._chunks(x.shape[0])
            for s in range(0, x.shape[0], step):
                w, g, mu, var, _ = self._mixture(x[s:s + step], t)
                wg = w[:, None, None] * g                                                   # (J, K + 1, G)
                m = torch.einsum("jkg,jkgp->gp", wg, mu)
                second = torch.einsum("jkg,jkgp->gp", wg, mu * mu + var[..., None])
                out_m.append(m)
                out_v.append((second - m * m).clamp_min(0.0))
        if not out_m:
            empty = torch.zeros(0, self.output_dims, dtype=torch.float64, device=self.device)
            return empty, empty.clone()
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0], device=order.device)
        return torch.cat(out_m)[back] / sbar, torch.cat(out_v)[back] / sbar ** 2

    @property
    def calibrates(self) -> bool:
        """False: a reading's predictive distribution here is a mixture over particles and experts, each with
        its own noise (log_predictive_density scores the mixture itself); a single Gaussian variance model
        does not describe it."""
        return False

    def predict_reading(self, x, t=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (G, P) of a reading at x (original units): the mixture's moments with each
        expert's noise added to its latent variance (law of total variance)."""
        xt = self._check_x(x)
        sbar = self._work_scale()[2]
        means, variances = [], []
        with torch.no_grad():
            step = self._chunks(max(xt.shape[0], 1))
            for s in range(0, xt.shape[0], step):
                w, g, mu, var, noise = self._mixture(xt[s:s + step], t)
                wg = w[:, None, None] * g
                m = torch.einsum("jkg,jkgp->gp", wg, mu)
                second = torch.einsum("jkg,jkgp->gp", wg, mu * mu + (var + noise[..., None])[..., None])
                means.append(m / sbar)
                variances.append((second - m * m).clamp_min(0.0) / sbar ** 2)
        if not means:
            empty = torch.zeros(0, self.output_dims, dtype=torch.float64, device=self.device)
            return empty, empty.clone()
        return torch.cat(means) * self.y_std + self.y_mean, torch.cat(variances) * self.y_std ** 2

    def predict(self, x, t=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (G, P) of the latent f at x, original units; gate at stamp t (default: newest)."""
        xt = self._check_x(x)
        with torch.no_grad():
            m, v = self._latent(xt, t)
        return m * self.y_std + self.y_mean, v * self.y_std ** 2

    def log_predictive_density(self, x, y, t=None) -> torch.Tensor:
        """log p(y*|x*) (N, P) in the original units: per component, the mixture over particles and gates of
        the experts' Gaussian predictive densities (with their noise)."""
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        mean_y, ratio, _ = self._work_scale()
        order = _spatial_order(xt)
        xt, ys = xt[order], ((yt - mean_y) * ratio)[order]
        out = []
        with torch.no_grad():
            step = self._chunks(xt.shape[0])
            for s in range(0, xt.shape[0], step):
                w, g, mu, var, noise = self._mixture(xt[s:s + step], t)
                v = (var + noise[..., None])[..., None]                                     # (J, K + 1, G, 1)
                comp = -0.5 * (LOG_2PI + torch.log(v) + (ys[s:s + step] - mu) ** 2 / v)
                logw = (torch.log(w.clamp_min(1e-300))[:, None, None] + torch.log(g.clamp_min(1e-300)))[..., None]
                out.append(torch.logsumexp((logw + comp).flatten(0, 1), 0))
        if not out:
            return torch.zeros(0, self.output_dims, dtype=torch.float64, device=self.device)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0], device=order.device)
        return torch.cat(out)[back] + torch.log(ratio)

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, particles={self.num_particles}, "
                f"max_experts={self.max_experts}, expert_memory={self.expert_memory}")


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a_i - b_j|^2 (..., N1, N2) for (..., N1, D) and (..., N2, D), one input dimension at a time (exact zeros
    for equal points, no (..., N1, N2, D) temporary)."""
    r2 = None
    for d in range(a.shape[-1]):
        diff = a[..., :, None, d] - b[..., None, :, d]
        r2 = diff * diff if r2 is None else r2 + diff * diff
    return r2


def _spatial_order(x: torch.Tensor, bits: int = 10) -> torch.Tensor:
    """A permutation of the points x (G, D) along a Z-order (Morton) curve over their first (up to three)
    coordinates, so that consecutive points are close at every scale: a group of them needs the experts of a
    small area, not of a whole grid row."""
    n = x.shape[0]
    if n < 2:
        return torch.arange(n, device=x.device)
    c = x[:, :min(3, x.shape[1])]
    lo, hi = c.min(0).values, c.max(0).values
    q = ((c - lo) / (hi - lo).clamp_min(1e-300) * (2 ** bits - 1)).round().to(torch.int64)
    key = torch.zeros(n, dtype=torch.int64, device=x.device)
    dims = q.shape[1]
    for b in range(bits):
        for d in range(dims):
            key |= ((q[:, d] >> b) & 1) << (b * dims + d)
    return torch.argsort(key, stable=True)
