"""Real recording: the three world-frame field components of the Osman et al. (2021) handheld IMU with OptiTrack
pose, mapped over 3-D position by the continual multi-output GP (Moreno-Munoz et al.) and, for comparison, by three
independent GPs (the dual-SVGP engine with output_dims=3: independent latents sharing Z and the kernel).

Protocol (../shared/data/README.md): train on the first 70 % of the samples, test on the last 30 %. The training
stream is subsampled to every 8th sample (200 Hz -> 25 Hz, 1,818 samples: the map does not need 5 mm spacing
and the test must stay within a minute on two cores) and fed in 2 consecutive batches (a first update with the
standard bound, then a continual one), as a robot would. The nearest-neighbour predictor on all training
samples is the bar: 0.586 / 0.721 / 0.651 uT per axis, mean 0.653 (the README's "0.65 uT per axis").

The test set lies below the training heights (0.48-0.64 m against 0.57-0.74 m after the first 20 s) and ends
with the sensor put down on the floor 0.19 m from where it was picked up: most of every model's error is that
extrapolation, which hangs on the learned lengthscales. The continual multi-output GP keeps no data, so each
update learns the hyperparameters from its own batch (through the continual bound); with 4 batches of 455 samples
the last batches (all at 0.57-0.74 m) teach lengthscales that extrapolate downwards less well, and z misses the bar
(measured 0.32 / 0.48 / 0.75 uT; independent GPs 0.44 / 0.46 / 0.58). With 2 batches: 0.38 / 0.56 / 0.57 uT
(independent GPs 0.41 / 0.50 / 0.50).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from support.paths import shared_data
from scipy.spatial import cKDTree
from scipy.spatial.transform import Rotation

from gp_mapping.config import ModelConfig
from gp_mapping.evaluation import calibration as calibration_bench
from gp_mapping.evaluation.datasets import load_osman2021
from gp_mapping.gp import build_model
from gp_mapping.gp.continual_mogp import ContinualMOGP
from gp_mapping.gp.dual_svgp.model import DualSVGP

SUBSAMPLE = 8
BATCHES = 2


def _config(engine: str) -> ModelConfig:
    # Q = 3 latents starting at lengthscales 0.33, 0.5 and 0.75 m; 3 variational EM iterations per update.
    return ModelConfig(engine=engine, kernel="matern52", constant_kernel=True, lengthscale=0.5, num_inducing=100,
                       noise_variance=0.05, hyper_steps=15, hyper_lr=0.05, device="cpu", seed=0, num_latents=3,
                       latent_lengthscale_ratio=1.5, vem_iterations=3, tile_size=0.0)  # the engines themselves


def _stream(model, x: np.ndarray, y: np.ndarray) -> float:
    start = time.perf_counter()
    for batch in np.array_split(np.arange(len(x)), BATCHES):
        model.update(x[batch], y[batch])
    return time.perf_counter() - start


def _rmse(model, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    mean, var = model.predict(x)
    assert torch.isfinite(mean).all() and torch.isfinite(var).all() and (var >= 0).all()
    return np.sqrt(((mean.numpy() - y) ** 2).mean(0))


@pytest.mark.slow
def test_osman_world_frame_vector_map_multi_output_vs_independent():
    rec = load_osman2021(shared_data("osman2021_optitrack"))
    # The world-frame field is R(q) b_sensor with q scalar-first body-to-world in the file: check the loader
    # against scipy's rotation (scalar-last) on the raw magnetometer rows 7-9 (nT).
    q_wxyz = np.column_stack([rec.orientation_xyzw[:, 3], rec.orientation_xyzw[:, :3]])
    world = Rotation.from_quat(np.column_stack([q_wxyz[:, 1:], q_wxyz[:, :1]])).apply(rec.field_sensor_nT) * 1e-3
    assert np.allclose(world, rec.field_world_uT, atol=1e-9)

    x, y = rec.position, rec.field_world_uT
    n_train = int(0.7 * len(x))
    x_train, y_train = x[:n_train:SUBSAMPLE], y[:n_train:SUBSAMPLE]
    x_test, y_test = x[n_train:], y[n_train:]
    nearest = cKDTree(x[:n_train]).query(x_test)[1]
    rmse_nn = np.sqrt(((y[:n_train][nearest] - y_test) ** 2).mean(0))
    rmse_const = np.sqrt(((y[:n_train].mean(0) - y_test) ** 2).mean(0))

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # M = 100: one thread is as fast, and much faster on a shared machine
    try:
        mogp = build_model(_config("continual_mogp"), 3, 3)
        assert isinstance(mogp, ContinualMOGP) and mogp.num_latents == 3
        t_mogp = _stream(mogp, x_train, y_train)
        rmse_mogp = _rmse(mogp, x_test, y_test)
        independent = build_model(_config("dual_svgp"), 3, 3)
        t_ind = _stream(independent, x_train, y_train)
        rmse_ind = _rmse(independent, x_test, y_test)
    finally:
        torch.set_num_threads(before)
    B = mogp.coregionalisation().numpy()
    print(f"\nOsman 2021, world-frame field, {len(x_train)} training samples in {BATCHES} batches, "
          f"{len(x_test)} test samples; RMSE per axis (x, y, z) [uT] and mean")
    for name, r in (("nearest neighbour", rmse_nn), ("constant mean", rmse_const),
                    ("multi-output (LMC, Q=3)", rmse_mogp), ("independent (dual SVGP)", rmse_ind)):
        print(f"  {name:26s} {r[0]:.3f} {r[1]:.3f} {r[2]:.3f}   mean {r.mean():.3f}")
    print(f"  update time: multi-output {t_mogp:.1f} s, independent {t_ind:.1f} s; "
          f"inducing points per latent {mogp.num_inducing}")
    print("  learned coregionalisation B [uT^2]:", np.array2string(B, precision=2).replace("\n", ""))

    assert rmse_nn.mean() == pytest.approx(0.653, abs=0.01)  # the README's bar, recomputed
    # Both maps explain the field: far below the constant-mean predictor on every axis.
    assert np.all(rmse_mogp < 0.35 * rmse_const)
    assert np.all(rmse_ind < 0.35 * rmse_const)
    # The multi-output map beats the README's nearest-neighbour bar (0.65 uT) on every axis.
    assert np.all(rmse_mogp < 0.65), rmse_mogp
    assert np.all(rmse_mogp < rmse_nn), (rmse_mogp, rmse_nn)
    # B is a covariance: symmetric positive semi-definite, rank <= Q.
    assert np.allclose(B, B.T) and np.linalg.eigvalsh(B).min() > -1e-9


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known bug (issue 37, docs/calibration.md Limits): with the pivoted-Cholesky "
                   "tolerance at 1e-6, so that M binds, 256 inducing points map y / z at 0.53 / 0.62 uT against "
                   "0.37 / 0.54 at 128 (the shipped time_error, streamed with the readings' stamps, the unit from "
                   "moving data; before that z 0.91 against 0.66, white noise alone 0.95 against 0.68). The exact "
                   "GP with those hyperparameters maps z as badly: the held-out readings lie below "
                   "the streamed ones and the model extrapolates the vertical change it fitted; the low-rank map "
                   "only smooths more")
def test_more_inducing_points_than_the_tolerance_keeps_do_not_make_the_vector_map_worse():
    """The issue's failure on a recording this repository holds: the shipped dual_svgp on the calibration bench's
    OptiTrack vector split (the first 70 % at 50 Hz streamed in batches of 50, the rest held out). At the default
    tolerance (1e-4) the pivoted Cholesky stops at 135 points for any M above it (the test below), which is why
    the bench's M candidates map this recording nearly alike; at 1e-6 M decides."""
    rec = calibration_bench.load("optitrack_vector", shared_data("osman2021_optitrack"), {})
    per_axis = {}
    for m in (128, 256):
        model = DualSVGP(calibration_bench.shipped(num_inducing=m), 3, 3, inducing_rel_tol=1e-6)
        for i in range(0, len(rec.x), rec.batch):
            # with the readings' stamps, as the Mapper streams them: the shipped time_error learns from them
            model.update(rec.x[i:i + rec.batch], rec.y[i:i + rec.batch], t=rec.t[i:i + rec.batch])
        assert model.Z.shape[0] == m  # M binds
        per_axis[m] = _rmse(model, rec.x_test, rec.y_test)
    # the bar: a larger M maps no worse than 1 % (every axis)
    assert (per_axis[256] <= 1.01 * per_axis[128]).all(), per_axis


@pytest.mark.slow
def test_a_budget_above_what_the_tolerance_places_changes_nothing():
    """Where the pivoted-Cholesky tolerance stops Z below M, a larger M must give the same map: nothing else in
    the engine may depend on M (a memory, a step size or a schedule sized by it would make "more inducing points,
    a different map" where none are placed). The shipped dual_svgp on the calibration bench's OptiTrack vector
    split places 135 points with M = 256 (measured 2026-11-29: M from 160 to 512 map alike to the last digit,
    0.4415 uT; docs/calibration.md, Limits)."""
    rec = calibration_bench.load("optitrack_vector", shared_data("osman2021_optitrack"), {})
    maps = {}
    for m in (256, 512):
        # streamed as the bench streams it (spike gate included); one engine, so that its Z can be counted
        model, _ = calibration_bench.stream_engine(calibration_bench.shipped(num_inducing=m, tile_size=0.0), rec)
        assert model.Z.shape[0] < 256, model.Z.shape  # the tolerance, not M, stopped the placement
        maps[m] = model.predict_reading(rec.x_test)
    for got, want in zip(maps[512], maps[256]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
