"""Memory-based dual sparse variational GP (Chang, Verma, John, Solin, Khan, "Memory-Based Dual Gaussian Processes
for Sequential Learning", ICML 2023).

State: inducing inputs Z (M x D), dual parameters a (M x P) and B (P x M x M), kernel and likelihood
hyperparameters. q(u) = N(m, S) with m = K (K+B)^{-1} a and S = K (K+B)^{-1} K, K = K_ZZ + jitter I, and

    E[f(x)]   = k_x^T (K+B)^{-1} a
    Var[f(x)] = k(x,x) - k_x^T K^{-1} k_x + k_x^T (K+B)^{-1} k_x.

Numerics: the duals are stored whitened by L = chol(K): a_w = L^{-1} a and W = L^{-1} B L^{-T} (``a`` and
``B`` are available as properties). chol(K + B) = L R with R = chol(I + W); I + W has every eigenvalue >= 1,
so only K can ever need more jitter. B itself grows like (number of data) / (noise variance) while K is
ill-conditioned, so moving B between inducing sets or hyperparameters in raw form (A_p^T B A_p) and
whitening it afterwards loses every digit; in whitened form the same move is G^T W G with G = L_old^{-1} C
L_new^{-T}, which is close to the identity. The P outputs are independent latent GPs that share Z and the
kernel; each has its own likelihood parameter (noise variance).

Bookkeeping (every datum seen contributes exactly once):
    a = a_old + sum_{i held} k_i lambda1_i,     B = B_old + sum_{i held} lambda2_i k_i k_i^T
  * "held" data are the memory and the pending points (batches conditioned on in fast mode since the last
    full update). Each holds its own site (lambda1, lambda2) = (beta*ytilde, beta) as a tensor row, so its
    contribution is recomputed exactly whenever Z or the hyperparameters change and is refitted by the BLR
    steps of every full update (the paper's "remove the memory's sites and re-fit", eqs. 18-20).
  * (a_old, B_old) is the sum of the sites of every datum no longer held. A datum moves there exactly once:
    when its batch is done and it is not kept in memory, or when it is evicted from memory (with the site it
    had then). A point entering memory is never also added to (a_old, B_old) - the reference code counts
    such a point twice (once in the batch's sites, again in the memory's).

Memory (bounded by memory_size): from each full update's batch, memory_per_batch candidates are drawn without
replacement, in proportion to their Bayesian leverage score (or uniformly). The candidates then compete in a
weighted reservoir (Efraimidis & Spirakis A-Res): each gets the key log(U)/w, U ~ Uniform(0, 1), with
w = batch size / number of candidates (the number of data it stands for), and the memory keeps the
memory_size largest keys among old members and new candidates. With equal weights this is exactly reservoir
sampling: the memory is a uniform sample of all candidates ever offered, so every stretch of the stream is
represented in proportion to its amount of data, however long the robot runs. Losers are folded into
(a_old, B_old).

Hyperparameters (full mode): Adam on the dual-fixed objective (Chang et al. 2023, sec. 3.4)
    l(theta) = sum_{batch} E_q[log p(y|f)] + (N_old / |memory|) sum_{memory} E_q[log p(y|f)] - KL[q || p_theta]
with N_old the number of data seen before this batch: reservoir sampling makes the memory a uniform sample of
the old data, so each member stands for N_old/|memory| of them (unbiased for a uniform memory; the reference
code's num_seen/num_mem_per_batch over-weights a memory that has grown). The optimiser is reset per update.
Sites stay fixed during the steps. When theta changes, held data's contributions are recomputed with the new
k_i (their sites are per datum), while the old part is kept fixed as a pseudo-likelihood on u = f(Z): its
natural parameters K^{-1} a_old and K^{-1} B_old K^{-1} (eqs. 14-17: ytilde_u, Sigma_u) do not depend on theta,
so a_old <- K_new K_old^{-1} a_old and B_old <- K_new K_old^{-1} B_old K_old^{-1} K_new, the same A_p transport
as a move of Z (A_p = K_old^{-1} Cov(u_old, u_new)). This is exact for a change of signal variance (k_i and
K scale together), where keeping (a_old, B_old) fixed, as the reference code does, is not. After the steps
the held sites are refitted under the new hyperparameters (n_steps BLR steps) before any is folded. With Z
fixed a step's gradient is worked out by hand down to the kernel matrices (_fixed_z_bound, ~13 M^3 against
autograd's ~37 through the factorisations); with learned Z, autograd differentiates the general objective.

Inducing inputs: a fixed grid, or pivoted Cholesky over [Z; X_batch] in every full update (the current Z
kept first, then the greedy search over the batch), stopping at num_inducing points or when no candidate's
residual prior variance exceeds 1e-4 of the largest, so the number of inducing points starts small (a few
for a first batch along a short stretch of path) and grows up to num_inducing as the robot explores; no
point ever duplicates another.
When Z is full, re-selection only exchanges points: the batch point with the largest residual variance
replaces the most redundant inducing point (smallest variance given the others) while that increases the
smallest residual variance: Z changes only where the batch is poorly covered, because every change
projects the old part with A_p = K_old^{-1} K_{old,new} (eq. 27), a Nystrom step that loses what the new
columns cannot represent (growing Z loses nothing: kept points are carried exactly). Held data need no
projection (recomputed exactly).
With learn_inducing (full mode), Z also takes Adam steps (inducing_lr) alongside theta, on l_Z: the ELBO with
the held data unweighted and the old data seen through their pseudo-likelihood t_old(u0), u0 = f(Z0), under
q(u0) = int p(u0|u) q(u) du (Bui et al. 2017 do the same for their old inducing points). The conditional
variance of u0 given u charges each move for the old information the new Z cannot represent: on the paper's
objective alone, a move of Z that projects old information away lowers the KL by more than the scaled memory
term notices, so Z drifts away from the old data and the map diverges. The paper says pivoted Cholesky
suffices; on real magnetometer data gradient-trained Z maps markedly better at the same M, but the gain
depends on the recording and on inducing_lr, so learn_inducing is off by default (the measurements are in
bench/README.md, "Inducing-input learning").

Modes: 'fast' conditions on the batch with hyperparameters and Z frozen, one dual step (exact for the
Gaussian likelihood): O(N M^2 + M^3). The batch is held as pending, so the next full update treats all data
since the previous full update as its batch (inducing re-selection, BLR, memory sampling). 'full' does
re-selection of Z, n_steps BLR steps on batch and memory, hyperparameter steps, refit, memory sampling.

New data's first BLR step is undamped (rho = 1): the new site is the site evaluated at the current posterior,
which for a Gaussian likelihood is already exact; damping towards the empty site would just under-count it.
Later steps are damped with rho.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch
from torch import nn

from .base import Engine, difference_noise_estimate, resolve_device, spans_space, symmetrise
from .config import ModelConfig
from .errors import ConfigError, GPNumericalError, ModelInputError
from .inducing import DEFAULT_REL_TOL, grid_points, pivoted_cholesky
from .kernels import build_kernel, jittered_cholesky
from .likelihoods import build_likelihood

#: Pending (fast-mode) points kept before the oldest are folded into the old part.
DEFAULT_MAX_PENDING = 8192
#: A scheduled fast update becomes full when a batch input keeps more than this fraction of its prior variance
#: given a full Z (see DualSVGP._leaves_the_cover).
COVER_LOST = 0.5


def _site_sums(V: torch.Tensor, lam1: torch.Tensor, lam2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitened site sums (V lambda1 (M, P), V diag(lambda2) V^T (P, M, M)) for V = L^{-1} K_ZX (M, N)."""
    a_w = V @ lam1
    if lam2.shape[1] == 1:  # one output: a plain matrix product (einsum's three-operand path is slower)
        W = ((V * lam2[:, 0]) @ V.T)[None]
    else:
        W = torch.einsum("mn,np,kn->pmk", V, lam2, V)
    return a_w, symmetrise(W)


class DualSVGP(Engine):
    """Online dual-parameter SVGP with bounded memory. See the module docstring for the method."""

    #: buffers whose size changes as data arrive (resized on load_state_dict)
    RESIZABLE = ("Z", "a_w", "W", "a_w_old", "b_w_old", "W_old", "mem_x", "mem_y", "mem_lam1", "mem_lam2",
                 "mem_logkey", "pend_x", "pend_y", "pend_lam1", "pend_lam2", "rng_state", "adam_avg", "adam_avg_sq")

    def __init__(self, config: ModelConfig, input_dims: int, output_dims: int, *,
                 max_pending: int = DEFAULT_MAX_PENDING, inducing_rel_tol: float = DEFAULT_REL_TOL) -> None:
        super().__init__(config, input_dims, output_dims)
        d, p = self.input_dims, self.output_dims
        self.max_pending = int(max_pending)
        self.inducing_rel_tol = float(inducing_rel_tol)
        device = resolve_device(config.device)
        self.kernel = build_kernel(config, d)
        self.likelihood = build_likelihood(config, p)
        f64 = dict(dtype=torch.float64)
        z_fixed = config.inducing == "grid"
        if z_fixed:
            if d != 2:
                raise ConfigError(f"'grid' needs 2-D inputs, got input_dims {d}; use 'pivoted_cholesky'", "inducing")
            z0 = grid_points(config.inducing_bounds, config.num_inducing)
        else:
            z0 = torch.zeros(0, d, **f64)
        m = z0.shape[0]
        self.register_buffer("Z", z0)
        self.register_buffer("a_w", torch.zeros(m, p, **f64))
        self.register_buffer("W", torch.zeros(p, m, m, **f64))
        self.register_buffer("a_w_old", torch.zeros(m, p, **f64))
        # sum_i V_i lambda2_i of the old part: what a shift of the targets' origin changes a_old by
        self.register_buffer("b_w_old", torch.zeros(m, p, **f64))
        self.register_buffer("W_old", torch.zeros(p, m, m, **f64))
        self.register_buffer("jitter_t", torch.tensor(float(config.jitter), **f64))
        self.register_buffer("z_fixed", torch.tensor(z_fixed))
        self._register_target_statistics(p)
        self.register_buffer("standardised", torch.tensor(False))
        self.register_buffer("rescalings_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("hyper_learned", torch.tensor(False))  # learned from a batch that spans space
        self.register_buffer("scale_fixed", torch.tensor(False))  # set_standardisation: never re-expressed
        self._register_adam_state()
        self.register_buffer("num_seen_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("num_updates_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("seen_at_full_t", torch.tensor(-1, dtype=torch.int64))  # num_seen after the last full
        for prefix in ("mem", "pend"):
            self.register_buffer(f"{prefix}_x", torch.zeros(0, d, **f64))
            self.register_buffer(f"{prefix}_y", torch.zeros(0, p, **f64))
            self.register_buffer(f"{prefix}_lam1", torch.zeros(0, p, **f64))
            self.register_buffer(f"{prefix}_lam2", torch.zeros(0, p, **f64))
        self.register_buffer("mem_logkey", torch.zeros(0, **f64))
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(int(config.seed))
        self.register_buffer("rng_state", self._generator.get_state())
        self._cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._pred: tuple[torch.Tensor, torch.Tensor] | None = None  # (alpha, Q) for prediction, see _latent
        self._chol_memo: tuple[tuple, torch.Tensor] | None = None  # (fingerprint of Z and theta, chol K)
        self.to(device)

    # ------------------------------------------------------------------ properties
    @property
    def num_inducing(self) -> int:
        return int(self.Z.shape[0])

    @property
    def memory_size(self) -> int:
        return int(self.mem_x.shape[0])

    @property
    def jitter(self) -> float:
        return float(self.jitter_t)

    @property
    def a(self) -> torch.Tensor:
        """Dual parameter a = sum_i k_i beta_i ytilde_i (M, P), standardised units."""
        with torch.no_grad():
            return self._chol_K() @ self.a_w if self.num_inducing else self.a_w.clone()

    @property
    def B(self) -> torch.Tensor:
        """Dual parameter B = sum_i beta_i k_i k_i^T (P, M, M), standardised units."""
        with torch.no_grad():
            if not self.num_inducing:
                return self.W.clone()
            L = self._chol_K()
            return L @ self.W @ L.T

    # ------------------------------------------------------------------ torch.nn.Module plumbing
    def _drop_caches(self) -> None:
        self._cache = None
        self._pred = None
        self._chol_memo = None

    def _loaded(self) -> None:
        self._generator.set_state(self.rng_state.detach().to("cpu", torch.uint8))

    # ------------------------------------------------------------------ standardisation
    def _standardise(self, y: torch.Tensor) -> torch.Tensor:
        return (y - self.y_mean) / self.y_std

    @property
    def rescalings(self) -> int:
        """How many times the target scaling has been re-expressed (see :meth:`_track_targets`)."""
        return int(self.rescalings_t)

    def set_standardisation(self, mean, std) -> None:
        """Standardise with this offset and scale (P,) from now on and never adapt them (a caller that keeps
        several engines in one unit, e.g. tiles sharing hyperparameters). Data already held are re-expressed
        exactly, as in an adaptive re-scaling."""
        m, sd = self._standardisation_args(mean, std)
        with torch.no_grad():
            if bool(self.standardised) and not (torch.equal(m, self.y_mean) and torch.equal(sd, self.y_std)):
                self._rescale_targets(m, sd, adaptation=False)
            self.y_mean.copy_(m)
            self.y_std.copy_(sd)
            self.standardised.fill_(True)
            self.scale_fixed.fill_(True)

    def _rescale_targets(self, mean: torch.Tensor, std: torch.Tensor, adaptation: bool = True) -> None:
        """Standardise with (mean, std) from now on: y_new = alpha (y_old - d), alpha = std_old / std, d = (mean -
        mean_old) / std_old, per output.

        The data's terms are re-expressed exactly: a site (lambda1, lambda2) of y_old becomes ((lambda1 - d
        lambda2) / alpha, lambda2 / alpha^2), so a_old -> (a_old - d b_old) / alpha and B_old -> B_old / alpha^2
        with b_old = sum_i k_i lambda2_i; stored targets move with them. The noise variance scales by
        alpha^2 once it has been learned from moving data (it is then a measurement and stays right in the
        original unit); before that it is still the initial guess and stays in standardised units. The kernel's
        variances stay in standardised units: the prior's scale follows the data's spread, which is what
        standardising is for (an exact re-expression would keep a prior fitted to a robot at rest).
        """
        alpha = self.y_std / std
        d = (mean - self.y_mean) / self.y_std
        self.a_w_old = (self.a_w_old - d * self.b_w_old) / alpha
        self.b_w_old = self.b_w_old / alpha ** 2
        self.W_old = self.W_old / (alpha ** 2)[:, None, None]
        for prefix in ("mem", "pend"):
            lam1, lam2 = getattr(self, f"{prefix}_lam1"), getattr(self, f"{prefix}_lam2")
            setattr(self, f"{prefix}_lam1", (lam1 - d * lam2) / alpha)
            setattr(self, f"{prefix}_lam2", lam2 / alpha ** 2)
            setattr(self, f"{prefix}_y", alpha * (getattr(self, f"{prefix}_y") - d))
        if bool(self.hyper_learned):
            self.likelihood.rescale_targets(alpha)
        self.y_mean.copy_(mean)
        self.y_std.copy_(std)
        if adaptation:  # (a scale set from outside is not counted in ``rescalings``)
            self.rescalings_t += 1
        if self.num_inducing:
            self._recompute_totals(self._chol_K())
        self._drop_caches()

    # ------------------------------------------------------------------ linear algebra
    def _prior_fingerprint(self) -> tuple:
        """Changes whenever Z, the jitter or a kernel parameter does (in place or by reassignment)."""
        return (self.Z.data_ptr(), self.Z._version, tuple(self.Z.shape), self.jitter,
                *((p.data_ptr(), p._version) for p in self.kernel.parameters()))

    def _chol_K(self, z: torch.Tensor | None = None) -> torch.Tensor:
        """chol(K_ZZ + jitter I) (for ``z``, default Z); the jitter escalates (and stays) if needed.

        For Z it is remembered until Z, the jitter or the kernel change, so fast updates (which change none of
        them) never refactorise K."""
        memo = z is None and not torch.is_grad_enabled()
        if memo and self._chol_memo is not None and self._chol_memo[0] == self._prior_fingerprint():
            return self._chol_memo[1]
        zz = self.Z if z is None else z
        factor = self._factorise(self.kernel(zz, zz))
        if memo:
            self._chol_memo = (self._prior_fingerprint(), factor)
        return factor

    def _factorise(self, kzz: torch.Tensor) -> torch.Tensor:
        """chol(K_ZZ + jitter I) of a kernel matrix; the jitter escalates (and stays) if needed."""
        factor, used = jittered_cholesky(kzz, self.jitter)
        if used > self.jitter:
            self.jitter_t.fill_(used)
        return factor

    @staticmethod
    def _posterior(a_w: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """R = chol(I + W) (P, M, M) and c = R^{-1} L^{-1} a (P, M) from the whitened duals."""
        m = W.shape[-1]
        eye = torch.eye(m, dtype=W.dtype, device=W.device)
        R, _ = jittered_cholesky(eye + W, 0.0)
        c = torch.linalg.solve_triangular(R, a_w.T[..., None], upper=False)[..., 0]
        return R, c

    @staticmethod
    def _marginals(V: torch.Tensor, R: torch.Tensor, c: torch.Tensor, kxx: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Latent mean, variance (N, P) and q_i = k_i^T K^{-1} S K^{-1} k_i (N, P), from V = L^{-1} K_ZX."""
        U = torch.linalg.solve_triangular(R, V.expand(R.shape[0], *V.shape), upper=False)  # (P, M, N)
        mean = torch.einsum("pmn,pm->np", U, c)
        explained = (U * U).sum(1).T
        var = kxx[:, None] - (V * V).sum(0)[:, None] + explained
        return mean, var.clamp_min(0.0), explained

    def _features(self, L: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """V = L^{-1} K_Zx (M, N)."""
        return torch.linalg.solve_triangular(L, self.kernel(self.Z, x), upper=False)

    def _refresh_cache(self) -> None:
        """Factors for prediction, always computed from the stored state (so a reload predicts identically)."""
        with torch.no_grad():
            self._pred = None
            if self.num_inducing == 0:
                self._cache = None
                return
            L = self._chol_K()
            R, c = self._posterior(self.a_w, self.W)
            self._cache = (L, R, c)

    def _prediction_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha (M, P), Q (P, M, M)) with E[f(x)] = k_x^T alpha and Var[f(x)] = k(x,x) + k_x^T Q k_x:
        alpha = L^{-T} R^{-T} c and Q = L^{-T} ((I + W)^{-1} - I) L^{-1}. Precomputed once per posterior, a
        prediction is a kernel matrix and one matrix product per output instead of two triangular solves."""
        if self._pred is None:
            if self._cache is None:
                self._refresh_cache()
            L, R, c = self._cache
            eye = torch.eye(L.shape[0], dtype=L.dtype, device=L.device)
            L_inv = torch.linalg.solve_triangular(L, eye, upper=False)
            R_inv = torch.linalg.solve_triangular(R, eye.expand_as(R), upper=False)  # (P, M, M)
            mean_w = (R_inv.transpose(-1, -2) @ c[..., None])[..., 0]  # (P, M): (I + W)^{-1} a_w
            alpha = (L_inv.T @ mean_w.T)
            B = R_inv @ L_inv  # (P, M, M): R^{-1} L^{-1}
            Q = B.transpose(-1, -2) @ B - L_inv.T @ L_inv
            self._pred = (alpha, symmetrise(Q))
        return self._pred

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Standardised latent mean and variance (N, P) at checked inputs."""
        kxx = self.kernel.diag(x)
        if self.num_inducing == 0:
            return (torch.zeros(x.shape[0], self.output_dims, dtype=x.dtype, device=x.device),
                    kxx[:, None].expand(-1, self.output_dims).clone())
        if 4 * x.shape[0] <= self.num_inducing:
            # A few points (the Mapper's check after every update): two triangular solves (M^2 N) instead of
            # building the grid's weights (~8 M^3, kept until the next update). By size alone, so the same points
            # always take the same path (a reloaded map predicts them bit for bit as the saved one did).
            if self._cache is None:
                self._refresh_cache()
            L, R, c = self._cache
            mean, var, _ = self._marginals(self._features(L, x), R, c, kxx)
            return mean, var
        alpha, Q = self._prediction_weights()
        Kxz = self.kernel(x, self.Z)
        mean = Kxz @ alpha
        var = kxx[:, None] + torch.stack([((Kxz @ Q[p]) * Kxz).sum(1) for p in range(Q.shape[0])], dim=1)
        return mean, var.clamp_min(0.0)

    # ------------------------------------------------------------------ leverage (predict: Engine, from _latent)
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

    # ------------------------------------------------------------------ site fitting
    def _fit_sites(self, V: torch.Tensor, kxx: torch.Tensor, y: torch.Tensor, lam1: torch.Tensor,
                   lam2: torch.Tensor, fresh: torch.Tensor, n_steps: int, rho: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Damped BLR steps (eq. 23) on the held data's sites, the old part fixed; V = L^{-1} K_ZH.

        ``fresh`` marks data without a site yet (lambda = 0): their first step is undamped. A conjugate
        likelihood's sites do not depend on q, so they are set to that fixed point at once (what the damped steps
        converge to, without the posterior each step needs).
        """
        if self.likelihood.conjugate:
            return self.likelihood.dual_sites(y, None, None)
        for step in range(n_steps):
            a_h, W_h = _site_sums(V, lam1, lam2)
            R, c = self._posterior(self.a_w_old + a_h, self.W_old + W_h)
            mean, var, _ = self._marginals(V, R, c, kxx)
            new1, new2 = self.likelihood.dual_sites(y, mean, var)
            r = torch.full((y.shape[0], 1), float(rho), dtype=y.dtype, device=y.device)
            if step == 0:
                r[fresh] = 1.0
            lam1 = (1.0 - r) * lam1 + r * new1
            lam2 = (1.0 - r) * lam2 + r * new2
        return lam1, lam2

    # ------------------------------------------------------------------ state changes
    def _recompute_totals(self, L: torch.Tensor) -> None:
        """Whitened totals = old part + held (memory and pending) contributions at the current Z and theta."""
        hx = torch.cat([self.mem_x, self.pend_x])
        a_h, W_h = _site_sums(self._features(L, hx), torch.cat([self.mem_lam1, self.pend_lam1]),
                              torch.cat([self.mem_lam2, self.pend_lam2]))
        self.a_w = self.a_w_old + a_h
        self.W = self.W_old + W_h

    def _transport_old_part(self, L_old: torch.Tensor, cross: torch.Tensor, L_new: torch.Tensor) -> None:
        """Carry the old part to a new prior: a <- A_p^T a, B <- A_p^T B A_p with A_p = K_old^{-1} cross,
        cross = Cov(u_old, u_new); whitened, G = L_old^{-1} cross L_new^{-T}."""
        m_new = L_new.shape[0]
        if self.a_w_old.shape[0] == 0:
            self.a_w_old = self.a_w_old.new_zeros(m_new, self.output_dims)
            self.b_w_old = self.b_w_old.new_zeros(m_new, self.output_dims)
            self.W_old = self.W_old.new_zeros(self.output_dims, m_new, m_new)
            return
        G = torch.linalg.solve_triangular(L_new, torch.linalg.solve_triangular(L_old, cross, upper=False).T,
                                          upper=False).T
        self.a_w_old = G.T @ self.a_w_old
        self.b_w_old = G.T @ self.b_w_old
        self.W_old = symmetrise(G.T @ self.W_old @ G)

    def _cross(self, z_old: torch.Tensor, z_new: torch.Tensor) -> torch.Tensor:
        # Identical points keep their dual exactly: the jitter belongs to the covariance of u with itself.
        same = (z_old[:, None, :] == z_new[None, :, :]).all(-1)
        return self.kernel(z_old, z_new) + self.jitter * same.to(z_old.dtype)

    def _move_inducing(self, z_new: torch.Tensor) -> torch.Tensor:
        """Set Z, projecting the old part; returns the new chol(K). Held data are the caller's."""
        z_old, m_old = self.Z, self.num_inducing
        L_old = self._chol_K() if m_old else None
        jitter = float(self.config.jitter)
        appended = m_old > 0 and self.jitter == jitter and self._extends_z(z_new)
        self.Z = z_new.clone()
        self.jitter_t.fill_(jitter)
        L_new = self._chol_K()
        if appended and self.jitter == jitter:  # (again: the new factor may have escalated the jitter)
            # Z grew with every old point kept first and in order (the common growth step), under the same jitter:
            # chol(K_new)'s leading block is chol(K_old), so the old whitened coordinates are the first new ones and
            # the transport G = L_old^{-1} Cov(u_old, u_new) L_new^{-T} is exactly [I 0]: zero rows and columns
            # (O(M^2) instead of the transport's ~3 M^3).
            k = z_new.shape[0] - m_old
            p = self.output_dims
            self.a_w_old = torch.cat([self.a_w_old, self.a_w_old.new_zeros(k, p)])
            self.b_w_old = torch.cat([self.b_w_old, self.b_w_old.new_zeros(k, p)])
            W_old = self.W_old.new_zeros(p, m_old + k, m_old + k)
            W_old[:, :m_old, :m_old] = self.W_old
            self.W_old = W_old
        else:
            cross = self._cross(z_old, z_new)
            self._transport_old_part(L_new[:0, :0] if L_old is None else L_old, cross, L_new)
        return L_new

    def _extends_z(self, z_new: torch.Tensor) -> bool:
        """Whether z_new is the current Z followed by new points."""
        m = self.num_inducing
        return z_new.shape[0] > m and bool(torch.equal(z_new[:m], self.Z))

    def set_inducing_points(self, z, fixed: bool = True) -> None:
        """Use these inducing inputs (old part projected onto them); ``fixed`` stops re-selection."""
        zt = self._check_x(z, "z")
        if zt.shape[0] == 0:
            raise ModelInputError("z must hold at least one inducing point")
        with torch.no_grad():
            L = self._move_inducing(zt)
            self.z_fixed.fill_(bool(fixed))
            self._recompute_totals(L)
        self._refresh_cache()

    @contextlib.contextmanager
    def hyperparameter_change(self) -> Iterator[None]:
        """Change kernel or likelihood parameters inside this block; on exit the old part is transported to
        the new prior (its pseudo-likelihood on u = f(Z) kept) and held contributions are recomputed."""
        with torch.no_grad():
            L_old = self._chol_K() if self.num_inducing else None
        yield
        with torch.no_grad():
            if L_old is not None:
                L_new = self._chol_K()
                self._transport_old_part(L_old, L_new @ L_new.T, L_new)
                self._recompute_totals(L_new)
        self._refresh_cache()

    def _grow_inducing(self, bx: torch.Tensor) -> torch.Tensor | None:
        """Add batch points to Z by pivoted Cholesky over [Z; batch] (Z kept first) while below num_inducing;
        returns the new chol(K), or None if nothing was added. Growing loses nothing: kept points carry their
        part of the old duals exactly. Held data are the caller's."""
        m_max, m_old = self.config.num_inducing, self.num_inducing
        cand = torch.cat([self.Z, bx])
        idx, _ = pivoted_cholesky(self.kernel, self.kernel.diag(cand), cand, m_max, self.inducing_rel_tol,
                                  keep_first=m_old)
        if idx.numel() == m_old and bool((idx < m_old).all()):
            return None
        return self._move_inducing(cand[idx])

    def _reselect_inducing(self, bx: torch.Tensor) -> bool:
        """Grow Z by pivoted Cholesky over [Z; batch] while below num_inducing; once full, exchange points
        (see the module docstring). Returns whether Z changed."""
        if self.num_inducing < self.config.num_inducing:
            return self._grow_inducing(bx) is not None
        z = self.Z.clone()
        L = self._chol_K()
        Kinv = torch.cholesky_inverse(L)
        changed = False
        for _ in range(bx.shape[0]):
            # Residual variance of each batch point given Z, and of each z_j given the other inducing points.
            V = torch.linalg.solve_triangular(L, self.kernel(z, bx), upper=False)
            resid = self.kernel.diag(bx) - (V * V).sum(0)
            loo = 1.0 / torch.diagonal(Kinv)
            i, j = int(torch.argmax(resid)), int(torch.argmin(loo))
            if not float(resid[i]) > float(loo[j]) * (1.0 + 1e-9):
                break
            z[j] = bx[i]
            L, _ = jittered_cholesky(self.kernel(z, z), self.jitter)
            Kinv = torch.cholesky_inverse(L)
            changed = True
        if changed:
            self._move_inducing(z)
        return changed

    # ------------------------------------------------------------------ hyperparameters
    def _hyper_parameters(self) -> list[nn.Parameter]:
        return list(self.kernel.parameters()) + list(self.likelihood.parameters())

    def _hyper_objective(self, L0, z0, z, hx, hy, lam1, lam2, weights,
                         fixed: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
        a_h, W_h = _site_sums(V, lam1, lam2)
        a_fixed, W_fixed = fixed if fixed is not None else (self.a_w_old, self.W_old)
        a_old = G.T @ a_fixed
        W_old = symmetrise(G.T @ W_fixed @ G)
        R, c = self._posterior(a_old + a_h, W_old + W_h)
        mean, var, _ = self._marginals(V, R, c, self.kernel.diag(hx))
        ell = self.likelihood.expected_log_lik(hy, mean, var)
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

    def _fixed_z_bound(self, a_u: torch.Tensor, W_u: torch.Tensor, hx, hy, lam1, lam2, weights
                       ) -> tuple[torch.Tensor, Callable[[float], None]]:
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
        """
        z = self.Z
        with torch.enable_grad():
            kzz, kzx, kxx = self.kernel(z, z), self.kernel(z, hx), self.kernel.diag(hx)
        with torch.no_grad():
            L = self._factorise(kzz.detach())
            V = torch.linalg.solve_triangular(L, kzx.detach(), upper=False)  # (M, N)
            X = W_u @ L  # (P, M, M)
            a_h, W_h = _site_sums(V, lam1, lam2)
            R, c = self._posterior(L.T @ a_u + a_h, L.T @ X + W_h)  # Cholesky reads the lower triangle only
            S = torch.cholesky_inverse(R)  # (P, M, M)
            m = torch.linalg.solve_triangular(R.transpose(-1, -2), c[..., None], upper=True)[..., 0]  # (P, M): S a
            SV = (V.T @ S).transpose(-1, -2)  # (P, M, N) S V, in V's column-major layout (S is symmetric)
            mean = V.T @ m.T  # (N, P)
            var = kxx.detach()[:, None] - (V * V).sum(0)[:, None] + (V * SV).sum(1).T
            kl = (torch.log(torch.diagonal(R, dim1=-2, dim2=-1)).sum()
                  + 0.5 * (torch.diagonal(S, dim1=-2, dim2=-1).sum() - S.shape[0] * S.shape[-1] + (m * m).sum()))
        mean_in = mean.requires_grad_(True)
        var_in = var.clamp_min(0.0).requires_grad_(True)
        with torch.enable_grad():
            ell = (self.likelihood.expected_log_lik(hy, mean_in, var_in) * weights[:, None]).sum()
        value = ell.detach() - kl

        def gradients(scale: float) -> None:
            lik_params = [p for p in self.likelihood.parameters() if p.requires_grad]
            kernel_params = [p for p in self.kernel.parameters() if p.requires_grad]
            gm, gv, *g_lik = torch.autograd.grad(ell, [mean_in, var_in] + lik_params, allow_unused=True)
            with torch.no_grad():
                gv = gv * (var >= 0)  # clamp_min(0)'s gradient
                a_bar = (S @ ((V @ gm).T - m)[..., None])[..., 0]  # (P, M): S dl/dm
                SVg = SV * gv.T[:, None, :]
                # dl/dA, symmetric: S S / 2 - S / 2 - S V diag(gv) V^T S - sym(a_bar m^T). (S is exactly symmetric
                # and column-major, so S.mT is S in the row-major layout of S @ S.)
                A_bar = torch.baddbmm(0.5 * (S @ S - S.mT), SVg, SV.transpose(-1, -2), alpha=-1.0)
                A_bar.baddbmm_(a_bar[:, :, None], m[:, None, :], alpha=-0.5)
                A_bar.baddbmm_(m[:, :, None], a_bar[:, None, :], alpha=-0.5)
                # dl/dV = a_bar lam1^T + m gm^T + 2 (S V diag(gv) - V diag(gv) + sum_p A_bar_p V diag(lam2_p)), every
                # term in V's column-major layout (A_bar V as (V^T A_bar)^T, A_bar symmetric)
                V_bar = (torch.cat([lam1, gm], 1) @ torch.cat([a_bar, m])).T
                V_bar.add_(SVg.sum(0) - V * gv.sum(1) + sum((V.T @ A_bar[p]).T * lam2[:, p]
                                                            for p in range(A_bar.shape[0])), alpha=2.0)
                kzx_bar = torch.linalg.solve_triangular(L.T, V_bar, upper=True)
                L_bar = a_u @ a_bar + 2.0 * (X @ A_bar).sum(0) - kzx_bar @ V.T
                # The bound depends on K alone, not on which square root L of it whitens (L -> L U, U orthogonal,
                # leaves it unchanged), so dl/dL = 2 K_bar L and K_bar = L_bar L^{-1} / 2 (one solve; the general
                # Cholesky adjoint L^{-T} Phi(L^T L_bar) L^{-1} takes two and equals it here).
                kzz_bar = 0.5 * torch.linalg.solve_triangular(L, L_bar, upper=False, left=False)
            outputs = [(t, g) for t, g in ((kzz, kzz_bar), (kzx, kzx_bar), (kxx, gv.sum(1))) if t.requires_grad]
            g_kernel = torch.autograd.grad([t for t, _ in outputs], kernel_params,
                                           grad_outputs=[g for _, g in outputs],
                                           allow_unused=True) if outputs and kernel_params else ()
            for p, g in zip(kernel_params + lik_params, list(g_kernel) + g_lik):
                p.grad = None if g is None else -scale * g

        return value, gradients

    def _learn_hyperparameters(self, hx, hy, lam1, lam2, weights, budget: int,
                               fixed: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[int, float]:
        """Adam steps on theta (l_theta) and, if configured, on Z (l_Z); returns (steps, final l_theta per
        datum). ``fixed``: the whitened pseudo-likelihood held fixed during the steps (default the old part).
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
        with torch.enable_grad():
            for _ in range(budget):
                optimiser.zero_grad()
                try:
                    if learn_z:
                        l_theta, l_z = self._hyper_objective(L0, z0, z, hx, hy, lam1, lam2, weights, fixed)
                    else:
                        l_theta, theta_gradients = self._fixed_z_bound(*old_part_on_u, hx, hy, lam1, lam2, weights)
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

    def _hyper_sample(self, V, hx, hy, lam1, lam2, weights, n_mem: int) -> tuple:
        """What the hyperparameter steps see: at most model.hyper_points held samples, drawn uniformly within
        the memory and within the batch and weighted to stand for their group (an unbiased estimate of the
        data term, as minibatches are in SVGP training); the others' sites join the old part as the fixed
        pseudo-likelihood on u, so q keeps their information. Each step then costs O(hyper_points M^2)
        however many samples a full update holds. With learned Z (l_Z needs the old part alone) everything is
        seen. Returns the arguments (hx, hy, lam1, lam2, weights, fixed) of _learn_hyperparameters."""
        n = hx.shape[0]
        cap = self.config.hyper_points
        if n <= cap or self.config.learn_inducing:
            return hx, hy, lam1, lam2, weights, None
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
        a_r, W_r = _site_sums(V[:, ~keep], lam1[~keep], lam2[~keep])
        return (hx[keep], hy[keep], lam1[keep], lam2[keep], w[keep],
                (self.a_w_old + a_r, self.W_old + W_r))

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

    # ------------------------------------------------------------------ updates
    def update(self, x, y, mode: str | None = None) -> dict:
        """Condition on a batch (x (N, D), y (N, P)); mode 'fast', 'full' or None (follow full_update_every)."""
        start = time.perf_counter()
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        if mode not in (None, "fast", "full"):
            raise ValueError(f"update mode must be 'fast', 'full' or None, got {mode!r}")
        cover = None  # (L, V = L^{-1} K_Zx) of the cover check, which a fast update reuses while L stays
        if mode is None:
            mode = self._scheduled_mode(xt.shape[0])
            if mode == "fast":
                cover = self._cover_features(xt)
                if cover is not None and self._leaves_the_cover(xt, cover[1]):
                    mode = "full"
        stats: dict = {"mode": mode, "n_batch": int(xt.shape[0]), "z_moved": 0, "hyper_steps": 0,
                       "objective": 0.0, "folded": 0}
        if xt.shape[0] > 0:
            yt = self._calibrate_on(xt, yt)
            with torch.no_grad():
                self._track_targets(yt)
            ys = self._standardise(yt)
            with torch.no_grad():
                if mode == "fast":
                    stats.update(self._fast_update(xt, ys, cover))
                else:
                    stats.update(self._full_update(xt, ys))
                self.num_seen_t += xt.shape[0]
                if mode == "full":
                    self.seen_at_full_t.fill_(int(self.num_seen_t))
                self.num_updates_t += 1
                self.rng_state = self._generator.get_state()
            self._refresh_cache()
        stats.update({"seconds": time.perf_counter() - start, "num_seen": self.num_seen,
                      "memory_size": self.memory_size, "pending": int(self.pend_x.shape[0]),
                      "num_inducing": self.num_inducing, "jitter": self.jitter})
        return stats

    def _scheduled_mode(self, n_new: int) -> str:
        """'full' on every full_update_every-th update once full_update_samples samples (this batch included)
        have arrived since the last full update, else 'fast'. Counting samples
        keeps a full update's cost per sample the same at 10 Hz and at 200 Hz: on the Solin recording (1-s
        batches of 50) a full update every third batch maps better than one every batch (the schedules bench,
        ``python -m gp_mapping.evaluation.schedules``, protocol 2: 2.10 against 2.24 uT), while protocol 1's
        batches of 470 are each full. Until hyperparameters
        have been learned from a batch that spans space, every update is full."""
        cfg = self.config
        learning = cfg.learn_hyperparameters and cfg.hyper_steps > 0
        # Nothing learned yet (a robot at rest teaches no hyperparameters): the drive's first batch must be a full
        # update, not 150 samples of conditioning under the initial kernel.
        if int(self.seen_at_full_t) < 0 or (learning and not bool(self.hyper_learned)):
            return "full"
        due = int(self.num_updates_t) % cfg.full_update_every == 0
        enough = self.num_seen + n_new - int(self.seen_at_full_t) >= cfg.full_update_samples
        return "full" if due and enough else "fast"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # maps saved before the sample count of the schedule existed: as if their last update was full
        if prefix + "seen_at_full_t" not in state_dict and prefix + "num_seen_t" in state_dict:
            state_dict[prefix + "seen_at_full_t"] = state_dict[prefix + "num_seen_t"].clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _cover_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(L, V = L^{-1} K_Zx) for the cover check, or None where the check does not apply: Z that can still
        grow, or a fixed Z, never promotes (growth is done in fast mode)."""
        if bool(self.z_fixed) or self.num_inducing < self.config.num_inducing or x.shape[0] == 0:
            return None
        with torch.no_grad():
            L = self._chol_K()
            return L, self._features(L, x)

    def _leaves_the_cover(self, x: torch.Tensor, V: torch.Tensor) -> bool:
        """Whether a batch reaches where a full Z no longer covers it: some input keeps more than COVER_LOST of
        its prior variance given Z (V = L^{-1} K_Zx from _cover_features). Conditioning such data with frozen
        hyperparameters overfits (the noise was learned where Z covered the data, and the missing variance is
        nobody's), so the scheduler promotes that update to a full one, which exchanges inducing points and
        re-learns."""
        with torch.no_grad():
            kxx = self.kernel.diag(x)
            lost = (kxx - (V * V).sum(0)) / kxx
            return bool(lost.max() > COVER_LOST)

    def _fast_update(self, x: torch.Tensor, ys: torch.Tensor,
                     cover: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
        z_moved = 0
        if not bool(self.z_fixed) and self.num_inducing < self.config.num_inducing:
            # Z grows over the batch where it is poorly covered (the first batch starts it), so the map follows
            # the robot into new areas between full updates; exchanges wait for the next full update.
            L = self._grow_inducing(x)
            if L is not None:
                self._recompute_totals(L)
                self._cache = None
                z_moved = 1
        if self._cache is None:
            self._refresh_cache()
        L, R, c = self._cache
        # the cover check's features, unless the prior factor changed since (Z grew, or a target rescaling)
        V = cover[1] if cover is not None and cover[0] is L else self._features(L, x)
        mean, var, _ = self._marginals(V, R, c, self.kernel.diag(x))
        lam1, lam2 = self.likelihood.dual_sites(ys, mean, var)  # one undamped dual step
        a_n, W_n = _site_sums(V, lam1, lam2)
        self.a_w = self.a_w + a_n
        self.W = self.W + W_n
        self.pend_x = torch.cat([self.pend_x, x])
        self.pend_y = torch.cat([self.pend_y, ys])
        self.pend_lam1 = torch.cat([self.pend_lam1, lam1])
        self.pend_lam2 = torch.cat([self.pend_lam2, lam2])
        folded = 0
        excess = self.pend_x.shape[0] - self.max_pending
        if excess > 0:
            # Oldest pending points leave: their sites go to the old part (totals unchanged).
            V_f = self._features(L, self.pend_x[:excess])
            a_f, W_f = _site_sums(V_f, self.pend_lam1[:excess], self.pend_lam2[:excess])
            self.a_w_old = self.a_w_old + a_f
            self.b_w_old = self.b_w_old + V_f @ self.pend_lam2[:excess]
            self.W_old = self.W_old + W_f
            for name in ("pend_x", "pend_y", "pend_lam1", "pend_lam2"):
                setattr(self, name, getattr(self, name)[excess:])
            folded = excess
        return {"z_moved": z_moved, "folded": folded}

    def _full_update(self, x: torch.Tensor, ys: torch.Tensor) -> dict:
        cfg = self.config
        n_pend, n_mem = self.pend_x.shape[0], self.mem_x.shape[0]
        # The batch: pending points (with sites) and the new points (without).
        bx = torch.cat([self.pend_x, x])
        by = torch.cat([self.pend_y, ys])
        zeros = x.new_zeros(x.shape[0], self.output_dims)
        n_b = bx.shape[0]
        z_moved = 0
        informative = cfg.hyper_steps > 0 and spans_space(bx, cfg.lengthscale)
        if informative and cfg.learn_hyperparameters and not bool(self.hyper_learned) and n_b > 2:
            # The first batch that can teach hyperparameters starts the noise at the data's own estimate.
            # (never below the configured initial value: on a moving robot the noise the map sees includes pose
            # errors times the field's gradient, which successive differences of a dense path do not measure)
            self.likelihood.initialise_noise(difference_noise_estimate(by).clamp(cfg.noise_variance, 1.0))
        if not bool(self.z_fixed):
            z_moved = int(self._reselect_inducing(bx))
        hx = torch.cat([self.mem_x, bx])
        hy = torch.cat([self.mem_y, by])
        lam1 = torch.cat([self.mem_lam1, self.pend_lam1, zeros])
        lam2 = torch.cat([self.mem_lam2, self.pend_lam2, zeros])
        fresh = torch.zeros(hx.shape[0], dtype=torch.bool, device=self.device)
        fresh[n_mem + n_pend:] = True
        kxx = self.kernel.diag(hx)
        L = self._chol_K()
        V = self._features(L, hx)
        lam1, lam2 = self._fit_sites(V, kxx, hy, lam1, lam2, fresh, cfg.n_steps, cfg.rho)
        steps, objective = 0, 0.0
        # _learn_hyperparameters decides what (theta, Z or nothing) is learned; nothing from a batch at rest
        if informative:
            n_old = self.num_seen - n_pend  # data seen before this batch
            weights = torch.ones(hx.shape[0], dtype=torch.float64, device=self.device)
            if n_mem:
                weights[:n_mem] = n_old / n_mem
            budget = self._hyper_budget(n_b)
            *seen, fixed = self._hyper_sample(V, hx, hy, lam1, lam2, weights, n_mem)
            steps, objective = self._learn_hyperparameters(*seen, budget, fixed=fixed)
            if steps:
                self.hyper_learned.fill_(True)
                kxx = self.kernel.diag(hx)
                L = self._chol_K()
                V = self._features(L, hx)
                lam1, lam2 = self._fit_sites(V, kxx, hy, lam1, lam2, torch.zeros_like(fresh), cfg.n_steps,
                                             cfg.rho)
        # Memory: candidates from the batch, then the reservoir over old members and candidates.
        k = min(cfg.memory_per_batch, n_b) if cfg.memory_size > 0 else 0
        if k > 0:
            if cfg.memory_selection == "leverage":
                a_h, W_h = _site_sums(V, lam1, lam2)
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
        a_f, W_f = _site_sums(V[:, leave], lam1[leave], lam2[leave])
        self.a_w_old = self.a_w_old + a_f
        self.b_w_old = self.b_w_old + V[:, leave] @ lam2[leave]
        self.W_old = self.W_old + W_f
        self.mem_x, self.mem_y = hx[kept], hy[kept]
        self.mem_lam1, self.mem_lam2 = lam1[kept], lam2[kept]
        self.mem_logkey = pool_keys[keep]
        for name in ("pend_x", "pend_y", "pend_lam1", "pend_lam2"):
            setattr(self, name, getattr(self, name)[:0])
        a_m, W_m = _site_sums(V[:, kept], self.mem_lam1, self.mem_lam2)
        self.a_w = self.a_w_old + a_m
        self.W = self.W_old + W_m
        return {"z_moved": z_moved, "hyper_steps": steps, "objective": objective, "folded": int(leave.sum())}

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, num_inducing={self.num_inducing}"
                f"/{self.config.num_inducing}, memory={self.memory_size}/{self.config.memory_size}")

    # ------------------------------------------------------------------ recyclable merge (gp/recyclable.py)
    def recyclable_summary(self) -> dict:
        """q(u) as a pseudo-likelihood on u = f(Z) in the original target units, for merging maps without data.

        Keys: ``z`` (M, D); ``target_mean``, ``target_scale`` (P,): f = target_mean + target_scale * f_std;
        ``prior_cov`` (P, M, M): prior covariance of f(Z) in original units (jitter included); ``site_a`` (P, M),
        ``site_W`` (P, M, M): q(u) / p(u) = exp(site_a^T v - v^T site_W v / 2) up to a constant, v =
        chol(prior_cov)^{-1} (f(Z) - target_mean); ``noise`` (P,): noise variance in original units (NaN for a
        likelihood without one); ``kernel``: a copy of the kernel (standardised units); ``num_seen``.
        """
        import copy

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
                for name in ("x", "y", "lam1", "lam2"):
                    setattr(self, f"{prefix}_{name}", getattr(self, f"{prefix}_{name}")[:0])
            self.mem_logkey = self.mem_logkey[:0]
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
            self.y_count.fill_(float(num_seen))
            self.y_run_mean.copy_(self.y_mean)
            self.y_run_m2.copy_(self.y_std ** 2 * float(num_seen))
            self.hyper_learned.fill_(True)
        self._refresh_cache()
