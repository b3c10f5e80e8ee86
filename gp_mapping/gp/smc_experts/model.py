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

The experts' GPs: :mod:`.experts`; the gate: :mod:`.gating`; the experts' memories and the bounded cost:
:mod:`.memory`; the Dirichlet-process and sampling primitives: :mod:`.dp_mixture`.

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

from ..base import Engine, resolve_device
from ..errors import ConfigError
from ..kernels import STATIONARY_KERNELS, lengthscale_groups
from ..likelihoods import GaussianLikelihood
from .dp_mixture import escobar_west, effective_sample_size, niw_add, normalise_log_weights, resample_indices
from .experts import LOG_2PI, ExpertGPs
from .gating import GATE_NEGLIGIBLE, Gating
from .memory import NEW_EXPERT_NODES, NEW_EXPERT_SPAN, ExpertMemory

#: test points per group of one prediction GEMM: smaller groups need fewer experts each (their union over the
#: group), larger ones fewer calls
PREDICT_GROUP = 128
#: prediction works on chunks of test points whose (J, K, M, G, D) temporaries hold about this many numbers
PREDICT_CHUNK_ELEMENTS = 1 << 22


class SMCExperts(ExpertGPs, Gating, ExpertMemory, Engine):
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

    # ------------------------------------------------------------------ updates
    def update(self, x, y, mode: str | None = None, t=None) -> dict:
        """Condition on a batch: x (N, D), y (N, P), stamps t (N,) [s] (None: a sample clock). ``mode`` is
        accepted for the common interface; every update is the same here."""
        start = time.perf_counter()
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        tt = self._check_stamps(t, xt.shape[0])  # None: a sample clock (num_seen, num_seen + 1, ...)
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

    def predict_reading(self, x, t=None, with_slope: bool = True, full_floor: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (G, P) of a reading at x (original units): the mixture's moments with each
        expert's noise added to its latent variance (law of total variance). (No calibration, so no slope term
        and no narrowed floor: ``with_slope`` and ``full_floor`` are Engine.predict_reading's and change nothing
        here.)"""
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
