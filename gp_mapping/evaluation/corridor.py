"""``sim_corridor``: a simulated building corridor walked with a hand-held sensor, the calibration bench's stand-in
for the issue's unseen corridor recording (68 m x 38 m, 3-D positions, scored on another pass).

The corridor is a loop around a 68 m x 38 m building (a rounded rectangle 1.5 m inside its walls). Four laps are
streamed at 1.2 m/s and 10 Hz, each weaving across the corridor (a lateral offset with a 0.3 m standard deviation
and a 20 s correlation time) with the sensor bobbing 8 cm about a hand height of 1 m. The readings are |B| with
0.3 uT of sensor noise, taken where the sensor was; the positions they are streamed with carry a horizontal track
error of 0.15 m that neighbouring readings share (correlated over 10 s, a visual-inertial track between loop
closures). The held-out pass is a fifth lap 0.5 m to one side of the corridor's centre line, scored at its true
positions. The field is the Earth's plus 300 dipoles 0.5-2.5 m below the sensor's height (the steel of the
floor and the walls' fittings), anomalies of 3-30 uT.

The errors shared along a pass are what make it hard: each lap reads the field shifted by its own slowly
varying error, and a map that trusts each reading independently explains the laps' disagreement as field
detail across the corridor, which the held-out lap, off to the side, does not find (docs/calibration.md,
Position noise).
"""
from __future__ import annotations

import math

import numpy as np

from gp_mapping.evaluation.calibration import Recording
from gp_mapping.evaluation.variants import RATE, track_error
from gp_mapping.sim import World, WorldConfig

AREA = (0.0, 0.0, 68.0, 38.0)
INSET, CORNER_RADIUS = 1.5, 2.0  # m: the corridor's centre line inside the walls, and its corners' radius
SPEED, LAPS = 1.2, 4  # m/s, laps streamed
HAND_HEIGHT, BOB = 1.0, 0.08  # m
WEAVE_SD, WEAVE_S = 0.3, 20.0  # m, s: the walker's lateral offset from the centre line
HELD_OUT_OFFSET = 0.5  # m: the held-out lap's mean lateral offset
NOISE_UT, TRACK_ERROR_M, TRACK_ERROR_S = 0.3, 0.15, 10.0


def centre_line(step: float = 0.01) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The corridor's centre line, anticlockwise from the middle of the south side: points (K, 2) about ``step``
    apart, their unit normals to the left (K, 2), and the arc length at each (K,)."""
    x0, y0, x1, y1 = AREA[0] + INSET, AREA[1] + INSET, AREA[2] - INSET, AREA[3] - INSET
    r = CORNER_RADIUS
    # the four corners' arcs (centre, starting angle); straight sides join each arc to the next
    arcs = [((x1 - r, y0 + r), -math.pi / 2), ((x1 - r, y1 - r), 0.0), ((x0 + r, y1 - r), math.pi / 2),
            ((x0 + r, y0 + r), math.pi)]

    def straight(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + np.linspace(0.0, 1.0, max(2, int(np.linalg.norm(b - a) / step)))[:, None] * (b - a)

    home = np.array([(x0 + x1) / 2, y0])
    pieces, here = [], home
    for (cx, cy), a0 in arcs:
        pieces.append(straight(here, np.array([cx + r * math.cos(a0), cy + r * math.sin(a0)])))
        angles = a0 + np.linspace(0.0, math.pi / 2, max(2, int(r * math.pi / 2 / step)))
        pieces.append(np.column_stack([cx + r * np.cos(angles), cy + r * np.sin(angles)]))
        here = pieces[-1][-1]
    pieces.append(straight(here, home))
    line = np.vstack(pieces)
    line = line[np.concatenate([[True], np.linalg.norm(np.diff(line, axis=0), axis=1) > 1e-9])]
    tangent = np.gradient(line, axis=0)
    tangent /= np.linalg.norm(tangent, axis=1, keepdims=True)
    length = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(line, axis=0), axis=1))])
    return line, np.column_stack([-tangent[:, 1], tangent[:, 0]]), length


def walk(laps: int, lateral: float, rng: np.random.Generator) -> np.ndarray:
    """Sensor positions (N, 3) of ``laps`` laps at SPEED and RATE, weaving about ``lateral`` metres left of the
    centre line."""
    line, normal, length = centre_line()
    n = int(length[-1] * laps / SPEED * RATE)
    s = (np.arange(n) * SPEED / RATE) % length[-1]
    at = np.column_stack([np.interp(s, length, line[:, k]) for k in range(2)])
    left = np.column_stack([np.interp(s, length, normal[:, k]) for k in range(2)])
    offset = lateral + track_error(n, WEAVE_SD, WEAVE_S, rng)[:, 0]
    height = HAND_HEIGHT + BOB * np.sin(2 * math.pi * 0.9 * np.arange(n) / RATE)
    return np.column_stack([at + left * offset[:, None], height])


def recording(seed: int = 0, batch: int = 50) -> Recording:
    """The ``sim_corridor`` recording (module docstring): four laps streamed at their reported positions, a fifth
    held out at its true ones."""
    rng = np.random.default_rng(seed)
    world = World.from_config(WorldConfig(area=AREA, margin=3.0, n_dipoles=300, plane_height=HAND_HEIGHT,
                                          depth_range=(0.5, 2.5), anomaly_range=(3e-6, 30e-6)), rng)
    streamed, held_out = walk(LAPS, 0.0, rng), walk(1, HELD_OUT_OFFSET, rng)

    def read(positions: np.ndarray) -> np.ndarray:
        return world.magnitude(positions)[:, None] * 1e6 + NOISE_UT * rng.standard_normal((len(positions), 1))

    y, y_test = read(streamed), read(held_out)
    reported = streamed.copy()
    reported[:, :2] += track_error(len(streamed), TRACK_ERROR_M, TRACK_ERROR_S, rng)
    return Recording("sim_corridor", reported, y, held_out, y_test, batch, np.arange(len(streamed)) / RATE)


__all__ = ["AREA", "centre_line", "recording", "walk"]
