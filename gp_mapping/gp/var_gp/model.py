"""Variational auto-regressive GP (Kapoor, Karaletsos & Bui, "Variational Auto-Regressive Gaussian Processes for
Continual Learning", ICML 2021; ALGORITHMS.md section 3), as an online mapping engine.

Model. The map is a list of region blocks of inducing points. Block j has inputs Z_j (M_j <= vargp_block_size),
parents P(j) (earlier blocks) and a variational conditional, per output p,

    q(u_j | u_P(j), theta) = N(A_j u_P(j) + m_j, S_j),      p(u_j | u_P(j), theta) = N(A_j u_P(j), C_j),
    A_j = K_{j,P} K_{P,P}^{-1},   C_j = K_{j,j} - K_{j,P} K_{P,P}^{-1} K_{P,j}     (eq. 6-7; the typo of C_t fixed)

with (m_j, S_j = L_j L_j^T) free parameters that do not depend on theta. Every block but the last (the current
one) is frozen. The running joint q(u_<=t | theta) is the App. C.3 recursion (:func:`.factors.ar_joint`). Because the
prior conditional has the same A_j, the KL of block t,

    D_t = KL[q(u_t | u_<t, theta) || p(u_t | u_<t, theta)] = KL[N(m_t, S_t) || N(0, C_t)],

does not depend on u_<t (:func:`.factors.block_kl`); only theta is sampled. Numerically everything is done in whitened
coordinates: with L = (I - A)^{-1} blockdiag(chol C_j) the Cholesky factor of the blocks' prior covariance,
v = L^{-1} u is block-diagonal under q: v_j ~ N(chol(C_j)^{-1} m_j, chol(C_j)^{-1} S_j chol(C_j)^{-T}). The latent
at x is then f(x) | v ~ N(a_x^T v, k(x,x) - |a_x|^2) with a_x = L^{-1} k_x (the usual SVGP marginal over all
Z_<=t, App. C.3), built block by block: a_{x,j} = chol(C_j)^{-1} (k_{j,x} - A_j k_{P(j),x}).

Hyperparameters. q(theta) is a mean-field log-normal over the kernel's hyperparameters (the logs of the
lengthscales, the signal variance and the constant variance: a Gaussian on the kernel's raw parameters), with
reparameterised samples theta = mu + sigma * eps. The prior of the first block is N(log of the configured
values, vargp_hyper_prior_std^2); block t's bound carries beta KL[q_t(theta) || q_{t-1}(theta)] with q_{t-1} the
posterior when block t was opened (beta: vargp_beta). The likelihood's noise is a point estimate (the paper puts
q on the kernel only). Prediction averages the latent over vargp_predict_samples fixed draws of q(theta) (a mixture:
its mean, and its variance by the law of total variance). No hyperparameter is learned from a batch that does not
span space (``spans_space``: a robot at rest), as in every engine here.

Where a block's points go and when a block opens (and the revisits of frozen blocks): :mod:`.blocks`.

Updates of the current block follow the bound of eq. 8 on the data seen since the block was opened (a uniform
weighted sample of at most vargp_block_memory of them, each standing for its share):

    F = sum_i w_i E_{q(theta)} E_{q(f_i | theta)}[log p(y_i | f_i)] - beta KL[q(theta) || q_{t-1}(theta)]
        - E_{q(theta)}[D_t(theta)]

* a *fast* update conditions the current block on the batch with theta fixed at its mean: for the Gaussian
  likelihood q(u_t) is set to the exact optimum of F at that theta (a closed form, one linear solve); for the
  others it takes up to hyper_steps Adam steps on (m_t, L_t) only;
* a *full* update does the same, then (when the batch spans space and learn_hyperparameters) takes up to
  hyper_steps Adam steps (fewer after the warm-up, see ``Engine._hyper_budget``) on q(theta), the noise and
  (m_t, L_t) together, vargp_samples reparameterised draws of theta per step (common to the steps of one update,
  so the bound is deterministic within it), each step's data term on at most hyper_points samples of the block's
  data; it stops early once F per datum rose by less than hyper_tol.

Bounded cost (the neighbours a block is conditioned on, distillation of the oldest blocks): :mod:`.blocks`. The
factors of a set of blocks and the latent's marginals through them: :mod:`.factors`.

Vector targets: the outputs are independent latent GPs that share the blocks' Z, q(theta) and the parent
structure, each with its own (m_j, S_j) and noise. Targets are standardised by running statistics (re-expressed
when they drift: S_j scales, m_j shifts by the mean change through (1 - A_j 1), exact at the mean theta).
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.func import functional_call

from ..base import Engine, difference_noise_estimate, resolve_device, spans_space
from ..config import ModelConfig
from ..errors import ConfigError, GPNumericalError
from ..kernels import build_kernel
from ..likelihoods import GaussianLikelihood, build_likelihood
from ..linalg import jittered_cholesky, symmetrise
from .blocks import RegionBlocks
from .factors import BlockFactors, block_kl

#: Standard deviation q(theta) starts with (the prior's is vargp_hyper_prior_std): a broad q makes the frozen blocks'
#: conditionals, which depend on theta through A_j, useless until many steps have narrowed it; the data narrow or
#: widen it from here, and the KL to the prior is what it is.
INITIAL_Q_STD = 0.05
#: Largest |log hyperparameter| step a reparameterised draw may take (keeps exp() finite on wild draws).
THETA_CLAMP = 30.0


class VARGP(BlockFactors, RegionBlocks, Engine):
    """Online VAR-GP with region blocks; see the module docstring. Interface as every engine in ``gp``."""

    #: buffers whose size follows the data (resized on load_state_dict)
    RESIZABLE = ("Z", "m", "S_chol", "counts", "parent_mask", "buf_x", "buf_y", "buf_w", "rng_state",
                 "adam_avg", "adam_avg_sq")

    def __init__(self, config: ModelConfig, input_dims: int, output_dims: int) -> None:
        super().__init__(config, input_dims, output_dims)
        cfg = self.config
        d, p = self.input_dims, self.output_dims
        # Distillation merges two blocks into one, so a block holds at most half of num_inducing.
        mb = min(int(cfg.vargp_block_size), int(cfg.num_inducing) // 2)
        if mb < 1:
            raise ConfigError(f"var_gp needs num_inducing >= 2 (two blocks), got {cfg.num_inducing}", "num_inducing")
        self._block_size = mb
        if cfg.inducing != "pivoted_cholesky":
            raise ConfigError("var_gp places its blocks' points by pivoted Cholesky; use 'pivoted_cholesky'",
                              "inducing")
        # one kernel: model.kernel_scales is measured for dual_svgp only (q(theta) over a sum's parameters is not)
        self.kernel = build_kernel(cfg, d, scales=1)
        self.kernel.requires_grad_(False)  # holds the q(theta) mean; q(theta) itself is q_mu, q_logsd
        self.likelihood = self._own_likelihood(build_likelihood(cfg, p))
        self._theta_layout = [(name, tuple(t.shape), t.numel()) for name, t in self.kernel.named_parameters()]
        theta0 = torch.cat([t.detach().reshape(-1) for _, t in self.kernel.named_parameters()]).to(torch.float64)
        h = theta0.numel()
        f64 = dict(dtype=torch.float64)
        logsd0 = torch.full((h,), math.log(cfg.vargp_hyper_prior_std), **f64)
        self.q_mu = nn.Parameter(theta0.clone())
        self.q_logsd = nn.Parameter(torch.full((h,), math.log(min(INITIAL_Q_STD, cfg.vargp_hyper_prior_std)), **f64))
        self.register_buffer("prev_mu", theta0.clone())      # q_{t-1}(theta): the KL's anchor for block t
        self.register_buffer("prev_logsd", logsd0.clone())
        self.register_buffer("Z", torch.zeros(0, mb, d, **f64))
        self.register_buffer("m", torch.zeros(0, mb, p, **f64))
        self.register_buffer("S_chol", torch.zeros(0, p, mb, mb, **f64))
        self.register_buffer("counts", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("parent_mask", torch.zeros(0, 0, dtype=torch.bool))
        self.register_buffer("buf_x", torch.zeros(0, d, **f64))     # the current block's data (standardised y)
        self.register_buffer("buf_y", torch.zeros(0, p, **f64))
        self.register_buffer("buf_w", torch.zeros(0, **f64))        # data each buffered sample stands for
        self.register_buffer("jitter_t", torch.tensor(float(cfg.jitter), **f64))
        self._register_target_statistics(p)
        self.register_buffer("standardised", torch.tensor(False))
        self.register_buffer("hyper_learned", torch.tensor(False))
        self.register_buffer("blocks_opened_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("distillations_t", torch.tensor(0, dtype=torch.int64))
        self._register_adam_state()
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(int(cfg.seed))
        # Fixed draws of q(theta) for prediction (antithetic pairs; one draw: the mean), from the seed alone, so
        # a reloaded engine predicts identically.
        s = int(cfg.vargp_predict_samples)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(cfg.seed) + 7919)
        half = torch.randn((s + 1) // 2, h, generator=gen, dtype=torch.float64)
        eps = torch.zeros(1, h, **f64) if s == 1 else torch.cat([half, -half])[:s]
        self.register_buffer("eps_predict", eps, persistent=False)
        self.register_buffer("rng_state", self._generator.get_state())
        self._pred = None
        self.to(resolve_device(cfg.device))

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_inducing(self) -> int:
        return int(self.counts.sum())

    @property
    def block_size(self) -> int:
        """Most points a block grows to: vargp_block_size, at most half of num_inducing (a distilled block may
        hold more; the storage is as wide as the largest block)."""
        return self._block_size

    @property
    def jitter(self) -> float:
        return float(self.jitter_t)

    @property
    def lengthscale_mean(self) -> torch.Tensor:
        """Mean of the lengthscales under the log-normal q(theta) (exp(mu + sigma^2 / 2))."""
        idx = self._lengthscale_index()
        with torch.no_grad():
            return torch.exp(self.q_mu[idx] + 0.5 * torch.exp(2 * self.q_logsd[idx]))

    def _lengthscale_index(self) -> slice:
        off = 0
        for name, _, n in self._theta_layout:
            if "lengthscale" in name:
                return slice(off, off + n)
            off += n
        raise RuntimeError("the kernel has no lengthscale")

    def inducing_inputs(self) -> torch.Tensor:
        """All blocks' inducing inputs (M, D), oldest block first."""
        return torch.cat([self.Z[j, :int(c)] for j, c in enumerate(self.counts)]) if self.num_blocks else \
            self.Z.new_zeros(0, self.input_dims)

    def block_of_inducing(self) -> torch.Tensor:
        """The block index of each of :meth:`inducing_inputs` (M,)."""
        return torch.repeat_interleave(torch.arange(self.num_blocks, device=self.device), self.counts)

    # ------------------------------------------------------------------ plumbing
    def _drop_caches(self) -> None:
        super()._drop_caches()
        self._pred = None

    def _loaded(self) -> None:
        self._generator.set_state(self.rng_state.detach().to("cpu", torch.uint8))
        self._sync_kernel()

    def _sync_kernel(self) -> None:
        """The kernel module holds the q(theta) mean (for its diag, tiles and readers of its parameters)."""
        with torch.no_grad():
            off = 0
            for (_, _, n), t in zip(self._theta_layout, self.kernel.parameters()):
                t.copy_(self.q_mu[off:off + n].view_as(t))
                off += n

    def _kernel_at(self, theta: torch.Tensor):
        """(k(x1, x2), diag(x)) of the kernel at raw parameters theta (H,) (differentiable in theta)."""
        params, off = {}, 0
        theta = theta.clamp(-THETA_CLAMP, THETA_CLAMP)
        for name, shape, n in self._theta_layout:
            params[name] = theta[off:off + n].view(shape)
            off += n

        def kern(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return functional_call(self.kernel, params, (a, b))

        def kdiag(x: torch.Tensor) -> torch.Tensor:  # stationary (and constant) kernels: k(x, x) is one value
            if x.shape[0] == 0:
                return x.new_zeros(0)
            return kern(x[:1], x[:1])[0, 0].expand(x.shape[0])

        return kern, kdiag

    # ------------------------------------------------------------------ prediction
    def _prediction_cache(self):
        """Per fixed draw of q(theta): (kernel, alpha (M, P), Q (P, M, M)) with mean = K_xZ alpha and
        var = k(x,x) + k_x^T Q_p k_x, Q_p = T^T (R_p R_p^T - I) T (the whitened SVGP marginal over all blocks)."""
        if self._pred is None:
            blocks = list(range(self.num_blocks))
            out = []
            with torch.no_grad():
                sd = torch.exp(self.q_logsd)
                for e in self.eps_predict:
                    fac = self._factors(self.q_mu + sd * e, blocks)
                    w, R = self._whitened(fac, blocks)
                    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
                    alpha = fac.T.T @ w
                    Q = fac.T.T @ (R @ R.transpose(-1, -2) - eye) @ fac.T
                    out.append((fac.kern, fac.kdiag, alpha, symmetrise(Q)))
            self._pred = (self.inducing_inputs(), out)
        return self._pred

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixture over the fixed draws of q(theta): mean and variance (law of total variance), standardised."""
        n, p = x.shape[0], self.output_dims
        if self.num_blocks == 0:
            sd = torch.exp(self.q_logsd)
            v = torch.stack([self._kernel_at(self.q_mu + sd * e)[1](x) for e in self.eps_predict]).mean(0) \
                if n else x.new_zeros(0)
            return x.new_zeros(n, p), v[:, None].expand(n, p).clone()
        Z, draws = self._prediction_cache()
        first = x.new_zeros(n, p)
        second = x.new_zeros(n, p)
        for kern, kdiag, alpha, Q in draws:
            Kxz = kern(x, Z)
            mean = Kxz @ alpha
            var = kdiag(x)[:, None] + torch.stack([((Kxz @ Q[q]) * Kxz).sum(1) for q in range(p)], 1)
            var = var.clamp_min(0.0)
            first = first + mean
            second = second + var + mean * mean
        s = len(draws)
        mean = first / s
        return mean, (second / s - mean * mean).clamp_min(0.0)

    # ------------------------------------------------------------------ standardisation
    def _rescale_targets(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Standardise with (mean, std) from now on: f_new = alpha (f_old - d), alpha = std_old / std, d = (mean
        - mean_old) / std_old. Block j: m_j -> alpha (m_j - d (1 - A_j 1)) (A_j at the q(theta) mean; exact for
        blocks without parents), S_j -> alpha^2 S_j; the buffered targets move with them. The kernel stays in
        standardised units; a learned noise is re-expressed (as in dual_svgp)."""
        alpha = self.y_std / std
        d = (mean - self.y_mean) / self.y_std
        if self.num_blocks:
            blocks = list(range(self.num_blocks))
            fac = self._factors(self.q_mu.detach(), blocks)
            for i, j in enumerate(blocks):
                c = int(self.counts[j])
                one = torch.ones(c, 1, dtype=torch.float64, device=self.device)
                if fac.parents[i]:
                    ones_p = torch.ones(fac.LP[i].shape[0], 1, dtype=torch.float64, device=self.device)
                    a1 = fac.G[i].T @ torch.linalg.solve_triangular(fac.LP[i], ones_p, upper=False)
                    one = one - a1
                self.m[j, :c] = alpha * (self.m[j, :c] - d * one)
                self.S_chol[j] = self.S_chol[j] * alpha[:, None, None]
        self.buf_y = alpha * (self.buf_y - d)
        if bool(self.hyper_learned):
            self.likelihood.rescale_targets(alpha)
        self.y_mean.copy_(mean)
        self.y_std.copy_(std)
        self._drop_caches()

    # ------------------------------------------------------------------ the current block's data
    def _clear_buffer(self) -> None:
        self.buf_x, self.buf_y, self.buf_w = self.buf_x[:0], self.buf_y[:0], self.buf_w[:0]

    def _add_to_buffer(self, x: torch.Tensor, ys: torch.Tensor) -> None:
        """Append the batch; above vargp_block_memory keep a uniform sample (probability by weight, each kept
        sample then stands for an equal share of the block's data)."""
        bx, by = torch.cat([self.buf_x, x]), torch.cat([self.buf_y, ys])
        bw = torch.cat([self.buf_w, torch.ones(x.shape[0], dtype=torch.float64, device=self.device)])
        cap = int(self.config.vargp_block_memory)
        if bx.shape[0] > cap:
            total = float(bw.sum())
            pick = torch.multinomial(bw.cpu(), cap, replacement=False, generator=self._generator).to(self.device)
            pick = torch.sort(pick).values
            bx, by = bx[pick], by[pick]
            bw = torch.full((cap,), total / cap, dtype=torch.float64, device=self.device)
        self.buf_x, self.buf_y, self.buf_w = bx, by, bw

    def _training_blocks(self) -> list[int]:
        """Every block, each with its own parents: a frozen block's m_j is an offset from A_j u_parents, not a
        mean, so dropping a parent's parents would misplace it (measured: a map 2x worse near the first region)."""
        return list(range(self.num_blocks))

    # ------------------------------------------------------------------ fitting the current block
    def _closed_form(self) -> None:
        """Gaussian likelihood, theta at the q(theta) mean: the exact optimum of F over (m_t, S_t). Whitened,
        v_t ~ N(w, Lambda^{-1}) with Lambda = I + sum_i w_i a_i a_i^T / s2 and w = Lambda^{-1} sum_i w_i a_i
        (y_i - b_i) / s2 (a_i: the current block's rows of a_x; b_i: the frozen blocks' part of the mean)."""
        if self.buf_x.shape[0] == 0:  # every reading so far went to frozen blocks: the block keeps its q
            return
        blocks = self._training_blocks()
        fac = self._factors(self.q_mu.detach(), blocks)
        w_all, _ = self._whitened(fac, blocks)
        A = fac.T @ fac.kern(fac.Z, self.buf_x)
        sl = fac.slices[-1]
        At = A[sl]                                             # (c, N)
        b = A.T @ w_all - At.T @ w_all[sl]                     # frozen blocks' mean (N, P)
        s2 = self.likelihood.noise_variance.detach()
        c = At.shape[0]
        eye = torch.eye(c, dtype=torch.float64, device=self.device)
        t = blocks[-1]
        for p in range(self.output_dims):
            wp = self.buf_w / s2[p]
            lam = symmetrise(eye + (At * wp) @ At.T)
            U, _ = jittered_cholesky(lam, 0.0)
            mean_w = torch.cholesky_solve(((At * wp) @ (self.buf_y[:, p] - b[:, p]))[:, None], U)[:, 0]
            R, _ = jittered_cholesky(symmetrise(torch.cholesky_inverse(U)), 0.0)
            self.m[t, :c, p] = fac.LC[-1] @ mean_w
            self.S_chol[t, p, :c, :c] = fac.LC[-1] @ R

    def _bound(self, theta: torch.Tensor, blocks, m_t, L_t, x, y, w) -> torch.Tensor:
        """sum_i w_i E_q[log p(y_i|f_i)] - D_t at one theta (eq. 8 without the theta KL)."""
        fac = self._factors(theta, blocks)
        wv, R = self._whitened(fac, blocks, current=(m_t, L_t))
        mean, var = self._marginals(fac, wv, R, x)
        ell = (self.likelihood.expected_log_lik(y, mean, var) * w[:, None]).sum()
        return ell - block_kl(m_t, L_t, fac.LC[-1]).sum()

    def _theta_kl(self) -> torch.Tensor:
        """KL[q(theta) || q_{t-1}(theta)] of two diagonal Gaussians."""
        v, v0 = torch.exp(2 * self.q_logsd), torch.exp(2 * self.prev_logsd)
        return 0.5 * ((v + (self.q_mu - self.prev_mu) ** 2) / v0 - 1.0 + torch.log(v0 / v)).sum()

    def _steps(self, budget: int, learn_theta: bool, learn_q: bool) -> tuple[int, float]:
        """Adam on the bound of eq. 8 over q(u_t) (learn_q) and/or q(theta) and the likelihood's parameters
        (learn_theta). q(u_t) is stepped in the coordinates whitened at the start (m_t = LC0 w, L_t = LC0 R,
        LC0 = chol(C_t) at the q(theta) mean, R lower triangular with a softplus diagonal), where the prior is
        N(0, I) and Adam's per-coordinate steps have one scale. Returns (steps taken, final bound per datum)."""
        cfg = self.config
        if budget <= 0 or not (learn_theta or learn_q) or self.buf_x.shape[0] == 0:
            return 0, 0.0
        t = self.num_blocks - 1
        c = int(self.counts[t])
        blocks = self._training_blocks()
        x, y, w = self.buf_x, self.buf_y, self.buf_w
        if x.shape[0] > cfg.hyper_points:  # a weighted uniform sample stands for the block's data
            pick = torch.multinomial(w.cpu(), cfg.hyper_points, replacement=False,
                                     generator=self._generator).to(self.device)
            total = float(w.sum())
            x, y = x[pick], y[pick]
            w = torch.full((cfg.hyper_points,), total / cfg.hyper_points, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            LC0 = self._factors(self.q_mu.detach(), blocks).LC[-1]
            w0 = torch.linalg.solve_triangular(LC0, self.m[t, :c], upper=False)
            R0 = torch.linalg.solve_triangular(LC0, self.S_chol[t, :, :c, :c], upper=False)
            d0 = torch.diagonal(R0, dim1=-2, dim2=-1).clamp_min(1e-12)
        w_t = nn.Parameter(w0.clone(), requires_grad=learn_q)
        raw_diag = nn.Parameter(torch.where(d0 > 20, d0, torch.log(torch.expm1(d0))), requires_grad=learn_q)
        raw_low = nn.Parameter(torch.tril(R0, -1).clone(), requires_grad=learn_q)
        q_vars = [w_t, raw_diag, raw_low]
        hyper = ([self.q_mu, self.q_logsd] + list(self.likelihood.parameters())) if learn_theta else []
        groups = ([{"params": q_vars, "lr": cfg.variational_lr}] if learn_q else []) + \
            ([{"params": hyper, "lr": cfg.hyper_lr}] if hyper else [])
        opt = torch.optim.Adam(groups)
        if hyper:
            self._restore_adam(opt, hyper)
        n_s = int(cfg.vargp_samples) if learn_theta else 1
        eps = torch.randn(n_s, self.q_mu.numel(), generator=self._generator, dtype=torch.float64).to(self.device)
        if n_s == 2:
            eps[1] = -eps[0]  # an antithetic pair
        if not learn_theta:
            eps.zero_()
        scale = 1.0 / max(1.0, float(w.sum()))
        variables = q_vars + hyper
        good = [q.detach().clone() for q in variables]
        steps, value, failed = 0, 0.0, False

        def q_t():
            L = LC0 @ (torch.tril(raw_low, -1) + torch.diag_embed(nn.functional.softplus(raw_diag)))
            return LC0 @ w_t, L

        with torch.enable_grad():
            for _ in range(budget):
                opt.zero_grad()
                try:
                    m_t, L_t = q_t()
                    sd = torch.exp(self.q_logsd)
                    f = sum(self._bound(self.q_mu + sd * e, blocks, m_t, L_t, x, y, w) for e in eps) / n_s
                    if learn_theta:
                        f = f - cfg.vargp_beta * self._theta_kl()
                    ok = bool(torch.isfinite(f))
                    if ok and steps and cfg.hyper_tol > 0 and float(f.detach()) * scale - value < cfg.hyper_tol:
                        value = float(f.detach()) * scale
                        break
                    if ok:
                        (-f * scale).backward()
                        ok = all(q.grad is None or bool(torch.isfinite(q.grad).all()) for q in variables)
                except GPNumericalError:
                    ok = False
                if not ok:
                    failed = True
                    break
                good = [q.detach().clone() for q in variables]
                value = float(f.detach()) * scale
                opt.step()
                steps += 1
        with torch.no_grad():
            if failed or not all(bool(torch.isfinite(q).all()) for q in variables):
                for q, g in zip(variables, good):  # back to the last variables whose bound evaluated cleanly
                    q.copy_(g)
                steps = max(steps - 1, 0) if not failed else steps
            if hyper:
                self._store_adam(opt, hyper)
            if learn_q:
                m_t, L_t = q_t()
                self.m[t, :c] = m_t
                self.S_chol[t, :, :c, :c] = L_t
        return steps, value

    # ------------------------------------------------------------------ update
    def update(self, x, y, mode: str | None = None) -> dict:
        """Condition on a batch (x (N, D), y (N, P)); mode 'fast', 'full' or None (full every
        full_update_every updates)."""
        start = time.perf_counter()
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        if mode not in (None, "fast", "full"):
            raise ValueError(f"update mode must be 'fast', 'full' or None, got {mode!r}")
        cfg = self.config
        if mode is None:
            mode = "full" if int(self.num_updates_t) % cfg.full_update_every == 0 else "fast"
        stats: dict = {"mode": mode, "n_batch": int(xt.shape[0]), "hyper_steps": 0, "variational_steps": 0,
                       "revisit_points": 0, "objective": 0.0, "blocks_opened": 0, "points_added": 0, "distilled": 0}
        if xt.shape[0]:
            yt = self._calibrate_on(xt, yt)
            with torch.no_grad():
                informative = spans_space(xt, cfg.lengthscale)
                self._track_targets(yt, informative)
                ys = (yt - self.y_mean) / self.y_std
                learn = (mode == "full" and informative and cfg.learn_hyperparameters and cfg.hyper_steps > 0)
                if learn and not bool(self.hyper_learned) and xt.shape[0] > 2 \
                        and isinstance(self.likelihood, GaussianLikelihood):
                    self.likelihood.initialise_noise(difference_noise_estimate(ys).clamp(cfg.noise_variance, 1.0))
                stats.update(self._place(xt))
                gaussian = isinstance(self.likelihood, GaussianLikelihood)
                revisit = self._revisits(xt) if gaussian and cfg.vargp_revisits == "refine" else None
                if revisit is not None and bool(revisit.any()):
                    self._refine_frozen(xt[revisit], ys[revisit])
                    stats["revisit_points"] = int(revisit.sum())
                # every reading also enters the current block's bound (which fits what the frozen blocks leave:
                # a reading at the border of the two speaks to both)
                self._add_to_buffer(xt, ys)
                if gaussian:
                    self._closed_form()
            if not gaussian:
                stats["variational_steps"] = self._steps(cfg.hyper_steps, learn_theta=False, learn_q=True)[0]
            if learn:
                # Gaussian: q(u_t) is held during the theta steps and solved again at the new mean theta
                # (coordinate ascent on F); otherwise both are stepped together.
                steps, value = self._steps(self._hyper_budget(xt.shape[0]), learn_theta=True, learn_q=not gaussian)
                stats["hyper_steps"], stats["objective"] = steps, value
                if steps:
                    self.hyper_learned.fill_(True)
                    if gaussian:
                        with torch.no_grad():
                            self._closed_form()
            with torch.no_grad():
                self._sync_kernel()
                self.num_seen_t += xt.shape[0]
                self.num_updates_t += 1
                self.rng_state = self._generator.get_state()
            self._drop_caches()
        stats.update({"seconds": time.perf_counter() - start, "num_seen": self.num_seen,
                      "num_blocks": self.num_blocks, "num_inducing": self.num_inducing,
                      "buffer": int(self.buf_x.shape[0]), "jitter": self.jitter})
        return stats

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, blocks={self.num_blocks}, "
                f"num_inducing={self.num_inducing}/{self.config.num_inducing}")
