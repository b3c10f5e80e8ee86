"""Reference predictors that the online engine is judged against.

* :class:`NearestNeighbour` and :class:`ConstantMean`: the floor any map must beat by a wide margin.
* :class:`OfflineSVGP`: the gold standard for a sparse map, a batch SVGP (GPyTorch) with the same number
  of inducing points and the same kernel as the engine, trained on all data at once.
* :class:`ExactGPBaseline`: the exact GP (GPyTorch ExactGP, Cholesky), on a random subsample when the data
  are too many for an O(N^3) factorisation.
* :class:`StreamingSparseGP`: the streaming sparse GP of Bui, Nguyen and Turner (2017), OSGPR-VFE, the
  streaming baseline every seed paper compares against (written here from the paper; the engine's kernels).

The GP baselines share the engine's interface: ``predict(x) -> (mean, var)`` of the latent f in the units
of y, and ``log_predictive_density(x, y)``. Targets are standardised inside, as the engine does. GPyTorch is
a test and benchmark dependency, imported only when a GP baseline is built.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gp_mapping.gp.config import LENGTHSCALE_CHOICES
from gp_mapping.gp.kernels import lengthscale_groups

KERNELS = {"matern12": 0.5, "matern32": 1.5, "matern52": 2.5, "rbf": None}


class BaselineError(ValueError):
    """Bad input to a baseline (shapes, non-finite values, too few points) or a baseline used before fit."""


def _gpytorch():
    try:
        import gpytorch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the GP baselines need GPyTorch: pip install 'gpytorch>=1.11' "
                          "(it is a test/benchmark dependency of gp_mapping, `pip install gp_mapping[test]`)") from err
    return gpytorch


def _as_2d(name: str, a: Any, dims: int | None = None) -> np.ndarray:
    """(N, D) float64 array from a numpy array, a torch tensor or a list; a 1-D input becomes one column."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2:
        raise BaselineError(f"{name} must be 1-D or 2-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise BaselineError(f"{name} is empty")
    if dims is not None and arr.shape[1] != dims:
        raise BaselineError(f"{name} has {arr.shape[1]} columns, expected {dims}")
    if not np.isfinite(arr).all():
        raise BaselineError(f"{name} holds non-finite values")
    return arr


def _check_pair(x: Any, y: Any, x_dims: int | None = None, y_dims: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    xa, ya = _as_2d("x", x, x_dims), _as_2d("y", y, y_dims)
    if xa.shape[0] != ya.shape[0]:
        raise BaselineError(f"x has {xa.shape[0]} rows but y has {ya.shape[0]}")
    return xa, ya


# ---------------------------------------------------------------------------------------------------- metrics

def rmse(prediction: Any, truth: Any) -> float:
    """Root mean squared error over all points and outputs."""
    p, t = _as_2d("prediction", prediction), _as_2d("truth", truth)
    if p.shape != t.shape:
        raise BaselineError(f"prediction shape {p.shape} differs from truth shape {t.shape}")
    return float(np.sqrt(np.mean((p - t) ** 2)))


def gaussian_log_density(y: Any, mean: Any, var: Any) -> np.ndarray:
    """(N, P) log N(y | mean, var) elementwise; var is the predictive variance of y (noise included)."""
    y, mean, var = _as_2d("y", y), _as_2d("mean", mean), _as_2d("var", var)
    if not (y.shape == mean.shape == var.shape):
        raise BaselineError(f"shapes differ: y {y.shape}, mean {mean.shape}, var {var.shape}")
    if (var <= 0).any():
        raise BaselineError("predictive variances must be positive")
    return -0.5 * (np.log(2 * math.pi * var) + (y - mean) ** 2 / var)


def nlpd(log_density: Any) -> float:
    """Negative log predictive density averaged over points and outputs (per scalar observation)."""
    ld = log_density.detach().cpu().numpy() if isinstance(log_density, torch.Tensor) else np.asarray(log_density)
    if ld.size == 0 or not np.isfinite(ld).all():
        raise BaselineError("log densities must be a non-empty finite array")
    return float(-np.mean(ld))


# ------------------------------------------------------------------------------------------- simple baselines

class NearestNeighbour:
    """Predict each test point's target as the target of its nearest training input (Euclidean, cKDTree)."""

    def __init__(self, x: Any, y: Any):
        from scipy.spatial import cKDTree

        self.x, self.y = _check_pair(x, y)
        self._tree = cKDTree(self.x)

    def predict(self, x: Any) -> np.ndarray:
        """(G, P) targets of the nearest training inputs."""
        xq = _as_2d("x", x, self.x.shape[1])
        _, index = self._tree.query(xq)
        return self.y[index]


class ConstantMean:
    """Predict the training mean of each output everywhere."""

    def __init__(self, y: Any):
        self.mean = _as_2d("y", y).mean(axis=0)

    def predict(self, x: Any) -> np.ndarray:
        """(G, P) the training mean repeated."""
        return np.broadcast_to(self.mean, (_as_2d("x", x).shape[0], self.mean.shape[0])).copy()


# ----------------------------------------------------------------------------------------------- GP baselines

@dataclass
class KernelSpec:
    """Kernel and initial hyperparameters shared by the GP baselines (standardised-target units)."""

    kernel: str = "matern52"
    lengthscales: str = "horizontal"  # which input axes share a lengthscale (model.lengthscales)
    constant_kernel: bool = True
    lengthscale: float = 1.0
    signal_variance: float = 1.0
    constant_variance: float = 1.0
    noise_variance: float = 0.01

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise BaselineError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.lengthscales not in LENGTHSCALE_CHOICES:
            raise BaselineError(f"lengthscales must be one of {', '.join(LENGTHSCALE_CHOICES)}, "
                                f"got {self.lengthscales!r}")
        for name in ("lengthscale", "signal_variance", "constant_variance", "noise_variance"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise BaselineError(f"{name} must be a positive finite number, got {value!r}")

    @classmethod
    def from_model_config(cls, config: Any) -> "KernelSpec":
        """The kernel of a :class:`gp_mapping.config.ModelConfig`, so a baseline matches the engine."""
        return cls(kernel=config.kernel, lengthscales=config.lengthscales, constant_kernel=config.constant_kernel,
                   lengthscale=config.lengthscale, signal_variance=config.signal_variance,
                   constant_variance=config.constant_variance, noise_variance=config.noise_variance)

    def build(self, input_dims: int):
        """A GPyTorch covariance module: scale * stationary (+ constant)."""
        gpytorch = _gpytorch()
        groups = lengthscale_groups(self.lengthscales, input_dims)
        learned = max(groups) + 1
        nu = KERNELS[self.kernel]
        cls = gpytorch.kernels.RBFKernel if nu is None else gpytorch.kernels.MaternKernel
        if learned not in (1, input_dims):
            cls = _shared_lengthscale_kernel(cls, groups)
        base = cls(ard_num_dims=learned if learned > 1 else None, **({} if nu is None else {"nu": nu}))
        base.lengthscale = torch.full_like(base.raw_lengthscale, self.lengthscale)
        covar = gpytorch.kernels.ScaleKernel(base)
        covar.outputscale = torch.tensor(self.signal_variance)
        if self.constant_kernel:
            const = gpytorch.kernels.ConstantKernel()
            const.constant = torch.tensor(self.constant_variance)
            covar = covar + const
        return covar


def _shared_lengthscale_kernel(cls, groups: tuple[int, ...]):
    """A GPyTorch stationary kernel class whose input axes share learned lengthscales as ``groups`` says
    (GPyTorch knows one lengthscale or one per axis; its kernels read ``self.lengthscale`` per axis)."""
    index = list(groups)

    class SharedLengthscale(cls):
        @property
        def lengthscale(self):
            return super().lengthscale[..., index]

        @lengthscale.setter
        def lengthscale(self, value):
            self._set_lengthscale(value)

    return SharedLengthscale


def _kernel_hyperparameters(covar) -> dict[str, Any]:
    """Readable hyperparameters of a module built by :meth:`KernelSpec.build` (standardised units)."""
    gpytorch = _gpytorch()
    parts = covar.kernels if isinstance(covar, gpytorch.kernels.AdditiveKernel) else [covar]
    out: dict[str, Any] = {}
    for part in parts:
        if isinstance(part, gpytorch.kernels.ScaleKernel):
            out["signal_variance"] = float(part.outputscale.detach())
            out["lengthscale"] = part.base_kernel.lengthscale.detach().cpu().numpy().ravel().tolist()
        elif isinstance(part, gpytorch.kernels.ConstantKernel):
            out["constant_variance"] = float(part.constant.detach())
    return out


@dataclass
class _Standardiser:
    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, y: np.ndarray) -> "_Standardiser":
        std = y.std(axis=0)
        return cls(mean=y.mean(axis=0), std=np.where(std > 0, std, 1.0))


@dataclass
class BaselineScores:
    """Test-set scores of a baseline: RMSE of the mean and NLPD (noise included), in the units of y."""

    rmse: float
    nlpd: float
    extra: dict = field(default_factory=dict)


class _GPBaseline:
    """Common prediction and scoring for the GP baselines: one independent GP per output column."""

    def __init__(self, spec: KernelSpec | None, seed: int, device: str, dtype: torch.dtype):
        self.spec = spec or KernelSpec()
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise BaselineError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = seed
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        self.dtype = dtype
        self._models: list = []
        self._likelihoods: list = []
        self._scaler: _Standardiser | None = None
        self.input_dims: int | None = None
        self.train_seconds = 0.0

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=self.dtype, device=self.device)

    def _check_fitted(self) -> None:
        if not self._models:
            raise BaselineError(f"{type(self).__name__} is used before fit()")

    def _latent(self, model, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def predict(self, x: Any, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """Latent mean and variance of f at x, (G, P) each, in the units of y."""
        self._check_fitted()
        xa = _as_2d("x", x, self.input_dims)
        means, vars_ = [], []
        for p, model in enumerate(self._models):
            m_chunks, v_chunks = [], []
            for start in range(0, xa.shape[0], batch_size):
                m, v = self._latent(model, self._tensor(xa[start:start + batch_size]))
                m_chunks.append(m.cpu().numpy())
                v_chunks.append(v.cpu().numpy())
            scale = self._scaler.std[p]
            means.append(np.concatenate(m_chunks) * scale + self._scaler.mean[p])
            vars_.append(np.concatenate(v_chunks) * scale ** 2)
        return np.stack(means, axis=1), np.stack(vars_, axis=1)

    @property
    def noise_variance(self) -> np.ndarray:
        """(P,) learned observation-noise variance in the squared units of y."""
        self._check_fitted()
        return np.array([float(lik.noise.detach()) * self._scaler.std[p] ** 2
                         for p, lik in enumerate(self._likelihoods)])

    def log_predictive_density(self, x: Any, y: Any) -> np.ndarray:
        """(G, P) log p(y* | data) under the Gaussian likelihood (latent variance plus noise)."""
        xa, ya = _check_pair(x, y, self.input_dims, len(self._models) or None)
        mean, var = self.predict(xa)
        return gaussian_log_density(ya, mean, var + self.noise_variance[None, :])

    def evaluate(self, x: Any, y: Any) -> BaselineScores:
        """RMSE and NLPD on a test set."""
        xa, ya = _check_pair(x, y, self.input_dims, len(self._models) or None)
        mean, var = self.predict(xa)
        ld = gaussian_log_density(ya, mean, var + self.noise_variance[None, :])
        return BaselineScores(rmse=rmse(mean, ya), nlpd=nlpd(ld))

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Per output: kernel hyperparameters (standardised units) and the noise variance (units of y^2)."""
        self._check_fitted()
        out = []
        for p, model in enumerate(self._models):
            h = _kernel_hyperparameters(model.covar_module)
            h["noise_variance"] = float(self.noise_variance[p])
            out.append(h)
        return out


def _make_svgp_class():
    gpytorch = _gpytorch()

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


class OfflineSVGP(_GPBaseline):
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
        self.initial_inducing = None if inducing is None else _as_2d("inducing", inducing)
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
        gpytorch = _gpytorch()
        xa, ya = _check_pair(x, y)
        if self.initial_inducing is not None and self.initial_inducing.shape[1] != xa.shape[1]:
            raise BaselineError(f"inducing has {self.initial_inducing.shape[1]} columns but x has {xa.shape[1]}")
        if self.initial_inducing is None and xa.shape[0] < self.num_inducing:
            raise BaselineError(f"{xa.shape[0]} training points are fewer than num_inducing={self.num_inducing}")
        self.input_dims = xa.shape[1]
        self._scaler = _Standardiser.fit(ya)
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
        gpytorch = _gpytorch()
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
    gpytorch = _gpytorch()

    class _ExactModel(gpytorch.models.ExactGP):
        def __init__(self, x, y, likelihood, covar):
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = covar

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    return _ExactModel


class ExactGPBaseline(_GPBaseline):
    """Exact GP regression (Cholesky), hyperparameters by maximising the marginal likelihood with Adam.

    With more than ``max_points`` training points, a seeded uniform subsample of ``max_points`` is used
    (``subsampled`` and ``n_used`` record it): the exact GP is then exact on that subsample only.
    ``iterations=0`` keeps the :class:`KernelSpec` hyperparameters (for closed-form comparisons).
    """

    def __init__(self, spec: KernelSpec | None = None, *, max_points: int = 3000, iterations: int = 100,
                 lr: float = 0.05, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float64):
        super().__init__(spec, seed, device, dtype)
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
            raise BaselineError(f"max_points must be a positive integer, got {max_points!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
            raise BaselineError(f"iterations must be a non-negative integer, got {iterations!r}")
        self.max_points, self.iterations, self.lr = max_points, iterations, float(lr)
        self.subsampled = False
        self.n_used = 0

    def fit(self, x: Any, y: Any) -> "ExactGPBaseline":
        gpytorch = _gpytorch()
        xa, ya = _check_pair(x, y)
        self.input_dims = xa.shape[1]
        self.subsampled = xa.shape[0] > self.max_points
        if self.subsampled:
            keep = np.random.default_rng(self.seed).choice(xa.shape[0], self.max_points, replace=False)
            xa, ya = xa[np.sort(keep)], ya[np.sort(keep)]
        self.n_used = xa.shape[0]
        self._scaler = _Standardiser.fit(ya)
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
                model = exact_class(xt, yt, likelihood, self.spec.build(self.input_dims)).to(self.device, self.dtype)
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
        self.train_seconds = time.perf_counter() - start
        return self

    @staticmethod
    def _exact_settings():
        """Cholesky everywhere (GPyTorch would otherwise switch to CG/Lanczos for N > 800)."""
        gpytorch = _gpytorch()
        from contextlib import ExitStack

        stack = ExitStack()
        stack.enter_context(gpytorch.settings.max_cholesky_size(10 ** 7))
        stack.enter_context(gpytorch.settings.fast_computations(False, False, False))
        stack.enter_context(gpytorch.settings.fast_pred_var(False))
        return stack

    def _latent(self, model, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), self._exact_settings():
            f = model(xt)
            return f.mean, f.variance.clamp_min(0.0)


# ------------------------------------------------------------------------- streaming sparse GP (Bui et al.)

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

        self.kernel = build_kernel(spec, input_dims)  # the engine's own kernel code (same parameterisation)
        self.noise = PositiveParameter(spec.noise_variance)
        self.jitter = float(jitter)
        self.Z: torch.Tensor | None = None          # (M, D) inducing inputs of the current posterior
        self.L: torch.Tensor | None = None          # chol(K_ZZ + eps I) under the hyperparameters it was fitted with
        self.c_w: torch.Tensor | None = None        # (M,)
        self.psi_w: torch.Tensor | None = None      # (M, M)
        self.R: torch.Tensor | None = None          # chol(I + psi_w)
        self.to(device=device, dtype=dtype)

    def _chol(self, z: torch.Tensor) -> torch.Tensor:
        from gp_mapping.gp.kernels import jittered_cholesky

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


class StreamingSparseGP(_GPBaseline):
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
        self.fixed_inducing = None if inducing is None else _as_2d("inducing", inducing)
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
        xa, ya = _check_pair(x, y, self.input_dims, len(self._models) or None)
        start = time.perf_counter()
        if not self._models:
            self.input_dims = xa.shape[1]
            self._scaler = _Standardiser.fit(ya)
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


# ------------------------------------------------------------------------------------- reduced-rank GP

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
        xa, ya = _check_pair(x, y, self.input_dims, 1)
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
        xa = _as_2d("x", x, self.input_dims)
        L, mean = self._posterior
        means, variances = [], []
        for start in range(0, xa.shape[0], batch_size):
            phi = self.features(torch.as_tensor(xa[start:start + batch_size]))
            v = torch.linalg.solve_triangular(L, phi.T, upper=False)
            means.append((phi @ mean).numpy())
            variances.append((v * v).sum(0).numpy())
        m = np.concatenate(means)[:, None] * self._scale + self._offset
        return m, np.concatenate(variances)[:, None] * self._scale ** 2

    def log_predictive_density(self, x: Any, y: Any) -> np.ndarray:
        mean, var = self.predict(x)
        noise = float(torch.exp(self.raw["noise"])) * self._scale ** 2
        return gaussian_log_density(_as_2d("y", y), mean, var + noise)
