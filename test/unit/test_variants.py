"""The variants bench section: its simulated track error, its recordings and its report."""
from __future__ import annotations

import numpy as np

from gp_mapping.evaluation import calibration, harness, variants


def test_the_track_error_is_a_stationary_process_of_the_stated_spread_and_correlation():
    """Ornstein-Uhlenbeck per axis: standard deviation ``std`` from the first sample on, and correlation
    exp(-lag / correlation time) between samples ``lag`` seconds apart."""
    e = variants.track_error(200_000, 0.2, 10.0, np.random.default_rng(0))
    assert e.shape == (200_000, 2)
    assert np.allclose(e.std(axis=0), 0.2, rtol=0.05)
    lag = int(10.0 * variants.RATE)  # one correlation time
    corr = np.mean(e[lag:] * e[:-lag], axis=0) / e.var(axis=0)
    assert np.allclose(corr, np.exp(-1.0), atol=0.05)
    assert not np.any(variants.track_error(50, 0.0, 10.0, np.random.default_rng(0)))


def test_a_variant_moves_the_track_and_not_the_readings(monkeypatch):
    """A track error changes where the mapper is told the readings were taken, never what was read; a vector
    variant gives 3-D positions and the world-frame vector."""
    monkeypatch.setattr(variants, "VARIANTS", {"exact": {}, "drifted": {"track_error": (0.2, 10.0)},
                                                "vector": {"vector": True, "height_amplitude": 0.3}})
    exact = variants.recording("exact", seed=7, seconds=60.0)
    drifted = variants.recording("drifted", seed=7, seconds=60.0)
    assert np.array_equal(exact.y, drifted.y) and np.array_equal(exact.y_test, drifted.y_test)
    off = np.vstack([drifted.x - exact.x, drifted.x_test - exact.x_test])
    assert 0.05 < off.std() < 0.4 and exact.x.shape == (600, 2) and exact.y.shape == (600, 1)
    vector = variants.recording("vector", seed=7, seconds=60.0)
    assert vector.x.shape == (600, 3) and vector.y.shape == (600, 3) and np.ptp(vector.x[:, 2]) > 0.3
    # in the world frame the Earth's field (50 uT, 60 deg down) dominates: the readings point down, not with the robot
    assert np.all(vector.y[:, 2] < -25.0) and 35.0 < np.median(np.linalg.norm(vector.y, axis=1)) < 65.0


def test_the_section_is_opt_in_and_reports_each_variant_at_each_m(monkeypatch):
    assert "variants" in harness.OPTIONAL_SECTIONS and "variants" not in harness.SECTIONS
    monkeypatch.setattr(calibration, "M_LADDER", (("small", 8), ("large", 16)))
    # in two worker processes (calibration.run_tasks, as `gp-mapping bench --jobs 2` runs it): each stream a task
    out = variants.run({"variants": ("pose_drift",), "variants_peers": False, "variants_seconds": 40.0, "jobs": 2},
                       lambda message: None)
    row = out["variants"]["pose_drift"]
    assert set(row["dual_svgp"]) == {"8", "16"} and row["streamed"] == 400
    assert all(np.isfinite(r["nlpd"]) and 0.0 <= r["within_2sd"] <= 1.0 for r in row["dual_svgp"].values())
    holds = row["dual_svgp"]["16"]["rmse"] <= 1.01 * row["dual_svgp"]["8"]["rmse"] and \
        row["dual_svgp"]["16"]["nlpd"] <= row["dual_svgp"]["8"]["nlpd"] + 0.02
    assert row["ladder_holds"] == holds
    # a world with a track error is also mapped with position noise set to it
    known = row["position_noise"]
    assert known["track_error_sd"] == 0.2 and set(known) == {"track_error_sd", "8", "16", "ladder_holds"}
    assert all(np.isfinite(known[m]["nlpd"]) for m in ("8", "16"))
    text = "\n".join(variants.markdown(out))
    assert "| pose_drift |" in text and f"| {'yes' if holds else 'no'} |" in text
    assert "| pose_drift | 0.2 |" in text
