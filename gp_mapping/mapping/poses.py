"""Time-ordered poses: the matching rule's interpolation (:func:`interpolate_poses`, which the replay's tf lookups
share) and the buffer of poses the time sync keeps (:class:`PoseBuffer`)."""
from __future__ import annotations

import numpy as np

from gp_mapping.mapping.frames import slerp


def interpolate_poses(stamps: np.ndarray, positions: np.ndarray, orientations: np.ndarray, t: np.ndarray,
                      max_gap: float) -> tuple[np.ndarray, ...]:
    """The pose at each stamp ``t`` from time-ordered poses (``stamps`` (K,), ``positions`` (K, 3),
    ``orientations`` (K, 4) [x, y, z, w]): linear interpolation of the positions and slerp of the orientations
    between the last pose at or before ``t`` and the first at or after it, the matching rule of
    :mod:`gp_mapping.mapping.sync` (and of the replay's tf lookups). Returns (positions (N, 3), orientations (N, 4),
    has a pose before (N,), both neighbours within ``max_gap`` (N,), and the indices (N,) of the two neighbours,
    clipped to the poses).
    A stamp after the last pose takes the last one as both neighbours: callers decide only stamps up to it.
    """
    st = stamps
    i1 = np.searchsorted(st, t, side="left")  # first pose at or after t
    exact = (i1 < st.shape[0]) & (st[np.minimum(i1, st.shape[0] - 1)] == t)
    i0 = np.where(exact, i1, i1 - 1)          # last pose at or before t
    has_before = i0 >= 0
    i0c = np.clip(i0, 0, st.shape[0] - 1)
    i1c = np.clip(i1, 0, st.shape[0] - 1)
    t0, t1 = st[i0c], st[i1c]
    within = has_before & (t - t0 <= max_gap) & (t1 - t <= max_gap)
    span = t1 - t0
    alpha = np.where(span > 0, (t - t0) / np.where(span > 0, span, 1.0), 0.0)
    p0, p1 = positions[i0c], positions[i1c]
    q0, q1 = orientations[i0c], orientations[i1c]
    pos = p0 + alpha[:, None] * (p1 - p0)
    quat = slerp(q0, q1, alpha) if t.shape[0] else np.zeros((0, 4))
    return pos, quat, has_before, within, i0c, i1c


class PoseBuffer:
    """Time-ordered poses in growable numpy arrays, trimmed to a time window (cheap searchsorted lookups)."""

    def __init__(self, capacity: int = 256) -> None:
        self._t = np.empty(capacity)
        self._p = np.empty((capacity, 3))
        self._q = np.empty((capacity, 4))
        self._jump = np.zeros(capacity, dtype=bool)  # True: this pose teleported from the previous one
        self._lo = 0
        self._hi = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def stamps(self) -> np.ndarray:
        return self._t[self._lo:self._hi]

    @property
    def newest(self) -> float:
        return float(self._t[self._hi - 1])

    @property
    def newest_position(self) -> np.ndarray:
        return self._p[self._hi - 1]

    def append(self, t: float, p: np.ndarray, q: np.ndarray, jump: bool = False) -> None:
        if self._hi == self._t.shape[0]:
            n = len(self)
            cap = self._t.shape[0] * (2 if n > self._t.shape[0] // 2 else 1)
            for name in ("_t", "_p", "_q", "_jump"):
                old = getattr(self, name)
                new = np.empty((cap,) + old.shape[1:], dtype=old.dtype)
                new[:n] = old[self._lo:self._hi]
                setattr(self, name, new)
            self._lo, self._hi = 0, n
        self._t[self._hi], self._p[self._hi], self._q[self._hi] = t, p, q
        self._jump[self._hi] = jump
        self._hi += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the buffered stamps (K,), positions (K, 3), orientations (K, 4) and teleport flags (K,)."""
        lo, hi = self._lo, self._hi
        return self._t[lo:hi].copy(), self._p[lo:hi].copy(), self._q[lo:hi].copy(), self._jump[lo:hi].copy()

    def trim_before(self, cutoff: float) -> None:
        """Drop poses older than ``cutoff``, keeping the last one at or before it (a sample at the cutoff still
        has its left neighbour)."""
        k = int(np.searchsorted(self.stamps, cutoff, side="right")) - 1
        if k > 0:
            self._lo += k

    def interpolate(self, t: np.ndarray, max_gap: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Positions, orientations, and the masks (has a pose before, both within max_gap, across a teleport)
        at stamps ``t``. A sample exactly at a teleported pose counts as across it (its neighbourhood is unknown).

        Every ``t`` must be at or before the newest pose.
        """
        lo, hi = self._lo, self._hi
        pos, quat, has_before, within, _, i1 = interpolate_poses(self._t[lo:hi], self._p[lo:hi], self._q[lo:hi], t,
                                                                 max_gap)
        across = self._jump[lo + i1]
        return pos, quat, has_before, within, across

