"""400x400 grid at M = 256 on CUDA and the CPU: redraw time against the cells per prediction call
(``grid.tile_size``), median of 5 redraws on CUDA and 2 on the CPU after an untimed one. Run on a machine with a GPU:

    python bench/grid_tiles.py           (README, GPU paragraph: the numbers behind grid.tile_size 0)
"""
import time

import numpy as np
import torch

from gp_mapping.evaluation import bench_engine
from gp_mapping.gp import ModelConfig
from gp_mapping.mapping.grid import GridSpec, predict_grid

TILES = (2048, 8192, 32768, 160000)


def main() -> None:
    x, y, area = bench_engine.load_stream("sim", 0)
    spec = GridSpec(area[0], area[1], (area[2] - area[0]) / 400, 400, 400)
    for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
        config = ModelConfig(device=device, seed=0, num_inducing=256, memory_size=500, memory_per_batch=500)
        model = bench_engine.steady_model(config, bench_engine.Stream(x, y))
        for tile in TILES:
            predict_grid(model, spec, tile)
            seconds = []
            for _ in range(5 if device == "cuda" else 2):
                start = time.perf_counter()
                predict_grid(model, spec, tile)
                seconds.append(time.perf_counter() - start)
            print(f"{device} M={model.num_inducing} tile {tile}: median {1e3 * np.median(seconds):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
