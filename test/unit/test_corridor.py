"""The calibration bench's simulated corridor (gp_mapping/evaluation/corridor.py): its loop, its walker and its
recording."""
from __future__ import annotations

import math

import numpy as np
from scipy.spatial import cKDTree

from gp_mapping.evaluation import corridor


def _lateral(points: np.ndarray) -> np.ndarray:
    """Signed distance of (N, 2) points from the corridor's centre line, positive to the walker's left."""
    line, left, _ = corridor.centre_line()
    _, nearest = cKDTree(line).query(points)
    return np.sum((points - line[nearest]) * left[nearest], axis=1)


def test_the_centre_line_is_a_closed_rounded_rectangle_inside_the_walls():
    line, left, length = corridor.centre_line()
    x0, y0, x1, y1 = corridor.AREA
    inset, r = corridor.INSET, corridor.CORNER_RADIUS
    w, h = x1 - x0 - 2 * inset, y1 - y0 - 2 * inset
    assert math.isclose(length[-1], 2 * (w + h) - 8 * r + 2 * math.pi * r, rel_tol=1e-4)
    assert np.linalg.norm(line[0] - line[-1]) < 0.02  # closed
    assert np.allclose(line.min(axis=0), [x0 + inset, y0 + inset]) and np.allclose(line.max(axis=0),
                                                                                     [x1 - inset, y1 - inset])
    assert np.allclose(np.linalg.norm(left, axis=1), 1.0)
    # anticlockwise: the left normal of the south side points north, into the building
    assert left[len(line) // 50, 1] > 0.99


def test_the_walker_weaves_about_its_offset_at_hand_height():
    walked = corridor.walk(1, 0.5, np.random.default_rng(0))
    assert walked.shape == (int(corridor.centre_line()[2][-1] / corridor.SPEED * corridor.RATE), 3)
    offset = _lateral(walked[:, :2])
    assert abs(offset.mean() - 0.5) < 0.2 and 0.1 < offset.std() < 0.5
    assert np.all(np.abs(walked[:, 2] - corridor.HAND_HEIGHT) <= corridor.BOB + 1e-12)
    steps = np.linalg.norm(np.diff(walked[:, :2], axis=0), axis=1)
    assert 0.9 * corridor.SPEED / corridor.RATE < np.median(steps) < 1.1 * corridor.SPEED / corridor.RATE


def test_the_recording_streams_four_laps_and_holds_out_a_fifth_to_one_side():
    rec = corridor.recording(seed=0)
    laps = corridor.LAPS
    assert rec.name == "sim_corridor" and rec.x.shape[1] == 3 and rec.y.shape == (rec.x.shape[0], 1)
    assert abs(rec.x.shape[0] - laps * rec.x_test.shape[0]) <= laps
    assert abs(_lateral(rec.x_test[:, :2]).mean() - corridor.HELD_OUT_OFFSET) < 0.2
    assert abs(_lateral(rec.x[:, :2]).mean()) < 0.2
    # |B| about the Earth's 50 uT with anomalies of a few uT; the same field on both passes
    assert 40.0 < np.median(rec.y) < 60.0 and 1.0 < rec.y.std() < 10.0
    assert abs(np.median(rec.y) - np.median(rec.y_test)) < 2.0
    # the track error moves the streamed positions in the plane only
    assert np.all(np.abs(rec.x[:, 2] - corridor.HAND_HEIGHT) <= corridor.BOB + 1e-12)
