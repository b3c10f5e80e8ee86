"""Helpers of the replay tests: one torch thread while they run, and rosbags messages made comparable."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread while these tests run: on the shared 2-core machine, more threads oversubscribe the
    cores and the replays run ten times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _plain(value):
    """A rosbags message as nested dicts and lists, for equality."""
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__ if k != "__msgtype__"}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
