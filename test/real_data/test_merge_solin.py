"""A real room mapped in two sessions and merged (Solin et al. 2018: sequences 1-2 and 3-4, tested on sequence 5,
as the bench's merge section): the merged map's readings are as well calibrated as a map of all the data, because
its calibration is fitted on the sources' out-of-sample records (Engine.pool_calibration, what
gp_mapping.mapping.merge.merge_maps does). Without them a merged map states the latent variance and the learned
noise alone: 0.77 of sequence 5 within +-2 SD when this was written (z-std 2.06, NLPD 3.18)."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from support.paths import shared_data

from gp_mapping.evaluation import merge as bench_merge
from gp_mapping.evaluation.calibration import scores
from gp_mapping.evaluation.datasets import load_solin2018
from gp_mapping.gp.tiles import merge_tiled

pytestmark = pytest.mark.slow


def _sequence(root, i: int) -> tuple[np.ndarray, np.ndarray]:
    s = load_solin2018(root, i)
    return s.xy, np.linalg.norm(s.field_uT, axis=1)[:, None]


def test_a_merged_real_room_is_calibrated_on_its_sessions_records():
    root = shared_data("solin2018_invensense")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = bench_merge._shipped_model()
        x5, y5 = _sequence(root, 5)
        first, _ = bench_merge._mapped(cfg, [_sequence(root, 1), _sequence(root, 2)], 100)
        second, _ = bench_merge._mapped(cfg, [_sequence(root, 3), _sequence(root, 4)], 100)
        merged, _ = merge_tiled([("1-2", first.tile_summaries(), None), ("3-4", second.tile_summaries(), None)],
                                cfg, steps=0)
        uncalibrated = scores(*(t.numpy()[:, 0] for t in merged.predict_reading(x5)), y5[:, 0])
        kept = merged.pool_calibration([first.calibration_records(), second.calibration_records()])
        merged_scores = scores(*(t.numpy()[:, 0] for t in merged.predict_reading(x5)), y5[:, 0])
    finally:
        torch.set_num_threads(before)
    report = (f"merged: {merged_scores['rmse']:.3f} uT, NLPD {merged_scores['nlpd']:.3f}, "
              f"{merged_scores['within_2sd']:.3f} within +-2 SD, z-std {merged_scores['z_std']:.2f} "
              f"({kept} records); without the sources' records NLPD {uncalibrated['nlpd']:.3f}, "
              f"{uncalibrated['within_2sd']:.3f}, z-std {uncalibrated['z_std']:.2f}")
    print(report)
    assert kept >= 2000, report
    assert merged_scores["rmse"] == pytest.approx(uncalibrated["rmse"]), report  # the mean is not touched
    assert 0.90 <= merged_scores["within_2sd"] <= 0.99 and 0.8 <= merged_scores["z_std"] <= 1.25, report
    assert merged_scores["nlpd"] < uncalibrated["nlpd"] - 0.5, report
