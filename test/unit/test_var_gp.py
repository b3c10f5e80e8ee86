"""VAR-GP engine (gp/var_gp/; Kapoor et al. 2021): the closed-form D_t, the App. C.3 joint, the reduction to one
SVGP, block placement, state round trips, hyperparameters at rest, the two-task classification check and bad
input."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gp_mapping.gp import ConfigError, ModelConfig, ModelInputError, build_model
from gp_mapping.gp.var_gp import VARGP, ar_joint, block_kl

torch.set_num_threads(1)


def _dense_kl(m1, S1, m2, S2) -> float:
    k = m1.shape[0]
    S2i = torch.linalg.inv(S2)
    d = m2 - m1
    return float(0.5 * (torch.trace(S2i @ S1) + d @ S2i @ d - k + torch.logdet(S2) - torch.logdet(S1)))


def _path(t0: float, t1: float, n: int, offset=(0.0, 0.0)) -> np.ndarray:
    t = np.linspace(t0, t1, n)
    return np.stack([t + offset[0], 0.6 * np.sin(t) + offset[1]], 1)


def _field(x: np.ndarray) -> np.ndarray:
    return (np.sin(1.3 * x[:, 0]) + 0.5 * np.cos(0.9 * x[:, 1]))[:, None]


def _stream(model, segments: int = 6, per: int = 60, seed: int = 0, noise: float = 0.05):
    rng = np.random.default_rng(seed)
    for b in range(segments):
        x = _path(1.5 * b, 1.5 * (b + 1), per)
        model.update(x, _field(x) + noise * rng.standard_normal((per, 1)))


def _fixed(**kw) -> ModelConfig:
    """Hyperparameters fixed and predictions at the q(theta) mean: the tests of the algebra."""
    base = dict(engine="var_gp", device="cpu", kernel="rbf", num_inducing=60, vargp_block_size=6,
                vargp_neighbours=0, learn_hyperparameters=False, vargp_predict_samples=1, lengthscale=0.8)
    base.update(kw)
    return ModelConfig(**base)


def _prior_conditionals(model: VARGP):
    """Per block, (A_j over all earlier blocks' points, chol C_j) from the engine's factors at the q(theta) mean."""
    blocks = list(range(model.num_blocks))
    fac = model._factors(model.q_mu.detach(), blocks)
    A = []
    for i in blocks:
        width = fac.slices[i].start
        a = torch.zeros(fac.slices[i].stop - width, width, dtype=torch.float64)
        if fac.parents[i]:
            cols = torch.cat([torch.arange(fac.slices[k].start, fac.slices[k].stop) for k in fac.parents[i]])
            a[:, cols] = fac.G[i].T @ torch.linalg.inv(fac.LP[i])
        A.append(a)
    return fac, A


def test_d_t_is_the_kl_of_the_joints_and_independent_of_the_old_blocks():
    """Chain rule: KL[q(u1) q(u2|u1) || q(u1) p(u2|u1)] = E_q(u1) D_2 = D_2, closed form with no u_<t; and the
    engine's A_t, C_t are the paper's K_{t,<t} K_{<t}^{-1} and K_tt - K_{t,<t} K_{<t}^{-1} K_{<t,t}."""
    model = build_model(_fixed(), 2, 1)
    _stream(model, segments=3)
    assert model.num_blocks >= 2
    fac, A = _prior_conditionals(model)
    kern = fac.kern
    z1, z2 = fac.Z[fac.slices[0]], fac.Z[fac.slices[1]]
    jit = model.jitter * float(fac.kdiag(z1[:1])[0])
    K11 = kern(z1, z1) + jit * torch.eye(z1.shape[0], dtype=torch.float64)
    K21, K22 = kern(z2, z1), kern(z2, z2)
    A_ref = torch.linalg.solve(K11, K21.T).T
    C_ref = K22 - A_ref @ K21.T + jit * torch.eye(z2.shape[0], dtype=torch.float64)
    LC = fac.LC[1]
    assert torch.allclose(A[1], A_ref, atol=1e-8) and torch.allclose(LC @ LC.T, C_ref, atol=1e-10)
    rng = torch.Generator().manual_seed(3)
    c1, c2 = z1.shape[0], z2.shape[0]
    m1, m2 = torch.randn(c1, 1, generator=rng, dtype=torch.float64), torch.randn(c2, 1, generator=rng,
                                                                                  dtype=torch.float64)
    L1 = torch.tril(torch.randn(1, c1, c1, generator=rng, dtype=torch.float64)) * 0.3 + torch.eye(c1)
    L2 = (torch.tril(torch.randn(1, c2, c2, generator=rng, dtype=torch.float64)) * 0.1 + 0.5 * torch.eye(c2))
    mq, Sq = ar_joint([m1, m2], [L1, L2], [None, A[1]])
    mp, Sp = ar_joint([m1, torch.zeros_like(m2)], [L1, LC[None]], [None, A[1]])
    brute = _dense_kl(mq[:, 0], Sq[0], mp[:, 0], Sp[0])
    closed = float(block_kl(m2, L2, LC)[0])
    naive = _dense_kl(m2[:, 0], (L2 @ L2.transpose(-1, -2))[0], torch.zeros(c2, dtype=torch.float64), C_ref)
    assert closed == pytest.approx(brute, rel=1e-7) and closed == pytest.approx(naive, rel=1e-7)
    # the old block's q does not enter: another q(u1) gives the same D_2
    mq2, Sq2 = ar_joint([3 * m1, m2], [2 * L1, L2], [None, A[1]])
    mp2, Sp2 = ar_joint([3 * m1, torch.zeros_like(m2)], [2 * L1, LC[None]], [None, A[1]])
    assert _dense_kl(mq2[:, 0], Sq2[0], mp2[:, 0], Sp2[0]) == pytest.approx(brute, rel=1e-6)


def test_app_c3_joint_matches_sampling_the_autoregressive_chain():
    rng = torch.Generator().manual_seed(0)
    sizes = (3, 2, 3)
    ms = [torch.randn(c, 2, generator=rng, dtype=torch.float64) for c in sizes]
    Ls = [torch.tril(torch.randn(2, c, c, generator=rng, dtype=torch.float64)) * 0.4 + 0.6 * torch.eye(c)
          for c in sizes]
    As = [None, torch.randn(2, 3, generator=rng, dtype=torch.float64) * 0.7,
          torch.randn(3, 5, generator=rng, dtype=torch.float64) * 0.5]
    mean, cov = ar_joint(ms, Ls, As)
    n = 200_000
    samples = []
    for j, (m, L, a) in enumerate(zip(ms, Ls, As)):
        e = torch.randn(n, 2, m.shape[0], 1, generator=rng, dtype=torch.float64)
        u = m.T[None] + (L[None] @ e)[..., 0]                               # (n, P, c)
        if a is not None:
            prev = torch.cat(samples, 2)
            u = u + prev @ a.T
        samples.append(u)
    u = torch.cat(samples, 2)                                                # (n, P, M)
    assert torch.allclose(u.mean(0).T, mean, atol=0.02)
    centred = u - u.mean(0)
    emp = torch.einsum("npi,npj->pij", centred, centred) / (n - 1)
    assert torch.allclose(emp, cov, atol=0.03)


def test_prediction_is_the_svgp_marginal_of_the_joint_over_all_blocks():
    """The whitened, block-by-block prediction equals k^T K^-1 mu and k_xx - k^T K^-1 k + k^T K^-1 Sigma K^-1 k with
    the App. C.3 joint (mu, Sigma), K the blocks' prior covariance (the kernel's, up to the jitter)."""
    model = build_model(_fixed(), 2, 1)
    _stream(model, segments=6)
    assert model.num_blocks >= 3 and model.distillations_t == 0
    fac, A = _prior_conditionals(model)
    c = [s.stop - s.start for s in fac.slices]
    mu, Sigma = ar_joint([model.m[j, :c[j]] for j in range(model.num_blocks)],
                         [model.S_chol[j, :, :c[j], :c[j]] for j in range(model.num_blocks)], A)
    zeros = [torch.zeros(cj, 1, dtype=torch.float64) for cj in c]
    _, Kt = ar_joint(zeros, [fac.LC[j][None] for j in range(model.num_blocks)], A)
    K = fac.kern(fac.Z, fac.Z)
    assert torch.allclose(Kt[0], K, atol=1e-4 * float(K.diagonal().mean()))
    x = torch.as_tensor(_path(-0.5, 9.5, 40, (0.0, 0.3)))
    kx = fac.kern(fac.Z, x)
    Ki_k = torch.linalg.solve(Kt[0], kx)
    mean_ref = Ki_k.T @ mu
    var_ref = fac.kdiag(x) - (kx * Ki_k).sum(0) + (Ki_k * (Sigma[0] @ Ki_k)).sum(0)
    mean, var = model._latent(x)
    assert torch.allclose(mean, mean_ref, atol=1e-7) and torch.allclose(var[:, 0], var_ref, atol=1e-7)


def test_one_block_is_the_exact_sparse_gp_posterior_with_the_same_z():
    model = build_model(_fixed(num_inducing=80, vargp_block_size=40, vargp_new_block=1.0), 2, 1)
    _stream(model, segments=3, per=50)
    assert model.num_blocks == 1 and model.num_inducing > 10
    Z, X, y = model.inducing_inputs(), model.buf_x, model.buf_y
    assert X.shape[0] == 150 and bool((model.buf_w == 1).all())
    kern = model._kernel_at(model.q_mu.detach())[0]
    jit = model.jitter * float(model.kernel.diag(Z[:1])[0])
    K = kern(Z, Z) + jit * torch.eye(Z.shape[0], dtype=torch.float64)
    Kuf = kern(Z, X)
    s2 = float(model.likelihood.noise_variance[0].detach())
    # Titsias (2009): q(u) = N(K P^-1 Kuf y / s2, K P^-1 K) with P = K + Kuf Kfu / s2
    P = K + Kuf @ Kuf.T / s2
    m_ref = K @ torch.linalg.solve(P, Kuf @ y) / s2
    S_ref = K @ torch.linalg.solve(P, K)
    c = model.num_inducing
    S = model.S_chol[0, 0, :c, :c] @ model.S_chol[0, 0, :c, :c].T
    assert torch.allclose(model.m[0, :c], m_ref, atol=1e-6) and torch.allclose(S, S_ref, atol=1e-6)
    xs = torch.as_tensor(_path(0.0, 4.5, 30, (0.1, 0.2)))
    kx = kern(Z, xs)
    mean_ref = kx.T @ torch.linalg.solve(K, m_ref)
    Ki_k = torch.linalg.solve(K, kx)
    var_ref = model.kernel.diag(xs) - (kx * Ki_k).sum(0) + (Ki_k * (S_ref @ Ki_k)).sum(0)
    mean, var = model._latent(xs)
    assert torch.allclose(mean, mean_ref, atol=1e-6) and torch.allclose(var[:, 0], var_ref, atol=1e-6)


def test_blocks_open_where_the_map_is_not_covered_and_revisits_only_add_information():
    grid = torch.as_tensor(_path(0.0, 7.5, 80, (0.0, 0.1)))
    for revisits in ("freeze", "refine"):
        model = build_model(_fixed(vargp_neighbours=2, vargp_revisits=revisits), 2, 1)
        _stream(model, segments=5)
        assert model.num_blocks >= 3 and model.distillations_t == 0
        assert int(model.parent_mask.sum(1).max()) <= 2
        frozen = (model.Z[:-1].clone(), model.m[:-1].clone(), model.S_chol[:-1].clone())
        n_blocks = model.num_blocks
        var0 = model.predict(grid)[1]
        # driving back over the first segment opens no block
        x = _path(0.0, 1.5, 60)
        stats = model.update(x, _field(x))
        assert stats["blocks_opened"] == 0 and model.num_blocks == n_blocks
        assert torch.equal(model.Z[:-1], frozen[0])
        if revisits == "freeze":  # the paper's frozen blocks: nothing rewritten
            assert stats["revisit_points"] == 0
            assert torch.equal(model.m[:-1], frozen[1]) and torch.equal(model.S_chol[:-1], frozen[2])
        else:  # refined by streaming Bayes: the map is nowhere less certain than before, and more certain there
            assert stats["revisit_points"] == 60
            var1 = model.predict(grid)[1]
            assert bool((var1 <= var0 * (1 + 1e-9) + 1e-12).all())
            assert float((var1 / var0)[:10].max()) < 1.0 - 1e-6


def test_distillation_bounds_the_inducing_points_and_keeps_the_map():
    x = torch.as_tensor(_path(0.0, 12.0, 200))
    truth = torch.as_tensor(_field(x.numpy()))
    rmse = {}
    for cap in (120, 18):
        model = build_model(_fixed(num_inducing=cap, vargp_block_size=6), 2, 1)
        _stream(model, segments=8)
        rmse[cap] = float(((model.predict(x)[0] - truth) ** 2).mean().sqrt())
        if cap == 18:
            assert model.distillations_t >= 1 and model.num_inducing <= 18 and model.num_blocks <= 4
        else:
            assert model.distillations_t == 0 and model.num_inducing > 18
    # the same stream, 18 points instead of all: the map of a field with this lengthscale stays usable
    print(rmse)
    assert rmse[120] < 0.05 and rmse[18] < 4 * rmse[120] + 0.05, rmse


def test_distilling_without_dropping_points_keeps_the_map_mean():
    """Distillation keeps the merged blocks' joint marginal and re-expresses the blocks conditioned on them with
    their means exact: with the points kept (cap far away), the predictive mean does not move."""
    model = build_model(_fixed(num_inducing=400), 2, 1)
    _stream(model, segments=5)
    assert model.num_blocks >= 3 and bool(model.parent_mask[2, 0] & model.parent_mask[2, 1])
    x = torch.as_tensor(_path(0.0, 7.5, 60, (0.0, 0.2)))
    mean0, var0 = model.predict(x)
    blocks, points = model.num_blocks, model.num_inducing

    def joint_mean():
        fac, A = _prior_conditionals(model)
        c = [s.stop - s.start for s in fac.slices]
        mu, _ = ar_joint([model.m[j, :c[j]] for j in range(model.num_blocks)],
                         [model.S_chol[j, :, :c[j], :c[j]] for j in range(model.num_blocks)], A)
        return fac.Z, mu

    z0, mu0 = joint_mean()
    with torch.no_grad():
        model._distil_oldest()
    model._drop_caches()
    # (a point that the merged set holds below pivoted Cholesky's threshold may go)
    assert model.num_blocks == blocks - 1 and points - 1 <= model.num_inducing <= points
    z1, mu1 = joint_mean()
    match = (z1[:, None, :] == z0[None, :, :]).all(-1).float().argmax(1)
    assert torch.equal(z0[match], z1) and torch.allclose(mu1, mu0[match], atol=1e-8)  # E[u] kept exactly
    mean1, var1 = model.predict(x)
    assert torch.allclose(mean1, mean0, atol=0.01)
    ratio = var1 / var0  # the re-expressed covariance is approximate (the family fixes Cov(u_j, u_P) = A_j Cov(u_P))
    print(f"variance ratio after distillation: {float(ratio.min()):.2f} .. {float(ratio.max()):.2f}")
    assert bool((var1 > 0).all()) and 0.5 < float(ratio.min()) and float(ratio.max()) < 2.0


def test_state_round_trip_resizes_and_continues_identically():
    cfg = ModelConfig(engine="var_gp", device="cpu", num_inducing=18, vargp_block_size=6, hyper_steps=3,
                      vargp_neighbours=2)
    model = build_model(cfg, 2, 1)
    _stream(model, segments=5)
    fresh = build_model(cfg, 2, 1)
    fresh.load_state_dict(model.state_dict())
    assert fresh.num_blocks == model.num_blocks and torch.equal(fresh.q_logsd, model.q_logsd)
    x = torch.as_tensor(_path(0.0, 9.0, 50, (0.0, 0.2)))
    assert all(torch.equal(a, b) for a, b in zip(model.predict(x), fresh.predict(x)))
    rng = np.random.default_rng(9)
    for b in range(5, 8):
        xb = _path(1.5 * b, 1.5 * (b + 1), 60)
        yb = _field(xb) + 0.05 * rng.standard_normal((60, 1))
        model.update(xb, yb)
        fresh.update(xb, yb)
    assert all(torch.equal(a, b) for a, b in zip(model.predict(x), fresh.predict(x)))
    assert torch.equal(model.q_mu, fresh.q_mu)


def test_prediction_mixes_theta_draws_by_the_law_of_total_variance():
    model = build_model(ModelConfig(engine="var_gp", device="cpu", num_inducing=48, vargp_block_size=12,
                                    vargp_predict_samples=4, hyper_steps=5), 2, 1)
    _stream(model, segments=3)
    with torch.no_grad():
        model.q_logsd.fill_(math.log(0.2))  # a wide q(theta), so the draws differ
    model._drop_caches()
    x = torch.as_tensor(_path(0.0, 4.0, 25))
    mean, var = model._latent(x)
    _, draws = model._prediction_cache()
    Z = model.inducing_inputs()
    ms, vs = [], []
    for kern, kdiag, alpha, Q in draws:
        k = kern(x, Z)
        ms.append(k @ alpha)
        vs.append(kdiag(x)[:, None] + ((k @ Q[0]) * k).sum(1, keepdim=True))
    ms, vs = torch.stack(ms), torch.stack(vs)
    assert float(ms.std(0).max()) > 1e-3  # the draws disagree somewhere
    assert torch.allclose(mean, ms.mean(0)) and torch.allclose(var, vs.mean(0) + ms.var(0, unbiased=False))


def test_bad_input_and_settings_are_refused():
    model = build_model(ModelConfig(engine="var_gp", device="cpu"), 2, 1)
    with pytest.raises(ModelInputError):
        model.update([[0.0, math.nan]], [[1.0]])
    with pytest.raises(ModelInputError):
        model.update(np.zeros((3, 3)), np.zeros((3, 1)))
    with pytest.raises(ModelInputError):
        model.update(np.zeros((3, 2)), np.zeros((2, 1)))
    with pytest.raises(ModelInputError):
        model.predict([[math.inf, 0.0]])
    assert model.num_seen == 0 and model.num_blocks == 0
    mean, var = model.predict(np.zeros((2, 2)))  # the prior before any data
    assert bool(torch.isfinite(mean).all()) and bool((var > 0).all())
    classifier = build_model(ModelConfig(engine="var_gp", device="cpu", likelihood="bernoulli"), 2, 1)
    with pytest.raises(ModelInputError, match="0 or 1"):
        classifier.update(np.zeros((2, 2)), [[0.5], [1.0]])
    with pytest.raises(ConfigError, match="num_inducing"):
        build_model(ModelConfig(engine="var_gp", device="cpu", num_inducing=1), 2, 1)
    with pytest.raises(ConfigError, match="inducing"):
        build_model(ModelConfig(engine="var_gp", device="cpu", inducing="grid"), 2, 1)


def _rest_experiment(name: str, **kw) -> tuple[float, float, float]:
    """40 s of driving at 10 Hz, then 60 s at rest (pose jitter 2 mm): (largest relative change of the learned
    lengthscales, q(theta) mean for var_gp; largest change of the map's mean on a grid over the drive more than
    1 m from where the robot stood, in predictive standard deviations before the rest; the same in field units)."""
    def field(x):
        return (np.sin(1.1 * x[:, 0]) + 0.5 * np.cos(0.8 * x[:, 1]))[:, None]

    def lengthscales(m):
        if isinstance(m, VARGP):
            return m.lengthscale_mean.numpy().copy()
        return m.kernel.parts[0].lengthscale.detach().numpy().copy()

    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(np.linspace(0, 8, 24), np.linspace(-3, 3, 16)), -1).reshape(-1, 2)
    model = build_model(ModelConfig(engine=name, device="cpu", num_inducing=128, seed=0, **kw), 2, 1)
    rate = 10
    for b in range(40):
        t = b + np.arange(rate) / rate
        x = np.stack([0.2 * t, 2.5 * np.sin(0.5 * t)], 1)
        model.update(x, field(x) + 0.05 * rng.standard_normal((rate, 1)))
    ls0 = lengthscales(model)
    mean0, var0 = (a.numpy() for a in model.predict(grid))
    for b in range(60):
        xr = x[-1] + 0.002 * rng.standard_normal((rate, 2))
        model.update(xr, field(xr) + 0.05 * rng.standard_normal((rate, 1)))
    ls1, mean1 = lengthscales(model), model.predict(grid)[0].numpy()
    change = np.abs(mean1 - mean0)
    away = np.linalg.norm(grid - x[-1], axis=1) > 1.0  # where the robot stood, its readings rightly sharpen the map
    return (float(np.abs(ls1 / ls0 - 1).max()), float((change / np.sqrt(var0))[away].max()),
            float(change[away].max()))


def test_robot_at_rest_leaves_the_hyperparameters_and_the_map(monkeypatch):
    """60 s at rest in the middle of a drive: q(theta)'s mean lengthscales move by less than 10 % and the map by
    less than half a predictive standard deviation anywhere more than 1 m from the robot (where it stands, the
    readings at rest sharpen the map, as they should). As shipped every engine refuses hyperparameter steps on batches that do not
    span space (base.spans_space), so dual_svgp does not drift either. With that rule switched off, var_gp with
    the paper's beta = 10 holds its lengthscales within 10 % and its map better than dual_svgp's point estimates
    (measured 5.3 % / 0.10 sd against 11 % / 0.39 sd; beta = 1: 2.1 % / 0.44 sd)."""
    ls, shift, _ = _rest_experiment("var_gp")
    assert ls < 0.10 and shift < 0.5, (ls, shift)
    import gp_mapping.gp.dual_svgp.model as dual_module
    import gp_mapping.gp.var_gp.model as var_module
    monkeypatch.setattr(var_module, "spans_space", lambda x, lengthscale: True)
    monkeypatch.setattr(dual_module, "spans_space", lambda x, lengthscale: True)
    ls_v, shift_v, abs_v = _rest_experiment("var_gp", vargp_beta=10.0)
    ls_d, shift_d, abs_d = _rest_experiment("dual_svgp")
    print(f"no rest rule: var_gp (beta 10) lengthscale {ls_v:.3f} map {shift_v:.2f} sd ({abs_v:.3f}); "
          f"dual_svgp {ls_d:.3f} {shift_d:.2f} sd ({abs_d:.3f})")
    assert ls_v < 0.10 and shift_v < 0.5, (ls_v, shift_v)
    assert ls_d > ls_v and shift_d > shift_v, (ls_d, shift_d, ls_v, shift_v)


def test_two_task_classification_keeps_task_one_where_a_global_inducing_set_forgets():
    """The paper's synthetic check (Figs 1-2): task 1 separates classes 0 and 1 on the left, task 2 classes 2 and 3
    on the right (binary labels, the right pair's sides swapped). VAR-GP's task-1 accuracy after task 2 stays
    within 2 points of its value after task 1; one global inducing set of the same total M that moves to the
    new task's data (dual_svgp, old part projected onto the new Z, no memory: the paper's "Global") forgets."""
    rng = np.random.default_rng(10)

    def blobs(centres, n):
        x = np.concatenate([np.asarray(c) + 0.6 * rng.standard_normal((n, 2)) for c in centres])
        y = np.repeat([0.0, 1.0], n)[:, None]
        p = rng.permutation(len(x))
        return x[p], y[p]

    left, right = [(-3.0, -1.0), (-3.0, 1.0)], [(3.0, 1.0), (3.0, -1.0)]
    tasks, test1 = [blobs(left, 150), blobs(right, 150)], blobs(left, 500)

    def accuracy(model):
        return float(((model.predict(test1[0])[0].numpy()[:, 0] > 0) == (test1[1][:, 0] > 0.5)).mean())

    m_total = 40
    common = dict(device="cpu", likelihood="bernoulli", num_inducing=m_total, lengthscale=1.0,
                  constant_kernel=False, tile_size=0.0)  # one global inducing set against the blocks
    var = build_model(ModelConfig(engine="var_gp", vargp_block_size=m_total // 2, hyper_steps=30, **common), 2, 1)
    # (fixed hyperparameters: with learned ones the global set forgets as much, but on some draws the residue
    # of task 1 left by the projection still has the right sign at probabilities near 0.5)
    glob = build_model(ModelConfig(engine="dual_svgp", memory_size=0, learn_hyperparameters=False, **common), 2, 1)
    from gp_mapping.gp.inducing import pivoted_cholesky

    acc = {}
    for k, (x, y) in enumerate(tasks):
        xt = torch.as_tensor(x)
        idx, _ = pivoted_cholesky(glob.kernel, glob.kernel.diag(xt), xt, m_total)
        glob.set_inducing_points(xt[idx])
        for b in range(0, len(x), 50):
            var.update(x[b:b + 50], y[b:b + 50])
            glob.update(x[b:b + 50], y[b:b + 50])
        acc[k] = (accuracy(var), accuracy(glob))
    assert var.num_blocks == 2 and var.num_inducing <= m_total
    assert acc[0][0] > 0.9 and acc[0][1] > 0.9, acc
    assert abs(acc[1][0] - acc[0][0]) <= 0.02, acc
    assert acc[1][1] < 0.5, acc  # the global set predicts task 2's rule on task 1's region


def test_mapper_maps_saves_and_reloads_with_var_gp(tmp_path):
    """The Mapper (node and replay share it) runs the engine unchanged: vector field target, grid, state file."""
    from gp_mapping.config import config_from_dict
    from gp_mapping.mapping.frames import quaternion_from_rpy
    from gp_mapping.mapping.mapper import Mapper

    cfg = config_from_dict({"model": {"engine": "var_gp", "device": "cpu", "num_inducing": 64,
                                      "vargp_block_size": 16, "lengthscale": 0.5, "hyper_steps": 3},
                            "batching": {"mode": "count", "size": 40},
                            "grid": {"resolution": 0.2, "margin": 0.2, "unknown_distance": 0.4}})
    mapper = Mapper(cfg)
    t = np.arange(0.0, 12.0, 0.05)
    xy = np.stack([0.3 * t, np.sin(0.4 * t)], 1)
    for i, (s, p) in enumerate(zip(t, xy)):
        mapper.add_pose(s, [p[0], p[1], 0.0], quaternion_from_rpy(0.0, 0.0, 0.0))
        if 1 <= i < len(t) - 1:
            b = 40.0 + 3.0 * np.sin(2.0 * p[0]) + np.cos(1.5 * p[1])
            mapper.add_magnetic_field(s + 0.01, [b * 1e-6, 2e-6, -30e-6])
        mapper.process()
    mapper.flush()
    assert mapper.model.num_blocks >= 2
    grid = mapper.grid()
    name = next(iter(grid.layers))
    mean = grid.layers[name][0]
    assert np.isfinite(mean[grid.known]).all()
    path = tmp_path / "map.safetensors"
    mapper.save(path)
    loaded = Mapper.load(path)
    np.testing.assert_array_equal(loaded.grid().layers[name][0], mean)
