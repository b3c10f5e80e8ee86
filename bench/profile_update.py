"""Where one dual_svgp full update and one fast update spend their time (torch.profiler), on the simulated stream
of the bench's engine sweep: M = 256, memory 500, 50-sample batches, after 3000 samples.

    python bench/profile_update.py [cpu|cuda]      (bench/results/gpu/profile_full_update.txt: on an H200)

On a GPU the table shows whether an update is bound by the device's work (Self CUDA) or by the host's dispatch
(Self CPU, cudaLaunchKernel); the launch count is the number of kernels one update starts.
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gp_mapping.evaluation import bench_engine
from gp_mapping.gp import ModelConfig, build_model

BATCH, WARM_SAMPLES = 50, 3000


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(device: str) -> None:
    x, y, _ = bench_engine.load_stream("sim", 0)
    model = build_model(ModelConfig(device=device, seed=0, num_inducing=256, full_update_samples=1), x.shape[1],
                        y.shape[1])
    for lo in range(0, WARM_SAMPLES, BATCH):
        model.update(x[lo:lo + BATCH], y[lo:lo + BATCH])
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    lo = WARM_SAMPLES
    for mode in ("full", "fast"):
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            model.update(x[lo:lo + BATCH], y[lo:lo + BATCH], mode=mode)
            sync(device)
            print(mode, "wall ms", 1e3 * (time.perf_counter() - start))
        lo += BATCH
        events = prof.key_averages()
        print(events.table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=50))
        print(mode, "kernel launches", sum(e.count for e in events if e.key.startswith("cudaLaunchKernel")))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
