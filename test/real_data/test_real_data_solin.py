"""Engine acceptance test on the Solin et al. (2018) robot recording (the issue's wording):

  "map |B| over (x, y); stream sequences 1-4 in batches of about one second (50 samples); test on sequence 5.
   Online RMSE <= 1.10 x the RMSE of an offline batch SVGP with the same M and kernel trained on all of 1-4;
   both far below the nearest-neighbour 5.6 uT."

The issue leaves M open. Measured (online: the public update API, 50-sample batches; offline: minibatch natural
gradients + Adam with Z trained, the same M and kernel), RMSE / NLPD in uT on sequence 5:

  M     online                                  offline          ratio
  100   3.18 / 2.58 (learn_inducing, full each)  2.01 / 2.16      1.58
  200   2.35 / 2.40 (full every 5th)             2.06 / 2.60      1.14
  300   2.07 / 2.79 (full every 5th)             2.02 / 2.91      1.02   <- the acceptance test
  400   2.05 / 3.17 (full every 5th)             2.12 / 3.20      0.97

With M = 100 (the paper's setting) the online map is short of the bound: 100 points placed online (pivoted
Cholesky plus gradient steps, never seeing the whole room at once) cover the room worse than 100 points
trained on all of it, and the online noise and lengthscales grow to absorb the misfit. From M = 300 the
inducing set is no longer the bottleneck and online matches offline. M = 100 is not asserted here: its online
run (learn_inducing, every update full) takes 250-500 s and its result depends on the CPU's floating-point
paths (3.18 uT on one machine, 3.51 on another, same code and seed), so it cannot guard a regression; the
benchmark reports it (``gp-mapping bench``, protocol 2). Both GPs' NLPD worsens as M grows (the noise they learn
falls to ~1 uT^2 while sequence 5 departs from 1-4 by more), the online one no more than the offline one.

The README's 5.6 uT is the nearest-neighbour error of the 3-D field vector; on the mapped target |B| the same
nearest-neighbour predictor scores 2.85 uT (constant mean 8.37 uT, NLPD 3.68). The GPs must beat the |B|
figure, the harder of the two, by a clear margin. The numbers are printed (``pytest -s``) and kept in the
assertion messages, so a failure says by how much.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from support.paths import shared_data

pytest.importorskip("gpytorch")

from gp_mapping.evaluation.baselines import (ConstantMean, NearestNeighbour, OfflineSVGP,  # noqa: E402
                                  gaussian_log_density, nlpd, rmse)
from gp_mapping.config import ModelConfig  # noqa: E402
from gp_mapping.evaluation.datasets import load_solin2018  # noqa: E402
from gp_mapping.gp import build_model  # noqa: E402

pytestmark = pytest.mark.slow

BATCH = 50  # one second at 50 Hz
RMSE_RATIO_BOUND = 1.10
README_NN_VECTOR_RMSE = 5.6
# The offline gold standard: minibatch natural gradients + Adam, then the exact final q(u) step. Longer training
# overfits sequences 1-4 (measured on sequence 5, RMSE / NLPD: 3000 iterations 2.069 / 2.971 in 223 s; 1500
# 2.052 / 2.900 in 123 s; 1000 2.044 / 2.797, 74 s in the full suite against 91 s for 1500): 1000 is the strictest
# bar of the three on both, at the least cost.
OFFLINE_TRAINING = dict(iterations=1000, batch_size=1024, lr=0.05, ngd_lr=0.1, seed=0)
# The acceptance run: M = 300, every 5th update full (memory, hyperparameters, inducing re-selection), the others
# condition the map on their batch at once (fast mode).
ACCEPTANCE = dict(num_inducing=300, full_update_every=5)


def engine_config() -> ModelConfig:
    """Matern-5/2 + constant with ARD, Gaussian noise, with the acceptance run's M and update schedule."""
    return ModelConfig(kernel="matern52", constant_kernel=True, lengthscales="per_axis", likelihood="gaussian",
                       device="cpu", seed=0, tile_size=0.0, **ACCEPTANCE)  # the engine itself, not tiles


@pytest.fixture(scope="module")
def one_thread():
    """Batches of 50 points are too small for two threads to pay (and the two cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def split():
    root = shared_data("solin2018_invensense")
    train = [load_solin2018(root, s) for s in (1, 2, 3, 4)]
    test = load_solin2018(root, 5)
    x = np.vstack([s.xy for s in train])
    y = np.concatenate([s.magnitude_uT for s in train])[:, None]
    return x, y, test.xy, test.magnitude_uT[:, None]


def _online(split) -> dict:
    """Stream 1-4 in recorded order, 50 samples per update, through the public engine API."""
    x, y, x_test, y_test = split
    model = build_model(engine_config(), input_dims=2, output_dims=1)
    start = time.perf_counter()
    seconds = []
    for i in range(0, x.shape[0], BATCH):
        stats = model.update(x[i:i + BATCH], y[i:i + BATCH])
        seconds.append(stats["seconds"])
    elapsed = time.perf_counter() - start
    mean, var = model.predict(x_test)
    lpd = model.log_predictive_density(x_test, y_test)
    return {"model": model, "mean": mean.numpy(), "var": var.numpy(), "rmse": rmse(mean.numpy(), y_test),
            "nlpd": nlpd(lpd), "seconds": elapsed, "median_update": float(np.median(seconds)),
            "updates": len(seconds), "num_inducing": engine_config().num_inducing}


def _offline(split) -> dict:
    x, y, x_test, y_test = split
    # Minibatches of 1024 against 300 inducing points do pay for two threads (150 iterations: 11.9 s against
    # 19.8 s on the 2-core CI machine), and nothing runs beside this fixture: the suite's longest setup.
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        model = OfflineSVGP.from_model_config(engine_config(), **OFFLINE_TRAINING).fit(x, y)
    finally:
        torch.set_num_threads(before)
    scores = model.evaluate(x_test, y_test)
    return {"model": model, "rmse": scores.rmse, "nlpd": scores.nlpd, "seconds": model.train_seconds}


@pytest.fixture(scope="module")
def online(split, one_thread):
    return _online(split)


@pytest.fixture(scope="module")
def offline(split, one_thread):
    return _offline(split)


@pytest.fixture(scope="module")
def floors(split):
    x, y, x_test, y_test = split
    const = ConstantMean(y)
    # The constant predictor's NLPD: Gaussian with the training mean and variance.
    const_ld = gaussian_log_density(y_test, const.predict(x_test), np.full_like(y_test, y.var()))
    return {"nn_rmse": rmse(NearestNeighbour(x, y).predict(x_test), y_test),
            "const_rmse": rmse(const.predict(x_test), y_test), "const_nlpd": nlpd(const_ld)}


def _report(online, offline, floors) -> str:
    return (f"|B| on sequence 5 (uT), M = {online['num_inducing']}: online dual SVGP RMSE {online['rmse']:.3f} "
            f"NLPD {online['nlpd']:.3f} "
            f"({online['updates']} updates, {online['seconds']:.1f} s, median {1e3 * online['median_update']:.1f} "
            f"ms/update); offline SVGP RMSE {offline['rmse']:.3f} NLPD {offline['nlpd']:.3f} "
            f"({offline['seconds']:.1f} s); ratio {online['rmse'] / offline['rmse']:.3f} (bound "
            f"{RMSE_RATIO_BOUND}); nearest neighbour RMSE {floors['nn_rmse']:.3f}; constant mean RMSE "
            f"{floors['const_rmse']:.3f} NLPD {floors['const_nlpd']:.3f}")


def test_offline_svgp_is_a_real_gold_standard(offline, floors):
    m = ACCEPTANCE["num_inducing"]
    report = (f"offline SVGP M = {m}: RMSE {offline['rmse']:.3f} NLPD {offline['nlpd']:.3f}; nearest neighbour "
              f"{floors['nn_rmse']:.3f}; constant {floors['const_rmse']:.3f} NLPD {floors['const_nlpd']:.3f}")
    print("\n" + report)
    assert offline["rmse"] < 0.8 * floors["nn_rmse"], report
    assert offline["rmse"] < 0.5 * README_NN_VECTOR_RMSE, report
    assert offline["nlpd"] < floors["const_nlpd"] - 0.5, report
    assert offline["model"].inducing_points().shape == (m, 2)


def test_online_engine_streams_every_sample_into_a_finite_map(split, online, offline, floors):
    report = _report(online, offline, floors)
    print("\n" + report)
    assert np.isfinite(online["mean"]).all() and (online["var"] >= 0).all(), report
    assert online["model"].num_inducing <= online["num_inducing"], report
    assert online["model"].num_seen == split[0].shape[0], report
    assert online["rmse"] < 0.6 * floors["const_rmse"], report
    assert online["nlpd"] < floors["const_nlpd"] - 0.5, report


def test_online_engine_within_ten_percent_of_offline_svgp(online, offline, floors):
    """The acceptance bound (test 8), M = 300."""
    report = _report(online, offline, floors)
    print("\n" + report)
    assert online["rmse"] <= RMSE_RATIO_BOUND * offline["rmse"], report
    assert online["rmse"] < 0.8 * floors["nn_rmse"], report
    assert online["rmse"] < 0.5 * README_NN_VECTOR_RMSE, report
    # Calibration no worse than the gold standard's (measured 2.79 vs 2.91).
    assert online["nlpd"] <= offline["nlpd"] + 0.1, report

