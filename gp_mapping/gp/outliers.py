"""Isolated spikes in a batch of readings, found before the map is conditioned on them.

Why: a magnetometer now and then sends a reading tens of microtesla off (an electrical transient, a bit error),
and a Gaussian likelihood takes it as field. On the bundled demo bag, 15 such readings among 7942 (0.2 %) put
the held-out RMSE of the map at 0.60 uT against 0.26 without them: each spike drags the map around it, teaches
the hyperparameters a rougher field, and enters the calibration's records as a huge error.

What: each reading is compared with the median reading of its neighbours just before it, with that of its
neighbours just after it (HALF_WINDOW readings on each side, within the batch) and with the midpoint of the
two, in units of the reading's predictive standard deviation s (the calibrated variance of a reading,
Engine.predict_reading, before the batch). A reading farther than ``model.spike_gate`` SDs from all three, on
any output, is a spike. Both sides: at an edge of the field (a steel beam crossed) a reading agrees with the
readings on one side of it; the midpoint: on a steep stretch of field it lies between them; a spike agrees
with none. A batch's first and last readings have one side only and are judged by it: a real step that falls
exactly there costs one reading, while a spike let through there bent the map and inflated the learned noise
(a test stream: the noise SD from 0.36 to 4 uT).

This is the Hampel identifier (Hampel 1974; Pearson 2002, "Outliers in process modeling and identification"),
scaled by the map's own predictive SD (at least ``model.noise_floor``'s and the batch's median step between
consecutive readings) instead of the window's MAD (which is 0 for a quantised sensor, where
every reading would then count as a spike). It compares readings with each other, not with the map's mean: a
session's constant offset, a moved steel cabinet or a map that is wrong moves neighbouring readings together,
and a spike that slipped through (at a batch's edge) and bent the map must not make the next batch's good
readings look like spikes. Where the map knows little, s is large and only gross spikes are caught.

Not used: a map with no data (no scale yet), a batch of fewer than MIN_READINGS readings. ROS-free; the Mapper
drops and counts what this finds (``dropped_spikes``).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

#: neighbours on each side of a reading that it is compared with (within its batch): a burst of up to
#: HALF_WINDOW // 2 + 1 spikes in a row is still caught
HALF_WINDOW = 3
#: the fewest readings in a batch for the gate to apply (an edge reading is judged by one full side)
MIN_READINGS = HALF_WINDOW + 1


def isolated_spikes(model, x, y, gate: float) -> np.ndarray:
    """(N,) bool: the readings y (N, P) at inputs x (N, D), in time order, that are spikes (module docstring)
    under ``model`` (an Engine, before it is conditioned on them); none where ``gate`` is 0."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(len(x), -1)
    n = len(x)
    if gate <= 0 or n < MIN_READINGS or int(model.num_seen) == 0:
        return np.zeros(n, dtype=bool)
    with torch.no_grad():
        _, var = model.predict_reading(x, with_slope=False)  # neighbours share a position's error
    # never finer than the sensor's noise floor: an engine without it (smc_experts) can state 0.01 uT, and a
    # reading on a steady slope at a batch's edge then looked like a spike
    sd = np.sqrt(np.maximum(var.cpu().numpy(), max(float(model.config.noise_floor), 1e-300)))
    # nor finer than the batch's own median step from one reading to the next: on a steady slope an edge reading
    # lies two steps from the median of its one side, and a map whose learned noise collapsed (`noise_floor: 0`
    # on OptiTrack |B|: 0.06 uT) dropped such readings by the dozen; a spike moves two of the steps, not the median
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an output with no readings in the batch
        step = np.nan_to_num(np.nanmedian(np.abs(np.diff(y, axis=0)), axis=0), nan=0.0)
    sd = np.maximum(sd, step[None, :])
    # median reading of the neighbours before and after each reading (within the batch), per output
    pad = np.pad(y, ((HALF_WINDOW, HALF_WINDOW), (0, 0)), constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(pad, 2 * HALF_WINDOW + 1, axis=0)  # (N, P, W)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a batch's first and last readings have one side
        before = np.nanmedian(windows[..., :HALF_WINDOW], axis=-1)
        after = np.nanmedian(windows[..., HALF_WINDOW + 1:], axis=-1)
        n_before = np.isfinite(windows[..., :HALF_WINDOW]).sum(-1)
        n_after = np.isfinite(windows[..., HALF_WINDOW + 1:]).sum(-1)
        both = np.minimum(np.minimum(np.abs(y - before), np.abs(y - after)), np.abs(y - 0.5 * (before + after)))
        # a batch's edge: judged by the one side it has, once that side is full (a lone neighbour could be the
        # spike); a real step that falls on the edge costs one reading, a spike let through bends the map
        off = np.where((n_before > 0) & (n_after > 0), both,
                       np.where((n_after == 0) & (n_before == HALF_WINDOW), np.abs(y - before),
                                np.where((n_before == 0) & (n_after == HALF_WINDOW), np.abs(y - after), 0.0)))
        score = off / sd
    return np.nan_to_num(score, nan=0.0).max(axis=1) > gate

__all__ = ["HALF_WINDOW", "MIN_READINGS", "isolated_spikes"]
