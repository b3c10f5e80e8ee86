"""The sources of a merge: local maps as Gaussian pseudo-likelihoods on their inducing values, and the frames they
are moved by (:mod:`.recyclable` merges them).

Frames: a source may carry a rigid transform into the merged frame (:class:`RigidTransform`): Z_k is moved; for
a vector target (3 outputs) the field components are rotated too, channel by channel (q(R f) per channel keeps
sum_j R_dj^2 of the channel variances: cross-channel correlations are dropped). A rigid move transports a
stationary kernel exactly when it is isotropic (equal ARD lengthscales in the rotated plane).

"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import GPNumericalError
from ..kernels import Kernel
from ..linalg import jittered_cholesky, symmetrise

# Whitened posterior variances of a moments-form source are clamped into [MIN_EIG, 1] before inversion:
# a posterior can never be wider than its prior, rounding aside.
MIN_EIG = 1e-12


class MergeError(ValueError):
    """Sources that cannot be merged: wrong shapes, non-finite values, mismatched dimensions."""



@dataclass
class RigidTransform:
    """x_merged = R x_source + t. ``rotation`` (3, 3) acts on the field vector; its leading (D, D) block (D = 2:
    the yaw part, D = 3: all of it) on the inputs."""

    rotation: torch.Tensor
    translation: torch.Tensor

    @classmethod
    def planar(cls, x: float = 0.0, y: float = 0.0, yaw: float = 0.0, z: float = 0.0) -> "RigidTransform":
        """A move by (x, y, z) and a rotation by ``yaw`` radians about the vertical axis."""
        c, s = math.cos(yaw), math.sin(yaw)
        rot = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
        return cls(rot, torch.tensor([x, y, z], dtype=torch.float64))

    def __post_init__(self) -> None:
        self.rotation = torch.as_tensor(self.rotation, dtype=torch.float64)
        self.translation = torch.as_tensor(self.translation, dtype=torch.float64).reshape(-1)
        r = self.rotation
        if r.shape != (3, 3) or not bool(torch.isfinite(r).all()) or not bool(torch.isfinite(self.translation).all()):
            raise MergeError(f"a frame transform needs a finite 3x3 rotation, got shape {tuple(r.shape)}")
        if float((r @ r.T - torch.eye(3, dtype=torch.float64)).abs().max()) > 1e-6 or float(torch.det(r)) < 0:
            raise MergeError("a frame transform's rotation must be a proper rotation matrix (R R^T = I, det 1)")
        if self.translation.shape[0] not in (2, 3):
            raise MergeError(f"a frame transform's translation needs 2 or 3 numbers, got {self.translation.shape[0]}")

    def apply_inputs(self, z: torch.Tensor) -> torch.Tensor:
        d = z.shape[1]
        if d not in (2, 3):
            raise MergeError(f"frame transforms move 2-D or 3-D inputs, got {d}-D inducing inputs")
        if d == 2 and float(self.rotation[:2, 2].abs().max() + self.rotation[2, :2].abs().max()) > 1e-9:
            raise MergeError("a 2-D map can only be rotated about the vertical axis (yaw)")
        t = torch.zeros(d, dtype=torch.float64)
        t[:min(d, self.translation.shape[0])] = self.translation[:d]
        return z @ self.rotation[:d, :d].T + t


@dataclass
class Source:
    """One local model as a Gaussian pseudo-likelihood on u = f(z), original target units, P outputs.

    ``prior_chol`` (P, M, M) = chol(prior covariance of f(z)); ``site_a`` (P, M), ``site_W`` (P, M, M) in
    v = prior_chol^-1 (f(z) - prior_mean); ``prior_mean`` and ``scale`` (P,) (scale: the source's target scale,
    used to pick the global one); ``noise`` (P,) in original units (NaN if none); ``kernel`` (optional) the
    local kernel in the source's standardised units; ``num_data`` the data it summarises; ``name`` for messages.
    """

    z: torch.Tensor
    prior_mean: torch.Tensor
    prior_chol: torch.Tensor
    site_a: torch.Tensor
    site_W: torch.Tensor
    scale: torch.Tensor
    noise: torch.Tensor
    num_data: int = 0
    kernel: Kernel | None = None
    name: str = "source"

    @property
    def num_inducing(self) -> int:
        return int(self.z.shape[0])

    @property
    def output_dims(self) -> int:
        return int(self.prior_mean.shape[0])

    @classmethod
    def from_summary(cls, summary: dict, name: str = "source", transform: RigidTransform | None = None
                     ) -> "Source":
        """From an engine's ``recyclable_summary()`` (sites or moments form), moved by ``transform``."""
        f64 = dict(dtype=torch.float64, device="cpu")
        try:
            z = torch.as_tensor(summary["z"], **f64)
            mean0 = torch.as_tensor(summary["target_mean"], **f64).reshape(-1)
            scale = torch.as_tensor(summary["target_scale"], **f64).reshape(-1)
            prior_cov = torch.as_tensor(summary["prior_cov"], **f64)
            noise = torch.as_tensor(summary.get("noise", torch.full_like(mean0, float("nan"))), **f64).reshape(-1)
        except KeyError as err:
            raise MergeError(f"{name}: model summary lacks {err}") from None
        p = mean0.shape[0]
        if z.dim() != 2 or prior_cov.shape != (p, z.shape[0], z.shape[0]) or scale.shape != (p,):
            raise MergeError(f"{name}: inconsistent summary shapes z {tuple(z.shape)}, prior_cov "
                             f"{tuple(prior_cov.shape)}, target_mean {tuple(mean0.shape)}")
        for key, t in (("z", z), ("target_mean", mean0), ("target_scale", scale), ("prior_cov", prior_cov)):
            if not bool(torch.isfinite(t).all()):
                raise MergeError(f"{name}: summary '{key}' holds NaN or Inf")
        if not bool((scale > 0).all()):
            raise MergeError(f"{name}: target_scale must be positive")
        try:
            chol, _ = jittered_cholesky(symmetrise(prior_cov), 0.0)
        except GPNumericalError as err:
            raise MergeError(f"{name}: prior covariance is not positive definite: {err}") from None
        if "site_a" in summary:
            a = torch.as_tensor(summary["site_a"], **f64).reshape(p, z.shape[0])
            W = symmetrise(torch.as_tensor(summary["site_W"], **f64).reshape(p, z.shape[0], z.shape[0]))
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(W).all())):
                raise MergeError(f"{name}: summary sites hold NaN or Inf")
        else:
            try:
                mean = torch.as_tensor(summary["mean"], **f64).reshape(p, z.shape[0])
                cov = torch.as_tensor(summary["cov"], **f64).reshape(p, z.shape[0], z.shape[0])
            except KeyError as err:
                raise MergeError(f"{name}: model summary has neither sites nor moments ({err} missing)") from None
            if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(cov).all())):
                raise MergeError(f"{name}: summary moments hold NaN or Inf")
            a, W = sites_from_moments(mean, cov, mean0, chol)
        src = cls(z=z, prior_mean=mean0, prior_chol=chol, site_a=a, site_W=W, scale=scale, noise=noise,
                  num_data=int(summary.get("num_seen", 0)), kernel=summary.get("kernel"), name=name)
        return src.transformed(transform) if transform is not None else src

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q(f(z)) as (mean (P, M), cov (P, M, M)) in original units."""
        eye = torch.eye(self.num_inducing, dtype=torch.float64)
        R, _ = jittered_cholesky(eye + self.site_W, 0.0)
        Rinv = torch.linalg.solve_triangular(R, eye.expand_as(R), upper=False)
        cov_w = Rinv.transpose(-1, -2) @ Rinv
        mean_w = (cov_w @ self.site_a[..., None])[..., 0]
        L = self.prior_chol
        return (self.prior_mean[:, None] + (L @ mean_w[..., None])[..., 0],
                symmetrise(L @ cov_w @ L.transpose(-1, -2)))

    def transformed(self, transform: RigidTransform) -> "Source":
        """This source seen in another frame: Z moved; a 3-output (vector) source's channels rotated."""
        out = copy.copy(self)
        out.z = transform.apply_inputs(self.z)
        rot = transform.rotation
        if self.output_dims == 3 and not torch.allclose(rot, torch.eye(3, dtype=torch.float64)):
            mean, cov = self.moments()
            prior_cov = self.prior_chol @ self.prior_chol.transpose(-1, -2)
            r2 = rot ** 2
            new_mean = rot @ mean
            new_cov = torch.einsum("dj,jmn->dmn", r2, cov)
            new_prior = torch.einsum("dj,jmn->dmn", r2, prior_cov)
            new_mean0 = rot @ self.prior_mean
            out.prior_chol, _ = jittered_cholesky(symmetrise(new_prior), 0.0)
            out.prior_mean = new_mean0
            out.scale = torch.sqrt(r2 @ self.scale ** 2)
            out.noise = r2 @ self.noise
            out.site_a, out.site_W = sites_from_moments(new_mean, new_cov, new_mean0, out.prior_chol)
        return out


def sites_from_moments(mean: torch.Tensor, cov: torch.Tensor, prior_mean: torch.Tensor, prior_chol: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitened pseudo-likelihood (a, W) of q = N(mean, cov) against p = N(prior_mean, L L^T), (P, M[, M]):
    with S_w = L^-1 cov L^-T = U diag(s) U^T, W = U diag(1/s - 1) U^T and a = S_w^-1 L^-1 (mean - prior_mean).
    s is clamped into [MIN_EIG, 1] (a posterior is never wider than its prior)."""
    L = prior_chol
    Linv_cov = torch.linalg.solve_triangular(L, cov, upper=False)
    S_w = symmetrise(torch.linalg.solve_triangular(L, Linv_cov.transpose(-1, -2), upper=False))
    s, U = torch.linalg.eigh(S_w)
    s = s.clamp(MIN_EIG, 1.0)
    m_w = torch.linalg.solve_triangular(L, (mean - prior_mean[:, None])[..., None], upper=False)
    W = symmetrise(U @ torch.diag_embed(1.0 / s - 1.0) @ U.transpose(-1, -2))
    a = (U @ torch.diag_embed(1.0 / s) @ U.transpose(-1, -2) @ m_w)[..., 0]
    return a, W


def source_from_engine(model, name: str = "source", transform: RigidTransform | None = None) -> Source:
    """A Source from any engine with ``recyclable_summary()`` (dual_svgp, continual_mogp)."""
    summary = getattr(model, "recyclable_summary", None)
    if summary is None:
        raise MergeError(f"{name}: engine {type(model).__name__} cannot be summarised for a merge "
                         "(it has no recyclable_summary())")
    return Source.from_summary(summary(), name=name, transform=transform)


def dual_sum(sources: Sequence[Source]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of sources that share Z and the prior: (sum_k a_k, sum_k W_k)."""
    first = sources[0]
    for s in sources[1:]:
        if not (torch.equal(s.z, first.z) and torch.allclose(s.prior_chol, first.prior_chol)
                and torch.allclose(s.prior_mean, first.prior_mean)):
            raise MergeError(f"{s.name} and {first.name} do not share Z and the prior; use merge()")
    return sum(s.site_a for s in sources), sum(s.site_W for s in sources)


__all__ = ["MIN_EIG", "MergeError", "RigidTransform", "Source", "dual_sum", "sites_from_moments", "source_from_engine"]
