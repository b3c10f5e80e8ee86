"""Continual multi-output GP (Moreno-Munoz et al., continual multi-task GPs): the bound against closed forms and the
dual engine, no forgetting, asynchronous channels, coregionalisation recovery, state round trip and bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gp_mapping.config import ModelConfig
from gp_mapping.gp.continual_mogp import ContinualMOGP
from gp_mapping.gp import DualSVGP, ModelInputError

JITTER = 1e-6


@pytest.fixture(autouse=True)
def one_thread():
    # Small matrices: one thread is as fast, and far faster when other processes share the two cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(**kw) -> ModelConfig:
    base = dict(engine="continual_mogp", kernel="rbf", constant_kernel=False, lengthscales="per_axis",
                lengthscale=0.5, signal_variance=1.0, noise_variance=0.05, num_inducing=30, hyper_steps=10, hyper_lr=0.05,
                learn_hyperparameters=True, jitter=JITTER, device="cpu", seed=0,
                time_error=False)  # the DualSVGPs built from it to compare with: their white-noise algebra
    base.update(kw)
    return ModelConfig(**base)


# ----------------------------------------------------------------------------- independent closed forms (numpy)
def rbf(x1, x2, lengthscale, variance):
    d = (x1[:, None, :] - x2[None, :, :]) / np.asarray(lengthscale)
    return variance * np.exp(-0.5 * (d * d).sum(-1))


def matern52(x1, x2, lengthscale, variance):
    d = (x1[:, None, :] - x2[None, :, :]) / np.asarray(lengthscale)
    r = np.sqrt(5.0 * (d * d).sum(-1))
    return variance * (1.0 + r + r * r / 3.0) * np.exp(-r)


def gauss_kl(m1, S1, m2, S2):
    """KL[N(m1, S1) || N(m2, S2)] by the textbook formula."""
    k = m1.shape[0]
    S2_inv = np.linalg.inv(S2)
    diff = m2 - m1
    return 0.5 * (np.trace(S2_inv @ S1) + diff @ S2_inv @ diff - k
                  + np.linalg.slogdet(S2)[1] - np.linalg.slogdet(S1)[1])


def svgp_elbo(kern, x, y, z, m, S, noise):
    """Hensman et al. (2013) ELBO for one Gaussian output: sum E_q log N(y|f, noise) - KL[q(u)||p(u)]."""
    K = kern(z, z) + JITTER * np.eye(len(z))
    Kzx = kern(z, x)
    A = np.linalg.solve(K, Kzx)
    mu = A.T @ m
    var = kern(x, x).diagonal() - (Kzx * A).sum(0) + (A * (S @ A)).sum(0)
    ell = -0.5 * (np.log(2 * np.pi * noise) + ((y - mu) ** 2 + var) / noise)
    return ell.sum() - gauss_kl(m, S, np.zeros(len(z)), K)


def titsias_bound(kern, x, y, z, noise):
    """Collapsed bound log N(y | 0, Qnn + noise I) - tr(Knn - Qnn) / (2 noise): the optimum of the ELBO over q."""
    K = kern(z, z) + JITTER * np.eye(len(z))
    Kzx = kern(z, x)
    Qnn = Kzx.T @ np.linalg.solve(K, Kzx)
    C = Qnn + noise * np.eye(len(x))
    _, logdet = np.linalg.slogdet(C)
    fit = -0.5 * (len(x) * np.log(2 * np.pi) + logdet + y @ np.linalg.solve(C, y))
    return fit - 0.5 * np.trace(kern(x, x) - Qnn) / noise


def random_spd(rng, n, scale=0.3):
    B = rng.standard_normal((n, n)) * scale
    return B @ B.T / n + 0.05 * np.eye(n)


# ----------------------------------------------------------------------------- the bound
def _toy_2d(rng, n=120):
    x = rng.uniform(0, 3, size=(n, 2))
    y = np.sin(2 * x[:, 0]) + 0.5 * np.cos(3 * x[:, 1]) + 0.1 * rng.standard_normal(n)
    return x, y[:, None]


def test_single_latent_bound_equals_svgp_elbo_of_dual_engine():
    rng = np.random.default_rng(1)
    x, y = _toy_2d(rng)
    cfg = config(kernel="matern52", lengthscale=0.7, learn_hyperparameters=False, memory_size=0,
                 kernel_scales=1)  # the dual engine with the one kernel a latent has
    dual = DualSVGP(cfg, 2, 1)
    z = rng.uniform(0, 3, size=(15, 2))
    dual.set_inducing_points(z)
    dual.update(x, y, mode="full")
    assert dual.jitter == JITTER
    with torch.no_grad():
        K = dual.kernel(dual.Z, dual.Z) + JITTER * torch.eye(15, dtype=torch.float64)
        KB_inv = torch.linalg.inv(K + dual.B[0])
        m = (K @ KB_inv @ dual.a[:, 0]).numpy()
        S = (K @ KB_inv @ K).numpy()
    model = ContinualMOGP(cfg, 2, 1, num_latents=1)
    model.kernels[0].load_state_dict(dual.kernel.state_dict())
    model.likelihood.load_state_dict(dual.likelihood.state_dict())
    model.set_standardisation(dual.y_mean, dual.y_std)
    model.set_variational(0, z, m, S)
    assert torch.allclose(model.mixing, torch.ones(1, 1, dtype=torch.float64))
    ours = float(model.elbo(x, y))

    # Independent closed forms, standardised units, then the Jacobian of the standardisation.
    ls = model.kernels[0].lengthscale.detach().numpy()
    var = float(model.kernels[0].variance.detach())
    noise = float(model.likelihood.noise_variance.detach())
    ys = (y[:, 0] - float(dual.y_mean)) / float(dual.y_std)
    jac = len(y) * math.log(float(dual.y_std))
    kern = lambda a, b: matern52(a, b, ls, var)  # noqa: E731
    hensman = svgp_elbo(kern, x, ys, z, m, S, noise) - jac
    titsias = titsias_bound(kern, x, ys, z, noise) - jac
    assert ours == pytest.approx(hensman, rel=1e-9, abs=1e-8)
    # The dual engine's q(u) is the optimal one for a Gaussian likelihood: the bound there is Titsias's.
    assert ours == pytest.approx(titsias, rel=1e-7)
    # Our predictions at the dual engine's q(u) are the dual engine's.
    xt = rng.uniform(0, 3, size=(40, 2))
    (m1, v1), (m2, v2) = model.predict(xt), dual.predict(xt)
    assert torch.allclose(m1, m2, rtol=0, atol=1e-8) and torch.allclose(v1, v2, rtol=0, atol=1e-8)


def test_analytic_e_step_is_the_optimum_and_matches_dual_posterior():
    rng = np.random.default_rng(2)
    x, y = _toy_2d(rng)
    cfg = config(kernel="matern52", lengthscale=0.7, learn_hyperparameters=False, memory_size=0, num_inducing=20,
                 kernel_scales=1)  # the dual engine with the one kernel a latent has
    model = ContinualMOGP(cfg, 2, 1, num_latents=1)
    stats = model.update(x, y)
    z = model.z(0).numpy()
    assert stats["num_inducing"] == [20] and stats["continual"] is False
    dual = DualSVGP(cfg, 2, 1)
    dual.set_inducing_points(z)
    dual.update(x, y, mode="full")
    xt = rng.uniform(0, 3, size=(40, 2))
    (m1, v1), (m2, v2) = model.predict(xt), dual.predict(xt)
    assert torch.allclose(m1, m2, rtol=0, atol=1e-7) and torch.allclose(v1, v2, rtol=0, atol=1e-7)
    ls = model.kernels[0].lengthscale.detach().numpy()
    ys = (y[:, 0] - float(model.y_mean)) / float(model.y_std)
    titsias = titsias_bound(lambda a, b: matern52(a, b, ls, float(model.kernels[0].variance.detach())), x, ys, z,
                            float(model.likelihood.noise_variance.detach())) - len(y) * math.log(float(model.y_std))
    assert float(model.elbo(x, y)) == pytest.approx(titsias, rel=1e-7)
    assert stats["bound"] == pytest.approx(titsias, rel=1e-7)


def test_continual_bound_adds_up_to_the_batch_bound_with_fixed_hyperparameters():
    """psi_new = psi_old and Z fixed: L_C(q; D2 | q1) + L(q1; D1) = L(q; D1 u D2) for every q, where q1
    maximises L(.; D1). With A = I each channel is one latent (no coupling), so q1 is the exact optimum."""
    rng = np.random.default_rng(3)
    n = 80
    x1, x2 = rng.uniform(0, 4, size=(n, 1)), rng.uniform(0, 4, size=(n, 1))
    y1 = np.column_stack([np.sin(2 * x1[:, 0]), np.cos(x1[:, 0])]) + 0.1 * rng.standard_normal((n, 2))
    y2 = np.column_stack([np.sin(2 * x2[:, 0]), np.cos(x2[:, 0])]) + 0.1 * rng.standard_normal((n, 2))
    y1[rng.random(n) < 0.3, 0] = np.nan  # missing entries take part in neither bound
    y2[rng.random(n) < 0.3, 1] = np.nan
    model = ContinualMOGP(config(learn_hyperparameters=False, num_inducing=12), 1, 2, num_latents=2)
    with torch.no_grad():
        model.mixing_raw.copy_(torch.eye(2, dtype=torch.float64))
    model.update(x1, y1)
    old = [model.latent_posterior(q) for q in range(2)]
    first = float(model.elbo(x1, y1))
    for q in range(2):
        zq = model.z(q).numpy()
        model.set_variational(q, zq, rng.standard_normal(len(zq)), random_spd(rng, len(zq)))
    continual = float(model.elbo(x2, y2, old=old))
    batch = float(model.elbo(np.vstack([x1, x2]), np.vstack([y1, y2])))
    assert continual + first == pytest.approx(batch, rel=1e-8)


def test_continual_bound_terms_match_closed_form_with_new_hyperparameters_and_grown_inducing_set():
    rng = np.random.default_rng(4)
    n = 60
    x1 = rng.uniform(0, 2, size=(n, 1))
    y1 = np.column_stack([np.sin(3 * x1[:, 0]), np.sin(3 * x1[:, 0]) + np.cos(x1[:, 0])])
    y1 = y1 + 0.1 * rng.standard_normal((n, 2))
    model = ContinualMOGP(config(learn_hyperparameters=False, num_inducing=8), 1, 2, num_latents=2)
    model.update(x1, y1)
    old = [model.latent_posterior(q) for q in range(2)]
    old_hyper = [(model.kernels[q].lengthscale.detach().numpy().copy(), float(model.kernels[q].variance.detach()))
                 for q in range(2)]
    # New hyperparameters and a grown inducing set (old points kept, new ones elsewhere).
    new_hyper = [(np.array([0.8]), 1.7), (np.array([0.3]), 0.6)]
    zs = []
    for q, (ls, var) in enumerate(new_hyper):
        model.kernels[q].lengthscale_param.set(torch.tensor(ls))
        model.kernels[q].variance_param.set(var)
        zq = np.vstack([model.z(q).numpy(), rng.uniform(2.2, 3.0, size=(3, 1))])
        zs.append(zq)
        model.set_variational(q, zq, rng.standard_normal(len(zq)), random_spd(rng, len(zq)))
    with torch.no_grad():
        model.mixing_raw.copy_(torch.tensor([[0.9, -0.4], [0.3, 1.1]], dtype=torch.float64))
    x2 = rng.uniform(1.5, 3.0, size=(n, 1))
    y2 = np.column_stack([np.sin(3 * x2[:, 0]), np.nan * np.ones(n)])  # only channel 0 in this batch
    terms = model.bound_terms(x2, y2, old=old)

    A = model.mixing.detach().numpy()
    noise = model.likelihood.noise_variance.detach().numpy()
    ys = (y2[:, 0] - float(model.y_mean[0])) / float(model.y_std[0])
    kl_new = kl_old = kl_tilde = 0.0
    mu = np.zeros(n)
    var = np.zeros(n)
    for q in range(2):
        zq = zs[q]
        mq, Sq = (t.numpy() for t in model.variational(q)[1:])
        k_new = lambda a, b, q=q: rbf(a, b, *new_hyper[q])  # noqa: E731
        k_old = lambda a, b, q=q: rbf(a, b, *old_hyper[q])  # noqa: E731
        Knn = k_new(zq, zq) + JITTER * np.eye(len(zq))
        Knn_old = k_old(zq, zq) + JITTER * np.eye(len(zq))
        zo, mo = old[q].z.numpy(), old[q].mean.numpy()
        So = (old[q].chol @ old[q].chol.T).numpy()
        Koo = k_old(zo, zo) + JITTER * np.eye(len(zo))
        Kno = k_old(zq, zo) + JITTER * (zq[:, None, 0] == zo[None, :, 0])  # kept points: same u, same jitter
        P = np.linalg.solve(Koo, Kno.T).T
        tilde_mean = P @ mo
        tilde_cov = Knn_old + P @ (So - Koo) @ P.T
        kl_new += gauss_kl(mq, Sq, np.zeros(len(zq)), Knn)
        kl_old += gauss_kl(mq, Sq, np.zeros(len(zq)), Knn_old)
        kl_tilde += gauss_kl(mq, Sq, tilde_mean, tilde_cov)
        Kzx = k_new(zq, x2)
        B = np.linalg.solve(Knn, Kzx)
        mu += A[0, q] * (B.T @ mq)
        var += A[0, q] ** 2 * (new_hyper[q][1] - (Kzx * B).sum(0) + (B * (Sq @ B)).sum(0))
    ell = (-0.5 * (np.log(2 * np.pi * noise[0]) + ((ys - mu) ** 2 + var) / noise[0])).sum()
    assert terms["ell"] == pytest.approx(ell, rel=1e-8)
    assert terms["kl_new"] == pytest.approx(kl_new, rel=1e-6)
    assert terms["kl_old"] == pytest.approx(kl_old, rel=1e-6)
    assert terms["kl_tilde"] == pytest.approx(kl_tilde, rel=1e-6)
    assert terms["bound"] == pytest.approx(ell - kl_new + kl_old - kl_tilde, rel=1e-6)


def test_adam_e_step_reaches_the_closed_form_optimum():
    rng = np.random.default_rng(5)
    x = rng.uniform(0, 3, size=(50, 1))
    y = np.column_stack([np.sin(2 * x[:, 0]), 0.5 * np.sin(2 * x[:, 0]) + 0.3 * np.cos(x[:, 0])])
    y = y + 0.1 * rng.standard_normal(y.shape)
    cfg = config(learn_hyperparameters=False, num_inducing=6, lengthscale=0.8)
    exact = ContinualMOGP(cfg, 1, 2, num_latents=2)
    adam = ContinualMOGP(cfg, 1, 2, num_latents=2, analytic_e_step=False, variational_steps=600,
                         variational_lr=0.05)
    s_exact, s_adam = exact.update(x, y), adam.update(x, y)
    assert s_adam["variational_steps"] == 600
    # The closed form is the maximum; Adam on (m, L) climbs to it from the prior.
    assert s_adam["bound"] <= s_exact["bound"] + 1e-8
    assert s_adam["bound"] == pytest.approx(s_exact["bound"], abs=0.05)
    xt = np.linspace(0, 3, 30)[:, None]
    (m1, v1), (m2, v2) = adam.predict(xt), exact.predict(xt)
    assert torch.allclose(m1, m2, atol=1e-4)
    assert torch.allclose(v1, v2, atol=0.1 * float(v2.mean()))


def test_m_step_gradient_at_the_fixed_optimum_equals_the_gradient_through_it():
    """The M-step differentiates the continual bound at q*(theta) held fixed; by the envelope theorem this is the
    gradient of max_q L(q, theta), which the solve differentiated through gives (every hyperparameter, the
    mixing weights and the noise), for two coupled latents with a continual prior."""
    rng = np.random.default_rng(11)
    x1, x2 = rng.uniform(0, 3, size=(60, 2)), rng.uniform(0, 3, size=(60, 2))
    field = lambda x: np.column_stack([np.sin(2 * x[:, 0]), 0.5 * np.sin(2 * x[:, 0]) + np.cos(x[:, 1])])
    y1 = field(x1) + 0.1 * rng.standard_normal((60, 2))
    y2 = field(x2) + 0.1 * rng.standard_normal((60, 2))
    y2[rng.random(60) < 0.3, 0] = np.nan
    model = ContinualMOGP(config(learn_hyperparameters=False, num_inducing=25, mixing_learning="always"), 2, 2,
                          num_latents=2)
    model.update(x1, y1)
    old = [model.latent_posterior(q) for q in range(2)]
    xt = model._check_x(x2)
    yt, mask = model._check_targets(y2, 60, allow_missing=True)
    ys = model._standardise(yt, mask)
    priors = model._place_inducing(xt, [model.z(q) for q in range(2)], old)
    with torch.no_grad():  # move the hyperparameters off the last fit, so the gradient is far from zero
        for p in model.kernels.parameters():
            p.add_(0.3)
    params, _ = model._hyper_parameters()
    through = torch.autograd.grad(model._bound(xt, ys, mask, priors, given=model._optimal_q(xt, ys, mask, priors))[0],
                                  params, allow_unused=True)
    with torch.no_grad():
        best = model._optimal_q(xt, ys, mask, priors)
    fixed = torch.autograd.grad(model._bound(xt, ys, mask, priors, given=best)[0], params, allow_unused=True)
    assert len(params) >= 4 and any(g is not None and float(g.abs().max()) > 1e-2 for g in through)
    for a, b in zip(through, fixed):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-8), (a, b)


def _two_updates_and_priors(rng, num_inducing=25):
    """A model after one update and, for a second batch, its placement's continual priors and inputs."""
    x1, x2 = rng.uniform(0, 3, size=(60, 2)), rng.uniform(0, 3, size=(60, 2))
    field = lambda x: np.column_stack([np.sin(2 * x[:, 0]), 0.5 * np.sin(2 * x[:, 0]) + np.cos(x[:, 1])])  # noqa: E731
    model = ContinualMOGP(config(learn_hyperparameters=False, num_inducing=num_inducing), 2, 2, num_latents=2)
    model.update(x1, field(x1) + 0.1 * rng.standard_normal((60, 2)))
    old = [model.latent_posterior(q) for q in range(2)]
    xt = model._check_x(x2)
    yt, mask = model._check_targets(field(x2) + 0.1 * rng.standard_normal((60, 2)), 60, allow_missing=True)
    priors = model._place_inducing(xt, [model.z(q) for q in range(2)], old)
    return model, xt, model._standardise(yt, mask), mask, priors


def test_continual_kls_computed_once_per_q_equal_the_direct_ones_for_every_q():
    """The M-step holds q at q* and its two continual KLs do not depend on the hyperparameters, so inside an update
    they are memoised per q: the bound must still be the one computed afresh, for q* and for any other q, and a q
    with gradients (the Adam E-step) must still get them."""
    model, xt, ys, mask, priors = _two_updates_and_priors(np.random.default_rng(12))
    with torch.no_grad():
        best = model._optimal_q(xt, ys, mask, priors)
        other = [(b.mean + 0.1, 0.9 * b.chol) for b in best]
        afresh = [model._bound(xt, ys, mask, priors, given=g)[1] for g in (best, other)]
    model._memo = {}
    try:
        for _ in range(2):  # the second round reads the memo
            for given, expected in zip((best, other), afresh):
                _, terms = model._bound(xt, ys, mask, priors, given=given)
                for name in ("kl_old", "kl_tilde"):
                    assert torch.equal(terms[name], expected[name]), name
                for name in ("ell", "kl_new"):  # (differentiable kernel path here, the in-place one above)
                    torch.testing.assert_close(terms[name].detach(), expected[name], rtol=1e-12, atol=0.0)
        assert sum(key[0] == "continual_kls" for key in model._memo) == 4  # two latents, two q
        mean = best[0].mean.clone().requires_grad_(True)
        _, terms = model._bound(xt, ys, mask, priors, given=[(mean, best[0].chol), best[1]])
        (grad,) = torch.autograd.grad(terms["kl_old"] - terms["kl_tilde"], mean)
        assert float(grad.abs().max()) > 0
    finally:
        model._memo = None


def test_q_star_whitened_by_the_current_factor_skips_the_solves_and_a_stale_one_does_not():
    """q* comes with its whitened mean and factor, which the bound uses while the prior factor is the very one it
    was solved under (same kernel and Z, from the memo); after a kernel change it whitens q* afresh."""
    model, xt, ys, mask, priors = _two_updates_and_priors(np.random.default_rng(16))
    model._memo = {}
    try:
        with torch.no_grad():
            best = model._optimal_q(xt, ys, mask, priors)
            plain = [(b.mean, b.chol) for b in best]
            for q, b in enumerate(best):
                assert b.factor is model._chol_K(model.kernels[q], model.z(q))
                torch.testing.assert_close(b.factor @ b.mean_w, b.mean, rtol=0, atol=1e-12)
                torch.testing.assert_close(b.factor @ b.chol_w, b.chol, rtol=0, atol=1e-12)
            for _ in range(2):  # the kernel as solved under, then changed
                value, terms = model._bound(xt, ys, mask, priors, given=best)
                reference, reference_terms = model._bound(xt, ys, mask, priors, given=plain)
                torch.testing.assert_close(value, reference, rtol=1e-10, atol=0.0)
                torch.testing.assert_close(terms["kl_new"], reference_terms["kl_new"], rtol=1e-10, atol=0.0)
                for p in model.kernels.parameters():
                    p.add_(0.2)
    finally:
        model._memo = None


def test_known_factors_carry_the_gradients_of_the_factorisation_and_the_solve():
    """A factor or a solve already computed without a graph is reused with gradients: KnownCholesky and KnownSolve
    return it and differentiate as torch's Cholesky and triangular solve do."""
    from gp_mapping.gp.linalg import KnownCholesky, KnownSolve

    rng = np.random.default_rng(17)
    B = torch.as_tensor(rng.standard_normal((12, 20)))
    K = (B @ B.T / 20 + 0.1 * torch.eye(12, dtype=torch.float64)).requires_grad_(True)
    R = torch.as_tensor(rng.standard_normal((12, 5))).requires_grad_(True)
    weights = torch.as_tensor(rng.standard_normal((12, 5)))

    def through_torch():
        L = torch.linalg.cholesky(K)
        return (torch.linalg.solve_triangular(L, R, upper=False) * weights).sum() + (L * L).sum()

    def through_known():
        with torch.no_grad():
            L0 = torch.linalg.cholesky(K)
            X0 = torch.linalg.solve_triangular(L0, R, upper=False)
        L = KnownCholesky.apply(K, L0)
        return (KnownSolve.apply(L, R, X0) * weights).sum() + (L * L).sum()

    # the solve alone, against a lower-triangular leaf
    L = (torch.as_tensor(rng.standard_normal((12, 12))).tril() + 4 * torch.eye(12, dtype=torch.float64)).requires_grad_(True)
    expected = torch.autograd.grad((torch.linalg.solve_triangular(L, R, upper=False) * weights).sum(), [L, R])
    known = torch.linalg.solve_triangular(L.detach(), R.detach(), upper=False)
    got = torch.autograd.grad((KnownSolve.apply(L, R, known) * weights).sum(), [L, R])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # and both in a chain
    expected = torch.autograd.grad(through_torch(), [K, R])
    value = through_known()
    got = torch.autograd.grad(value, [K, R])
    assert float(value.detach()) == pytest.approx(float(through_torch().detach()), rel=1e-14)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_m_step_gradient_with_the_update_memo_equals_the_plain_one(monkeypatch):
    """Inside an update the M-step's objective reuses the factors and the whitened q* of the E-step; its value and
    gradient must be those computed from scratch."""
    from gp_mapping.gp import linalg

    reused = []
    monkeypatch.setattr(linalg.KnownSolve, "apply",
                        lambda *args, apply=linalg.KnownSolve.apply: reused.append(1) or apply(*args))
    model, xt, ys, mask, priors = _two_updates_and_priors(np.random.default_rng(18))
    with torch.no_grad():
        for p in model.kernels.parameters():
            p.add_(0.3)
    params, _ = model._hyper_parameters()

    def value_and_gradient():
        with torch.no_grad():
            best = model._optimal_q(xt, ys, mask, priors)
        value = model._bound(xt, ys, mask, priors, given=best)[0]
        return value, torch.autograd.grad(value, params, allow_unused=True)

    plain_value, plain = value_and_gradient()
    assert not reused
    model._memo = {}
    try:
        memo_value, memo = value_and_gradient()
        assert len(reused) == 2 * 2  # the whitened mean and factor of both latents
    finally:
        model._memo = None
    torch.testing.assert_close(memo_value, plain_value, rtol=1e-10, atol=0.0)
    assert any(g is not None and float(g.abs().max()) > 1e-2 for g in plain)
    for a, b in zip(memo, plain):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_the_update_memo_is_bounded_and_lets_the_oldest_entries_go_first():
    """An update's memo holds at most 64 entries; beyond that the oldest (factors of hyperparameters the M-step has
    left) go, and the newest, which the next evaluations ask for, stay."""
    model = ContinualMOGP(config(), 2, 2, num_latents=2)
    model._memo = {}
    try:
        with torch.no_grad():
            tensors = [torch.zeros(1) for _ in range(100)]
            for i, t in enumerate(tensors):
                assert model._memoised("entry", (t,), (i,), lambda i=i: i) == i
            assert len(model._memo) == 64
            calls = []
            assert model._memoised("entry", (tensors[-1],), (99,), lambda: calls.append(1)) == 99 and not calls
            model._memoised("entry", (tensors[0],), (0,), lambda: calls.append(1))
            assert calls == [1]  # evicted, so computed again
    finally:
        model._memo = None


def test_placement_kernel_is_the_kernel_with_its_lengthscale_capped_and_follows_it():
    """Z is chosen under each latent's kernel with lengthscales capped at model.lengthscale: a copy kept per latent
    and refreshed from the kernel at every placement; the kernel itself is never touched."""
    model = ContinualMOGP(config(lengthscale=0.5, lengthscales="isotropic", constant_kernel=True), 2, 2, num_latents=2)
    x = torch.as_tensor(np.random.default_rng(13).uniform(0, 3, size=(20, 2)))
    assert model._placement_kernel(0) is model.kernels[0]  # latent 0 starts at 0.5 / 2 ** 0.5: not capped
    for lengthscale, variance in ((2.0, 1.3), (0.9, 0.7)):
        kernel = model.kernels[1]
        main = kernel.parts[0]
        main.lengthscale_param.set(lengthscale)
        main.variance_param.set(variance)
        capped = model._placement_kernel(1)
        reference = ContinualMOGP(config(lengthscale=0.5, lengthscales="isotropic", constant_kernel=True), 2, 2,
                                  num_latents=2).kernels[1]
        reference.load_state_dict(kernel.state_dict())
        reference.parts[0].lengthscale_param.set(0.5)
        assert capped is not kernel
        assert torch.equal(capped(x, x), reference(x, x))
        assert float(main.lengthscale.detach()) == pytest.approx(lengthscale)  # the kernel keeps its own
    assert model._placement_kernel(1) is capped  # one copy, refreshed


def test_a_full_inducing_set_moves_over_the_batch_and_stays_where_the_batch_is_covered():
    """With the budget used up, a batch that the set does not cover re-covers [Z_old; X] by pivoted Cholesky (the
    budget's size, old points first on ties); a covered batch leaves Z as it is."""
    from gp_mapping.gp.inducing import pivoted_cholesky

    model, xt, ys, mask, priors = _two_updates_and_priors(np.random.default_rng(14), num_inducing=10)
    z_old = model.z(0)
    assert z_old.shape[0] == 10
    kernel = model._placement_kernel(0)
    far = torch.as_tensor(np.random.default_rng(15).uniform(5, 6, size=(8, 2)))
    moved = model._select_inducing(0, far, z_old)
    cand = torch.cat([z_old, far])
    idx, _ = pivoted_cholesky(kernel, kernel.diag(cand), cand, 10, model.inducing_rel_tol)
    assert torch.equal(moved, cand[torch.sort(idx).values])
    assert moved.shape[0] == 10 and bool((moved[:, 0] > 4).any())
    assert torch.equal(model._select_inducing(0, z_old[:5].clone(), z_old), z_old)


# --------------------------------------------------------------- continual multi-task GPs paper, Table 1: no forgetting
def toy_function(x):
    return (4.5 * np.cos(2 * np.pi * x + 1.5 * np.pi) - 3.0 * np.sin(4.3 * np.pi * x + 0.3 * np.pi)
            + 5.0 * np.cos(7 * np.pi * x + 2.4 * np.pi))


def test_no_forgetting_streaming_toy_table1_protocol():
    """Paper Table 1: N = 2000 on [0, 1], 10 non-overlapping batches, a third held out for testing, RBF kernel,
    fixed noise sigma_n = 1.5. The NLPD on the first region after the tenth update stays within 5 % of its value
    after the first. (Inducing points come from pivoted Cholesky, not M(t) = 3t; lengthscale starts at 0.05.)"""
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(0, 1, 2000))
    y = toy_function(x) + 1.5 * rng.standard_normal(2000)
    test = rng.random(2000) < 1 / 3
    region = np.minimum((x * 10).astype(int), 9)
    model = ContinualMOGP(config(lengthscale=0.05, num_inducing=100, hyper_steps=10, hyper_lr=0.05), 1, 1,
                          num_latents=1, vem_iterations=2)
    first = (region == 0) & ~test
    model.set_standardisation([y[first].mean()], [y[first].std()])
    model.likelihood.noise_param.set(torch.tensor([1.5 ** 2 / y[first].std() ** 2]))
    model.likelihood.noise_param.raw.requires_grad_(False)  # the protocol fixes the noise

    def nlpd(r):
        s = (region == r) & test
        return float(-model.log_predictive_density(x[s, None], y[s, None]).mean())

    history, sizes = [], []
    for t in range(10):
        s = (region == t) & ~test
        z_before = model.z(0).clone()
        stats = model.update(x[s, None], y[s, None])
        assert stats["continual"] == (t > 0)
        # The inducing set grows and keeps every old point (first, in order).
        assert torch.equal(model.z(0)[: len(z_before)], z_before)
        sizes.append(model.num_inducing[0])
        history.append(nlpd(0))
        # The region just learnt is fitted: NLPD near the noise floor 0.5 log(2 pi e 1.5^2) = 1.824.
        assert nlpd(t) < 2.1
    assert sizes[-1] > sizes[0]
    assert abs(history[-1] - history[0]) <= 0.05 * history[0], history
    mean, _ = model.predict(x[test, None])
    rmse = float(np.sqrt(((mean[:, 0].numpy() - toy_function(x[test])) ** 2).mean()))
    assert rmse < 0.6  # the whole map, against the noise-free function (noise sd 1.5, signal sd about 5)


# ----------------------------------------------------------------------------- multi-output behaviour
def _lmc_truth(x):
    u = np.column_stack([np.sin(1.3 * x), np.cos(3.1 * x)])
    return u @ np.array([[1.0, 0.4], [-0.6, 0.9]]).T


def test_asynchronous_channels_give_the_synchronous_map():
    """The same five batches delivered with both channels at once, or channel by channel (the other one NaN):
    the two maps agree to within 10 % of each channel's spread, and both fit the truth to within the noise."""
    rng = np.random.default_rng(6)
    xs = [rng.uniform(0, 6, 60) for _ in range(5)]
    ys = [_lmc_truth(x) + 0.05 * rng.standard_normal((60, 2)) for x in xs]

    def make():
        return ContinualMOGP(config(num_inducing=40, hyper_steps=10), 1, 2, num_latents=2, vem_iterations=2)

    sync, asynchronous = make(), make()
    for x, y in zip(xs, ys):
        sync.update(x[:, None], y)
        for d in range(2):
            part = np.full_like(y, np.nan)
            part[:, d] = y[:, d]
            stats = asynchronous.update(x[:, None], part)
            assert stats["n_observed"] == [60 if c == d else 0 for c in range(2)]
    grid = np.linspace(0, 6, 200)[:, None]
    truth = _lmc_truth(grid[:, 0])
    ms, va_s = (t.numpy() for t in sync.predict(grid))
    ma, va_a = (t.numpy() for t in asynchronous.predict(grid))
    spread = truth.std(0)
    assert np.all(np.sqrt(((ms - ma) ** 2).mean(0)) < 0.1 * spread)
    assert np.all(np.sqrt(((ma - truth) ** 2).mean(0)) < 0.1 * spread)
    assert np.all(np.sqrt(((ms - truth) ** 2).mean(0)) < 0.1 * spread)
    assert asynchronous.num_seen == 600 and sync.num_seen == 300
    assert np.isfinite(va_a).all() and (va_a >= 0).all()


def test_channel_first_seen_late_is_standardised_then():
    rng = np.random.default_rng(8)
    x = rng.uniform(0, 4, (50, 1))
    y = np.column_stack([np.sin(x[:, 0]), 100.0 + 10.0 * np.cos(x[:, 0])])
    model = ContinualMOGP(config(hyper_steps=5), 1, 2, num_latents=2, vem_iterations=1)
    first = y.copy()
    first[:, 1] = np.nan
    model.update(x, first)
    assert bool(model.channel_seen[0]) and not bool(model.channel_seen[1])
    assert float(model.y_std[1]) == 1.0
    model.update(x, y)
    assert float(model.y_mean[1]) == pytest.approx(y[:, 1].mean())
    assert float(model.y_std[1]) == pytest.approx(y[:, 1].std())
    mean, var = model.predict(x)
    assert np.sqrt(((mean[:, 1].numpy() - y[:, 1]) ** 2).mean()) < 0.5  # 10 units of spread
    # A batch of rows with nothing observed changes nothing.
    before = model.state_dict()
    stats = model.update(x[:3], np.full((3, 2), np.nan))
    assert stats["n_rows"] == 0 and model.num_seen == 100
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_coregionalisation_recovers_known_mixing():
    """y = A u + noise with A (3 x 2) known and two unit-variance latents of lengthscale 0.5 over [0, 16].
    The latents share their kernel, so A is identifiable only up to a rotation (LMC identifiability): B is
    compared, not A. The realised latents are whitened over the sample (empirical covariance exactly I), so
    A A^T is also the sample covariance of f. What remains is the error of estimating a prior variance from
    one realisation 32 lengthscales long (about sqrt(2 / 18) = 0.33 per latent for independent draws;
    0.17-0.30 of ||B|| measured over six seeds, correlations off by 0.12-0.23). Tolerance: 0.35 relative
    Frobenius error (the identity, a B that knows nothing of the mixing, is 0.65 away) and 0.3 on every
    correlation coefficient."""
    rng = np.random.default_rng(0)
    n = 800
    x = np.sort(rng.uniform(0, 16, (n, 1)), 0)
    chol = np.linalg.cholesky(rbf(x, x, [0.5], 1.0) + 1e-8 * np.eye(n))
    U = chol @ rng.standard_normal((n, 2))
    U = U - U.mean(0)
    U = U @ np.linalg.inv(np.linalg.cholesky(U.T @ U / n)).T
    A = np.array([[1.0, 0.5], [-0.8, 0.6], [0.3, -1.2]])
    y = U @ A.T + 0.05 * rng.standard_normal((n, 3))
    model = ContinualMOGP(config(num_inducing=80, hyper_steps=20, lengthscale=0.5), 1, 3, num_latents=2,
                          vem_iterations=3, latent_lengthscale_ratio=1.0)
    for batch in np.array_split(rng.permutation(n), 4):
        model.update(x[batch], y[batch])
    B = model.coregionalisation().numpy()
    truth = A @ A.T
    assert np.linalg.norm(B - truth) / np.linalg.norm(truth) < 0.35
    corr = lambda m: m / np.sqrt(np.outer(np.diag(m), np.diag(m)))  # noqa: E731
    assert np.abs(corr(B) - corr(truth)).max() < 0.3
    assert np.linalg.norm(np.eye(3) - truth) / np.linalg.norm(truth) > 0.6
    # The map itself is good: f to within the noise everywhere.
    mean, _ = model.predict(x)
    assert np.sqrt(((mean.numpy() - U @ A.T) ** 2).mean()) < 0.05


# ----------------------------------------------------------------------------- state, modes, bad input
def test_state_dict_round_trip_predicts_identically_and_continues_identically():
    rng = np.random.default_rng(9)
    x = rng.uniform(0, 4, (120, 2))
    y = np.column_stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 0] * 0.3])
    cfg = config(hyper_steps=5, num_inducing=25)
    model = ContinualMOGP(cfg, 2, 3, num_latents=2, vem_iterations=1)
    model.update(x[:60], y[:60])
    model.update(x[60:90], y[60:90])
    state = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    fresh = ContinualMOGP(cfg, 2, 3, num_latents=2, vem_iterations=1)
    fresh.load_state_dict(state)
    grid = rng.uniform(0, 4, (50, 2))
    for a, b in zip(model.predict(grid), fresh.predict(grid)):
        assert torch.equal(a, b)
    assert fresh.num_seen == model.num_seen == 90 and fresh.num_inducing == model.num_inducing
    model.update(x[90:], y[90:])
    fresh.update(x[90:], y[90:])
    for a, b in zip(model.predict(grid), fresh.predict(grid)):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_fast_mode_keeps_hyperparameters_and_conditions_exactly():
    rng = np.random.default_rng(10)
    x = rng.uniform(0, 3, (80, 1))
    y = np.sin(2 * x) + 0.1 * rng.standard_normal((80, 1))
    model = ContinualMOGP(config(num_inducing=15), 1, 1, num_latents=1)
    model.update(x[:40], y[:40])
    hyper = [p.detach().clone() for p in model.kernels.parameters()]
    stats = model.update(x[40:], y[40:], mode="fast")
    assert stats["mode"] == "fast" and stats["hyper_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(hyper, model.kernels.parameters()))


def test_standing_still_and_far_away_stay_finite():
    """A robot standing still sends the same position many times: no duplicate inducing points, no NaN."""
    rng = np.random.default_rng(11)
    x = np.repeat(np.array([[1.0, 2.0]]), 200, axis=0)
    y = np.column_stack([3.0 + 0.01 * rng.standard_normal(200), -1.0 + 0.01 * rng.standard_normal(200)])
    model = ContinualMOGP(config(num_inducing=20), 2, 2, num_latents=2, vem_iterations=2)
    model.update(x, y)
    model.update(x + 1e-9, y)
    assert model.num_inducing == [1, 1]
    mean, var = model.predict(np.array([[1.0, 2.0], [1e4, -1e4]]))
    assert torch.isfinite(mean).all() and torch.isfinite(var).all() and (var >= 0).all()
    assert mean[0].numpy() == pytest.approx(y.mean(0), abs=0.01)
    lpd = model.log_predictive_density(x[:5], y[:5])
    assert torch.isfinite(lpd).all()


@pytest.mark.parametrize("x, y, what", [
    (np.zeros((3, 3)), np.zeros((3, 2)), "shape"),
    (np.zeros((3, 2)), np.zeros((4, 2)), "rows"),
    (np.array([[0.0, np.nan]] * 3), np.zeros((3, 2)), "NaN or Inf"),
    (np.zeros((3, 2)), np.array([[np.inf, 0.0]] * 3), "Inf"),
    (np.zeros((3, 2)), np.zeros((3, 3)), "shape"),
    (np.zeros((3, 2)), [["a", "b"]] * 3, "real numbers"),
    (torch.zeros(3, 2, dtype=torch.bool), np.zeros((3, 2)), "real numbers"),
])
def test_bad_input_is_refused_with_a_message(x, y, what):
    model = ContinualMOGP(config(), 2, 2, num_latents=2)
    with pytest.raises(ModelInputError, match=what):
        model.update(x, y)
    assert model.num_seen == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_latents"):
        ContinualMOGP(config(), 2, 2, num_latents=0)
    with pytest.raises(ValueError, match="mixing_learning"):
        ContinualMOGP(config(), 2, 2, mixing_learning="sometimes")
    with pytest.raises(ValueError, match="inducing policy"):
        ContinualMOGP(config(inducing="grid"), 2, 2)
    with pytest.raises(ValueError, match="output_dims"):
        ContinualMOGP(config(), 2, 0)
    model = ContinualMOGP(config(), 1, 1, num_latents=1)
    with pytest.raises(ValueError, match="mode"):
        model.update(np.zeros((2, 1)), np.zeros((2, 1)), mode="slow")
    with pytest.raises(ModelInputError, match="every target"):
        model.log_predictive_density(np.zeros((2, 1)), np.array([[np.nan], [0.0]]))


# ----------------------------------------------------------------------------- the engine behind the Mapper
def test_mapper_vector_target_with_continual_mogp_engine(tmp_path):
    """model.engine continual_mogp through the one registry (build_model): a magnetometer turning with the robot
    over a smooth map-frame field gives per-component layers x, y, z that match the truth, a norm layer that is
    |m| with the delta-method variance of the components, and a state file that reloads to the same map."""
    from gp_mapping.config import config_from_dict
    from gp_mapping.gp import ENGINES, build_model
    from gp_mapping.mapping.frames import quaternion_from_rpy, rotate_vectors
    from gp_mapping.mapping.mapper import Mapper

    assert ENGINES["continual_mogp"] is ContinualMOGP
    assert isinstance(build_model({"engine": "continual_mogp", "num_latents": 2, "device": "cpu", "tile_size": 0.0},
                                  2, 3), ContinualMOGP)

    def field(px, py):  # uT, map frame
        return np.stack([20.0 + 2.0 * np.sin(px), -5.0 + 2.0 * np.cos(py), -42.0 + np.sin(px + py)], axis=-1)

    cfg = config_from_dict({
        "model": {"engine": "continual_mogp", "num_latents": 3, "num_inducing": 40, "hyper_steps": 10,
                  "vem_iterations": 2, "lengthscale": 1.0, "device": "cpu", "tile_size": 0.0},
        "sync": {"target": "vector"},
        "batching": {"size": 120},
        "grid": {"resolution": 0.25, "margin": 0.0, "unknown_distance": 0.3, "tile_size": 50},
    })
    mapper = Mapper(cfg)
    assert isinstance(mapper.model, ContinualMOGP) and mapper.model.num_latents == 3
    # Lawnmower over [0, 3]^2 (lanes 0.5 m apart) at 0.5 m/s; poses at 10 Hz, field samples at 20 Hz between.
    lanes = []
    for k, ly in enumerate(np.arange(0.0, 3.01, 0.5)):
        xs = np.arange(0.0, 3.01, 0.05)
        lanes.append(np.column_stack([xs if k % 2 == 0 else xs[::-1], np.full_like(xs, ly)]))
    xy = np.vstack(lanes)
    t = np.arange(len(xy)) * 0.1
    yaw = np.unwrap(np.arctan2(*np.gradient(xy, axis=0)[:, ::-1].T))
    for k in range(len(t)):
        mapper.add_pose(t[k], [xy[k, 0], xy[k, 1], 0.0], quaternion_from_rpy(0.0, 0.0, yaw[k]))
        if k:
            s = t[k] - 0.05
            p = 0.5 * (xy[k] + xy[k - 1])
            # The sensor (identity extrinsic) reads the map-frame field in the body frame: R^T b.
            b_body = rotate_vectors(quaternion_from_rpy(0.0, 0.0, -0.5 * (yaw[k] + yaw[k - 1])), field(*p)[None])[0]
            mapper.add_magnetic_field(s, b_body * 1e-6)
        mapper.process()
    mapper.flush()
    assert mapper.updates >= 4 and mapper.failed_updates == 0
    grid = mapper.grid()
    assert set(grid.layers) == {"x", "y", "z", "norm"}
    gx, gy = np.meshgrid(grid.spec.column_centres(), grid.spec.row_centres())
    truth = field(gx, gy)
    known = grid.known
    assert known.sum() > 100
    for k, name in enumerate("xyz"):
        mean, var = grid.layers[name]
        assert np.isfinite(mean).all() and (var >= 0).all()
        rmse = np.sqrt(((mean - truth[..., k])[known] ** 2).mean())
        assert rmse < 0.1, (name, rmse)  # amplitude 1-2 uT, noise-free readings; measured 0.015-0.022
    # The norm layer from the component layers: |m| and sum_i (m_i / |m|)^2 var_i (delta method, diagonal).
    m = np.stack([grid.layers[c][0] for c in "xyz"], -1)
    v = np.stack([grid.layers[c][1] for c in "xyz"], -1)
    norm, var_norm = grid.layers["norm"]
    assert np.allclose(norm, np.linalg.norm(m, axis=-1), rtol=1e-12)
    assert np.allclose(var_norm, (m * m * v).sum(-1) / (m * m).sum(-1), rtol=1e-10)
    assert np.sqrt(((norm - np.linalg.norm(truth, axis=-1))[known] ** 2).mean()) < 0.1
    # The layers are the model's predictions at the cell centres.
    mean, var = mapper.model.predict(np.column_stack([gx.ravel(), gy.ravel()]))
    assert np.allclose(grid.layers["z"][0].ravel(), mean[:, 2].numpy(), atol=1e-10)
    assert np.allclose(grid.layers["y"][1].ravel(), var[:, 1].numpy(), atol=1e-10)
    # The state file reloads to the same map (inducing sets of the saved sizes).
    mapper.save(tmp_path / "map.gpmap")
    again = Mapper.load(tmp_path / "map.gpmap")
    assert again.model.num_inducing == mapper.model.num_inducing
    for name, (mean, var) in again.grid().layers.items():
        assert np.array_equal(mean, grid.layers[name][0]) and np.array_equal(var, grid.layers[name][1])
