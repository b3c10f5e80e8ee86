"""Likelihoods: expected log-likelihoods, predictive densities and dual sites against numerical integration
(scipy quad) and closed forms."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from gp_mapping.config import ModelConfig
from gp_mapping.gp.likelihoods import (BernoulliLikelihood, GaussianLikelihood, Likelihood, StudentTLikelihood,
                                       build_likelihood)


def _quad_expectation(fn, mu, var):
    sd = math.sqrt(var)
    value, _ = integrate.quad(lambda f: fn(f) * stats.norm.pdf(f, mu, sd), mu - 12 * sd, mu + 12 * sd,
                              limit=200, epsabs=1e-13, epsrel=1e-11)
    return value


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_gaussian_closed_forms_match_quadrature_and_generic_path():
    lik = GaussianLikelihood(2, noise_variance=0.3)
    lik.noise_param.set(_t([0.3, 0.05]))
    y, mu, var = _t([[0.4, -1.0], [2.0, 0.1]]), _t([[0.1, -0.7], [1.5, 0.3]]), _t([[0.2, 0.01], [0.7, 0.4]])
    ell = lik.expected_log_lik(y, mu, var).detach().numpy()
    generic = Likelihood.expected_log_lik(lik, y, mu, var).detach().numpy()  # Gauss-Hermite path
    for i in range(2):
        for p, s2 in enumerate((0.3, 0.05)):
            want = _quad_expectation(lambda f: stats.norm.logpdf(float(y[i, p]), f, math.sqrt(s2)),
                                     float(mu[i, p]), float(var[i, p]))
            assert ell[i, p] == pytest.approx(want, rel=1e-9)
            assert generic[i, p] == pytest.approx(want, rel=1e-9)
            lpd = float(lik.log_predictive_density(y, mu, var)[i, p])
            assert lpd == pytest.approx(stats.norm.logpdf(float(y[i, p]), float(mu[i, p]),
                                                          math.sqrt(float(var[i, p]) + s2)), rel=1e-12)


def test_gaussian_sites_are_exact_and_equal_the_autograd_path():
    lik = GaussianLikelihood(1, noise_variance=0.04)
    y, mu, var = _t([[1.3], [-0.2]]), _t([[0.2], [0.5]]), _t([[0.3], [0.01]])
    lam1, lam2 = lik.dual_sites(y, mu, var)
    np.testing.assert_allclose(lam2.numpy(), np.full((2, 1), 25.0), rtol=1e-12)
    np.testing.assert_allclose(lam1.numpy(), y.numpy() * 25.0, rtol=1e-12)
    g1, g2 = Likelihood.dual_sites(lik, y, mu, var)  # autograd of the closed-form e(mu, var)
    np.testing.assert_allclose(g1.numpy(), lam1.numpy(), rtol=1e-10)
    np.testing.assert_allclose(g2.numpy(), lam2.numpy(), rtol=1e-12)


def test_student_t_expectation_and_sites_match_quadrature_and_finite_differences():
    lik = StudentTLikelihood(1, dof=4.0, scale_variance=0.09)
    y, mu, var = 0.8, 0.3, 0.05

    def logpdf(f):
        return stats.t.logpdf(y, df=4.0, loc=f, scale=0.3)

    ell = float(lik.expected_log_lik(_t([[y]]), _t([[mu]]), _t([[var]])))
    assert ell == pytest.approx(_quad_expectation(logpdf, mu, var), rel=1e-6)
    lpd = float(lik.log_predictive_density(_t([[y]]), _t([[mu]]), _t([[var]])))
    assert lpd == pytest.approx(math.log(_quad_expectation(lambda f: math.exp(logpdf(f)), mu, var)), rel=1e-6)

    # Sites from the derivatives of e(mu, var), checked by central differences of the quadrature.
    h = 1e-5
    e = lambda m, v: _quad_expectation(logpdf, m, v)  # noqa: E731
    g_m = (e(mu + h, var) - e(mu - h, var)) / (2 * h)
    g_v = (e(mu, var + h) - e(mu, var - h)) / (2 * h)
    lam1, lam2 = lik.dual_sites(_t([[y]]), _t([[mu]]), _t([[var]]))
    assert float(lam2) == pytest.approx(-2 * g_v, rel=1e-4)
    assert float(lam1) == pytest.approx(g_m - 2 * g_v * mu, rel=1e-4)


def test_curvature_clamp_keeps_site_precision_positive_for_an_outlier():
    # Far in the tail the Student-t log density is convex in f: de/dvar > 0 without the clamp.
    lik = StudentTLikelihood(1, dof=3.0, scale_variance=0.01)
    _, lam2 = lik.dual_sites(_t([[20.0]]), _t([[0.0]]), _t([[1e-4]]))
    assert float(lam2) == pytest.approx(2e-8, rel=1e-12)


@pytest.mark.parametrize("link", ["probit", "logit"])
def test_bernoulli_expectation_and_predictive_match_quadrature(link):
    lik = BernoulliLikelihood(1, link=link)
    p1 = (lambda f: stats.norm.cdf(f)) if link == "probit" else (lambda f: 1.0 / (1.0 + math.exp(-f)))
    for y, mu, var in ((1.0, 0.4, 0.8), (0.0, -1.2, 0.3), (1.0, -2.0, 2.0)):
        lp = (lambda f: math.log(p1(f))) if y == 1.0 else (lambda f: math.log(1.0 - p1(f)))
        ell = float(lik.expected_log_lik(_t([[y]]), _t([[mu]]), _t([[var]])))
        assert ell == pytest.approx(_quad_expectation(lp, mu, var), rel=1e-6)
        lpd = float(lik.log_predictive_density(_t([[y]]), _t([[mu]]), _t([[var]])))
        assert lpd == pytest.approx(math.log(_quad_expectation(lambda f: math.exp(lp(f)), mu, var)), rel=1e-6)
        _, lam2 = lik.dual_sites(_t([[y]]), _t([[mu]]), _t([[var]]))
        assert float(lam2) > 0


def test_bernoulli_validates_targets_and_builders():
    lik = BernoulliLikelihood(1)
    assert lik.validate_targets(_t([[0.0], [1.0]])) is None
    assert "0 or 1" in lik.validate_targets(_t([[0.5]]))
    with pytest.raises(ValueError, match="link"):
        BernoulliLikelihood(1, link="cauchit")
    assert isinstance(build_likelihood(ModelConfig(likelihood="student_t"), 2), StudentTLikelihood)
    assert isinstance(build_likelihood(ModelConfig(likelihood="bernoulli"), 1), BernoulliLikelihood)
    g = build_likelihood(ModelConfig(noise_variance=0.2), 3)
    np.testing.assert_allclose(g.noise_variance.detach().numpy(), [0.2] * 3, rtol=1e-14)


def test_the_correlated_term_and_its_written_out_gradient_match_the_closed_form_under_autograd():
    """GaussianLikelihood.correlated_expected_log_lik (model.time_error's data term) against
    E_q[log N(y | f, Sigma)] = log N(y | mu, Sigma) - tr(Sigma^{-1} cov) / 2, written with torch.distributions
    and differentiated by autograd: value and gradients in the mean, q's covariance and Sigma's parameters (white
    noise, e's variance and timescale), with and without the inverse given."""
    rng = np.random.default_rng(5)
    n, p = 40, 2
    t = torch.as_tensor(np.sort(rng.uniform(0.0, 20.0, n)))
    y = torch.as_tensor(rng.normal(size=(n, p)))
    a = torch.as_tensor(rng.normal(size=(p, n, n))) / n
    cov0 = a @ a.transpose(-1, -2) + 0.1 * torch.eye(n, dtype=torch.float64)

    def fresh():
        lik = GaussianLikelihood(p, noise_variance=0.2, time_error=(0.4, 1.5))
        mu = torch.as_tensor(rng.normal(size=(n, p))).requires_grad_(True)
        return lik, mu, cov0.clone().requires_grad_(True)

    for give_inverse in (False, True):
        lik, mu, cov = fresh()
        sigma = lik.correlated_covariance(t)
        chol = torch.linalg.cholesky(sigma.detach())
        value = lik.correlated_expected_log_lik(y, mu, cov, sigma, chol,
                                                torch.cholesky_inverse(chol) if give_inverse else None)
        params = [q for q in lik.parameters() if q.requires_grad]
        grads = torch.autograd.grad(value, [mu, cov] + params)
        ref_lik = GaussianLikelihood(p, noise_variance=0.2, time_error=(0.4, 1.5))
        ref_lik.load_state_dict(lik.state_dict())
        ref_mu, ref_cov = mu.detach().clone().requires_grad_(True), cov.detach().clone().requires_grad_(True)
        ref_sigma = ref_lik.correlated_covariance(t)
        normal = torch.distributions.MultivariateNormal(ref_mu.T, covariance_matrix=ref_sigma)
        ref = (normal.log_prob(y.T).sum()
               - 0.5 * torch.diagonal(torch.linalg.solve(ref_sigma, ref_cov), dim1=-2, dim2=-1).sum())
        ref_grads = torch.autograd.grad(ref, [ref_mu, ref_cov] + [q for q in ref_lik.parameters() if q.requires_grad])
        assert float(value.detach()) == pytest.approx(float(ref.detach()), rel=1e-10)
        assert len(grads) == len(ref_grads) >= 5
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-7, atol=1e-10)
