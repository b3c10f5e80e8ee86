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

Modes: 'fast' conditions on the batch with hyperparameters and Z frozen, one dual step (exact for the
Gaussian likelihood): O(N M^2 + M^3). The batch is held as pending, so the next full update treats all data
since the previous full update as its batch (inducing re-selection, BLR, memory sampling). 'full' does
re-selection of Z, n_steps BLR steps on batch and memory, hyperparameter steps, refit, memory sampling.

The engine's parts are mixins in the modules beside this one (their methods run on this engine's state, so its
state files and buffer names are those of one class): :mod:`.sites` the sites and the posterior they give,
:mod:`.placement` the inducing inputs and the transport of the old part, :mod:`.hyperparameters` the
hyperparameter steps, :mod:`.memory` the memory, :mod:`.recyclable` the summary for a merge of maps.
"""
from __future__ import annotations

import time

import torch

from ..base import UNSTAMPED_GAP, Engine, difference_noise_estimate, resolve_device, spans_space
from ..config import ModelConfig
from ..errors import ConfigError
from ..inducing import DEFAULT_REL_TOL, grid_points
from ..kernels import PositiveParameter, build_kernel
from ..likelihoods import build_likelihood
from ..linalg import jittered_cholesky, symmetrise
from ..revisits import Moments, RevisitNugget
from .hyperparameters import HyperparameterSteps
from .memory import DualMemory
from .placement import InducingPlacement
from .recyclable import RecyclableDual
from .sites import DualSites, residual_weighted_sites, site_sums

#: Pending (fast-mode) points kept before the oldest are folded into the old part.
DEFAULT_MAX_PENDING = 8192


class DualSVGP(DualSites, InducingPlacement, HyperparameterSteps, DualMemory, RecyclableDual, Engine):
    """Online dual-parameter SVGP with bounded memory. The method: this module's docstring and those of the
    modules of its mixins."""

    #: buffers whose size changes as data arrive (resized on load_state_dict)
    RESIZABLE = ("Z", "a_w", "W", "a_w_old", "b_w_old", "b_w_session", "W_old", "mem_x", "mem_y", "mem_lam1",
                 "mem_lam2", "mem_logkey", "mem_in_session", "mem_t", "pend_x", "pend_y", "pend_lam1", "pend_lam2",
                 "pend_in_session", "pend_t", "rng_state", "adam_avg", "adam_avg_sq")

    def __init__(self, config: ModelConfig, input_dims: int, output_dims: int, *,
                 max_pending: int = DEFAULT_MAX_PENDING, inducing_rel_tol: float = DEFAULT_REL_TOL) -> None:
        super().__init__(config, input_dims, output_dims)
        d, p = self.input_dims, self.output_dims
        self.max_pending = int(max_pending)
        self.inducing_rel_tol = float(inducing_rel_tol)
        device = resolve_device(config.device)
        self.kernel = build_kernel(config, d)
        # model.time_error is the Gaussian likelihood's (another likelihood has no error in time and leaves it out)
        self.learns_time_error = bool(config.time_error) and config.likelihood == "gaussian"
        self.likelihood = self._own_likelihood(build_likelihood(config, p, with_time_error=self.learns_time_error))
        if self.learns_time_error:  # e's variance is held to what revisits show (gp/revisits.py)
            self.revisits = RevisitNugget(p)
            # the same error's evidence from other ground (a tiled map sets its other tiles' before an update)
            self.revisits_elsewhere: Moments | None = None
        if config.position_noise > 0:  # the variance of the positions' error [m^2] (_slope_noise)
            self.position_param = PositiveParameter(float(config.position_noise) ** 2)
            self.position_param.raw.requires_grad_(config.learn_position_noise)
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
        # the part of b_w_old from the current session's data: what a change of its offset moves a_old by
        self.register_buffer("b_w_session", torch.zeros(m, p, **f64))
        self.register_buffer("W_old", torch.zeros(p, m, m, **f64))
        self.register_buffer("jitter_t", torch.tensor(float(config.jitter), **f64))
        self.register_buffer("z_fixed", torch.tensor(z_fixed))
        self._register_target_statistics(p)
        self.register_buffer("standardised", torch.tensor(False))
        self.register_buffer("rescalings_t", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("hyper_learned", torch.tensor(False))  # learned from a batch that spans space
        self.register_buffer("scale_fixed", torch.tensor(False))  # set_standardisation: never re-expressed
        self._register_adam_state()
        self.register_buffer("seen_at_full_t", torch.tensor(-1, dtype=torch.int64))  # num_seen after the last full
        for prefix in ("mem", "pend"):
            self.register_buffer(f"{prefix}_x", torch.zeros(0, d, **f64))
            self.register_buffer(f"{prefix}_y", torch.zeros(0, p, **f64))
            self.register_buffer(f"{prefix}_lam1", torch.zeros(0, p, **f64))
            self.register_buffer(f"{prefix}_lam2", torch.zeros(0, p, **f64))
            self.register_buffer(f"{prefix}_in_session", torch.zeros(0, dtype=torch.bool))  # current session's
        self.register_buffer("mem_logkey", torch.zeros(0, **f64))
        # the pending points' stamps [s]: with model.time_error the hyperparameter steps see the batch's errors as
        # correlated in time (the memory's readings, far apart in time, as independent)
        self.register_buffer("pend_t", torch.zeros(0, **f64))
        # the memory's stamps [s] (NaN: unknown): the pairs across passes that bound e's variance (gp/revisits.py)
        self.register_buffer("mem_t", torch.zeros(0, **f64))
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(int(config.seed))
        self.register_buffer("rng_state", self._generator.get_state())
        self._cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._pred: tuple[torch.Tensor, torch.Tensor] | None = None  # (alpha, Q) for prediction, see _latent
        self._chol_memo: tuple[tuple, torch.Tensor] | None = None  # (fingerprint of Z and theta, chol K)
        self.to(device)

    # ------------------------------------------------------------------ properties
    @property
    def wants_stamps(self) -> bool:  # Engine.wants_stamps: model.time_error learns from the readings' times
        return self.learns_time_error

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

    # ------------------------------------------------------------------ sessions (base.Engine._calibrate_on)
    @property
    def reexpresses_sessions(self) -> bool:
        # a Gaussian site is linear in its target (lambda1 = y lambda2): a shift of the targets is exact
        return bool(self.likelihood.conjugate)

    def _close_session(self) -> None:
        self.b_w_session = torch.zeros_like(self.b_w_session)
        self.mem_in_session = torch.zeros_like(self.mem_in_session)
        self.pend_in_session = torch.zeros_like(self.pend_in_session)

    def _holds_session_data(self) -> bool:
        return bool(self.mem_in_session.any() or self.pend_in_session.any() or (self.b_w_session != 0).any())

    def _reexpress_session(self, delta: torch.Tensor) -> None:
        """The session's targets move by -delta (standardised: -d): held sites (lambda1 - d lambda2, lambda2)
        and targets, and the old part's a_old - d b_session, exactly as if conditioned so."""
        d = delta.to(self.y_std) / self.y_std
        self.a_w_old = self.a_w_old - d * self.b_w_session
        for prefix in ("mem", "pend"):
            flag = getattr(self, f"{prefix}_in_session")[:, None]
            lam2 = getattr(self, f"{prefix}_lam2")
            setattr(self, f"{prefix}_lam1", getattr(self, f"{prefix}_lam1") - d * lam2 * flag)
            setattr(self, f"{prefix}_y", getattr(self, f"{prefix}_y") - d * flag)
        self._drop_caches()
        if self.num_inducing:
            self._recompute_totals(self._chol_K())

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
        self.b_w_session = self.b_w_session / alpha ** 2
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

    # ------------------------------------------------------------------ prediction
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

    #: rows per pass of the position-noise gradient (its kernel matrix and adjoints are a few (rows, M) buffers)
    SLOPE_CHUNK = 8192

    @property
    def position_variance(self) -> torch.Tensor:
        """The variance of the positions' error on each input axis [m^2] (model.position_noise; 0 when off)."""
        if not hasattr(self, "position_param"):
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return self.position_param.value

    def _fit_slope2(self, x: torch.Tensor) -> torch.Tensor | None:
        """The squared slope (N, P) that the fit's position noise uses (:meth:`_mean_slope2`); None where position
        noise is off or the likelihood is not conjugate. (The calibration's slope term asks _reading_slope2.)"""
        if self.config.position_noise <= 0.0 or not self.likelihood.conjugate:
            return None
        return self._mean_slope2(x)

    def _reading_slope2(self, xt: torch.Tensor) -> torch.Tensor | None:
        """|grad m(x)|^2 in the targets' units per m^2 (Engine._reading_slope2)."""
        slope2 = self._mean_slope2(xt)
        return None if slope2 is None else slope2 * self.y_std ** 2

    def _mean_slope2(self, x: torch.Tensor) -> torch.Tensor | None:
        """|grad m(x)|^2 (N, P), m the posterior mean now (standardised, per metre^2); None with no inducing
        points yet (a flat prior mean)."""
        if self.num_inducing == 0 or x.shape[0] == 0:
            return None
        if self._cache is None:
            self._refresh_cache()
        L, R, c = self._cache
        mean_w = torch.linalg.solve_triangular(R.transpose(-1, -2), c[..., None], upper=True)[..., 0]  # (P, M)
        alpha = torch.linalg.solve_triangular(L.T, mean_w.T, upper=True)  # (M, P): m(x) = k(x, Z) alpha
        parts = []
        for rows in torch.split(x.detach(), self.SLOPE_CHUNK):
            with torch.enable_grad():
                xg = rows.clone().requires_grad_(True)
                kxz = self.kernel(xg, self.Z)
                slopes = [torch.autograd.grad(kxz, xg, alpha[:, p].expand_as(kxz), retain_graph=True)[0]
                          for p in range(alpha.shape[1])]
            parts.append(torch.stack([(g * g).sum(1) for g in slopes], dim=1).detach())
        return torch.cat(parts)

    def _slope_noise(self, slope2: torch.Tensor | None) -> torch.Tensor | None:
        """The noise (N, P, standardised) a reading adds through its position's error, to first order:
        position_variance |grad m(x)|^2, from :meth:`_fit_slope2`. A noisy-input GP (McHutchon and Rasmussen
        2011, "Gaussian process training with input noise", NIPS): a position off by delta reads the field at
        x + delta, m(x) + grad m(x)^T delta."""
        return None if slope2 is None else self.position_variance * slope2

    def _noise_variance(self, x: torch.Tensor, reported: bool = True) -> torch.Tensor:
        noise = super()._noise_variance(x)
        if not reported:  # a reading taken exactly at x: no position error to read through the slope
            return noise
        moved = self._slope_noise(self._fit_slope2(x))
        return noise if moved is None else noise + moved.detach()

    # ------------------------------------------------------------------ updates
    def update(self, x, y, mode: str | None = None, t=None) -> dict:
        """Condition on a batch (x (N, D), y (N, P)); mode 'fast', 'full' or None (follow full_update_every); t
        (N,): the readings' stamps [s], which model.time_error learns from (None: readings UNSTAMPED_GAP apart,
        whose shared error is then indistinguishable from white noise)."""
        start = time.perf_counter()
        xt = self._check_x(x)
        yt = self._check_y(y, xt.shape[0])
        tt = self._check_stamps(t, xt.shape[0], UNSTAMPED_GAP).to(self.device)
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
                self._track_targets(yt, spans_space(xt, self.config.lengthscale))
                if hasattr(self, "revisits"):
                    self._bound_time_error(xt, yt, tt)
            ys = self._standardise(yt)
            with torch.no_grad():
                if mode == "fast":
                    stats.update(self._fast_update(xt, ys, tt, cover))
                else:
                    stats.update(self._full_update(xt, ys, tt))
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

    def _bound_time_error(self, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> None:
        """Fold a batch (targets' units) and the readings held before it into the revisit moments, and cap e's
        variance at what they show (gp/revisits.py), in the standardised units the likelihood learns in. A batch
        at rest is not a pass: a robot standing at one place for longer than the revisits' gap would otherwise
        pair with itself, its readings agreeing to the sensor's noise, and pull e's bound towards 0 for the rest of
        the stream (60 s at rest before six passes: 0.34 against the passes' own 2.42; test_revisits.py)."""
        if spans_space(x, self.config.lengthscale):
            held_y = torch.cat([self.mem_y, self.pend_y]) * self.y_std + self.y_mean
            self.revisits.observe(x, y, t, torch.cat([self.mem_x, self.pend_x]), held_y,
                                  torch.cat([self.mem_t, self.pend_t]))
        # never exactly 0: e's covariance stays a valid, if negligible, part of every reading's noise
        floor = 1e-4 * self.y_std ** 2
        bound = self.revisits.shared_variance(self.revisits_elsewhere)
        self.likelihood.time_error.variance_cap.copy_(torch.maximum(bound, floor) / self.y_std ** 2)

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
        # maps saved without position noise, loaded with it: at the configured value
        if hasattr(self, "position_param") and prefix + "position_param.raw" not in state_dict \
                and prefix + "num_seen_t" in state_dict:
            state_dict[prefix + "position_param.raw"] = self.position_param.raw.detach().clone()
        # maps saved before the sample count of the schedule existed: as if their last update was full
        if prefix + "seen_at_full_t" not in state_dict and prefix + "num_seen_t" in state_dict:
            state_dict[prefix + "seen_at_full_t"] = state_dict[prefix + "num_seen_t"].clone()
        # maps saved before pending points had stamps: theirs are far apart, from each other and (negative) from
        # any a sample clock gives later readings (their errors independent)
        if prefix + "pend_t" not in state_dict and prefix + "pend_x" in state_dict:
            n = state_dict[prefix + "pend_x"].shape[0]
            state_dict[prefix + "pend_t"] = -(torch.arange(n, dtype=torch.float64) + 1.0) * UNSTAMPED_GAP
        # maps saved before the memory had stamps: unknown, so they pair with nothing across passes
        if prefix + "mem_t" not in state_dict and prefix + "mem_x" in state_dict:
            state_dict[prefix + "mem_t"] = torch.full((state_dict[prefix + "mem_x"].shape[0],), float("nan"),
                                                      dtype=torch.float64)
        # time_error maps saved before e was bounded by revisits: unbounded until this map's revisits bound it
        if hasattr(self, "revisits") and prefix + "num_seen_t" in state_dict:
            cap = prefix + "likelihood.time_error.variance_cap"
            state_dict.setdefault(cap, self.likelihood.time_error.variance_cap.detach().clone())
            for name, value in self.revisits.state_dict().items():
                state_dict.setdefault(prefix + "revisits." + name, value.detach().clone())
        # maps saved before sessions were re-expressed: their data keep the offsets they were conditioned with
        if prefix + "b_w_session" not in state_dict and prefix + "b_w_old" in state_dict:
            state_dict[prefix + "b_w_session"] = torch.zeros_like(state_dict[prefix + "b_w_old"])
            for held in ("mem", "pend"):
                n = state_dict[prefix + f"{held}_x"].shape[0] if prefix + f"{held}_x" in state_dict else 0
                state_dict[prefix + f"{held}_in_session"] = torch.zeros(n, dtype=torch.bool)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _fast_update(self, x: torch.Tensor, ys: torch.Tensor, t: torch.Tensor,
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
        kxx = self.kernel.diag(x)
        mean, var, _ = self._marginals(V, R, c, kxx)
        lam1, lam2 = self.likelihood.dual_sites(ys, mean, var)  # one undamped dual step
        extra = (kxx - (V * V).sum(0)).clamp_min(0.0)[:, None]
        moved = self._slope_noise(self._fit_slope2(x))
        lam1, lam2 = residual_weighted_sites(lam1, lam2, extra if moved is None else extra + moved)
        a_n, W_n = site_sums(V, lam1, lam2)
        self.a_w = self.a_w + a_n
        self.W = self.W + W_n
        self.pend_x = torch.cat([self.pend_x, x])
        self.pend_y = torch.cat([self.pend_y, ys])
        self.pend_lam1 = torch.cat([self.pend_lam1, lam1])
        self.pend_lam2 = torch.cat([self.pend_lam2, lam2])
        self.pend_in_session = torch.cat([self.pend_in_session, lam2.new_ones(x.shape[0], dtype=torch.bool)])
        self.pend_t = torch.cat([self.pend_t, t])
        folded = 0
        excess = self.pend_x.shape[0] - self.max_pending
        if excess > 0:
            # Oldest pending points leave: their sites go to the old part (totals unchanged).
            self._fold_into_old_part(self._features(L, self.pend_x[:excess]), self.pend_lam1[:excess],
                                     self.pend_lam2[:excess], self.pend_in_session[:excess], self.pend_t[:excess])
            for name in ("pend_x", "pend_y", "pend_lam1", "pend_lam2", "pend_in_session", "pend_t"):
                setattr(self, name, getattr(self, name)[excess:])
            folded = excess
        return {"z_moved": z_moved, "folded": folded}

    def _full_update(self, x: torch.Tensor, ys: torch.Tensor, t: torch.Tensor) -> dict:
        cfg = self.config
        n_pend, n_mem = self.pend_x.shape[0], self.mem_x.shape[0]
        # The batch: pending points (with sites) and the new points (without).
        bx = torch.cat([self.pend_x, x])
        by = torch.cat([self.pend_y, ys])
        zeros = x.new_zeros(x.shape[0], self.output_dims)
        n_b = bx.shape[0]
        z_moved = 0
        # each held reading's squared slope, from the map before this update (NIGP's fixed-point iteration: the
        # slope of the last posterior, held fixed while the sites and hyperparameters are fitted)
        slope2 = self._fit_slope2(torch.cat([self.mem_x, bx]))
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
        lam1, lam2 = self._fit_sites(V, kxx, hy, lam1, lam2, fresh, cfg.n_steps, cfg.rho,
                                     extra=self._slope_noise(slope2))
        steps, objective = 0, 0.0
        # _learn_hyperparameters decides what (theta, Z or nothing) is learned; nothing from a batch at rest
        if informative:
            n_old = self.num_seen - n_pend  # data seen before this batch
            weights = torch.ones(hx.shape[0], dtype=torch.float64, device=self.device)
            if n_mem:
                weights[:n_mem] = n_old / n_mem
            budget = self._hyper_budget(n_b)
            # the batch's stamps; the memory's readings (NaN), scattered in time, count as independent of each
            # other and of the batch (made correlated by their stamps, they learned the same: docs/calibration.md)
            times = None
            if self.learns_time_error:
                unstamped = torch.full((n_mem,), float("nan"), dtype=torch.float64, device=self.device)
                times = torch.cat([unstamped, self.pend_t, t])
            *seen, fixed, slope2_seen, times_seen = self._hyper_sample(V, hx, hy, lam1, lam2, weights, n_mem, slope2,
                                                                       times)
            steps, objective = self._learn_hyperparameters(*seen, budget, fixed=fixed, slope2=slope2_seen,
                                                           times=times_seen)
            if steps:
                self.hyper_learned.fill_(True)
                kxx = self.kernel.diag(hx)
                L = self._chol_K()
                V = self._features(L, hx)
                lam1, lam2 = self._fit_sites(V, kxx, hy, lam1, lam2, torch.zeros_like(fresh), cfg.n_steps,
                                             cfg.rho, extra=self._slope_noise(slope2))
        in_session = torch.cat([self.mem_in_session, self.pend_in_session,
                                x.new_ones(x.shape[0], dtype=torch.bool)])
        folded = self._renew_memory(V, kxx, hx, hy, lam1, lam2, n_mem, in_session,
                                    torch.cat([self.mem_t, self.pend_t, t]))
        return {"z_moved": z_moved, "hyper_steps": steps, "objective": objective, "folded": folded}

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, num_inducing={self.num_inducing}"
                f"/{self.config.num_inducing}, memory={self.memory_size}/{self.config.memory_size}")


__all__ = ["DEFAULT_MAX_PENDING", "DualSVGP"]
