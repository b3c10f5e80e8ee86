"""Recyclable GPs (Moreno-Munoz, Artes-Rodriguez, Alvarez, "Recyclable Gaussian Processes", 2020): merge maps
without their data.

Each source (a robot's or a session's map) is summarised by its inducing inputs Z_k, its variational posterior
q_k(u_k) and its prior p_k(u_k), u_k = f(Z_k), in the original target units (``recyclable_summary()`` of an
engine). The global model is q(u*) = N(mu*, S*) on its own inducing inputs Z* with its own kernel psi*. The
ensemble bound (eqs. 6 / 14) is

    L_E = sum_k E_{q_C(u_k)}[log q_k(u_k) - log p_k(u_k)] - KL[q(u*) || p(u*)]

with the contrastive predictive (eq. 17, "+" sign: appendix A.2 prints "-", a typo; the authors' code has "+")

    q_C(u_k) = N(K_k* K_**^-1 mu*,  K_kk + K_k* K_**^-1 (S* - K_**) K_**^-1 K_*k),

i.e. q_C(u_k) = int p(u_k | u*) q(u*) du* under the GLOBAL kernel, while q_k and p_k keep the local kernel.
The expectations are closed form (App. B, eq. 18).

Structure used here (the sources: :mod:`.sources`). For Gaussian q_k and p_k, log q_k - log p_k is a quadratic in u_k: a Gaussian
pseudo-likelihood t_k(u_k), stored whitened by the local prior, v_k = chol(prior_cov_k)^-1 (u_k - m_k):
t_k(v_k) = exp(a_k^T v_k - v_k^T W_k v_k / 2) + const (for a dual SVGP (a_k, W_k) are exactly its whitened dual
parameters). So L_E is an ELBO whose "likelihood" is t_k seen through p(u_k | u*): for fixed (Z*, psi*) the
optimal q(u*) is closed form, and in the global whitened coordinates v* = chol(K_**)^-1 (u* - m*) / s* it is
q(v*) = N((I + W*)^-1 a*, (I + W*)^-1) with

    u_k = m* + s* f*(Z_k),  f*(Z_k) | v* ~ N(C_k v*, D_k),  C_k = K*(Z_k, Z*) L*^-T,  D_k = K*(Z_k, Z_k) - C_k C_k^T
    G_k = s* L_k^-1 C_k,  delta_k = L_k^-1 (m* - m_k) 1,  E_k = s*^2 L_k^-1 D_k L_k^-T
    a*  = sum_k G_k^T (a_k - W_k delta_k),      W* = sum_k G_k^T W_k G_k

(the same whitened dual form as gp/dual_svgp/, so the merged map IS a DualSVGP state: loadable, predictable
and updatable like any map). Plugging the optimum in collapses the bound to

    L_E(Z*, psi*) = sum_k c_k - 1/2 log|I + W*| + 1/2 a*^T (I + W*)^-1 a*,
    c_k = a_k^T delta_k - 1/2 delta_k^T W_k delta_k - 1/2 tr(W_k E_k) + 1/2 log|I + W_k| - 1/2 a_k^T (I + W_k)^-1 a_k

(the last two terms are the normalisers of q_k / p_k, so L_E = 0 when the global model equals a single source).
Only Z* and psi* take gradient steps (Adam on L_E), instead of the paper's VEM with tiny learning rates. The
trace term tr(W_k E_k) charges Z* for every local inducing value it cannot represent.

Raw data (App. C, eq. 19): new samples (x_i, y_i) with a Gaussian likelihood add the exact sites
a* += V y / sigma^2, W* += V V^T / sigma^2 (V = L*^-1 K*(Z*, X), standardised targets) and the constant
sum_i [log N(y_i | 0, sigma^2) - (k_ii - |V_i|^2) / (2 sigma^2)].

Where every source shares Z, the prior (kernel, offset, scale) and the global model takes them too, G_k = I and
delta_k = 0: the merge is exactly a* = sum_k a_k, W* = sum_k W_k (:func:`.sources.dual_sum`).

Limits (as in the paper): f is assumed stationary across sources, and the sources must come from disjoint data
(two sources holding the same data count it twice; the map layer guards this with source ids and lineage).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from ..errors import GPNumericalError
from ..inducing import DEFAULT_REL_TOL, pivoted_cholesky
from ..kernels import Kernel, build_kernel, constant_part, stationary_parts
from ..linalg import jittered_cholesky, symmetrise
from .sources import MergeError, Source

if TYPE_CHECKING:
    from .levels import Levels

LOG_2PI = math.log(2.0 * math.pi)


@dataclass
class RawData:
    """New samples for the eq. 19 term: x (N, D), y (N, P) in original units, Gaussian noise variance (P,)."""

    x: torch.Tensor
    y: torch.Tensor


@dataclass
class MergeResult:
    """The global posterior: Z*, whitened sites (P, M) and (P, M, M) relative to chol(kernel(Z*, Z*) + jitter),
    the targets' offset and scale (P,), the kernel (standardised units), noise (P,) standardised, the bound."""

    z: torch.Tensor
    site_a: torch.Tensor
    site_W: torch.Tensor
    target_mean: torch.Tensor
    target_scale: torch.Tensor
    kernel: Kernel
    jitter: float
    noise: torch.Tensor
    num_data: int
    bound: float
    steps: int
    seconds: float
    history: list = field(default_factory=list)
    #: what a merge of one engine shares with TiledMergeResult: no tiles made, none taken from a cache
    tiles: int = 0
    reused: int = 0
    #: the sources' offsets removed before the merge (gp/merging/levels.py; set by mapping/merge.py merge_maps)
    levels: "Levels | None" = None

    @property
    def num_inducing(self) -> int:
        return int(self.z.shape[0])

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent mean and variance (N, P) in original units (for checks; the merged engine predicts the same)."""
        x = torch.as_tensor(x, dtype=torch.float64)
        with torch.no_grad():
            L, _ = jittered_cholesky(self.kernel(self.z, self.z), self.jitter)
            V = torch.linalg.solve_triangular(L, self.kernel(self.z, x), upper=False)
            eye = torch.eye(self.z.shape[0], dtype=torch.float64)
            R, _ = jittered_cholesky(eye + self.site_W, 0.0)
            U = torch.linalg.solve_triangular(R, V.expand(R.shape[0], *V.shape), upper=False)
            c = torch.linalg.solve_triangular(R, self.site_a[..., None], upper=False)[..., 0]
            mean = torch.einsum("pmn,pm->np", U, c)
            var = self.kernel.diag(x)[:, None] - (V * V).sum(0)[:, None] + (U * U).sum(1).T
            return mean * self.target_scale + self.target_mean, var.clamp_min(0.0) * self.target_scale ** 2


class RecyclableMerge(nn.Module):
    """The ensemble bound over a fixed set of sources, as a function of the global Z* and kernel psi*."""

    def __init__(self, sources: Sequence[Source], kernel: Kernel, z: torch.Tensor, target_mean: torch.Tensor,
                 target_scale: torch.Tensor, jitter: float = 1e-6, raw: RawData | None = None,
                 noise: torch.Tensor | None = None) -> None:
        super().__init__()
        if not sources and raw is None:
            raise MergeError("nothing to merge: no sources and no data")
        self.sources = list(sources)
        self.kernel = kernel
        self.z = nn.Parameter(torch.as_tensor(z, dtype=torch.float64).clone())
        self.register_buffer("target_mean", torch.as_tensor(target_mean, dtype=torch.float64).reshape(-1))
        self.register_buffer("target_scale", torch.as_tensor(target_scale, dtype=torch.float64).reshape(-1))
        self.jitter = float(jitter)
        self.raw = raw
        p = self.target_mean.shape[0]
        self.noise_param = None
        if noise is not None:
            from ..kernels import PositiveParameter
            self.noise_param = PositiveParameter(torch.as_tensor(noise, dtype=torch.float64).reshape(p), (p,))
        # Per source, fixed: L_k^-1 as a solve, the normaliser of q_k / p_k.
        self._consts = []
        with torch.no_grad():
            for s in self.sources:
                eye = torch.eye(s.num_inducing, dtype=torch.float64)
                R, _ = jittered_cholesky(eye + s.site_W, 0.0)
                c = torch.linalg.solve_triangular(R, s.site_a[..., None], upper=False)[..., 0]
                logdet = 2.0 * torch.log(torch.diagonal(R, dim1=-2, dim2=-1)).sum(-1)
                self._consts.append(0.5 * logdet - 0.5 * (c * c).sum(-1))  # (P,)

    def sites(self, z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """(a* (P, M), W* (P, M, M), constant (P,), jitter) at the current (or given) Z* and kernel."""
        z = self.z if z is None else z
        L, used = jittered_cholesky(self.kernel(z, z), self.jitter)
        m = z.shape[0]
        p = self.target_mean.shape[0]
        a_star = torch.zeros(p, m, dtype=torch.float64)
        W_star = torch.zeros(p, m, m, dtype=torch.float64)
        const = torch.zeros(p, dtype=torch.float64)
        s_star, m_star = self.target_scale, self.target_mean
        for src, c0 in zip(self.sources, self._consts):
            # Identical points carry the jitter of K_** (as in the engines), so a Z* that contains Z_k
            # reproduces u_k exactly (D = 0) and a global model equal to one source has L_E = 0.
            same = (z[:, None, :] == src.z[None, :, :]).all(-1).to(z.dtype)
            C = torch.linalg.solve_triangular(L, self.kernel(z, src.z) + used * same, upper=False).T  # (Mk, M)
            eye_k = torch.eye(src.num_inducing, dtype=torch.float64)
            D = self.kernel(src.z, src.z) + used * eye_k - C @ C.T
            Lk = src.prior_chol                                                              # (P, Mk, Mk)
            G = s_star[:, None, None] * torch.linalg.solve_triangular(Lk, C.expand(p, *C.shape), upper=False)
            delta = torch.linalg.solve_triangular(
                Lk, (m_star - src.prior_mean)[:, None, None].expand(p, src.num_inducing, 1), upper=False)[..., 0]
            Wd = (src.site_W @ delta[..., None])[..., 0]
            r = src.site_a - Wd
            a_star = a_star + (G.transpose(-1, -2) @ r[..., None])[..., 0]
            W_star = W_star + G.transpose(-1, -2) @ src.site_W @ G
            # tr(W_k E_k) = s*^2 tr(L_k^-T W_k L_k^-1 D)
            LinvD = torch.linalg.solve_triangular(Lk, D.expand(p, *D.shape), upper=False)
            E = torch.linalg.solve_triangular(Lk, LinvD.transpose(-1, -2), upper=False)
            tr = (src.site_W * E).sum((-1, -2)) * s_star ** 2
            const = const + (src.site_a * delta).sum(-1) - 0.5 * (delta * Wd).sum(-1) - 0.5 * tr + c0
        if self.raw is not None:
            if self.noise_param is None:
                raise MergeError("the raw-data term needs a noise variance")
            noise = self.noise_param.value
            x = self.raw.x
            ys = (self.raw.y - m_star) / s_star                                               # (N, P)
            V = torch.linalg.solve_triangular(L, self.kernel(z, x), upper=False)              # (M, N)
            a_star = a_star + (V @ ys / noise).T
            W_star = W_star + (V @ V.T)[None] / noise[:, None, None]
            resid = self.kernel.diag(x) - (V * V).sum(0)
            n = x.shape[0]
            const = const + (-0.5 * n * (LOG_2PI + torch.log(noise)) - 0.5 * (ys * ys).sum(0) / noise
                             - 0.5 * resid.sum() / noise - n * torch.log(s_star))
        return a_star, symmetrise(W_star), const, used

    def bound(self) -> torch.Tensor:
        """The collapsed ensemble bound L_E at the optimal q(u*) (summed over outputs)."""
        a, W, const, _ = self.sites()
        eye = torch.eye(W.shape[-1], dtype=torch.float64)
        R, _ = jittered_cholesky(eye + W, 0.0)
        c = torch.linalg.solve_triangular(R, a[..., None], upper=False)[..., 0]
        return (const - torch.log(torch.diagonal(R, dim1=-2, dim2=-1)).sum(-1) + 0.5 * (c * c).sum(-1)).sum()


def _weighted(values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum() if float(w.sum()) > 0 else torch.full_like(w, 1.0 / len(weights))
    return sum(wi * v for wi, v in zip(w, values))


def initial_kernel(model_config, sources: Sequence[Source], input_dims: int, target_scale: torch.Tensor) -> Kernel:
    """The global kernel the config names, started from the sources' kernels where they have one: geometric
    mean of the lengthscales and mean variances in the global units (weighted by the data they hold), each
    stationary part from the sources' part of the same rank (model.kernel_scales: a sum of several scales)."""
    kernel = build_kernel(model_config, input_dims)
    mains, const = stationary_parts(kernel), constant_part(kernel)
    with_k = [s for s in sources if s.kernel is not None and stationary_parts(s.kernel)]
    if not with_k or not mains:
        return kernel
    weights = [max(s.num_data, 1) for s in with_k]
    ratio = [float(((s.scale / target_scale) ** 2).mean()) for s in with_k]
    source_parts = [stationary_parts(s.kernel) for s in with_k]
    for rank, main in enumerate(mains):
        parts = [sp[min(rank, len(sp) - 1)] for sp in source_parts]  # fewer scales: the last (longest) one lends
        # Per input axis, then averaged over the axes that share a lengthscale in the global kernel (the sources
        # may have been built with other lengthscale groups).
        per_axis = _weighted([torch.log(p.lengthscale.detach().cpu()).expand(input_dims) for p in parts], weights)
        groups = torch.tensor(main.groups)
        main.lengthscale_param.set(torch.exp(torch.stack([per_axis[groups == g].mean()
                                                          for g in range(main.num_lengthscales)])))
        main.variance_param.set(_weighted([p.variance.detach().cpu() * r for p, r in zip(parts, ratio)], weights))
    if const is not None:
        consts = [(constant_part(s.kernel).variance.detach().cpu() * r) for s, r in zip(with_k, ratio)
                  if constant_part(s.kernel) is not None]
        if consts:
            const.variance_param.set(_weighted(consts, weights[:len(consts)]))
    return kernel


def _candidate_inputs(sources: Sequence[Source], raw: RawData | None) -> torch.Tensor:
    """The sources' (moved) inducing inputs and the raw inputs, if any, stacked: what Z* is chosen from."""
    cand = [s.z for s in sources] + ([raw.x] if raw is not None else [])
    return torch.cat(cand) if cand else torch.zeros(0, 1, dtype=torch.float64)


def initial_inducing(kernel: Kernel, sources: Sequence[Source], num_inducing: int, jitter: float,
                     raw: RawData | None = None) -> torch.Tensor:
    """Z* by pivoted Cholesky over the union of the sources' (moved) inducing inputs, and raw inputs if any, up
    to ``num_inducing``, with the engines' own threshold (inducing.DEFAULT_REL_TOL): a point that the points
    already picked explain is not added, as an engine would not add it. Where the sources cover the same ground
    their points are largely redundant, and keeping them all (threshold 1e-10, as before) fitted the sources'
    summaries better and predicted worse: Solin sequences 1-2 and 3-4 merged in closed form, tested on 5, 2.705
    uT with all 512 points, 2.138 with the 465 this keeps (one map of all four: 2.092); two robots on disjoint
    halves keep all their points (0.219 either way). A lone source within ``num_inducing`` keeps its own points:
    merging one map only moves it (and is then exact)."""
    if len(sources) == 1 and raw is None and sources[0].num_inducing <= int(num_inducing):
        return sources[0].z.clone()
    cand = torch.unique(_candidate_inputs(sources, raw), dim=0)
    with torch.no_grad():
        idx, _ = pivoted_cholesky(kernel, kernel.diag(cand), cand, int(num_inducing), rel_tol=DEFAULT_REL_TOL)
    return cand[idx].clone()


#: Adam steps of an automatic merge (``steps=None``) whose Z* must compress the sources' inducing points.
COMPRESSING_STEPS = 100


def explains_sources(kernel: Kernel, sources: Sequence[Source], z: torch.Tensor, jitter: float,
                     raw: RawData | None = None) -> bool:
    """Whether Z* explains every source's inducing input (and raw input) to the engines' threshold: given f(Z*),
    none keeps more than inducing.DEFAULT_REL_TOL of the largest prior variance. Then the closed form is the merge
    of the sources' summaries as they are, nothing compressed, and steps on Z* and the kernel have nothing to
    recover: they fit the summaries better and predicted worse or the same wherever the bench measured it (bench
    merge section). A Z* that had to drop some (fewer points than the sources need) is what the steps are for."""
    cand = _candidate_inputs(sources, raw)
    if cand.shape[0] == 0 or z.shape[0] == 0:
        return cand.shape[0] == 0
    with torch.no_grad():
        L, _ = jittered_cholesky(kernel(z, z), jitter)
        V = torch.linalg.solve_triangular(L, kernel(z, cand), upper=False)
        prior = kernel.diag(cand)
        residual = prior - (V * V).sum(0)
        return bool(residual.max() <= DEFAULT_REL_TOL * prior.max())


def merge(sources: Sequence[Source], model_config, num_inducing: int | None = None, steps: int | None = 100,
          lr: float = 0.02, learn_hyperparameters: bool = True, learn_inducing: bool = True,
          raw: RawData | None = None, kernel: Kernel | None = None, z: torch.Tensor | None = None,
          target_mean: torch.Tensor | None = None, target_scale: torch.Tensor | None = None,
          noise: torch.Tensor | None = None) -> MergeResult:
    """Fit the global q(u*), Z* and psi* to the sources (and raw data) by maximising the ensemble bound.

    ``model_config`` (a ModelConfig) names the global kernel (and jitter; num_inducing unless given). Adam with
    rate ``lr`` for ``steps`` steps on the kernel's hyperparameters and Z* (each optional); q(u*) is optimal in
    closed form at every step. ``steps=None``: none when Z* explains every source's inducing point
    (:func:`explains_sources`: the closed form), else COMPRESSING_STEPS. Returns the best point seen. ``kernel``, ``z``, ``target_mean`` and
    ``target_scale`` override the initial global choices (defaults: from the sources); ``noise`` (P,) the
    Gaussian noise variance of the raw data in the global standardised units (default: the sources' noise).
    """
    start = time.perf_counter()
    sources = list(sources)
    if not sources and raw is None:
        raise MergeError("nothing to merge: no sources")
    dims = {s.z.shape[1] for s in sources} | ({raw.x.shape[1]} if raw is not None else set())
    outs = {s.output_dims for s in sources} | ({raw.y.shape[1]} if raw is not None else set())
    if len(dims) != 1 or len(outs) != 1:
        raise MergeError(f"sources differ in input dimensions {sorted(dims)} or outputs {sorted(outs)}")
    d, p = dims.pop(), outs.pop()
    weights = [max(s.num_data, 1) for s in sources]
    if target_mean is None:
        target_mean = _weighted([s.prior_mean for s in sources], weights) if sources else raw.y.mean(0)
    if target_scale is None:
        target_scale = (torch.sqrt(_weighted([s.scale ** 2 for s in sources], weights)) if sources
                        else raw.y.std(0).clamp_min(1e-9))
    target_mean = torch.as_tensor(target_mean, dtype=torch.float64).reshape(p)
    target_scale = torch.as_tensor(target_scale, dtype=torch.float64).reshape(p)
    if kernel is None:
        kernel = initial_kernel(model_config, sources, d, target_scale)
    m = int(num_inducing if num_inducing is not None else model_config.num_inducing)
    jitter = float(model_config.jitter)
    if z is None:
        z = initial_inducing(kernel, sources, m, jitter, raw)
    if steps is None:
        steps = 0 if explains_sources(kernel, sources, z, jitter, raw) else COMPRESSING_STEPS
    noise_src = [s.noise / target_scale ** 2 for s in sources if bool(torch.isfinite(s.noise).all())]
    if noise is not None:
        noise = torch.as_tensor(noise, dtype=torch.float64).reshape(p)
    elif noise_src:
        noise = _weighted(noise_src, weights[:len(noise_src)])
    else:
        noise = torch.full((p,), float(model_config.noise_variance), dtype=torch.float64)
    obj = RecyclableMerge(sources, kernel, z, target_mean, target_scale, jitter, raw=raw,
                          noise=noise if raw is not None else None)
    params = list(obj.kernel.parameters()) if learn_hyperparameters else []
    if raw is not None and obj.noise_param is not None and learn_hyperparameters:
        params += list(obj.noise_param.parameters())
    if learn_inducing:
        params.append(obj.z)
    else:
        obj.z.requires_grad_(False)
    scale = 1.0 / max(1.0, float(sum(s.num_data for s in sources) + (raw.x.shape[0] if raw is not None else 0)))
    best_value, best_state, history, done = -math.inf, None, [], 0
    with torch.enable_grad():
        optimiser = torch.optim.Adam(params, lr=lr) if params and steps > 0 else None
        for step in range(steps + 1):
            if optimiser is not None:
                optimiser.zero_grad()
            try:
                value = obj.bound()
            except GPNumericalError:
                break
            if not bool(torch.isfinite(value)):
                break
            v = float(value.detach())
            history.append(v)
            if v > best_value:
                best_value = v
                best_state = {k: t.detach().clone() for k, t in obj.state_dict().items()}
            if optimiser is None or step == steps:
                break
            (-value * scale).backward()
            if not all(bool(torch.isfinite(q.grad).all()) for q in params if q.grad is not None):
                break
            optimiser.step()
            done += 1
    if best_state is None:
        raise MergeError("the ensemble bound is not finite at the initial global model")
    obj.load_state_dict(best_state)
    with torch.no_grad():
        a, W, _, used = obj.sites()
        noise_out = obj.noise_param.value.detach().clone() if obj.noise_param is not None else noise
    return MergeResult(z=obj.z.detach().clone(), site_a=a.detach(), site_W=W.detach(), target_mean=target_mean,
                       target_scale=target_scale, kernel=obj.kernel, jitter=max(used, jitter), noise=noise_out,
                       num_data=int(sum(s.num_data for s in sources) + (raw.x.shape[0] if raw is not None else 0)),
                       bound=best_value, steps=done, seconds=time.perf_counter() - start, history=history)


def merged_engine(result: MergeResult, model_config, output_dims: int):
    """A DualSVGP holding the merged map (so it predicts, saves and keeps learning like any map)."""
    from ..dual_svgp import DualSVGP

    cfg = copy.deepcopy(model_config)
    cfg.engine = "dual_svgp"
    cfg.tile_size = 0.0
    cfg.num_inducing = max(int(cfg.num_inducing), int(result.z.shape[0]))
    if cfg.inducing == "grid":
        cfg.inducing = "pivoted_cholesky"
    engine = DualSVGP(cfg, result.z.shape[1], output_dims)
    load_merged(engine, result)
    return engine


def load_merged(engine, result: MergeResult) -> None:
    """Make a DualSVGP the merged map: the merged kernel and noise into its modules (a tile's are the ones its
    tiled map shares), then the merged posterior under them."""
    with torch.no_grad():
        engine.kernel.load_state_dict(result.kernel.state_dict())
    engine.set_recycled_posterior(result.z, result.site_a, result.site_W, result.target_mean,
                                  result.target_scale, result.jitter, result.num_data)
    if bool(torch.isfinite(result.noise).all()):
        with torch.no_grad():
            # the whole noise (a floor included, in the target scale just set): the likelihood keeps its floor,
            # and with a time error splits it (GaussianLikelihood.take_reading_noise)
            engine.likelihood.take_reading_noise(result.noise.to(engine.device))


__all__ = ["COMPRESSING_STEPS", "LOG_2PI", "MergeResult", "RawData", "RecyclableMerge", "explains_sources",
           "initial_inducing", "initial_kernel", "load_merged", "merge", "merged_engine"]
