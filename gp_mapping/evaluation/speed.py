"""Speed: engine latency over M (bench_engine's sweep), replay real-time factors, and the CUDA section.

Real-time factor = seconds of recording / seconds of processing, through the same ``Mapper`` the node and the
replay drive, with the shipped ``config/mapper.yaml``:
* ``bags/demo``: ``gp_mapping.replay.replay_bag`` (bag reading, sync, batching, model updates, final grid);
* the Solin et al. (2018) recordings: each sequence's poses (identity orientation: the field is already in
  the room frame) and fields (converted to tesla, as a MagneticField message carries them) fed in time
  order to a Mapper, ``process()`` after every sample, ``flush()`` and one final grid at the end;
* ``continual_mogp`` on a 3-D vector recording (Osman et al. 2021, handheld, OptiTrack pose): the shipped config
  with ``model.engine: continual_mogp``, ``sync.target: vector`` and ``sync.input_dims: 3``; the sensor-frame
  readings and the real orientation track fed the same way, at the file's 200 Hz and every second sample (100 Hz).
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gp_mapping.config import MapperConfig, ModelConfig, load_config
from gp_mapping.evaluation import bench_engine
from gp_mapping.evaluation.common import SOURCE_ROOT, percentiles, shipped_config_path

DEMO_BAG = SOURCE_ROOT / "bags" / "demo" if SOURCE_ROOT is not None else None


def shipped_config(device: str = "cpu") -> MapperConfig:
    """config/mapper.yaml with the model on ``device`` (the file says 'auto')."""
    path = shipped_config_path()
    cfg = load_config(path) if path is not None else MapperConfig()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device))


def engine_sweep(plan: dict, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """bench_engine's latency sweep (M, memory, full/fast, grid sizes) on the simulated stream."""
    x, y, area = bench_engine.load_stream("sim", 0)
    base = ModelConfig(device=device, seed=0, tile_size=0.0)  # the engine itself, not tiles of it
    updates, grids = bench_engine.run_sweep(plan, base, x, y, area, int(bench_engine.SAMPLE_RATE_HZ), log=log)
    return {"device": device, "data": "sim", "batch": int(bench_engine.SAMPLE_RATE_HZ), "updates": updates,
            "grids": grids}


#: The command that wrote bags/demo (bags/README.md); an installed package, which has no bags/, writes it again.
DEMO_BAG_COMMAND = ("--seed", "0", "--duration", "180")


def replay_demo(log: Callable[[str], None], device: str = "cpu") -> dict[str, Any]:
    """Replay bags/demo with the shipped config on ``device`` (no output files: only the final map is predicted);
    without the source checkout, the same simulated bag written by ``gp-mapping demo-bag`` into a temporary
    folder."""
    from gp_mapping.replay import replay_bag

    with tempfile.TemporaryDirectory(prefix="gp-mapping-bench-") as tmp:
        bag, recording = DEMO_BAG, "bags/demo"
        if bag is None or not bag.is_dir():
            from gp_mapping.sim import demo_bag

            parser = argparse.ArgumentParser()
            demo_bag.add_arguments(parser)
            bag = Path(tmp) / "demo"
            if demo_bag.run(parser.parse_args([str(bag), *DEMO_BAG_COMMAND])) != 0:
                raise RuntimeError("the demo bag could not be written")
            recording = "gp-mapping demo-bag " + " ".join(DEMO_BAG_COMMAND)
        result = replay_bag(bag, shipped_config(device), out_dir=None)
    mapper = result.mapper
    out = {"recording": recording, "device": device, "duration_s": result.bag_duration,
           "processing_s": result.processing_seconds, "real_time_factor": result.real_time_factor,
           "updates": result.counts["updates"], "samples": int(mapper.model.num_seen),
           "update_latency_last_100": percentiles(list(mapper._update_seconds))}
    log(f"  replay bags/demo on {device}: {out['duration_s']:.0f} s of bag in {out['processing_s']:.1f} s "
        f"(x{out['real_time_factor']:.1f} real time)")
    return out


def _feed(config: MapperConfig, recording: str, t: np.ndarray, position: np.ndarray, orientation_xyzw: np.ndarray,
          field_tesla: np.ndarray, final_grid: bool) -> dict[str, Any]:
    """One replay row: poses and sensor-frame fields fed in time order to a Mapper with ``config``, ``process()``
    after every sample, ``flush()`` (and one final grid) at the end, timed as a whole."""
    from gp_mapping.gp import warm_up
    from gp_mapping.mapping.mapper import Mapper

    warm_up()  # torch's lazy imports belong to start-up (as in replay_bag), not to the timed mapping
    mapper = Mapper(config)
    seconds: list[float] = []
    start = time.perf_counter()
    for i in range(t.shape[0]):
        mapper.add_pose(float(t[i]), tuple(float(v) for v in position[i]), tuple(float(v) for v in orientation_xyzw[i]))
        mapper.add_magnetic_field(float(t[i]), field_tesla[i])
        seconds += [u["update_seconds"] for u in mapper.process()]
    seconds += [u["update_seconds"] for u in mapper.flush()]
    row: dict[str, Any] = {}
    if final_grid:
        grid = mapper.grid()
        row["grid_cells"] = None if grid is None else int(grid.spec.num_cells)
    processing = time.perf_counter() - start
    duration = float(t[-1] - t[0])
    return {"recording": recording, "device": config.model.device, "duration_s": duration, "processing_s": processing,
            "real_time_factor": duration / processing, "updates": len(seconds),
            "samples": int(mapper.model.num_seen), **row, "update_latency": percentiles(seconds)}


def replay_solin(data_root, sequences: tuple[int, ...], max_seconds: float | None,
                 log: Callable[[str], None], device: str = "cpu") -> dict[str, Any]:
    """Feed Solin 2018 sequences through a Mapper with the shipped config on ``device``; ``max_seconds`` keeps
    only the start of each sequence (the quick plan)."""
    from gp_mapping.evaluation.datasets import load_solin2018

    rows = []
    for s in sequences:
        seq = load_solin2018(data_root, s)
        t = seq.t
        keep = slice(None) if max_seconds is None else slice(0, int(np.searchsorted(t, t[0] + max_seconds)))
        t, xy = t[keep], seq.xy[keep]
        position = np.column_stack([xy, np.zeros(len(t))])
        identity = np.tile([0.0, 0.0, 0.0, 1.0], (len(t), 1))
        row = _feed(shipped_config(device), f"solin2018 sequence {s}", t, position, identity, seq.field_uT[keep] * 1e-6,
                    final_grid=True)
        rows.append(row)
        log(f"  replay Solin sequence {s} on {device}: {row['duration_s']:.0f} s in {row['processing_s']:.1f} s "
            f"(x{row['real_time_factor']:.1f} real time, {row['samples']} samples)")
    return {"runs": rows}


def replay_osman_vector(data_root, every: tuple[int, ...], max_seconds: float | None,
                        log: Callable[[str], None], device: str = "cpu") -> list[dict[str, Any]]:
    """continual_mogp with the shipped settings on ``device`` mapping the OptiTrack recording's world-frame field
    in 3-D, one row per sample step in ``every`` (1: the file's 200 Hz); ``max_seconds`` keeps only the start."""
    from gp_mapping.evaluation.datasets import load_osman2021

    rec = load_osman2021(data_root)
    cfg = shipped_config(device)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine="continual_mogp"),
                              sync=dataclasses.replace(cfg.sync, target="vector", input_dims=3))
    end = rec.t.shape[0] if max_seconds is None else int(np.searchsorted(rec.t, rec.t[0] + max_seconds))
    rows = []
    for step in every:
        keep = np.arange(0, end, step)
        t = rec.t[keep]
        rate = (t.shape[0] - 1) / float(t[-1] - t[0])
        row = _feed(cfg, f"osman2021 OptiTrack, 3-D vector, continual_mogp, {rate:.0f} Hz", t, rec.position[keep],
                    rec.orientation_xyzw[keep], rec.field_sensor_nT[keep] * 1e-9, final_grid=False)
        rows.append(row)
        log(f"  replay {row['recording']} on {device}: {row['duration_s']:.0f} s in {row['processing_s']:.1f} s "
            f"(x{row['real_time_factor']:.2f} real time, {row['samples']} samples)")
    return rows


def replay_rows(plan: dict, data_root, why: str | None, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The replay real-time factors on ``device``: bags/demo (when the plan says), the Solin sequences and the
    continual_mogp vector recording, with the reason for each one skipped."""
    out: dict[str, Any] = {"replay": []}
    if plan["demo_bag"]:
        out["replay"].append(replay_demo(log, device))
    if data_root is None:
        out["replay_solin_skipped"] = why
        return out
    out["replay"] += replay_solin(data_root, plan["solin_sequences"], plan["solin_max_seconds"], log, device)["runs"]
    from gp_mapping.evaluation.datasets import DatasetNotFoundError

    try:
        out["replay"] += replay_osman_vector(data_root, plan["osman_every"], plan["solin_max_seconds"], log, device)
    except DatasetNotFoundError as err:
        out["replay_osman_skipped"] = str(err)
    return out


def cuda_section(plan: dict, data_root, why: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    """The engine sweep and the replays on CUDA (the same code as the speed section's CPU rows), or why they
    were skipped."""
    if not torch.cuda.is_available():
        return {"skipped": "torch.cuda.is_available() is False on this machine (no NVIDIA GPU / CUDA build)"}
    out = engine_sweep(plan["engine"], "cuda", log)
    out["device_name"] = torch.cuda.get_device_name(0)
    out.update(replay_rows(plan, data_root, why, "cuda", log))
    return out
