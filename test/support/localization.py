"""The map of a simulated survey that the localizer tests (``gp-mapping localize`` and the localizer node) drive on."""
from __future__ import annotations

import argparse
from pathlib import Path

from gp_mapping.config import config_from_dict
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.sim.demo_bag import add_arguments, configs_from_args
from gp_mapping.sim.simulation import simulate

AREA = ["--area", "-2.5", "-2.5", "2.5", "2.5"]
SEED = "3"


def survey_map(root: Path) -> Path:
    """The map of a lawnmower survey of the world of seed 3 (a Mapper fed at 25 Hz), saved as root/map.safetensors
    (also the localizer node's test map)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(root / "survey"), "--seed", SEED, "--duration", "70", "--line-spacing", "0.6",
                              "--spike-rate", "0", *AREA])
    rec = simulate(*configs_from_args(args), seed=int(SEED))
    cfg = config_from_dict({"model": {"num_inducing": 96, "tile_size": 0.0, "device": "cpu"},
                            "batching": {"size": 100}, "grid": {"resolution": 0.1}})
    mapper = Mapper(cfg)
    for k in range(0, len(rec.t), 2):  # 25 Hz
        mapper.add_pose(float(rec.t[k]), rec.position[k], rec.orientation_xyzw[k])
        if rec.received[k]:
            mapper.add_magnetic_field(float(rec.t[k]), rec.field_sensor_tesla[k])
        mapper.process()
    mapper.flush()
    state = root / "map.safetensors"
    mapper.save(state)
    return state
