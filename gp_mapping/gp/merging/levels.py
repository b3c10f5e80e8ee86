"""The constant offsets between the sources of a merge (each source a session: another robot, sensor or day).

Two magnetometers read the same field a few uT apart (a hard-iron residue, a sensor swapped, another day's
calibration). Merged as they are, the map of the ground both covered is their average and their edges are steps.
A merge therefore measures each source's offset to the first's where both maps know the field, and moves every
source to the first one's level before merging. The merged map holds the offsets as its sessions'
(gp/calibration.py, SessionOffsets): it is published at their median level, and their spread about it is added to
a reading's variance (a reading of a sensor not seen yet), as a map of several sessions is.

How: each source's map alone, in the merged frame, predicts at probe points (the places the sources visited).
Where both maps of a pair state a latent variance at most their noise (the rule a session's offset is measured
by), their difference is an observation of the pair's offset; its mean over those places is the pair's offset.
The plain mean, not one weighted by the maps' latent variances: what the mean must average out is the maps'
disagreement on shared ground (on the Solin room 1.8 uT SD between two sessions' maps), which their latent
variance does not state, and weights put the estimate on the few places both maps are surest of (there -0.50 uT
between two sessions of one sensor at their inducing inputs, against +0.24 unweighted over the cells they
visited). Pairs that share fewer than :data:`MIN_OVERLAP` such places say nothing. The sources' offsets to the
first are the least-squares solution over the pairs that connect them to it; a source not connected keeps offset 0
(its level cannot be told).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: probe points two maps must both know before their difference counts as their offset
MIN_OVERLAP = 25


@dataclass
class Levels:
    """What a merge measured of its sources' levels: ``offsets`` (S, P), each source's to the first (removed before
    the merge); ``measured`` (S, P), False where a source shared too little known ground with the others to tell
    (offset 0 then); ``noise_sd`` (P,), the readings' typical noise SD, the scale the offsets are judged on."""

    offsets: torch.Tensor
    measured: torch.Tensor
    noise_sd: torch.Tensor


def pair_offsets(moments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                 ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """For each pair (j, k), j < k, of sources given as (mean, latent variance, noise variance) (N, P) at the
    same probe points: (offset of k to j (P,), places both know per output (P,)); pairs that share fewer than
    MIN_OVERLAP known places on every output are left out, and an output with too few has offset NaN."""
    out = {}
    for j in range(len(moments)):
        for k in range(j + 1, len(moments)):
            (mj, vj, nj), (mk, vk, nk) = moments[j], moments[k]
            both = (vj <= nj) & (vk <= nk) & torch.isfinite(mj) & torch.isfinite(mk)
            count = both.sum(0)
            if not bool((count >= MIN_OVERLAP).any()):
                continue
            diff = torch.where(both, mk - mj, torch.zeros_like(mk))
            offset = diff.sum(0) / count.clamp_min(1)
            out[(j, k)] = (torch.where(count >= MIN_OVERLAP, offset, torch.full_like(offset, float("nan"))), count)
    return out


def source_offsets(num_sources: int, pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
                   output_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each source's offset to the first, (S, P), least squares over the measured pairs (:func:`pair_offsets`),
    and whether it was connected to the first by them, (S, P) bool (the first always is). A source that is not
    keeps offset 0."""
    offsets = torch.zeros(num_sources, output_dims, dtype=torch.float64)
    connected = torch.zeros(num_sources, output_dims, dtype=torch.bool)
    connected[0] = True
    for p in range(output_dims):
        edges = [(j, k, float(o[p])) for (j, k), (o, _) in pairs.items() if bool(torch.isfinite(o[p]))]
        reach = {0}
        grew = True
        while grew:  # the sources linked to the first through measured pairs
            grew = False
            for j, k, _ in edges:
                if (j in reach) != (k in reach):
                    reach |= {j, k}
                    grew = True
        unknown = sorted(reach - {0})
        if not unknown:
            continue
        col = {s: i for i, s in enumerate(unknown)}
        rows = [(j, k, o) for j, k, o in edges if j in reach and k in reach]
        a = torch.zeros(len(rows), len(unknown), dtype=torch.float64)
        b = torch.zeros(len(rows), dtype=torch.float64)
        for r, (j, k, o) in enumerate(rows):  # o = offset_k - offset_j, offset_0 = 0
            if k in col:
                a[r, col[k]] = 1.0
            if j in col:
                a[r, col[j]] = -1.0
            b[r] = o
        solution = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
        for s, i in col.items():
            offsets[s, p] = solution[i]
            connected[s, p] = True
    return offsets, connected


__all__ = ["Levels", "MIN_OVERLAP", "pair_offsets", "source_offsets"]
