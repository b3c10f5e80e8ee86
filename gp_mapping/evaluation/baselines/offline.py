"""The offline GP baselines (GPyTorch), trained on all data at once: :class:`OfflineSVGP`, the gold standard for a
sparse map, and :class:`ExactGPBaseline`, the exact GP (on a random subsample when the data are too many)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .gp_base import GPBaseline, KernelSpec, Standardiser, import_gpytorch, kernel_hyperparameters
from .metrics import BaselineError, as_2d, check_pair


def _make_svgp_class():
    gpytorch = import_gpytorch()

    class _SVGPModel(gpytorch.models.ApproximateGP):
        def __init__(self, inducing: torch.Tensor, covar, learn_inducing: bool):
            dist = gpytorch.variational.NaturalVariationalDistribution(inducing.shape[0])
            strategy = gpytorch.variational.VariationalStrategy(self, inducing, dist,
                                                                 learn_inducing_locations=learn_inducing)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = covar

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    return _SVGPModel


class OfflineSVGP(GPBaseline):
    """Batch SVGP (Hensman et al. 2013) trained on all data: the gold standard for an online sparse GP.

    Per output: M inducing inputs initialised on a seeded random subset of the training inputs (or on
    ``inducing``) and learned (unless ``learn_inducing`` is False: a diagnostic for a fixed-Z policy);
    natural-gradient steps on q(u) and Adam on the kernel, noise and inducing inputs, over shuffled
    minibatches (the schedule of Salimbeni et al. 2018). Training ends with one full-batch natural-gradient
    step of length 1, which for a Gaussian likelihood puts q(u) at its exact optimum given Z and the
    hyperparameters (Titsias' optimal q), so the result does not depend on minibatch noise in q(u).
    """

    def __init__(self, num_inducing: int = 100, spec: KernelSpec | None = None, *, iterations: int = 1500,
                 batch_size: int = 1024, lr: float = 0.02, ngd_lr: float = 0.1, seed: int = 0,
                 learn_inducing: bool = True, inducing: Any = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float64):
        super().__init__(spec, seed, device, dtype)
        self.learn_inducing = bool(learn_inducing)
        self.initial_inducing = None if inducing is None else as_2d("inducing", inducing)
        if self.initial_inducing is not None:
            num_inducing = self.initial_inducing.shape[0]
        for name, value, low in (("num_inducing", num_inducing, 1), ("iterations", iterations, 0),
                                 ("batch_size", batch_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BaselineError(f"{name} must be an integer >= {low}, got {value!r}")
        for name, value in (("lr", lr), ("ngd_lr", ngd_lr)):
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise BaselineError(f"{name} must be in (0, 1], got {value!r}")
        self.num_inducing, self.iterations, self.batch_size = num_inducing, iterations, batch_size
        self.lr, self.ngd_lr = float(lr), float(ngd_lr)
        self.final_elbo: list[float] = []

    @classmethod
    def from_model_config(cls, config: Any, **kwargs) -> "OfflineSVGP":
        """Same M and kernel (and initial hyperparameters) as the engine built from ``config``."""
        return cls(config.num_inducing, KernelSpec.from_model_config(config), **kwargs)

    def fit(self, x: Any, y: Any) -> "OfflineSVGP":
        """Train one SVGP per column of y; returns self."""
        gpytorch = import_gpytorch()
        xa, ya = check_pair(x, y)
        if self.initial_inducing is not None and self.initial_inducing.shape[1] != xa.shape[1]:
            raise BaselineError(f"inducing has {self.initial_inducing.shape[1]} columns but x has {xa.shape[1]}")
        if self.initial_inducing is None and xa.shape[0] < self.num_inducing:
            raise BaselineError(f"{xa.shape[0]} training points are fewer than num_inducing={self.num_inducing}")
        self.input_dims = xa.shape[1]
        self._scaler = Standardiser.fit(ya)
        ys = (ya - self._scaler.mean) / self._scaler.std
        svgp_class = _make_svgp_class()
        generator = torch.Generator().manual_seed(self.seed)
        n = xa.shape[0]
        xt = self._tensor(xa)
        self._models, self._likelihoods, self.final_elbo = [], [], []
        # The same initial inducing inputs for every output: given, or a seeded random subset of x.
        z0 = (self._tensor(self.initial_inducing) if self.initial_inducing is not None
              else xt[torch.randperm(n, generator=generator)[: self.num_inducing]])
        start = time.perf_counter()
        for p in range(ys.shape[1]):
            torch.manual_seed(self.seed + p)
            yt = self._tensor(ys[:, p])
            model = svgp_class(z0.clone(), self.spec.build(self.input_dims),
                               self.learn_inducing).to(self.device, self.dtype)
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(self.device, self.dtype)
            likelihood.noise = torch.tensor(self.spec.noise_variance)
            model.train()
            likelihood.train()
            elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=n)
            ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=n, lr=self.ngd_lr)
            adam = torch.optim.Adam([{"params": model.hyperparameters()},
                                     {"params": likelihood.parameters()}], lr=self.lr)
            order = torch.randperm(n, generator=generator)
            cursor = 0
            for _ in range(self.iterations):
                if cursor + self.batch_size > n:
                    order, cursor = torch.randperm(n, generator=generator), 0
                batch = order[cursor: cursor + self.batch_size].to(self.device)
                cursor += self.batch_size
                ngd.zero_grad()
                adam.zero_grad()
                loss = -elbo(model(xt[batch]), yt[batch])
                loss.backward()
                ngd.step()
                adam.step()
            self.final_elbo.append(self._polish(model, likelihood, elbo, xt, yt))
            model.eval()
            likelihood.eval()
            self._models.append(model)
            self._likelihoods.append(likelihood)
        self.train_seconds = time.perf_counter() - start
        return self

    def _polish(self, model, likelihood, elbo, xt: torch.Tensor, yt: torch.Tensor, chunk: int = 16384) -> float:
        """Full-batch natural-gradient step of length 1 on q(u) (exact for a Gaussian likelihood); ELBO/N."""
        gpytorch = import_gpytorch()
        ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=xt.shape[0], lr=1.0)
        ngd.zero_grad()
        n = xt.shape[0]
        for start in range(0, n, chunk):  # the full-data gradient, accumulated chunk by chunk
            sl = slice(start, start + chunk)
            part = xt[sl].shape[0]
            (-elbo(model(xt[sl]), yt[sl]) * part / n).backward()
        ngd.step()
        with torch.no_grad():
            total = sum(float(elbo(model(xt[s:s + chunk]), yt[s:s + chunk])) * xt[s:s + chunk].shape[0]
                        for s in range(0, n, chunk))
        return total / n

    def _latent(self, model, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            f = model(xt)
            return f.mean, f.variance.clamp_min(0.0)

    def inducing_points(self, output: int = 0) -> np.ndarray:
        """(M, D) learned inducing inputs of one output's GP."""
        self._check_fitted()
        return self._models[output].variational_strategy.inducing_points.detach().cpu().numpy()


def _make_exact_class():
    gpytorch = import_gpytorch()

    class _ExactModel(gpytorch.models.ExactGP):
        def __init__(self, x, y, likelihood, covar):
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = covar

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    return _ExactModel


class ExactGPBaseline(GPBaseline):
    """Exact GP regression (Cholesky), hyperparameters by maximising the marginal likelihood with Adam.

    With more than ``max_points`` training points, a seeded uniform subsample of ``max_points`` is used
    (``subsampled`` and ``n_used`` record it): the exact GP is then exact on that subsample only.
    ``iterations=0`` keeps the :class:`KernelSpec` hyperparameters (for closed-form comparisons).

    ``time_error=True``: each reading also carries an error that neighbouring readings share, e(t), a zero-mean
    Ornstein-Uhlenbeck process in the reading's time (Matern-1/2: variance ``error_variance`` and timescale
    ``error_timescale``, learned with the rest), as a track's pose error or a sensor's drift is:
    y = f(x) + e(t) + noise. ``fit`` then needs the times, and the hyperparameters are the marginal likelihood's
    under that model. ``predict`` gives the field f alone (a new pass has its own error, independent of these: a
    reading there has variance latent + ``noise_variance`` + ``error_variance``). Readings of different passes
    are independent when their times are far apart (more than a few timescales).
    """

    def __init__(self, spec: KernelSpec | None = None, *, max_points: int = 3000, iterations: int = 100,
                 lr: float = 0.05, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float64,
                 time_error: bool = False, error_timescale: float = 5.0, error_variance: float = 0.1):
        super().__init__(spec, seed, device, dtype)
        for name, value in (("error_timescale", error_timescale), ("error_variance", error_variance)):
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise BaselineError(f"{name} must be a positive finite number, got {value!r}")
        self.time_error = bool(time_error)
        self.initial_error = (float(error_timescale), float(error_variance))
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
            raise BaselineError(f"max_points must be a positive integer, got {max_points!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
            raise BaselineError(f"iterations must be a non-negative integer, got {iterations!r}")
        self.max_points, self.iterations, self.lr = max_points, iterations, float(lr)
        self.subsampled = False
        self.n_used = 0

    def fit(self, x: Any, y: Any, t: Any = None) -> "ExactGPBaseline":
        """Fit to inputs x (N, D) and targets y (N, P); ``t`` (N,) seconds: the readings' times, which
        ``time_error`` needs (and nothing else uses)."""
        gpytorch = import_gpytorch()
        xa, ya = check_pair(x, y)
        self.input_dims = d = xa.shape[1]
        if self.time_error:
            if t is None:
                raise BaselineError("time_error needs the readings' times: fit(x, y, t)")
            ta = np.asarray(t, dtype=np.float64).reshape(-1)
            if ta.shape[0] != xa.shape[0] or not np.all(np.isfinite(ta)):
                what = f"shape {np.shape(t)}" if ta.shape[0] != xa.shape[0] else "non-finite values"
                raise BaselineError(f"t must hold one finite time per reading ({xa.shape[0]}), got {what}")
            xa = np.column_stack([xa, ta])  # the time is the last input column, which only e(t) reads
        self.subsampled = xa.shape[0] > self.max_points
        if self.subsampled:
            keep = np.random.default_rng(self.seed).choice(xa.shape[0], self.max_points, replace=False)
            xa, ya = xa[np.sort(keep)], ya[np.sort(keep)]
        self.n_used = xa.shape[0]
        self._scaler = Standardiser.fit(ya)
        ys = (ya - self._scaler.mean) / self._scaler.std
        exact_class = _make_exact_class()
        xt = self._tensor(xa)
        self._models, self._likelihoods = [], []
        start = time.perf_counter()
        with self._exact_settings():
            for p in range(ys.shape[1]):
                torch.manual_seed(self.seed + p)
                yt = self._tensor(ys[:, p])
                likelihood = gpytorch.likelihoods.GaussianLikelihood().to(self.device, self.dtype)
                likelihood.noise = torch.tensor(self.spec.noise_variance)
                model = exact_class(xt, yt, likelihood, self._covariance(d)).to(self.device, self.dtype)
                if self.iterations:
                    model.train()
                    likelihood.train()
                    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
                    adam = torch.optim.Adam(model.parameters(), lr=self.lr)
                    for _ in range(self.iterations):
                        adam.zero_grad()
                        (-mll(model(xt), yt)).backward()
                        adam.step()
                model.eval()
                likelihood.eval()
                self._models.append(model)
                self._likelihoods.append(likelihood)
        if self.time_error:
            for model, likelihood in zip(self._models, self._likelihoods):
                model.field_posterior = self._field_posterior(model, likelihood)
        self.train_seconds = time.perf_counter() - start
        return self

    def _covariance(self, d: int):
        """The prior covariance: the field's kernel (KernelSpec), plus e(t) on column d with ``time_error``."""
        if not self.time_error:
            return self.spec.build(d)
        gpytorch = import_gpytorch()
        field = self.spec.build(d, active_dims=tuple(range(d)))
        error = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=0.5, active_dims=(d,)))
        error.base_kernel.lengthscale = torch.tensor(self.initial_error[0])
        error.outputscale = torch.tensor(self.initial_error[1])
        covar = field + error
        covar.field, covar.error = field, error  # the parts by name, for the field's posterior and the report
        return covar

    def _field_posterior(self, model, likelihood) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, alpha): chol(K + noise I) of the training inputs under the whole prior (field + e(t)) and
        alpha = (K + noise I)^{-1} y, which the field's posterior at new inputs needs."""
        with torch.no_grad():
            xt, yt = model.train_inputs[0], model.train_targets
            K = model.covar_module(xt).to_dense() + float(likelihood.noise) * torch.eye(
                xt.shape[0], dtype=xt.dtype, device=xt.device)
            L = torch.linalg.cholesky(K)
            return L, torch.cholesky_solve(yt[:, None], L)[:, 0]

    @property
    def error_variance(self) -> np.ndarray:
        """(P,) variance of the error e(t) that neighbouring readings share, in the squared units of y (zeros
        without ``time_error``)."""
        self._check_fitted()
        return np.array([float(m.covar_module.error.outputscale.detach()) * self._scaler.std[p] ** 2
                         if self.time_error else 0.0 for p, m in enumerate(self._models)])

    @property
    def reading_noise_variance(self) -> np.ndarray:
        """(P,) a new pass's reading adds the learned noise and, with ``time_error``, its own e(t)."""
        return self.noise_variance + self.error_variance

    def hyperparameters(self) -> list[dict[str, Any]]:
        """GPBaseline's, and with ``time_error`` the field's kernel alone plus e(t)'s variance (units of y^2)
        and timescale [s]."""
        if not self.time_error:
            return super().hyperparameters()
        out = []
        for p, model in enumerate(self._models):
            h = kernel_hyperparameters(model.covar_module.field)
            h.update({"noise_variance": float(self.noise_variance[p]), "error_variance": float(self.error_variance[p]),
                      "error_timescale": float(model.covar_module.error.base_kernel.lengthscale.detach())})
            out.append(h)
        return out

    @staticmethod
    def _exact_settings():
        """Cholesky everywhere (GPyTorch would otherwise switch to CG/Lanczos for N > 800)."""
        gpytorch = import_gpytorch()
        from contextlib import ExitStack

        stack = ExitStack()
        stack.enter_context(gpytorch.settings.max_cholesky_size(10 ** 7))
        stack.enter_context(gpytorch.settings.fast_computations(False, False, False))
        stack.enter_context(gpytorch.settings.fast_pred_var(False))
        return stack

    def _latent(self, model, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.time_error:  # the field alone: its cross-covariance with the readings, which e(t) does not touch
            L, alpha = model.field_posterior
            with torch.no_grad():
                at = torch.cat([xt, torch.zeros_like(xt[:, :1])], dim=1)  # a time column, which the field ignores
                cross = model.covar_module.field(at, model.train_inputs[0]).to_dense()
                explained = torch.linalg.solve_triangular(L, cross.T, upper=False)
                prior = model.covar_module.field(at, diag=True)
                return cross @ alpha, (prior - (explained * explained).sum(0)).clamp_min(0.0)
        with torch.no_grad(), self._exact_settings():
            f = model(xt)
            return f.mean, f.variance.clamp_min(0.0)
