"""Covariance functions (the jittered Cholesky factorisation of kernel matrices is :mod:`gp_mapping.gp.linalg`'s).

Stationary kernels (Matern-1/2, 3/2, 5/2 and RBF) whose input axes share lengthscales as
:func:`lengthscale_groups` says (one for all, one for the horizontal plane and one for height, or one per axis),
a constant (bias) kernel, and their sum (with several stationary kernels at spread lengthscales when
model.kernel_scales asks). Positive hyperparameters are stored as logarithms so that Adam steps are
multiplicative (a lengthscale moves from 1 m to 0.5 m in as many steps as from 0.1 m to 0.05 m).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import LENGTHSCALE_CHOICES


class PositiveParameter(nn.Module):
    """Holds log(value) as the trainable parameter; ``value`` is always positive and finite."""

    def __init__(self, init: torch.Tensor | float, shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        init_t = torch.as_tensor(init, dtype=torch.float64).expand(shape).clone()
        if not bool(torch.all(init_t > 0)):
            raise ValueError(f"positive hyperparameter needs a positive initial value, got {init_t.tolist()}")
        self.raw = nn.Parameter(torch.log(init_t))

    @property
    def value(self) -> torch.Tensor:
        # Clamping the log keeps exp finite even if an optimiser step goes wild.
        return torch.exp(self.raw.clamp(-50.0, 50.0))

    def set(self, value: torch.Tensor | float) -> None:
        with torch.no_grad():
            self.raw.copy_(torch.log(torch.as_tensor(value, dtype=self.raw.dtype, device=self.raw.device)))


class Kernel(nn.Module):
    """A covariance function k(x1, x2) on inputs of ``input_dims`` columns."""

    def __init__(self, input_dims: int) -> None:
        super().__init__()
        self.input_dims = int(input_dims)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:  # (N1, N2)
        raise NotImplementedError

    def diag(self, x: torch.Tensor) -> torch.Tensor:  # (N,)
        raise NotImplementedError

    def add_to_(self, out: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """out += k(x1, x2) in place (no gradient tracked); a kernel may skip building the matrix."""
        return out.add_(self(x1, x2))


def lengthscale_groups(mode: str, input_dims: int) -> tuple[int, ...]:
    """The lengthscale each input axis uses (model.lengthscales): ``isotropic`` one for all; ``horizontal`` x and
    y share one and a third axis (height) has its own, because a field is statistically the same in every
    horizontal direction however the robot drove, while height is sampled differently (mostly one floor, sensor
    heights a few cm apart); ``per_axis`` one each (ARD)."""
    if mode == "isotropic":
        return (0,) * input_dims
    if mode == "horizontal":
        return tuple(0 if d < 2 else 1 for d in range(input_dims))
    if mode == "per_axis":
        return tuple(range(input_dims))
    raise ValueError(f"unknown lengthscales {mode!r}; known: {', '.join(LENGTHSCALE_CHOICES)}")


def _tracks_gradients(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class StationaryKernel(Kernel):
    """sigma^2 * g(r) with r the lengthscale-scaled Euclidean distance; subclasses define g."""

    def __init__(self, input_dims: int, lengthscale: float = 1.0, variance: float = 1.0,
                 lengthscales: str = "horizontal") -> None:
        super().__init__(input_dims)
        self.groups = lengthscale_groups(lengthscales, self.input_dims)
        self.num_lengthscales = max(self.groups, default=0) + 1
        self.lengthscale_param = PositiveParameter(lengthscale, (self.num_lengthscales,))
        self.variance_param = PositiveParameter(variance)
        # One learned value or one per axis broadcast as they are; shared groups are spread over their axes.
        spread = self.num_lengthscales not in (1, self.input_dims)
        self.register_buffer("_axis_group", torch.tensor(self.groups) if spread else None, persistent=False)

    @property
    def lengthscale(self) -> torch.Tensor:
        """The lengthscale of each input axis (one value when all axes share it)."""
        value = self.lengthscale_param.value
        return value if self._axis_group is None else value[self._axis_group]

    @property
    def variance(self) -> torch.Tensor:
        return self.variance_param.value

    def scaled_distance(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """r (N1, N2), not differentiated (training differentiates the kernel through _StationaryKernelFunction)."""
        return self._scaled_distance_in_place(x1 / self.lengthscale, x2 / self.lengthscale)

    @staticmethod
    def _scaled_distance_in_place(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The same distances in one (N1, N2) buffer: no autograd graph to keep, so no temporaries (a grid of
        cells against the inducing points is memory-bound; this is ~4x faster)."""
        return StationaryKernel._squared_scaled_distance_in_place(a, b).sqrt_()

    @staticmethod
    def _squared_scaled_distance_in_place(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # Differences, one input dimension at a time: exact zeros for coincident points (the expansion
        # |a|^2 + |b|^2 - 2ab leaves ~1e-8 in r, a first-order error for Matern-1/2) at the speed of the
        # expansion for the few dimensions of a map; (N1, N2, D) temporaries are several times slower.
        with torch.no_grad():
            r2 = a[:, 0, None] - b[None, :, 0]
            r2.square_()
            for d in range(1, a.shape[1]):
                diff = a[:, d, None] - b[None, :, d]
                r2.addcmul_(diff, diff)
        return r2

    def profile(self, r: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def profile_(self, r: torch.Tensor) -> torch.Tensor:
        """g(r), overwriting r (called only where no gradient is tracked)."""
        return self.profile(r)

    def profile_and_slope(self, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g and dg/d(r^2) at squared scaled distances r2 (no gradient tracked; r2 may be overwritten)."""
        raise NotImplementedError

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if _tracks_gradients(x1, x2, self.lengthscale_param.raw, self.variance_param.raw):
            return _StationaryKernelFunction.apply(x1, x2, self.lengthscale, self.variance, self.profile_and_slope)
        return self.profile_(self.scaled_distance(x1, x2)).mul_(self.variance)

    def diag(self, x: torch.Tensor) -> torch.Tensor:
        return self.variance.expand(x.shape[0]).clone()


class _StationaryKernelFunction(torch.autograd.Function):
    """variance * g(r) for inputs (N1, D), (N2, D) and per-axis (or one) lengthscales, with its gradients in
    closed form: the backward pass needs g and dg/d(r^2) only (saved by the forward), so the kernel of every
    hyperparameter step costs a few passes over the (N1, N2) matrix instead of autograd's ~20 (each elementwise
    step of the distance and of g saved and differentiated). dk/dl_d = -2 v g'(r^2) (x1_d - x2_d)^2 / l_d^3,
    dk/dx1_d = 2 v g'(r^2) (x1_d - x2_d) / l_d^2."""

    @staticmethod
    def forward(ctx, x1, x2, lengthscale, variance, profile_and_slope):
        a, b = x1 / lengthscale, x2 / lengthscale
        g, slope = profile_and_slope(StationaryKernel._squared_scaled_distance_in_place(a, b))
        ctx.save_for_backward(x1, x2, lengthscale, variance, g, slope)
        return g * variance

    @staticmethod
    def backward(ctx, grad):
        x1, x2, lengthscale, variance, g, slope = ctx.saved_tensors
        grad = grad.contiguous()  # adjoints from LAPACK are column-major: mixed layouts make each pass ~8x slower
        need_x1, need_x2, need_ls, need_var, _ = ctx.needs_input_grad
        grad_x1 = grad_x2 = grad_ls = grad_var = None
        if need_var:
            grad_var = (grad * g).sum().reshape(variance.shape)
        if need_x1 or need_x2 or need_ls:
            h = grad * slope
            h.mul_(variance)                                                  # dL/d(r^2)
            inv_l2 = (1.0 / (lengthscale * lengthscale)).expand(x1.shape[1])
            if need_ls:
                per_axis = torch.stack([(h * (x1[:, d, None] - x2[None, :, d]).square_()).sum()
                                        for d in range(x1.shape[1])])
                per_axis = -2.0 * per_axis * inv_l2 / lengthscale.expand(x1.shape[1])
                grad_ls = per_axis if lengthscale.numel() == x1.shape[1] else per_axis.sum().reshape(
                    lengthscale.shape)
            if need_x1:
                grad_x1 = 2.0 * (x1 * h.sum(1)[:, None] - h @ x2) * inv_l2
            if need_x2:
                grad_x2 = 2.0 * (x2 * h.sum(0)[:, None] - h.T @ x1) * inv_l2
        return grad_x1, grad_x2, grad_ls, grad_var, None


class Matern12Kernel(StationaryKernel):
    """Matern nu=1/2 (exponential): exp(-r)."""

    def profile(self, r: torch.Tensor) -> torch.Tensor:
        return torch.exp(-r)

    def profile_(self, r: torch.Tensor) -> torch.Tensor:
        return r.neg_().exp_()

    def profile_and_slope(self, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = r2.sqrt_()
        g = torch.exp(-r)
        # -g / (2r), infinite at r = 0 where the distance has no derivative: 0 there, as sqrt's clamp gave
        return g, torch.where(r > 0.0, -0.5 * g / r.clamp_min(1e-300), torch.zeros_like(g))


class Matern32Kernel(StationaryKernel):
    """Matern nu=3/2: (1 + sqrt3 r) exp(-sqrt3 r)."""

    def profile(self, r: torch.Tensor) -> torch.Tensor:
        s = math.sqrt(3.0) * r
        return (1.0 + s) * torch.exp(-s)

    def profile_(self, r: torch.Tensor) -> torch.Tensor:
        s = r.mul_(math.sqrt(3.0))
        poly = s + 1.0
        return poly.mul_(s.neg_().exp_())

    def profile_and_slope(self, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = r2.sqrt_().mul_(math.sqrt(3.0))
        e = torch.exp(-s)
        return (s + 1.0).mul_(e), e.mul_(-1.5)  # dg/dr = -3 r e^(-s), over 2r


class Matern52Kernel(StationaryKernel):
    """Matern nu=5/2: (1 + sqrt5 r + 5 r^2 / 3) exp(-sqrt5 r)."""

    def profile(self, r: torch.Tensor) -> torch.Tensor:
        s = math.sqrt(5.0) * r
        return (1.0 + s + s * s / 3.0) * torch.exp(-s)

    def profile_(self, r: torch.Tensor) -> torch.Tensor:
        s = r.mul_(math.sqrt(5.0))
        poly = s * s
        poly.div_(3.0).add_(s).add_(1.0)
        return poly.mul_(s.neg_().exp_())

    def profile_and_slope(self, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = r2.sqrt_().mul_(math.sqrt(5.0))
        e = torch.exp(-s)
        g = (s * s).div_(3.0).add_(s).add_(1.0).mul_(e)
        return g, s.add_(1.0).mul_(e).mul_(-5.0 / 6.0)  # dg/dr = -(5/3) r (1 + s) e^(-s), over 2r


class RBFKernel(StationaryKernel):
    """Squared exponential: exp(-r^2 / 2)."""

    def profile(self, r: torch.Tensor) -> torch.Tensor:
        return torch.exp(-0.5 * r * r)

    def profile_(self, r: torch.Tensor) -> torch.Tensor:
        return r.square_().mul_(-0.5).exp_()

    def profile_and_slope(self, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = r2.mul_(-0.5).exp_()
        return g, g * -0.5


class ConstantKernel(Kernel):
    """k(x1, x2) = c: a learned bias (an unknown constant offset of the whole map)."""

    def __init__(self, input_dims: int, variance: float = 1.0) -> None:
        super().__init__(input_dims)
        self.variance_param = PositiveParameter(variance)

    @property
    def variance(self) -> torch.Tensor:
        return self.variance_param.value

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.variance.expand(x1.shape[0], x2.shape[0]).clone()

    def add_to_(self, out: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return out.add_(self.variance)

    def diag(self, x: torch.Tensor) -> torch.Tensor:
        return self.variance.expand(x.shape[0]).clone()


class SumKernel(Kernel):
    """k = sum of the parts (independent processes added)."""

    def __init__(self, *parts: Kernel) -> None:
        if not parts:
            raise ValueError("SumKernel needs at least one kernel")
        super().__init__(parts[0].input_dims)
        self.parts = nn.ModuleList(parts)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        out = self.parts[0](x1, x2)
        if _tracks_gradients(out, *self.parameters()):
            for part in self.parts[1:]:
                out = out + part(x1, x2)
            return out
        for part in self.parts[1:]:  # without gradients: accumulated in the first part's fresh buffer
            part.add_to_(out, x1, x2)
        return out

    def diag(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parts[0].diag(x)
        for part in self.parts[1:]:
            out = out + part.diag(x)
        return out


STATIONARY_KERNELS: dict[str, type[StationaryKernel]] = {
    "matern12": Matern12Kernel,
    "matern32": Matern32Kernel,
    "matern52": Matern52Kernel,
    "rbf": RBFKernel,
}


#: ratio between the starting lengthscales of neighbouring scales (model.kernel_scales)
SCALE_RATIO = 2.0


def spread_lengthscales(lengthscale: float, count: int, ratio: float) -> list[float]:
    """``count`` lengthscales centred (geometrically) on ``lengthscale``, ``ratio`` apart: lengthscale * ratio **
    (s - (count - 1) / 2). Starting values for parts that should learn different scales."""
    return [lengthscale * ratio ** (s - (count - 1) / 2) for s in range(count)]


def build_kernel(model_config, input_dims: int, scales: int | None = None) -> Kernel:
    """The kernel a ModelConfig names: a stationary kernel (a sum of ``scales`` of them, default
    model.kernel_scales, at spread lengthscales), plus a constant kernel when asked."""
    try:
        cls = STATIONARY_KERNELS[model_config.kernel]
    except KeyError:
        raise ValueError(f"unknown kernel {model_config.kernel!r}; known: {', '.join(STATIONARY_KERNELS)}") from None
    scales = int(model_config.kernel_scales if scales is None else scales)
    parts: list[Kernel] = [cls(input_dims, lengthscale=ls, variance=model_config.signal_variance / scales,
                               lengthscales=model_config.lengthscales)
                           for ls in spread_lengthscales(model_config.lengthscale, scales, SCALE_RATIO)]
    if model_config.constant_kernel:
        parts.append(ConstantKernel(input_dims, variance=model_config.constant_variance))
    return parts[0] if len(parts) == 1 else SumKernel(*parts)


def scales_in_state(state: dict) -> int:
    """How many stationary parts a kernel's state_dict holds (a saved map's kernel is rebuilt with as many as it
    was saved with, whatever model.kernel_scales says now)."""
    if "lengthscale_param.raw" in state:
        return 1
    return max(sum(1 for k in state if k.startswith("parts.") and k.endswith(".lengthscale_param.raw")), 1)


def stationary_parts(kernel: Kernel) -> list[StationaryKernel]:
    """The stationary kernels of ``kernel`` (itself, or the stationary parts of a sum, in order)."""
    if isinstance(kernel, StationaryKernel):
        return [kernel]
    if isinstance(kernel, SumKernel):
        return [p for p in kernel.parts if isinstance(p, StationaryKernel)]
    return []


def stationary_part(kernel: Kernel) -> StationaryKernel | None:
    """The first stationary kernel of ``kernel`` (itself, or the first stationary part of a sum), or None."""
    parts = stationary_parts(kernel)
    return parts[0] if parts else None


def constant_part(kernel: Kernel) -> ConstantKernel | None:
    """The constant kernel of a sum, or None."""
    if isinstance(kernel, SumKernel):
        return next((p for p in kernel.parts if isinstance(p, ConstantKernel)), None)
    return None
