"""The reduced-rank GP (Hilbert-space basis functions, Solin and Sarkka) over a box."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from gp_mapping.gp.kernels import lengthscale_groups

from .gp_base import KERNELS, KernelSpec
from .metrics import BaselineError, as_2d, check_pair, gaussian_log_density


class ReducedRankGP:
    """Hilbert-space reduced-rank GP (Solin & Särkkä 2020), the model magnetic-field SLAM uses (Kok & Solin
    2018): f(x) = sum_j w_j phi_j(x) with phi_j the Dirichlet Laplacian eigenfunctions of a box Omega around
    the mapped area (a product of sines, eigenvalue lambda_j = |omega_j|^2) and w_j ~ N(0, S(omega_j)), S the
    kernel's spectral density; a constant feature carries the constant kernel. Sequential Bayesian linear
    regression: each batch adds Phi^T Phi and Phi^T y to sufficient statistics, so the posterior is exact for
    the truncated model and a batch costs O(N m^2 + m^3) whatever was seen before. The hyperparameters (signal
    and constant variances, lengthscales, noise) are re-fitted on the exact log marginal likelihood, which
    the sufficient statistics give for any hyperparameters at O(m^3) without revisiting data (``iterations`` Adam
    steps after every ``refit_every``-th batch, the first included).

    ``area`` (xmin, ymin, xmax, ymax) plus ``margin`` lengthscales on every side is the box; the basis must be
    fixed before the data come (its one limitation against an inducing-point map that follows the robot).
    """

    def __init__(self, area, num_basis: int = 256, spec: KernelSpec | None = None, *, margin: float = 1.0,
                 refit_every: int = 10, iterations: int = 10, lr: float = 0.05):
        lo, hi = np.asarray(area[: len(area) // 2], float), np.asarray(area[len(area) // 2:], float)
        if lo.shape != hi.shape or not np.all(hi > lo):
            raise BaselineError(f"area must be (mins..., maxs...) with max > min, got {area!r}")
        if isinstance(num_basis, bool) or not isinstance(num_basis, int) or num_basis < 1:
            raise BaselineError(f"num_basis must be a positive integer, got {num_basis!r}")
        self.spec = spec or KernelSpec()
        self.input_dims = d = lo.shape[0]
        extra = margin * self.spec.lengthscale
        self.centre = torch.as_tensor((lo + hi) / 2)
        self.half = torch.as_tensor((hi - lo) / 2 + extra)
        # the num_basis multi-indices with the smallest eigenvalues
        per_dim = int(math.ceil(num_basis ** (1.0 / d))) + 2
        grids = np.stack(np.meshgrid(*[np.arange(1, per_dim + 1)] * d, indexing="ij"), -1).reshape(-1, d)
        omega = np.pi * grids / (2.0 * self.half.numpy())
        order = np.argsort((omega ** 2).sum(1), kind="stable")[:num_basis]
        self.index = torch.as_tensor(grids[order], dtype=torch.float64)
        self.omega = torch.as_tensor(omega[order])
        self.num_basis = num_basis
        self.refit_every, self.iterations, self.lr = int(refit_every), int(iterations), float(lr)
        nu = KERNELS[self.spec.kernel]
        self.nu = nu
        self.axis_group = torch.tensor(lengthscale_groups(self.spec.lengthscales, d))
        ls = np.full(int(self.axis_group.max()) + 1, self.spec.lengthscale)
        self.raw = {"signal": torch.tensor(math.log(self.spec.signal_variance)),
                    "constant": torch.tensor(math.log(self.spec.constant_variance)),
                    "lengthscale": torch.as_tensor(np.log(ls)),
                    "noise": torch.tensor(math.log(self.spec.noise_variance))}
        k = num_basis + (1 if self.spec.constant_kernel else 0)
        self._A = torch.zeros(k, k, dtype=torch.float64)
        self._b = torch.zeros(k, dtype=torch.float64)
        self._yy = 0.0
        self._n = 0
        self._offset: float | None = None
        self._scale = 1.0
        self._batches = 0
        self._posterior: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_model_config(cls, config: Any, area, **kwargs) -> "ReducedRankGP":
        return cls(area, spec=KernelSpec.from_model_config(config), **kwargs)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, m [+1]) eigenfunctions at x (and the constant feature)."""
        u = (x - self.centre + self.half) / (2.0 * self.half)  # in [0, 1] inside the box
        phi = torch.prod(torch.sin(math.pi * self.index[None, :, :] * u[:, None, :]) /
                         torch.sqrt(self.half)[None, None, :], dim=-1)
        if self.spec.constant_kernel:
            phi = torch.cat([phi, torch.ones(x.shape[0], 1, dtype=phi.dtype)], 1)
        return phi

    def _prior_variances(self, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        d = self.input_dims
        ls = torch.exp(raw["lengthscale"])[self.axis_group]
        scaled = (self.omega * ls) ** 2
        if self.nu is None:
            s = (2 * math.pi) ** (d / 2) * torch.prod(ls) * torch.exp(-0.5 * scaled.sum(1))
        else:
            nu = self.nu
            const = (2 ** d * math.pi ** (d / 2) * math.gamma(nu + d / 2) * (2 * nu) ** nu / math.gamma(nu))
            s = const * torch.prod(ls) * (2 * nu + scaled.sum(1)) ** (-(nu + d / 2))
        s = torch.exp(raw["signal"]) * s
        if self.spec.constant_kernel:
            s = torch.cat([s, torch.exp(raw["constant"])[None]])
        return s

    def _log_marginal(self, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        s = self._prior_variances(raw).clamp_min(1e-300)
        noise = torch.exp(raw["noise"])
        P = torch.diag(1.0 / s) + self._A / noise
        L = torch.linalg.cholesky(P)
        v = torch.linalg.solve_triangular(L, (self._b / noise)[:, None], upper=False)[:, 0]
        return -0.5 * (self._n * torch.log(2 * math.pi * noise) + self._yy / noise - (v * v).sum()
                       + 2 * torch.log(torch.diagonal(L)).sum() + torch.log(s).sum())

    def _refit(self) -> None:
        params = {k: v.clone().requires_grad_(True) for k, v in self.raw.items()}
        opt = torch.optim.Adam(params.values(), lr=self.lr)
        for _ in range(self.iterations):
            opt.zero_grad()
            loss = -self._log_marginal(params) / max(self._n, 1)
            if not torch.isfinite(loss):
                return
            loss.backward()
            opt.step()
        with torch.no_grad():
            candidate = {k: v.detach().clone() for k, v in params.items()}
            if torch.isfinite(self._log_marginal(candidate)):
                self.raw = candidate

    def update(self, x: Any, y: Any) -> None:
        xa, ya = check_pair(x, y, self.input_dims, 1)
        if self._offset is None:  # the targets' unit: only a fixed shift and scale, everything else is learned
            self._offset, self._scale = float(ya.mean()), float(max(ya.std(), 1e-9))
        phi = self.features(torch.as_tensor(xa))
        yc = (torch.as_tensor(ya[:, 0]) - self._offset) / self._scale
        self._A += phi.T @ phi
        self._b += phi.T @ yc
        self._yy += float(yc @ yc)
        self._n += xa.shape[0]
        self._batches += 1
        if self.iterations and (self._batches - 1) % self.refit_every == 0:
            self._refit()
        with torch.no_grad():
            s = self._prior_variances(self.raw)
            noise = torch.exp(self.raw["noise"])
            L = torch.linalg.cholesky(torch.diag(1.0 / s) + self._A / noise)
            mean = torch.cholesky_solve((self._b / noise)[:, None], L)[:, 0]
            self._posterior = (L, mean)

    def predict(self, x: Any, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        if self._posterior is None:
            raise BaselineError("ReducedRankGP.predict called before any update")
        xa = as_2d("x", x, self.input_dims)
        L, mean = self._posterior
        means, variances = [], []
        for start in range(0, xa.shape[0], batch_size):
            phi = self.features(torch.as_tensor(xa[start:start + batch_size]))
            v = torch.linalg.solve_triangular(L, phi.T, upper=False)
            means.append((phi @ mean).numpy())
            variances.append((v * v).sum(0).numpy())
        m = np.concatenate(means)[:, None] * self._scale + self._offset
        return m, np.concatenate(variances)[:, None] * self._scale ** 2

    def predict_reading(self, x: Any, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of a reading at x: the latent variance plus the learned noise."""
        mean, var = self.predict(x, batch_size)
        return mean, var + float(torch.exp(self.raw["noise"])) * self._scale ** 2

    def log_predictive_density(self, x: Any, y: Any) -> np.ndarray:
        return gaussian_log_density(as_2d("y", y), *self.predict_reading(x))
