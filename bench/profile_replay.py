"""Where a replay with the shipped config spends its time: Solin 2018 sequence 1 fed through a Mapper exactly as
the speed section's replay rows feed it (speed._feed), once to warm up, then once under cProfile.

    python bench/profile_replay.py [cpu|cuda] [DATA_ROOT] [SECONDS]

Prints the unprofiled row (real-time factor, update latencies) and the profile by own time and by cumulative
time (bench/results/gpu_h100/profile_replay_solin1_cuda.txt: on an H100). The split between full and fast
updates, hyperparameter steps, inducing-point work and the Mapper's own work is read off the cumulative table.
"""
import cProfile
import io
import pstats
import sys

import numpy as np

from gp_mapping.evaluation import speed
from gp_mapping.evaluation.datasets import load_solin2018


def main(device: str, data_root: str | None, seconds: float | None) -> None:
    seq = load_solin2018(data_root, 1)
    end = len(seq.t) if seconds is None else int(np.searchsorted(seq.t, seq.t[0] + seconds))
    t = seq.t[:end]
    position = np.column_stack([seq.xy[:end], np.zeros(end)])
    identity = np.tile([0.0, 0.0, 0.0, 1.0], (end, 1))
    args = (speed.shipped_config(device), "solin2018 sequence 1", t, position, identity, seq.field_uT[:end] * 1e-6)
    row = speed._feed(*args, final_grid=True)  # warm: kernels loaded, caches filled
    print("unprofiled", {k: row[k] for k in ("duration_s", "processing_s", "real_time_factor", "updates")},
          row["update_latency"])
    profiler = cProfile.Profile()
    profiler.enable()
    row = speed._feed(*args, final_grid=True)
    profiler.disable()
    print("profiled processing s", row["processing_s"])
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
        print(text.getvalue())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu", (sys.argv[2] or None) if len(sys.argv) > 2 else None,
         float(sys.argv[3]) if len(sys.argv) > 3 else None)
