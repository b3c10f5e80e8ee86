"""What the baselines share with their callers: input checks (:class:`BaselineError`) and the scores (RMSE, the
Gaussian log density, NLPD)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


class BaselineError(ValueError):
    """Bad input to a baseline (shapes, non-finite values, too few points) or a baseline used before fit."""


def as_2d(name: str, a: Any, dims: int | None = None) -> np.ndarray:
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


def check_pair(x: Any, y: Any, x_dims: int | None = None, y_dims: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    xa, ya = as_2d("x", x, x_dims), as_2d("y", y, y_dims)
    if xa.shape[0] != ya.shape[0]:
        raise BaselineError(f"x has {xa.shape[0]} rows but y has {ya.shape[0]}")
    return xa, ya


def rmse(prediction: Any, truth: Any) -> float:
    """Root mean squared error over all points and outputs."""
    p, t = as_2d("prediction", prediction), as_2d("truth", truth)
    if p.shape != t.shape:
        raise BaselineError(f"prediction shape {p.shape} differs from truth shape {t.shape}")
    return float(np.sqrt(np.mean((p - t) ** 2)))


def gaussian_log_density(y: Any, mean: Any, var: Any) -> np.ndarray:
    """(N, P) log N(y | mean, var) elementwise; var is the predictive variance of y (noise included)."""
    y, mean, var = as_2d("y", y), as_2d("mean", mean), as_2d("var", var)
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
