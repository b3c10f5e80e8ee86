"""GP baselines against closed forms written here in numpy (exact GP posterior, Titsias' optimal q(u))."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gpytorch")

from gp_mapping.evaluation.baselines import (BaselineError, ExactGPBaseline, KernelSpec, OfflineSVGP,  # noqa: E402
                                  StreamingSparseGP, gaussian_log_density, nlpd)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SPEC = KernelSpec(kernel="matern52", lengthscales="per_axis", constant_kernel=True, lengthscale=0.7,
                  signal_variance=1.3, constant_variance=0.4, noise_variance=0.05)


def _matern52_plus_constant(a: np.ndarray, b: np.ndarray, spec: KernelSpec) -> np.ndarray:
    d = (a[:, None, :] - b[None, :, :]) / spec.lengthscale
    r = np.sqrt(np.maximum(np.sum(d * d, axis=-1), 0.0))
    s5 = np.sqrt(5.0) * r
    return spec.signal_variance * (1.0 + s5 + s5 ** 2 / 3.0) * np.exp(-s5) + spec.constant_variance


def _data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2.0, 2.0, size=(n, 2))
    y = 40.0 + 3.0 * np.sin(1.5 * x[:, 0]) * np.cos(x[:, 1]) + 0.3 * rng.standard_normal(n)
    return x, y[:, None]


def _standardise(y):
    mean, std = y.mean(), y.std()
    return (y[:, 0] - mean) / std, mean, std


def _exact_posterior(x, y, xs, spec):
    ys, mean, std = _standardise(y)
    k = _matern52_plus_constant(x, x, spec) + spec.noise_variance * np.eye(len(x))
    ks = _matern52_plus_constant(xs, x, spec)
    mu = ks @ np.linalg.solve(k, ys)
    var = spec.signal_variance + spec.constant_variance - np.einsum("ij,ji->i", ks, np.linalg.solve(k, ks.T))
    return mu * std + mean, var * std ** 2


def test_exact_gp_matches_closed_form_posterior():
    x, y = _data(80)
    xs = np.random.default_rng(1).uniform(-2.5, 2.5, size=(30, 2))
    model = ExactGPBaseline(SPEC, iterations=0).fit(x, y)
    mean, var = model.predict(xs)
    ref_mean, ref_var = _exact_posterior(x, y, xs, SPEC)
    np.testing.assert_allclose(mean[:, 0], ref_mean, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(var[:, 0], ref_var, rtol=1e-6, atol=1e-9)
    noise = SPEC.noise_variance * y.std() ** 2
    np.testing.assert_allclose(model.noise_variance, [noise], rtol=1e-4)  # GPyTorch stores it softplus-constrained
    ld = model.log_predictive_density(xs, np.zeros((30, 1)) + 40.0)
    np.testing.assert_allclose(ld[:, 0], -0.5 * (np.log(2 * np.pi * (ref_var + noise)) + (40.0 - ref_mean) ** 2
                                                 / (ref_var + noise)), rtol=1e-5)


def test_a_readings_variance_is_the_latent_variance_plus_what_a_new_reading_adds():
    """predict_reading (what the benches score coverage and NLPD with) is predict plus the learned noise, and with
    an error in time a new pass's own e(t) too; log_predictive_density is the Gaussian under it."""
    x, y = _data(60)
    xs = np.random.default_rng(2).uniform(-2.0, 2.0, size=(20, 2))
    white = ExactGPBaseline(SPEC, iterations=0).fit(x, y)
    mean, var = white.predict(xs)
    r_mean, r_var = white.predict_reading(xs)
    np.testing.assert_array_equal(r_mean, mean)
    np.testing.assert_allclose(r_var, var + white.noise_variance[None, :], rtol=1e-12)
    np.testing.assert_allclose(white.log_predictive_density(xs, y[:20]), gaussian_log_density(y[:20], r_mean, r_var))
    t = np.arange(60, dtype=float)  # one reading a second: e(t) shared by neighbours
    shared = ExactGPBaseline(SPEC, iterations=0, time_error=True, error_variance=0.2).fit(x, y, t)
    mean, var = shared.predict(xs)
    assert float(shared.error_variance[0]) > 0
    np.testing.assert_allclose(shared.predict_reading(xs)[1],
                               var + (shared.noise_variance + shared.error_variance)[None, :], rtol=1e-12)


def test_exact_gp_subsamples_and_says_so():
    x, y = _data(300)
    model = ExactGPBaseline(SPEC, max_points=120, iterations=5).fit(x, y)
    assert model.subsampled and model.n_used == 120
    assert not ExactGPBaseline(SPEC, iterations=0).fit(x, y).subsampled


def test_svgp_with_inducing_points_on_all_data_is_the_exact_gp():
    """With Z = X and q(u) at its optimum (the final full-batch natural step), the SVGP equals the exact GP."""
    x, y = _data(60)
    xs = np.random.default_rng(2).uniform(-2.5, 2.5, size=(25, 2))
    svgp = OfflineSVGP(60, SPEC, iterations=0).fit(x, y)
    mean, var = svgp.predict(xs)
    ref_mean, ref_var = _exact_posterior(x, y, xs, SPEC)
    np.testing.assert_allclose(mean[:, 0], ref_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(var[:, 0], ref_var, rtol=1e-4, atol=1e-6)


def test_svgp_final_step_gives_titsias_optimal_q():
    """M < N: the predictive equals the SGPR closed form of Titsias (2009) at the same Z and hyperparameters."""
    x, y = _data(200)
    xs = np.random.default_rng(3).uniform(-2.5, 2.5, size=(25, 2))
    svgp = OfflineSVGP(20, SPEC, iterations=0, seed=4).fit(x, y)
    z = svgp.inducing_points()
    ys, ymean, ystd = _standardise(y)
    s2 = SPEC.noise_variance
    kzz = _matern52_plus_constant(z, z, SPEC)
    kzx = _matern52_plus_constant(z, x, SPEC)
    ksz = _matern52_plus_constant(xs, z, SPEC)
    sigma = kzz + kzx @ kzx.T / s2
    mu = ksz @ np.linalg.solve(sigma, kzx @ ys) / s2
    qss = np.einsum("ij,ji->i", ksz, np.linalg.solve(kzz, ksz.T))
    explained = np.einsum("ij,ji->i", ksz, np.linalg.solve(sigma, ksz.T))
    var = SPEC.signal_variance + SPEC.constant_variance - qss + explained
    mean, v = svgp.predict(xs)
    np.testing.assert_allclose(mean[:, 0], mu * ystd + ymean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[:, 0], var * ystd ** 2, rtol=1e-3, atol=1e-5)


def test_svgp_training_learns_the_noise_and_beats_its_start():
    x, y = _data(1500)
    xs, ys = _data(400, seed=9)
    start = OfflineSVGP(30, KernelSpec(), iterations=0, seed=1).fit(x, y)
    trained = OfflineSVGP(30, KernelSpec(), iterations=300, batch_size=256, lr=0.05, seed=1).fit(x, y)
    assert trained.final_elbo[0] > start.final_elbo[0]
    assert trained.evaluate(xs, ys).nlpd < start.evaluate(xs, ys).nlpd
    assert trained.noise_variance[0] == pytest.approx(0.09, rel=0.35)  # simulated noise std 0.3
    # Deterministic given the seed.
    again = OfflineSVGP(30, KernelSpec(), iterations=300, batch_size=256, lr=0.05, seed=1).fit(x, y)
    np.testing.assert_allclose(again.predict(xs)[0], trained.predict(xs)[0], rtol=1e-10)


def test_svgp_multi_output_is_one_gp_per_column():
    x, y = _data(120)
    y2 = np.hstack([y, 2.0 * y - 5.0])
    both = OfflineSVGP(15, SPEC, iterations=0).fit(x, y2)
    mean, var = both.predict(x[:10])
    assert mean.shape == var.shape == (10, 2)
    # Standardisation makes the second column's fit the same up to the affine map.
    np.testing.assert_allclose(mean[:, 1], 2.0 * mean[:, 0] - 5.0, rtol=1e-6)
    np.testing.assert_allclose(var[:, 1], 4.0 * var[:, 0], rtol=1e-6)


def test_gp_baselines_refuse_bad_input():
    x, y = _data(20)
    with pytest.raises(BaselineError, match="before fit"):
        OfflineSVGP(5).predict(x)
    with pytest.raises(BaselineError, match="fewer than num_inducing"):
        OfflineSVGP(50, iterations=0).fit(x, y)
    with pytest.raises(BaselineError, match="non-finite"):
        ExactGPBaseline(iterations=0).fit(x, np.full((20, 1), np.nan))
    with pytest.raises(BaselineError, match="kernel must be one of"):
        KernelSpec(kernel="cosine")
    with pytest.raises(BaselineError, match="noise_variance"):
        KernelSpec(noise_variance=0.0)
    with pytest.raises(BaselineError, match="num_inducing"):
        OfflineSVGP(0)
    model = ExactGPBaseline(SPEC, iterations=0).fit(x, y)
    with pytest.raises(BaselineError, match="columns, expected 2"):
        model.predict(np.zeros((3, 3)))
    with pytest.raises(BaselineError, match="positive"):
        gaussian_log_density(np.zeros(2), np.zeros(2), np.array([1.0, 0.0]))
    with pytest.raises(BaselineError, match="finite"):
        nlpd(np.array([np.inf]))
    assert nlpd(torch.tensor([[-1.0], [-3.0]])) == pytest.approx(2.0)


def test_svgp_fixed_inducing_points_stay_put():
    x, y = _data(300)
    z = np.random.default_rng(5).uniform(-2.0, 2.0, size=(12, 2))
    fixed = OfflineSVGP(999, KernelSpec(), iterations=50, batch_size=64, lr=0.05, inducing=z,
                        learn_inducing=False).fit(x, y)
    np.testing.assert_array_equal(fixed.inducing_points(), z)
    moved = OfflineSVGP(999, KernelSpec(), iterations=50, batch_size=64, lr=0.05, inducing=z).fit(x, y)
    assert np.abs(moved.inducing_points() - z).max() > 1e-3
    with pytest.raises(BaselineError, match="columns"):
        OfflineSVGP(inducing=np.zeros((3, 3)), iterations=0).fit(x, y)


# ------------------------------------------------------------------------- streaming sparse GP (Bui et al.)

def _titsias_posterior(x, ys, z, xs, spec, jitter):
    """Titsias (2009) SGPR predictive of the latent f (standardised units), K_zz with the jitter."""
    s2 = spec.noise_variance
    kzz = _matern52_plus_constant(z, z, spec) + jitter * np.eye(len(z))
    kzx = _matern52_plus_constant(z, x, spec)
    ksz = _matern52_plus_constant(xs, z, spec)
    sigma = kzz + kzx @ kzx.T / s2
    mu = ksz @ np.linalg.solve(sigma, kzx @ ys) / s2
    var = (spec.signal_variance + spec.constant_variance - np.einsum("ij,ji->i", ksz, np.linalg.solve(kzz, ksz.T))
           + np.einsum("ij,ji->i", ksz, np.linalg.solve(sigma, ksz.T)))
    return mu, var


def test_streaming_sparse_gp_with_fixed_z_and_hyperparameters_is_batch_titsias():
    """Bui et al. (2017) with Z and hyperparameters the same for every batch: the old data's pseudo-likelihood
    is exactly their Titsias contribution, so streaming 5 batches gives the batch posterior on all data."""
    x, y = _data(250, seed=11)
    xs = np.random.default_rng(12).uniform(-2.5, 2.5, size=(40, 2))
    z = np.random.default_rng(13).uniform(-2.0, 2.0, size=(18, 2))
    jitter = 1e-6
    model = StreamingSparseGP(spec=SPEC, inducing=z, learn_inducing=False, learn_hyperparameters=False,
                              iterations=0, jitter=jitter)
    for part in np.array_split(np.arange(250), 5):
        stats = model.update(x[part], y[part])
    assert stats["num_seen"] == 250 and model.num_updates == 5
    # Targets are standardised with the first batch's statistics (all a streaming method has).
    first = y[np.array_split(np.arange(250), 5)[0], 0]
    ymean, ystd = first.mean(), first.std()
    mu, var = _titsias_posterior(x, (y[:, 0] - ymean) / ystd, z, xs, SPEC, jitter)
    mean, v = model.predict(xs)
    np.testing.assert_allclose(mean[:, 0], mu * ystd + ymean, rtol=1e-6, atol=1e-6 * ystd)
    np.testing.assert_allclose(v[:, 0], var * ystd ** 2, rtol=1e-6, atol=1e-8)
    noise = SPEC.noise_variance * ystd ** 2
    ld = model.log_predictive_density(xs, np.full((40, 1), 40.0))
    ref = -0.5 * (np.log(2 * np.pi * (var * ystd ** 2 + noise)) + (40.0 - (mu * ystd + ymean)) ** 2
                  / (var * ystd ** 2 + noise))
    np.testing.assert_allclose(ld[:, 0], ref, rtol=1e-6)


def test_streaming_sparse_gp_learns_and_beats_its_start():
    """With learning (Z by pivoted Cholesky then gradient, hyperparameters by L-BFGS) the streamed map beats the
    same stream with everything fixed at the start, and the noise comes out near the simulated 0.09."""
    x, y = _data(1200, seed=21)
    xs, ys = _data(300, seed=22)
    order = np.argsort(x[:, 0])  # sweep across the area: later batches cover new ground
    fixed = StreamingSparseGP(25, KernelSpec(), iterations=0, learn_inducing=False, learn_hyperparameters=False)
    learned = StreamingSparseGP(25, KernelSpec(), iterations=15)
    for part in np.array_split(order, 6):
        fixed.update(x[part], y[part])
        learned.update(x[part], y[part])
    assert learned.inducing_points().shape == (25, 2)
    assert learned.evaluate(xs, ys).nlpd < fixed.evaluate(xs, ys).nlpd - 0.3
    assert learned.evaluate(xs, ys).rmse < 0.6
    assert learned.noise_variance[0] == pytest.approx(0.09, rel=0.5)
    mean, var = learned.predict(xs)
    assert np.isfinite(mean).all() and (var >= 0).all()


def test_streaming_sparse_gp_refuses_bad_input():
    x, y = _data(30)
    with pytest.raises(BaselineError, match="before fit"):
        StreamingSparseGP(5).predict(x)
    with pytest.raises(BaselineError, match="num_inducing"):
        StreamingSparseGP(0)
    with pytest.raises(BaselineError, match="iterations"):
        StreamingSparseGP(5, iterations=-1)
    model = StreamingSparseGP(5, SPEC, iterations=0)
    model.update(x, y)
    with pytest.raises(BaselineError, match="columns, expected 2"):
        model.update(np.zeros((3, 3)), np.zeros((3, 1)))
    with pytest.raises(BaselineError, match="non-finite"):
        model.update(x[:3], np.array([[1.0], [np.nan], [2.0]]))
    with pytest.raises(BaselineError, match="rows"):
        model.update(x[:3], y[:4])


def test_reduced_rank_gp_converges_to_the_exact_gp_and_learns_from_sufficient_statistics():
    """Solin & Särkkä (2020): with enough Laplacian eigenfunctions on a box with margin, the reduced-rank GP's
    posterior is the exact GP's (same kernel and hyperparameters); fed in batches it is the same as in one go
    (sufficient statistics), and refitting raises the exact log marginal likelihood."""
    from gp_mapping.evaluation.baselines import ReducedRankGP

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 4, (300, 2))
    y = np.sin(x[:, :1]) * 3 + np.cos(2 * x[:, 1:]) + 0.1 * rng.standard_normal((300, 1))
    spec = KernelSpec(lengthscale=0.8, signal_variance=1.0, constant_kernel=False, noise_variance=0.01)
    xt = rng.uniform(0.5, 3.5, (200, 2))
    exact_mean, exact_var = ExactGPBaseline(spec, iterations=0).fit(x, y).predict(xt)
    errors = []
    for m in (64, 1024):
        rr = ReducedRankGP((0, 0, 4, 4), num_basis=m, spec=spec, iterations=0, margin=3.0)
        rr.update(x, y)
        mean, var = rr.predict(xt)
        errors.append(np.abs(mean - exact_mean).max())
    assert errors[1] < 0.02 and errors[1] < 0.2 * errors[0]
    assert np.abs(var - exact_var).max() < 0.005
    batched = ReducedRankGP((0, 0, 4, 4), num_basis=1024, spec=spec, iterations=0, margin=3.0)
    for i in range(0, 300, 50):
        batched.update(x[i:i + 50], y[i:i + 50])
    # batches change only the constants the first batch fixed (offset and scale): compare in the same units
    b_mean, _ = batched.predict(xt)
    assert np.abs(b_mean - mean).max() < 0.05
    learner = ReducedRankGP((0, 0, 4, 4), num_basis=256, spec=KernelSpec(lengthscale=3.0), iterations=0)
    learner.update(x, y)
    before = float(learner._log_marginal(learner.raw))
    learner.iterations = 50
    learner._refit()
    assert float(learner._log_marginal(learner.raw)) > before + 10


@pytest.mark.parametrize("kernel", ["matern52", "rbf"])
def test_baseline_kernel_shares_lengthscales_like_the_engine(kernel):
    """The baselines' GPyTorch kernel with model.lengthscales 'horizontal' on 3-D inputs is the engine's kernel:
    x and y share a learned lengthscale, height has its own, and there are two lengthscales to learn."""
    from gp_mapping.config import ModelConfig
    from gp_mapping.gp.kernels import build_kernel

    spec = KernelSpec(kernel=kernel, lengthscales="horizontal", constant_kernel=False, lengthscale=0.7)
    covar = spec.build(3).double()
    covar.base_kernel.lengthscale = torch.tensor([[0.6, 0.25]], dtype=torch.float64)
    assert covar.base_kernel.raw_lengthscale.shape == (1, 2)
    engine = build_kernel(ModelConfig(kernel=kernel, lengthscales="horizontal", constant_kernel=False), 3, scales=1)
    engine.lengthscale_param.set(torch.tensor([0.6, 0.25]))
    x = torch.as_tensor(np.random.default_rng(3).uniform(-1, 1, (9, 3)))
    with torch.no_grad():
        # (GPyTorch forms distances by the |a|^2 + |b|^2 - 2ab expansion: agreement to ~1e-8, not to rounding)
        assert torch.allclose(covar(x, x).to_dense(), engine(x, x), rtol=1e-6, atol=1e-8)
