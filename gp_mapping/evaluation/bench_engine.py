#!/usr/bin/env python3
"""Latency of the GP engine: one update of a batch, and a map redraw on a grid.

    python -m gp_mapping.evaluation.bench_engine [--quick] [--out DIR] [--device cpu|cuda|auto] [--data sim|solin]

For every number of inducing points M and memory size, one engine is built through ``build_model`` with
the configuration defaults otherwise (Matern-5/2 + constant, ARD, Gaussian likelihood, hyperparameters
learned in full updates), brought to a steady state (M inducing points selected, memory full), and timed
on consecutive batches of the stream: full updates first, then fast updates. Grid prediction is timed on
the same model with ``gp_mapping.mapping.grid.predict_grid`` (the code path of the node). Results go to
``DIR/bench_engine.json`` and ``DIR/bench_engine.md``; bench/README.md explains every column.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gp_mapping.config import GridConfig, ModelConfig
from gp_mapping.evaluation.common import default_results_dir
from gp_mapping.gp import build_model
from gp_mapping.mapping.grid import GridSpec, predict_grid

SAMPLE_RATE_HZ = 50.0  # both data sources are 50 Hz: a batch of 50 is one second of data
WARM_BATCH = 1000      # samples per warm-up update (hyperparameters frozen, see steady_model)
MAX_WARM_UPDATES = 20
TILE_SIZE = GridConfig().tile_size  # the shipped default

FULL = dict(ms=(64, 128, 256, 512), memories=(500, 2000), full_reps=10, fast_reps=30, grid_sizes=(100, 400),
            cell_seconds=60.0)
QUICK = dict(ms=(64, 128), memories=(500,), full_reps=5, fast_reps=10, grid_sizes=(100,), cell_seconds=8.0)


# ------------------------------------------------------------------------------------------------------ data

def load_stream(source: str, seed: int) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float, float]]:
    """Positions (N, 2) [m], targets |B| (N, 1) [uT] and the area (xmin, ymin, xmax, ymax) the map covers."""
    if source == "solin":
        from gp_mapping.evaluation.datasets import load_solin2018

        seqs = [load_solin2018(None, s) for s in (1, 2, 3, 4, 5)]
        x = np.vstack([s.xy for s in seqs])
        y = np.concatenate([s.magnitude_uT for s in seqs])[:, None]
    elif source == "sim":
        from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

        # 10 x 10 m, lawnmower then loops: 400 s of path is long enough for M = 512 to be used.
        rec = simulate(WorldConfig(), TrajectoryConfig(duration=400.0, rate=SAMPLE_RATE_HZ), SensorConfig(),
                       seed=seed)
        x = rec.sensor_position[:, :2]
        y = np.linalg.norm(rec.field_sensor_tesla, axis=1)[:, None] * 1e6
    else:
        raise ValueError(f"unknown data source {source!r}; use 'sim' or 'solin'")
    lo, hi = x.min(axis=0), x.max(axis=0)
    return x, y, (float(lo[0]), float(lo[1]), float(hi[0]), float(hi[1]))


class Stream:
    """Consecutive slices of the recording, wrapping around at the end."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y, self.pos = x, y, 0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.pos + n > self.x.shape[0]:
            self.pos = 0
        sl = slice(self.pos, self.pos + n)
        self.pos += n
        return self.x[sl], self.y[sl]


# ---------------------------------------------------------------------------------------------------- timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(seconds: list[float], cpu_seconds: list[float]) -> dict:
    a = np.asarray(seconds) * 1e3
    return {"reps": len(a), "median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95)),
            "mean_ms": float(a.mean()), "min_ms": float(a.min()), "max_ms": float(a.max()),
            # CPU time of this process (all threads): below the wall time when other processes share the cores
            "cpu_median_ms": float(np.median(cpu_seconds) * 1e3)}


def steady_model(config: ModelConfig, stream: Stream):
    """An engine with (up to) M inducing points and a full memory, ready to time.

    Reaching that state with the timed configuration would cost minutes at M = 512 (every full update learns
    hyperparameters on batch + memory), so a twin with hyperparameter learning off streams large batches until
    Z stops growing and the memory is full; its state (Z, duals, memory, hyperparameters) is loaded into the
    engine under test, which then runs a few ordinary updates before any timing.
    """
    warm_cfg = dataclasses.replace(config, learn_hyperparameters=False)
    twin = build_model(warm_cfg, input_dims=2, output_dims=1)
    stalled = 0
    for _ in range(MAX_WARM_UPDATES):
        before = twin.num_inducing
        twin.update(*stream.take(WARM_BATCH), mode="full")
        stalled = stalled + 1 if twin.num_inducing <= before else 0
        full_memory = twin.memory_size >= config.memory_size
        if full_memory and (twin.num_inducing >= config.num_inducing or stalled >= 3):
            break
    model = build_model(config, input_dims=2, output_dims=1)
    model.load_state_dict(twin.state_dict())
    return model


def after_warmup(model, config: ModelConfig):
    """``model``'s state in an engine whose hyperparameter warm-up is over (``hyper_warmup`` 0): what a run reaches
    after its first hyper_warmup optimiser steps."""
    done = build_model(dataclasses.replace(config, hyper_warmup=0), input_dims=2, output_dims=1)
    done.load_state_dict(model.state_dict())
    return done


def time_calls(step, stream: Stream, batch: int, reps: int, warmup: int, budget_s: float,
               device: torch.device | str = "cpu") -> dict:
    """Wall and CPU time of ``step(x, y)`` on consecutive batches of the stream (any method's update); at least
    3 timed reps, then stop at ``reps`` or when the budget is spent. On CUDA the clock waits for the device."""
    device = torch.device(device)
    for _ in range(warmup):
        step(*stream.take(batch))
    _sync(device)
    seconds: list[float] = []
    cpu: list[float] = []
    spent = 0.0
    while len(seconds) < reps and (len(seconds) < 3 or spent < budget_s):
        x, y = stream.take(batch)
        start, start_cpu = time.perf_counter(), time.process_time()
        step(x, y)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        spent += seconds[-1]
    return _summary(seconds, cpu)


def time_updates(model, stream: Stream, mode: str, batch: int, reps: int, warmup: int, budget_s: float) -> dict:
    """Wall time of ``model.update`` in ``mode`` on consecutive batches (see :func:`time_calls`)."""
    return time_calls(lambda x, y: model.update(x, y, mode=mode), stream, batch, reps, warmup, budget_s,
                      model.device)


def time_grid(model, area: tuple[float, float, float, float], cells: int, budget_s: float) -> dict:
    """A ``cells`` x ``cells`` grid over the area, predicted in tiles as the node does."""
    width = max(area[2] - area[0], area[3] - area[1])
    spec = GridSpec(origin_x=area[0], origin_y=area[1], resolution=width / cells, width=cells, height=cells)
    device = model.device
    predict_grid(model, GridSpec(area[0], area[1], width / 32, 32, 32), TILE_SIZE)  # warm-up
    _sync(device)
    seconds: list[float] = []
    cpu: list[float] = []
    while len(seconds) < 5 and (len(seconds) < 1 or sum(seconds) < budget_s):
        start, start_cpu = time.perf_counter(), time.process_time()
        predict_grid(model, spec, TILE_SIZE)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    out = _summary(seconds, cpu)
    out["cells"] = spec.num_cells
    out["mcells_per_s"] = spec.num_cells / (out["median_ms"] * 1e-3) / 1e6
    return out


def run_sweep(plan: dict, base: ModelConfig, x: np.ndarray, y: np.ndarray, area: tuple[float, float, float, float],
              batch: int, log=print) -> tuple[list[dict], list[dict]]:
    """Update latency (full and fast) for every M and memory size of ``plan``, and grid prediction time per M.

    ``plan`` holds ms, memories, full_reps, fast_reps, grid_sizes and cell_seconds (see FULL and QUICK); the
    engine is ``base`` with num_inducing, memory_size and memory_per_batch set per cell."""
    updates: list[dict] = []
    grids: list[dict] = []
    for m in plan["ms"]:
        for mem in plan["memories"]:
            # Every point of a batch is a memory candidate, so the memory fills during the warm-up and the
            # reservoir keeps it at memory_size; the cost of a full update depends on the memory's size only.
            cfg = dataclasses.replace(base, num_inducing=m, memory_size=mem, memory_per_batch=mem)
            stream = Stream(x, y)
            t0 = time.perf_counter()
            model = steady_model(cfg, stream)
            log(f"M={m} memory={mem}: steady state in {time.perf_counter() - t0:.1f} s "
                f"(M used {model.num_inducing}, memory {model.memory_size})")
            # Full first: fast updates leave pending points that the next full update would take as its batch.
            # "full" is a full update in the hyperparameter warm-up (up to hyper_steps Adam steps each, the first
            # hyper_warmup steps of a run); "full after warm-up" the same model once the optimiser has taken them
            # (one step per hyper_batch new samples), the cost a long run pays.
            for label, mode, reps in (("full", "full", plan["full_reps"]),
                                      ("full after warm-up", "full", plan["full_reps"]),
                                      ("fast", "fast", plan["fast_reps"])):
                if label == "full after warm-up":
                    model = after_warmup(model, cfg)
                r = time_updates(model, stream, mode, batch, reps, warmup=2, budget_s=plan["cell_seconds"] / 2)
                r.update({"M": m, "M_used": model.num_inducing, "memory": mem, "memory_used": model.memory_size,
                          "mode": label, "batch": batch,
                          "budget_used": r["median_ms"] * 1e-3 / (batch / SAMPLE_RATE_HZ)})
                updates.append(r)
                log(f"  {label}: median {r['median_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms ({r['reps']} reps)")
            if mem == plan["memories"][0]:  # prediction cost depends on M only
                for cells in plan["grid_sizes"]:
                    g = time_grid(model, area, cells, budget_s=plan["cell_seconds"] / 4)
                    g.update({"M": m, "M_used": model.num_inducing, "grid": cells})
                    grids.append(g)
                    log(f"  grid {cells}x{cells}: median {g['median_ms']:.1f} ms")
    return updates, grids


# --------------------------------------------------------------------------------------------------- report

def markdown(meta: dict, updates: list[dict], grids: list[dict]) -> str:
    lines = [f"# Engine latency ({meta['date']})", "",
             f"Device: {meta['device_name']} ({meta['device']}), torch {meta['torch']}, threads {meta['threads']}; "
             f"data: {meta['data']}; batch {meta['batch']} samples = {meta['batch_seconds']:.2f} s of data; "
             f"engine defaults otherwise (hyper_steps {meta['hyper_steps']}, n_steps {meta['n_steps']}).", "",
             "## Update latency", "",
             "| M | M used | memory | memory used | mode | reps | median ms | p95 ms | CPU ms | budget used "
             "| full/fast |",
             "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|"]
    fast = {(r["M"], r["memory"]): r["median_ms"] for r in updates if r["mode"] == "fast"}
    for r in updates:
        ratio = r["median_ms"] / fast[(r["M"], r["memory"])] if r["mode"] == "full" and (r["M"], r["memory"]) in fast \
            else None
        lines.append(f"| {r['M']} | {r['M_used']} | {r['memory']} | {r['memory_used']} | {r['mode']} | {r['reps']} | "
                     f"{r['median_ms']:.1f} | {r['p95_ms']:.1f} | {r['cpu_median_ms']:.1f} | {r['budget_used']:.1%} | "
                     f"{'' if ratio is None else f'{ratio:.0f}x'} |")
    lines += ["", "## Grid prediction (mean and variance of every cell)", "",
              "| M used | grid | cells | reps | median ms | p95 ms | CPU ms | Mcells/s |",
              "|---:|:---|---:|---:|---:|---:|---:|---:|"]
    for g in grids:
        lines.append(f"| {g['M_used']} | {g['grid']}x{g['grid']} | {g['cells']} | {g['reps']} | {g['median_ms']:.1f} | "
                     f"{g['p95_ms']:.1f} | {g['cpu_median_ms']:.1f} | {g['mcells_per_s']:.2f} |")
    lines += ["", f"Total run time {meta['total_seconds']:.0f} s. Columns: see bench/README.md.", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="M in {64, 128}, memory 500, 100x100 grid (< 1 min)")
    parser.add_argument("--out", type=Path, default=default_results_dir(),
                        help="output folder (default bench/results of the checkout, else ./bench-results)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--data", choices=("sim", "solin"), default="sim",
                        help="sim: simulated 10x10 m world (always available); solin: the Solin 2018 recording "
                             "in ../shared/data or $GP_MAPPING_DATA")
    parser.add_argument("--batch", type=int, default=50, help="samples per update (default 50 = 1 s at 50 Hz)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: small batches gain little from more, and shared cores "
                             "slow down badly when oversubscribed); 0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    torch.manual_seed(args.seed)
    start_all = time.perf_counter()
    x, y, area = load_stream(args.data, args.seed)
    base = ModelConfig(device=device.type, seed=args.seed, tile_size=0.0)  # the engine itself
    updates, grids = run_sweep(plan, base, x, y, area, args.batch)
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "data": args.data, "batch": args.batch, "batch_seconds": args.batch / SAMPLE_RATE_HZ,
            "quick": args.quick, "hyper_steps": base.hyper_steps, "n_steps": base.n_steps,
            "total_seconds": time.perf_counter() - start_all, "python": platform.python_version()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_engine.json").write_text(json.dumps({"meta": meta, "updates": updates, "grids": grids},
                                                           indent=2) + "\n")
    table = markdown(meta, updates, grids)
    (args.out / "bench_engine.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
