"""Kernels against closed forms written out independently in numpy, and the jittered Cholesky."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gp_mapping.config import ConfigError, ModelConfig, config_from_dict
from gp_mapping.gp.errors import GPNumericalError
from gp_mapping.gp.kernels import (ConstantKernel, Matern12Kernel, Matern32Kernel, Matern52Kernel, RBFKernel,
                                   SumKernel, _StationaryKernelFunction, build_kernel)
from gp_mapping.gp.linalg import jittered_cholesky


def _scaled_r(x1, x2, ls):
    out = np.zeros((len(x1), len(x2)))
    for i, a in enumerate(x1):
        for j, b in enumerate(x2):
            out[i, j] = math.sqrt(sum(((a[d] - b[d]) / ls[d]) ** 2 for d in range(len(a))))
    return out


CLOSED_FORMS = {
    Matern12Kernel: lambda r: np.exp(-r),
    Matern32Kernel: lambda r: (1 + math.sqrt(3) * r) * np.exp(-math.sqrt(3) * r),
    Matern52Kernel: lambda r: (1 + math.sqrt(5) * r + 5 * r ** 2 / 3) * np.exp(-math.sqrt(5) * r),
    RBFKernel: lambda r: np.exp(-0.5 * r ** 2),
}


@pytest.mark.parametrize("cls", list(CLOSED_FORMS))
def test_stationary_kernels_match_closed_forms_with_ard(cls):
    rng = np.random.default_rng(1)
    x1, x2 = rng.normal(size=(7, 2)) * 2, rng.normal(size=(5, 2)) * 2
    ls, var = [0.7, 2.3], 1.9
    k = cls(2, lengthscale=1.0, variance=var, lengthscales="per_axis")
    k.lengthscale_param.set(torch.tensor(ls, dtype=torch.float64))
    got = k(torch.tensor(x1), torch.tensor(x2)).detach().numpy()
    want = var * CLOSED_FORMS[cls](_scaled_r(x1, x2, ls))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(k.diag(torch.tensor(x1)).detach().numpy(), np.full(7, var), rtol=1e-14)


def test_shared_lengthscale_and_far_from_origin():
    # One lengthscale for all dimensions; coordinates far from the origin must not lose the diagonal.
    k = Matern12Kernel(2, lengthscale=0.5, variance=1.0, lengthscales="isotropic")
    assert k.lengthscale.shape == (1,)
    x = torch.tensor([[1e4, -2e4], [1e4 + 0.3, -2e4 + 0.4]], dtype=torch.float64)
    got = k(x, x).detach().numpy()
    want = np.exp(-_scaled_r(x.numpy(), x.numpy(), [0.5, 0.5]))
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_sum_with_constant_kernel_and_build_from_config():
    cfg = ModelConfig(kernel="rbf", lengthscale=0.8, signal_variance=2.0, constant_variance=3.0, kernel_scales=1)
    k = build_kernel(cfg, 3)
    assert isinstance(k, SumKernel) and isinstance(k.parts[1], ConstantKernel)
    x = torch.randn(6, 3, dtype=torch.float64)
    want = 2.0 * np.exp(-0.5 * _scaled_r(x.numpy(), x.numpy(), [0.8] * 3) ** 2) + 3.0
    np.testing.assert_allclose(k(x, x).detach().numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(k.diag(x).detach().numpy(), np.full(6, 5.0), rtol=1e-14)
    plain = build_kernel(ModelConfig(kernel="matern32", constant_kernel=False, lengthscales="isotropic", kernel_scales=1), 2)
    assert isinstance(plain, Matern32Kernel) and plain.lengthscale.shape == (1,)


def test_kernel_scales_sum_kernels_at_spread_lengthscales_with_the_prior_variance_kept():
    """model.kernel_scales 3: three Matern-5/2 parts started at lengthscale * 2^(-1, 0, 1), each a third of the
    signal variance, so k(x, x) (the prior variance) is what one kernel states; the sum is their sum."""
    cfg = ModelConfig(kernel="matern52", lengthscale=0.8, signal_variance=2.0, constant_variance=3.0, kernel_scales=3)
    k = build_kernel(cfg, 3)
    assert isinstance(k, SumKernel) and isinstance(k.parts[3], ConstantKernel) and len(k.parts) == 4
    np.testing.assert_allclose([float(p.lengthscale_param.value[0]) for p in k.parts[:3]], [0.4, 0.8, 1.6],
                               rtol=1e-12)
    x = torch.randn(5, 3, dtype=torch.float64)
    np.testing.assert_allclose(k.diag(x).detach().numpy(), np.full(5, 5.0), rtol=1e-12)
    want = sum(build_kernel(ModelConfig(kernel="matern52", lengthscale=ls, signal_variance=2.0 / 3,
                                        constant_kernel=False), 3, scales=1)(x, x) for ls in (0.4, 0.8, 1.6)) + 3.0
    np.testing.assert_allclose(k(x, x).detach().numpy(), want.detach().numpy(), rtol=1e-12)
    one = build_kernel(ModelConfig(kernel="matern52", constant_kernel=False, kernel_scales=3), 3, scales=1)
    assert isinstance(one, Matern52Kernel)  # an engine with its own scales (continual_mogp) asks for one
    with pytest.raises(ConfigError, match="kernel_scales"):
        config_from_dict({"model": {"kernel_scales": 0}})


@pytest.mark.parametrize("cls", list(CLOSED_FORMS))
def test_gradients_finite_at_zero_distance_and_match_finite_differences(cls):
    x = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.3, -0.2], [1.0, 0.5]], dtype=torch.float64)
    k = cls(2, lengthscale=0.9, variance=1.3, lengthscales="per_axis")

    def total():
        return (k(x, x) * torch.arange(16, dtype=torch.float64).reshape(4, 4)).sum()

    value = total()
    grads = torch.autograd.grad(value, [k.lengthscale_param.raw, k.variance_param.raw])
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    eps = 1e-6
    with torch.no_grad():
        for i in range(2):
            k.lengthscale_param.raw[i] += eps
            up = total()
            k.lengthscale_param.raw[i] -= 2 * eps
            down = total()
            k.lengthscale_param.raw[i] += eps
            assert float(grads[0][i]) == pytest.approx(float((up - down) / (2 * eps)), rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("cls", list(CLOSED_FORMS))
def test_horizontal_lengthscales_share_one_over_x_and_y_and_learn_one_for_height(cls):
    x = torch.rand(7, 3, dtype=torch.float64) * 3
    shared = cls(3, variance=1.3, lengthscales="horizontal")
    shared.lengthscale_param.set(torch.tensor([0.8, 0.3]))
    ard = cls(3, variance=1.3, lengthscales="per_axis")
    ard.lengthscale_param.set(torch.tensor([0.8, 0.8, 0.3]))
    assert shared.lengthscale_param.value.shape == (2,)
    assert torch.allclose(shared(x, x), ard(x, x), rtol=1e-12, atol=0)
    with torch.no_grad():
        assert torch.allclose(shared(x, x), ard(x, x), rtol=1e-12, atol=0)  # the in-place path too
    # The x-y lengthscale's gradient is the sum of the per-axis ones (one parameter on two axes).
    g_shared = torch.autograd.grad(shared(x, x).sum(), shared.lengthscale_param.raw)[0]
    g_ard = torch.autograd.grad(ard(x, x).sum(), ard.lengthscale_param.raw)[0]
    assert torch.allclose(g_shared, torch.stack([g_ard[0] + g_ard[1], g_ard[2]]), rtol=1e-10)
    # In 2-D "horizontal" is one lengthscale, and "isotropic" is one in 3-D too.
    assert cls(2, lengthscales="horizontal").lengthscale_param.value.shape == (1,)
    assert cls(3, lengthscales="isotropic").lengthscale_param.value.shape == (1,)
    with pytest.raises(ValueError, match="unknown lengthscales"):
        cls(3, lengthscales="planar")


def test_kernel_matrix_is_positive_definite():
    x = torch.rand(40, 2, dtype=torch.float64) * 5
    for cls in CLOSED_FORMS:
        K = cls(2, lengthscale=0.4)(x, x).detach()
        assert float(torch.linalg.eigvalsh(K).min()) > -1e-10


def test_positive_parameter_refuses_nonpositive_init():
    with pytest.raises(ValueError, match="positive"):
        RBFKernel(2, lengthscale=0.0)


def test_jittered_cholesky_escalates_and_reports_jitter():
    # Rank one: needs jitter; the factor must reproduce matrix + jitter I.
    v = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    A = v @ v.T
    L, used = jittered_cholesky(A, 1e-12)
    assert used >= 1e-12
    np.testing.assert_allclose((L @ L.T).numpy(), (A + used * torch.eye(3, dtype=torch.float64)).numpy(),
                               atol=1e-12)
    # A well-conditioned matrix takes the initial jitter.
    L2, used2 = jittered_cholesky(torch.eye(3, dtype=torch.float64) * 2, 1e-6)
    assert used2 == 1e-6
    # Zero jitter: tried as is first.
    _, used3 = jittered_cholesky(torch.eye(2, dtype=torch.float64), 0.0)
    assert used3 == 0.0


def test_jittered_cholesky_raises_clear_errors():
    with pytest.raises(GPNumericalError, match="NaN or Inf"):
        jittered_cholesky(torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=torch.float64), 1e-6)
    with pytest.raises(GPNumericalError, match="failed even with jitter"):
        jittered_cholesky(-torch.eye(3, dtype=torch.float64), 1e-6)


def test_jittered_cholesky_refuses_only_non_finite_entries_and_adds_the_jitter_exactly():
    # Every non-finite entry is refused, wherever it sits and whatever its sign.
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in ((0, 0), (1, 0), (2, 2)):
            A = torch.eye(3, dtype=torch.float64)
            A[where] = bad
            with pytest.raises(GPNumericalError, match="NaN or Inf"):
                jittered_cholesky(A, 1e-6)
    # A finite matrix whose entries sum past the largest double is factorised, not refused as non-finite (the
    # factorisation reads the lower triangle, here the identity).
    huge = torch.eye(3, dtype=torch.float64) + torch.triu(torch.full((3, 3), 1e308, dtype=torch.float64), 1)
    L, used = jittered_cholesky(huge, 0.0)
    assert used == 0.0 and torch.equal(L, torch.eye(3, dtype=torch.float64))
    # The factor is chol(A + jitter I) bit for bit, for either memory layout of A and through autograd.
    rng = np.random.default_rng(1)
    B = torch.as_tensor(rng.standard_normal((40, 60)))
    A = B @ B.T / 60
    A = 0.5 * (A + A.T)
    for matrix in (A, A.T.contiguous().T):
        leaf = matrix.clone().requires_grad_(True)
        L, used = jittered_cholesky(leaf, 1e-3)
        assert used == 1e-3 and torch.equal(L, torch.linalg.cholesky(matrix + 1e-3 * torch.eye(40, dtype=A.dtype)))
        L.sum().backward()
        expected = torch.autograd.grad(torch.linalg.cholesky(leaf + 1e-3 * torch.eye(40, dtype=A.dtype)).sum(), leaf)[0]
        torch.testing.assert_close(leaf.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["matern12", "matern32", "matern52", "rbf"])
def test_the_in_place_path_without_gradients_equals_the_differentiable_one(name):
    """Prediction evaluates kernels under no_grad through in-place buffers; training through autograd. Both must
    give the same matrix (to round-off), with and without the constant kernel, coincident points included."""
    rng = np.random.default_rng(3)
    x1 = torch.as_tensor(rng.uniform(-3, 3, (40, 3)))
    x2 = torch.cat([x1[:5], torch.as_tensor(rng.uniform(-3, 3, (20, 3)))])
    for constant in (False, True):
        kernel = build_kernel(ModelConfig(kernel=name, lengthscale=0.7, signal_variance=2.0, constant_kernel=constant,
                                          constant_variance=0.3), 3, scales=1)
        tracked = kernel(x1, x2)
        assert tracked.requires_grad
        with torch.no_grad():
            untracked = kernel(x1, x2)
        np.testing.assert_allclose(untracked.numpy(), tracked.detach().numpy(), rtol=1e-14, atol=1e-15)
        # the closed form, away from the autograd path altogether
        ls = np.full(3, 0.7)
        expected = 2.0 * CLOSED_FORMS[type(kernel.parts[0] if constant else kernel)](_scaled_r(x1.numpy(), x2.numpy(), ls))
        np.testing.assert_allclose(untracked.numpy(), expected + (0.3 if constant else 0.0), rtol=1e-12)


@pytest.mark.parametrize("name", ["matern12", "matern32", "matern52", "rbf"])
@pytest.mark.parametrize("mode", ["isotropic", "horizontal", "per_axis"])
def test_closed_form_kernel_gradients_equal_autograd_through_the_formula(name, mode):
    """Hyperparameter steps differentiate the kernel through closed-form gradients (one pass over the matrix
    for g and dg/dr^2 in the forward, a few in the backward); they must equal autograd through the elementwise
    formula for lengthscales, variance and both inputs (learned inducing points), coincident points included,
    and finite differences away from them (gradcheck)."""
    rng = np.random.default_rng(11)
    cls = type(build_kernel(ModelConfig(kernel=name, constant_kernel=False, kernel_scales=1), 3))
    k = cls(3, lengthscale=0.8, variance=1.7, lengthscales=mode)
    with torch.no_grad():
        k.lengthscale_param.raw.add_(torch.as_tensor(rng.normal(0.0, 0.3, k.lengthscale_param.raw.shape)))
    x1 = torch.as_tensor(rng.uniform(-2, 2, (9, 3))).requires_grad_(True)
    x2 = torch.cat([x1.detach()[:3], torch.as_tensor(rng.uniform(-2, 2, (6, 3)))]).requires_grad_(True)
    weights = torch.as_tensor(rng.normal(size=(9, 9)))
    params = [x1, x2, k.lengthscale_param.raw, k.variance_param.raw]
    fused = k(x1, x2)
    assert fused.grad_fn is not None and "StationaryKernelFunction" in type(fused.grad_fn).__name__
    diff = (x1[:, None, :] - x2[None, :, :]) / k.lengthscale          # the elementwise formula under autograd
    reference = k.variance * k.profile(torch.sqrt((diff * diff).sum(-1).clamp_min(1e-36)))
    torch.testing.assert_close(fused, reference, rtol=1e-13, atol=1e-15)
    for got, want in zip(torch.autograd.grad((fused * weights).sum(), params),
                         torch.autograd.grad((reference * weights).sum(), params)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
    apart = torch.as_tensor(rng.uniform(-2, 2, (6, 3))).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, raw_l, raw_v: _fused(k, a, b, raw_l, raw_v),
                                    (x1.detach()[:4].clone().requires_grad_(True), apart,
                                     k.lengthscale_param.raw.detach().clone().requires_grad_(True),
                                     k.variance_param.raw.detach().clone().requires_grad_(True)))


def _fused(kernel, a, b, raw_lengthscale, raw_variance):
    """The training forward of ``kernel`` at given log hyperparameters (gradcheck varies them)."""
    lengthscale = torch.exp(raw_lengthscale)
    if kernel._axis_group is not None:
        lengthscale = lengthscale[kernel._axis_group]
    return _StationaryKernelFunction.apply(a, b, lengthscale, torch.exp(raw_variance), kernel.profile_and_slope)
