"""The exact GP with an error that neighbouring readings share (ExactGPBaseline(time_error=True)) against its
closed form and on passes with a known error; the recordings' times; the ``time_errors`` bench section."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpytorch")

from gp_mapping.evaluation import calibration, time_errors  # noqa: E402
from gp_mapping.evaluation.baselines import BaselineError, ExactGPBaseline, KernelSpec  # noqa: E402
from gp_mapping.evaluation.variants import track_error  # noqa: E402

SPEC = KernelSpec(kernel="matern52", lengthscales="isotropic", constant_kernel=True, lengthscale=1.5,
                  signal_variance=1.0, constant_variance=0.2, noise_variance=0.05)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _matern52(a, b, lengthscale, variance):
    r = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0.0)) / lengthscale
    s5 = np.sqrt(5.0) * r
    return variance * (1.0 + s5 + s5 ** 2 / 3.0) * np.exp(-s5)


def _field(x):
    return 50.0 + 3.0 * np.sin(1.3 * x[:, 0]) + 2.0 * np.cos(0.7 * x[:, 0] + 0.5 * x[:, 1])


def _passes(n_passes, rng, error_sd=1.0, timescale=5.0, noise_sd=0.1):
    """Passes along the same 20 m strip at 1 m/s and 2 Hz, each reading the field plus its own Ornstein-Uhlenbeck
    error in time (``error_sd``, ``timescale``) and white noise; returns x, y, t (the passes far apart in time)."""
    xs, ys, ts = [], [], []
    steps = np.arange(0.0, 20.0, 0.5)
    for p in range(n_passes):
        x = np.column_stack([steps, rng.uniform(-0.5, 0.5, len(steps))])
        e = track_error(len(steps), error_sd, timescale, rng, rate=2.0, axes=1)[:, 0]
        xs.append(x)
        ys.append(_field(x) + e + noise_sd * rng.standard_normal(len(steps)))
        ts.append(steps.copy())
    return np.vstack(xs), np.concatenate(ys)[:, None], calibration.passes(*ts)


def test_the_field_posterior_is_the_closed_form_with_the_shared_error_in_the_readings_covariance():
    rng = np.random.default_rng(0)
    x, y, t = _passes(3, rng)
    xs = rng.uniform(0.0, 20.0, size=(25, 2))
    timescale, error_var = 3.0, 0.4
    model = ExactGPBaseline(SPEC, iterations=0, time_error=True, error_timescale=timescale,
                            error_variance=error_var).fit(x, y, t)
    mean, var = model.predict(xs)
    ys = (y[:, 0] - y.mean()) / y.std()
    k_field = _matern52(x, x, SPEC.lengthscale, SPEC.signal_variance) + SPEC.constant_variance
    k_error = error_var * np.exp(-np.abs(t[:, None] - t[None, :]) / timescale)
    k = k_field + k_error + SPEC.noise_variance * np.eye(len(x))
    ks = _matern52(xs, x, SPEC.lengthscale, SPEC.signal_variance) + SPEC.constant_variance
    ref_mean = ks @ np.linalg.solve(k, ys) * y.std() + y.mean()
    ref_var = (SPEC.signal_variance + SPEC.constant_variance - np.einsum("ij,ji->i", ks, np.linalg.solve(k, ks.T))
               ) * y.std() ** 2
    np.testing.assert_allclose(mean[:, 0], ref_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var[:, 0], ref_var, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(model.error_variance, [error_var * y.std() ** 2], rtol=1e-4)
    h = model.hyperparameters()[0]
    assert h["error_timescale"] == pytest.approx(timescale, rel=1e-4)
    assert h["lengthscale"] == pytest.approx([SPEC.lengthscale], rel=1e-4)  # the field's kernel, not e(t)'s
    # without time_error: no error term
    assert ExactGPBaseline(SPEC, iterations=0).fit(x, y).error_variance.tolist() == [0.0]


def test_with_the_shared_error_modelled_the_map_of_a_new_pass_is_better_and_the_error_is_learned():
    rng = np.random.default_rng(3)
    x, y, t = _passes(6, rng, error_sd=1.0, timescale=5.0)
    x_new = np.column_stack([np.arange(0.25, 20.0, 0.5), rng.uniform(-0.5, 0.5, 40)])
    scores, hyper = {}, {}
    for time_error in (False, True):
        model = ExactGPBaseline(SPEC, iterations=150, time_error=time_error).fit(x, y, t)
        mean, _ = model.predict(x_new)
        scores[time_error] = float(np.sqrt(np.mean((mean[:, 0] - _field(x_new)) ** 2)))
        hyper[time_error] = model.hyperparameters()[0]
    # white noise takes each pass's error for field detail and noise; with e(t) the field is what the passes share
    # (seeds 3, 4, 5: 0.449 -> 0.381, 0.372 -> 0.295, 0.403 -> 0.364 uT)
    assert scores[True] < 0.9 * scores[False], scores
    assert hyper[True]["lengthscale"][0] > 1.1 * hyper[False]["lengthscale"][0], hyper
    assert 2.5 < hyper[True]["error_timescale"] < 12.5, hyper[True]  # the truth: 5 s
    assert 0.5 < hyper[True]["error_variance"] < 2.0, hyper[True]  # the truth: 1 (uT^2, the targets' units)
    assert hyper[True]["noise_variance"] < 0.1, hyper[True]  # the white part: 0.01


def test_bad_times_are_refused_with_a_clear_error():
    x, y, t = _passes(2, np.random.default_rng(0))
    model = ExactGPBaseline(SPEC, iterations=0, time_error=True)
    with pytest.raises(BaselineError, match="needs the readings' times"):
        model.fit(x, y)
    with pytest.raises(BaselineError, match="one finite time per reading"):
        model.fit(x, y, t[:-1])
    bad = t.copy()
    bad[3] = np.nan
    with pytest.raises(BaselineError, match="non-finite"):
        model.fit(x, y, bad)
    for name in ("error_timescale", "error_variance"):
        with pytest.raises(BaselineError, match=name):
            ExactGPBaseline(SPEC, time_error=True, **{name: 0.0})


def test_passes_are_far_apart_in_time_and_each_recording_has_one_time_per_streamed_reading():
    t = calibration.passes(np.array([5.0, 6.0, 7.5]), np.array([100.0, 100.5]))
    np.testing.assert_allclose(t, [0.0, 1.0, 2.5, 2.5 + calibration.PASS_GAP, 3.0 + calibration.PASS_GAP])
    for name in ("sim_world", "sim_revisit", "sim_corridor"):
        rec = calibration.load(name, None, {})
        assert rec.t is not None and rec.t.shape == (len(rec.x),) and np.all(np.diff(rec.t) > 0), name


def test_the_section_reports_both_models_and_their_hyperparameters():
    runs = ("white noise", "time_error, M = 128")
    out = time_errors.run({"time_errors_recordings": ("sim_revisit", "no_such_recording"), "time_errors_points": 150,
                           "time_errors_iterations": 5, "time_errors_engine_runs": runs}, None, lambda _: None)
    assert list(out["recordings"]) == ["sim_revisit"]  # the unknown one is skipped, with its reason logged
    row = out["recordings"]["sim_revisit"]
    assert set(row["models"]) == set(time_errors.MODELS)
    for label, m in row["models"].items():
        assert np.isfinite(m["rmse"]) and np.isfinite(m["nlpd"]) and 0.0 <= m["within_2sd"] <= 1.0
        assert ("error_timescale" in m["hyperparameters"][0]) == time_errors.MODELS[label]
    # the engine streamed with white noise alone and as shipped, with its own e(t): the learned noise says which
    assert list(row["engine"]) == list(runs)
    for label, m in row["engine"].items():
        assert np.isfinite(m["rmse"]) and np.isfinite(m["nlpd"]) and min(m["noise"]["white"]) > 0
        assert ("error_variance" in m["noise"]) == (label != "white noise")
    text = "\n".join(time_errors.markdown(out))
    assert "| sim_revisit | white noise |" in text and "| sim_revisit | error in time |" in text
    assert "| sim_revisit | time_error, M = 128 |" in text
    # opt-in (gp-mapping bench --only time_errors), and the bench's report holds its table
    from gp_mapping.evaluation import harness
    from gp_mapping.evaluation.common import machine_info

    assert "time_errors" in harness.OPTIONAL_SECTIONS and "time_errors" not in harness.SECTIONS
    report = harness.markdown({"machine": machine_info(), "plan": {}, "sections": {"time_errors": out},
                               "total_seconds": 1.0})
    assert "| sim_revisit | error in time |" in report
