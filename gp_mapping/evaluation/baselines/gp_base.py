"""What the GP baselines share: the kernel they use (:class:`KernelSpec`, GPyTorch's, or the engine's for the
streaming GP), their standardisation, and their interface (``GPBaseline``: predict, log predictive density,
scores, hyperparameters). GPyTorch is imported only when a GP baseline is built (:func:`import_gpytorch`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gp_mapping.gp.config import LENGTHSCALE_CHOICES
from gp_mapping.gp.kernels import lengthscale_groups

from .metrics import BaselineError, as_2d, check_pair, gaussian_log_density, nlpd, rmse

KERNELS = {"matern12": 0.5, "matern32": 1.5, "matern52": 2.5, "rbf": None}


def import_gpytorch():
    try:
        import gpytorch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the GP baselines need GPyTorch: pip install 'gpytorch>=1.11' "
                          "(it is a test/benchmark dependency of gp_mapping, `pip install gp_mapping[test]`)") from err
    return gpytorch


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

    def build(self, input_dims: int, active_dims: tuple[int, ...] | None = None):
        """A GPyTorch covariance module: scale * stationary (+ constant), on the input columns ``active_dims``
        (``input_dims`` of them; None: all)."""
        gpytorch = import_gpytorch()
        on = {} if active_dims is None else {"active_dims": tuple(active_dims)}
        groups = lengthscale_groups(self.lengthscales, input_dims)
        learned = max(groups) + 1
        nu = KERNELS[self.kernel]
        cls = gpytorch.kernels.RBFKernel if nu is None else gpytorch.kernels.MaternKernel
        if learned not in (1, input_dims):
            cls = _shared_lengthscale_kernel(cls, groups)
        base = cls(ard_num_dims=learned if learned > 1 else None, **on, **({} if nu is None else {"nu": nu}))
        base.lengthscale = torch.full_like(base.raw_lengthscale, self.lengthscale)
        covar = gpytorch.kernels.ScaleKernel(base)
        covar.outputscale = torch.tensor(self.signal_variance)
        if self.constant_kernel:
            const = gpytorch.kernels.ConstantKernel(**on)
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


def kernel_hyperparameters(covar) -> dict[str, Any]:
    """Readable hyperparameters of a module built by :meth:`KernelSpec.build` (standardised units)."""
    gpytorch = import_gpytorch()
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
class Standardiser:
    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, y: np.ndarray) -> "Standardiser":
        std = y.std(axis=0)
        return cls(mean=y.mean(axis=0), std=np.where(std > 0, std, 1.0))


@dataclass
class BaselineScores:
    """Test-set scores of a baseline: RMSE of the mean and NLPD (noise included), in the units of y."""

    rmse: float
    nlpd: float
    extra: dict = field(default_factory=dict)


class GPBaseline:
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
        self._scaler: Standardiser | None = None
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
        xa = as_2d("x", x, self.input_dims)
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

    @property
    def reading_noise_variance(self) -> np.ndarray:
        """(P,) what a new reading adds to the latent variance, in the squared units of y: the learned noise."""
        return self.noise_variance

    def predict_reading(self, x: Any, batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance (G, P) of a reading at x, in the units of y: the latent variance plus
        :attr:`reading_noise_variance` (what the engines' ``predict_reading`` states, uncalibrated)."""
        mean, var = self.predict(x, batch_size)
        return mean, var + self.reading_noise_variance[None, :]

    def log_predictive_density(self, x: Any, y: Any) -> np.ndarray:
        """(G, P) log p(y* | data) of readings under :meth:`predict_reading`."""
        xa, ya = check_pair(x, y, self.input_dims, len(self._models) or None)
        return gaussian_log_density(ya, *self.predict_reading(xa))

    def evaluate(self, x: Any, y: Any) -> BaselineScores:
        """RMSE and NLPD on a test set."""
        xa, ya = check_pair(x, y, self.input_dims, len(self._models) or None)
        mean, var = self.predict_reading(xa)
        return BaselineScores(rmse=rmse(mean, ya), nlpd=nlpd(gaussian_log_density(ya, mean, var)))

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Per output: kernel hyperparameters (standardised units) and the noise variance (units of y^2)."""
        self._check_fitted()
        out = []
        for p, model in enumerate(self._models):
            h = kernel_hyperparameters(model.covar_module)
            h["noise_variance"] = float(self.noise_variance[p])
            out.append(h)
        return out
