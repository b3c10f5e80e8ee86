"""A small mapper fed a short straight drive, whose saved state the state-file tests start from."""
from __future__ import annotations

import numpy as np

from gp_mapping.config import config_from_dict
from gp_mapping.mapping.mapper import Mapper


def small_config(**keys):
    return config_from_dict({"model.num_inducing": 16, "model.memory_size": 30, "model.hyper_steps": 2,
                             "model.device": "cpu", "batching.size": 20, "grid.resolution": 0.25, **keys})


def fed_mapper(config, n=80):
    mapper = Mapper(config)
    for k in range(n + 1):
        t = 10.0 + 0.1 * k
        mapper.add_pose(t, np.array([0.05 * k, 0.02 * k, 0.1]), np.array([0.0, 0.0, 0.0, 1.0]))
        if k < n:
            mapper.add_magnetic_field(t, np.array([2e-5, 1e-6 * np.sin(k / 5), -4e-5]))
    mapper.process()
    assert mapper.updates > 0
    return mapper
