"""The streaming sparse GP of Bui, Nguyen and Turner (2017), OSGPR-VFE: the streaming baseline every seed paper
compares against (written here from the paper; the engine's kernels)."""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from .gp_base import GPBaseline, KernelSpec, Standardiser
from .metrics import BaselineError, as_2d, check_pair


class _OSGPRState(torch.nn.Module):
    """One output of :class:`StreamingSparseGP`: kernel, noise, inducing inputs and the whitened posterior.

    After a batch, with L = chol(K_bb + eps I) at the batch's hyperparameters, the posterior over u = f(Z) is
    held whitened: c_w = L^{-1} c and Psi_w = D - I = L^{-1} (K_bf K_fb / s2 + K_ba Lambda_a K_ab) L^{-T}
    (Bui et al. 2017, collapsed VFE form). Psi_w is also the next batch's old-likelihood precision in
    whitened form: Lambda_a = S_a^{-1} - K'_aa^{-1} = L^{-T} Psi_w L^{-1} exactly, so it is never formed by
    subtracting two inverses; likewise S_a^{-1} m_a = L^{-T} c_w.
    """

    def __init__(self, spec: KernelSpec, input_dims: int, jitter: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        from gp_mapping.gp.kernels import PositiveParameter, build_kernel

        self.kernel = build_kernel(spec, input_dims, scales=1)  # the engine's kernel code (same parameterisation)
        self.noise = PositiveParameter(spec.noise_variance)
        self.jitter = float(jitter)
        self.Z: torch.Tensor | None = None          # (M, D) inducing inputs of the current posterior
        self.L: torch.Tensor | None = None          # chol(K_ZZ + eps I) under the hyperparameters it was fitted with
        self.c_w: torch.Tensor | None = None        # (M,)
        self.psi_w: torch.Tensor | None = None      # (M, M)
        self.R: torch.Tensor | None = None          # chol(I + psi_w)
        self.to(device=device, dtype=dtype)

    def _chol(self, z: torch.Tensor) -> torch.Tensor:
        from gp_mapping.gp.linalg import jittered_cholesky

        factor, used = jittered_cholesky(self.kernel(z, z), self.jitter)
        self.jitter = max(self.jitter, used)  # the jitter escalates (and stays) when Z is nearly singular
        return factor

    def _cross_old(self, z_old: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Cov(u_old, u_new): k(Z_old, Z), plus the jitter where a point is kept exactly (it is the same
        variable, whose prior variance carries the jitter), so keeping Z loses nothing."""
        cross = self.kernel(z_old, z)
        same = (z_old[:, None, :] == z[None, :, :]).all(-1)
        return cross + self.jitter * same.to(cross.dtype)

    def terms(self, z: torch.Tensor, x: torch.Tensor, y: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(objective, L_b, c_w, psi_w) for inducing inputs ``z`` and the batch (x, y) given the old posterior.

        The objective is the collapsed bound without the terms that depend on the old posterior only:
        log N([y; y_a] | 0, Q + Sigma) - tr(K_ff - Q_ff) / (2 s2) - tr(Lambda_a (K_aa - Q_aa)) / 2.
        """
        s2 = self.noise.value
        L = self._chol(z)
        A = torch.linalg.solve_triangular(L, self.kernel(z, x), upper=False)  # L^-1 K_bf  (M, N)
        psi = A @ A.T / s2
        c = A @ y / s2
        trace = (self.kernel.diag(x).sum() - (A * A).sum()) / s2
        if self.Z is not None:
            # Old data as pseudo-observations of u_a = f(Z_a) with precision Lambda_a (whitened by L_a).
            G = torch.linalg.solve_triangular(self.L, self._cross_old(self.Z, z), upper=False)  # L_a^-1 K_ab
            E = torch.linalg.solve_triangular(L, G.T, upper=False)                              # L_b^-1 K_ba L_a^-T
            psi = psi + E @ self.psi_w @ E.T
            c = c + E @ self.c_w
            k_aa = self.kernel(self.Z, self.Z) + self.jitter * torch.eye(self.Z.shape[0], dtype=z.dtype,
                                                                          device=z.device)
            P = torch.linalg.solve_triangular(self.L, torch.linalg.solve_triangular(self.L, k_aa, upper=False).T,
                                              upper=False)  # L_a^-1 K_aa L_a^-T (new hyperparameters)
            trace = trace + (self.psi_w * (P - E.T @ E)).sum()
        psi = 0.5 * (psi + psi.T)
        eye = torch.eye(psi.shape[0], dtype=psi.dtype, device=psi.device)
        R = torch.linalg.cholesky(eye + psi)
        v = torch.linalg.solve_triangular(R, c[:, None], upper=False)[:, 0]
        n = x.shape[0]
        objective = (-0.5 * n * torch.log(2 * math.pi * s2) - torch.log(torch.diagonal(R)).sum()
                     - 0.5 * (y * y).sum() / s2 + 0.5 * (v * v).sum() - 0.5 * trace)
        return objective, L, c, psi

    def commit(self, z: torch.Tensor, L: torch.Tensor, c_w: torch.Tensor, psi_w: torch.Tensor) -> None:
        eye = torch.eye(psi_w.shape[0], dtype=psi_w.dtype, device=psi_w.device)
        self.Z, self.L, self.c_w, self.psi_w = z.detach(), L.detach(), c_w.detach(), psi_w.detach()
        self.R = torch.linalg.cholesky(eye + self.psi_w)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean k_*b L^-T D^-1 c_w and variance k_** - |L^-1 k_b*|^2 + |R^-1 L^-1 k_b*|^2 (standardised)."""
        V = torch.linalg.solve_triangular(self.L, self.kernel(self.Z, x), upper=False)
        U = torch.linalg.solve_triangular(self.R, V, upper=False)
        w = torch.cholesky_solve(self.c_w[:, None], self.R)[:, 0]
        mean = V.T @ w
        var = self.kernel.diag(x) - (V * V).sum(0) + (U * U).sum(0)
        return mean, var.clamp_min(0.0)


class StreamingSparseGP(GPBaseline):
    """Streaming sparse GP of Bui, Nguyen and Turner (2017), collapsed VFE form (OSGPR-VFE), from the paper.

    Each batch is fitted once and never revisited. The old data enter only through the previous posterior
    q_old(u_a) on the previous inducing inputs Z_a, as the pseudo-likelihood q_old(u_a) / p_old(u_a) with
    p_old the prior under the previous hyperparameters (a Gaussian in u_a with precision
    S_a^{-1} - K'_aa^{-1}); the new q(u_b) is the collapsed (Titsias) optimum for the new batch plus that
    pseudo-likelihood, under the new hyperparameters. Per batch: Z_b starts as M points chosen by pivoted
    Cholesky over [Z_a; X_batch] (the engine's selection code), then the kernel hyperparameters, the noise
    and Z_b maximise the collapsed bound with ``iterations`` L-BFGS iterations (0: everything fixed).

    Targets are standardised with the first batch's mean and standard deviation (a streaming method sees no
    more); one independent GP per output column. ``inducing`` gives a fixed Z for every batch (with
    ``learn_inducing`` False it never moves): with fixed hyperparameters the streamed posterior is then the
    batch Titsias posterior on all data.
    """

    def __init__(self, num_inducing: int = 100, spec: KernelSpec | None = None, *, iterations: int = 20,
                 learn_hyperparameters: bool = True, learn_inducing: bool = True, inducing: Any = None,
                 jitter: float = 1e-6, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float64):
        super().__init__(spec, seed, device, dtype)
        self.fixed_inducing = None if inducing is None else as_2d("inducing", inducing)
        if self.fixed_inducing is not None:
            num_inducing = self.fixed_inducing.shape[0]
        for name, value, low in (("num_inducing", num_inducing, 1), ("iterations", iterations, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BaselineError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(jitter, (int, float)) and math.isfinite(jitter) and jitter >= 0):
            raise BaselineError(f"jitter must be a non-negative finite number, got {jitter!r}")
        self.num_inducing, self.iterations = num_inducing, iterations
        self.learn_hyperparameters, self.learn_inducing = bool(learn_hyperparameters), bool(learn_inducing)
        self.jitter = float(jitter)
        self.num_seen = 0
        self.num_updates = 0

    @classmethod
    def from_model_config(cls, config: Any, **kwargs) -> "StreamingSparseGP":
        """Same M, kernel and initial hyperparameters (and jitter) as the engine built from ``config``."""
        kwargs.setdefault("jitter", config.jitter)
        return cls(config.num_inducing, KernelSpec.from_model_config(config), **kwargs)

    def _select_inducing(self, state: _OSGPRState, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_inducing is not None:
            return self._tensor(self.fixed_inducing)
        from gp_mapping.gp.inducing import pivoted_cholesky

        cand = x if state.Z is None else torch.cat([state.Z, x])
        with torch.no_grad():
            idx, _ = pivoted_cholesky(state.kernel, state.kernel.diag(cand), cand, self.num_inducing)
        return cand[idx].clone()

    def _fit_output(self, state: _OSGPRState, x: torch.Tensor, y: torch.Tensor) -> float:
        z = self._select_inducing(state, x)
        params = list(state.kernel.parameters()) + list(state.noise.parameters()) if self.learn_hyperparameters \
            else []
        if self.learn_inducing and self.fixed_inducing is None:
            z = torch.nn.Parameter(z)
            params.append(z)
        n = x.shape[0]
        if params and self.iterations:
            backup = [p.detach().clone() for p in params]
            optimiser = torch.optim.LBFGS(params, lr=1.0, max_iter=self.iterations, line_search_fn="strong_wolfe")

            def closure() -> torch.Tensor:
                optimiser.zero_grad()
                loss = -state.terms(z, x, y)[0] / n
                loss.backward()
                return loss

            try:
                optimiser.step(closure)
                with torch.no_grad():
                    ok = all(bool(torch.isfinite(p).all()) for p in params)
                    ok = ok and bool(torch.isfinite(state.terms(z, x, y)[0]))
            except (RuntimeError, ArithmeticError):  # a wild step (singular K_bb): keep the start
                ok = False
            if not ok:
                with torch.no_grad():
                    for p, b in zip(params, backup):
                        p.copy_(b)
        with torch.no_grad():
            z = z.detach()
            objective, L, c_w, psi_w = state.terms(z, x, y)
            state.commit(z, L, c_w, psi_w)
        return float(objective)

    def update(self, x: Any, y: Any) -> dict:
        """Condition on one batch (x (N, D), y (N, P)); returns the bound per output and the wall time."""
        xa, ya = check_pair(x, y, self.input_dims, len(self._models) or None)
        start = time.perf_counter()
        if not self._models:
            self.input_dims = xa.shape[1]
            self._scaler = Standardiser.fit(ya)
            self._models = [_OSGPRState(self.spec, self.input_dims, self.jitter, self.dtype, self.device)
                            for _ in range(ya.shape[1])]
            self._likelihoods = [state.noise for state in self._models]
        ys = (ya - self._scaler.mean) / self._scaler.std
        xt = self._tensor(xa)
        bounds = [self._fit_output(state, xt, self._tensor(ys[:, p])) for p, state in enumerate(self._models)]
        self.num_seen += xa.shape[0]
        self.num_updates += 1
        seconds = time.perf_counter() - start
        self.train_seconds += seconds
        return {"bound": bounds, "seconds": seconds, "num_seen": self.num_seen,
                "num_inducing": int(self._models[0].Z.shape[0])}

    def _latent(self, model, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return model.latent(xt)

    @property
    def noise_variance(self) -> np.ndarray:
        """(P,) learned observation-noise variance in the squared units of y."""
        self._check_fitted()
        return np.array([float(state.noise.value.detach()) * self._scaler.std[p] ** 2
                         for p, state in enumerate(self._models)])

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Per output: kernel hyperparameters (standardised units) and the noise variance (units of y^2)."""
        self._check_fitted()
        out = []
        for p, state in enumerate(self._models):
            # Parameters are stored as logs (PositiveParameter.raw): report the values.
            h = {name.replace(".raw", ""): torch.exp(v.detach()).cpu().numpy().ravel().tolist()
                 for name, v in state.kernel.named_parameters()}
            h["noise_variance"] = float(self.noise_variance[p])
            out.append(h)
        return out

    def inducing_points(self, output: int = 0) -> np.ndarray:
        """(M, D) inducing inputs of one output's current posterior."""
        self._check_fitted()
        return self._models[output].Z.cpu().numpy()
