"""Cost as the stream grows: a long simulated drive at 50 Hz through the Mapper with the shipped config.

The robot drives lawnmower, loop and random-walk patterns over a 10 m x 10 m simulated world (the path is
repeated when the patterns end), for ``duration`` seconds at 50 Hz (one hour = 180 000 samples in the full
plan). Every pose and magnetometer sample goes to a ``Mapper`` built from ``config/mapper.yaml`` (its
batching and its update schedule: ``model.full_update_every``), ``process()`` after every sample. Recorded:
the wall time of every model update, and every ``sample_every`` samples the resident memory of the process
(/proc/self/statm) and the bytes of the model's state (every tensor of ``state_dict``). Bounded state means
flat curves: the summary compares the last tenth of the drive with the first tenth (after the first minute,
when memory and inducing points are still filling) and fits a line to the update latency against samples seen.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Callable

import numpy as np

from gp_mapping.evaluation.common import percentiles, rss_bytes
from gp_mapping.evaluation.speed import shipped_config

RATE_HZ = 50.0
WARMUP_SECONDS = 60.0  # memory and inducing set fill during the first minute; the deciles start after it


def state_bytes(model) -> int:
    return int(sum(t.numel() * t.element_size() for t in model.state_dict().values()))


def feed(mapper, rec, sample_every: int, log: Callable[[str], None], label: str = "drive",
         log_parts: int = 10) -> dict[str, Any]:
    """Every pose and reading of a simulated recording through ``mapper`` (``process()`` after each sample).
    Recorded per update: samples seen, wall and CPU milliseconds, mode, tiles of the model (1 without tiles);
    every ``sample_every`` samples and at the end: process RSS, model state bytes, tiles."""
    n = len(rec)
    pos, quat, field, t = rec.position, rec.orientation_xyzw, rec.field_sensor_tesla, rec.t
    updates: dict[str, list] = {"num_seen": [], "ms": [], "cpu_ms": [], "mode": [], "tiles": []}
    memory: dict[str, list] = {"samples": [], "rss_bytes": [], "state_bytes": [], "tiles": []}
    gc.collect()
    start = time.perf_counter()
    for i in range(n):
        mapper.add_pose(float(t[i]), pos[i], quat[i])
        mapper.add_magnetic_field(float(t[i]), field[i])
        cpu0 = time.process_time()
        done = mapper.process()
        if done:  # CPU time of this process: what the update costs, whatever else runs
            per_update = 1e3 * (time.process_time() - cpu0) / len(done)
        for u in done:
            updates["cpu_ms"].append(per_update)
            updates["num_seen"].append(int(u["num_seen"]))
            updates["ms"].append(1e3 * float(u["update_seconds"]))
            updates["mode"].append(str(u.get("mode", "")))
            updates["tiles"].append(int(u.get("tiles", 1)))
        if (i + 1) % sample_every == 0 or i == n - 1:
            memory["samples"].append(i + 1)
            memory["rss_bytes"].append(rss_bytes())
            memory["state_bytes"].append(state_bytes(mapper.model))
            memory["tiles"].append(int(getattr(mapper.model, "num_tiles", 1)))
        if (i + 1) % (n // log_parts or 1) == 0:
            last = updates["ms"][-1] if updates["ms"] else float("nan")
            log(f"  {label}: {i + 1}/{n} samples, {time.perf_counter() - start:.0f} s, "
                f"RSS {rss_bytes() / 2 ** 20:.0f} MiB, tiles {memory['tiles'][-1] if memory['tiles'] else 1}, "
                f"last update {last:.1f} ms")
    return {"updates": updates, "memory": memory, "processing_s": time.perf_counter() - start}


def drive(duration: float, sample_every: int, log: Callable[[str], None], seed: int = 0) -> dict[str, Any]:
    from gp_mapping.mapping.mapper import Mapper
    from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

    t0 = time.perf_counter()
    rec = simulate(WorldConfig(), TrajectoryConfig(patterns=("lawnmower", "loop", "random_walk"),
                                                   duration=float(duration), rate=RATE_HZ), SensorConfig(), seed=seed)
    sim_seconds = time.perf_counter() - t0
    config = shipped_config()
    n = len(rec)
    t = rec.t
    fed = feed(Mapper(config), rec, sample_every, log)
    u, mem = fed["updates"], fed["memory"]
    upd_seen, upd_ms, upd_cpu_ms, upd_mode = u["num_seen"], u["ms"], u["cpu_ms"], u["mode"]
    samples, rss, state = mem["samples"], mem["rss_bytes"], mem["state_bytes"]
    processing = fed["processing_s"]
    return {"duration_s": float(duration), "samples": n, "rate_hz": RATE_HZ, "sim_seconds": sim_seconds,
            "processing_s": processing, "real_time_factor": float(t[-1] - t[0]) / processing,
            "batching": {"mode": config.batching.mode, "size": config.batching.size,
                         "full_update_every": config.model.full_update_every},
            "updates": {"num_seen": upd_seen, "ms": upd_ms, "cpu_ms": upd_cpu_ms, "mode": upd_mode},
            "memory": {"samples": samples, "rss_bytes": rss, "state_bytes": state},
            "summary": summarise(upd_seen, upd_ms, samples, rss, state, n, upd_cpu_ms)}


def _decile_ratio(x: np.ndarray, v: np.ndarray, lo: float, hi: float, stat=np.median) -> tuple[float, float, float]:
    """stat(v) over the first and the last tenth of [lo, hi] in x, and last / first."""
    span = hi - lo
    first = v[(x >= lo) & (x <= lo + 0.1 * span)]
    last = v[x >= hi - 0.1 * span]
    if first.size == 0 or last.size == 0:
        return float("nan"), float("nan"), float("nan")
    a, b = float(stat(first)), float(stat(last))
    return a, b, (b / a if a > 0 else float("nan"))


def summarise(upd_seen, upd_ms, samples, rss, state, n, upd_cpu_ms) -> dict[str, Any]:
    seen = np.asarray(upd_seen, dtype=np.float64)
    ms = np.asarray(upd_ms, dtype=np.float64)
    lo = min(WARMUP_SECONDS * RATE_HZ, 0.5 * n)
    out: dict[str, Any] = {"warmup_samples": int(lo), "update_latency": percentiles(ms / 1e3)}
    a, b, r = _decile_ratio(seen, ms, lo, float(n))
    out["latency_first_decile_ms"], out["latency_last_decile_ms"], out["latency_ratio"] = a, b, r
    a, b, r = _decile_ratio(seen, np.asarray(upd_cpu_ms, dtype=np.float64), lo, float(n))
    out["cpu_first_decile_ms"], out["cpu_last_decile_ms"], out["cpu_ratio"] = a, b, r
    after = seen >= lo
    if after.sum() >= 2:
        slope = np.polyfit(seen[after], ms[after], 1)[0]
        out["latency_slope_ms_per_10k_samples"] = float(slope * 1e4)
    s = np.asarray(samples, dtype=np.float64)
    for key, values in (("rss", rss), ("state", state)):
        v = np.asarray(values, dtype=np.float64)
        a, b, r = _decile_ratio(s, v, lo, float(n), stat=np.mean)
        out[f"{key}_first_decile_mib"], out[f"{key}_last_decile_mib"] = a / 2 ** 20, b / 2 ** 20
        out[f"{key}_ratio"] = r
    return out
