"""What the time sync hands over: matched samples (:class:`Measurements`) and their units (the one table of field
units, the model outputs of a ``sync.target``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Multiply a value in tesla by this to get the named unit (the one table of field units).
UNIT_PER_TESLA: dict[str, float] = {
    "tesla": 1.0,
    "millitesla": 1e3,
    "microtesla": 1e6,
    "nanotesla": 1e9,
    "gauss": 1e4,
}
UNIT_SYMBOL: dict[str, str] = {"tesla": "T", "millitesla": "mT", "microtesla": "uT", "nanotesla": "nT",
                               "gauss": "G"}


class SyncError(ValueError):
    """A pose or field sample has the wrong shape (a programming error, not a data error)."""


def field_scale(unit: str) -> float:
    """Factor from tesla to ``unit``; raises SyncError naming the known units."""
    try:
        return UNIT_PER_TESLA[unit]
    except KeyError:
        raise SyncError(f"unknown field unit {unit!r}; known: {', '.join(UNIT_PER_TESLA)}") from None


def output_dims(target: str) -> int:
    """Number of model outputs P for a ``sync.target``: 1 for 'magnitude', 3 for 'vector'."""
    if target == "magnitude":
        return 1
    if target == "vector":
        return 3
    raise SyncError(f"unknown sync.target {target!r}; known: 'magnitude', 'vector'")


@dataclass
class Measurements:
    """Matched samples: model inputs ``x (N, D)``, targets ``y (N, P)`` in the field unit, stamps ``t (N,)``.

    ``position`` holds the full 3-D sensor positions (map frame), used for coverage and plots.
    """

    x: np.ndarray
    y: np.ndarray
    t: np.ndarray
    position: np.ndarray

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @classmethod
    def empty(cls, input_dims: int, output_dims: int) -> "Measurements":
        return cls(np.zeros((0, input_dims)), np.zeros((0, output_dims)), np.zeros(0), np.zeros((0, 3)))

    @classmethod
    def concatenate(cls, parts: list["Measurements"]) -> "Measurements":
        if not parts:
            raise ValueError("Measurements.concatenate needs at least one part")
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("x", "y", "t", "position")))

    def slice(self, start: int, stop: int | None = None) -> "Measurements":
        sl = slice(start, stop)
        return Measurements(self.x[sl], self.y[sl], self.t[sl], self.position[sl])

