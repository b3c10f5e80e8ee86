"""Does a long run in a bounded area level off in memory? A random walk through the node's path, faster than real time.

The robot drives a random walk (``gp_mapping.sim``: a random turn rate, steered back inside the area) over
``memory_area`` x ``memory_area`` metres for ``memory_seconds`` of simulated time at ``memory_rate`` Hz, through a
simulated world (the Earth's field and buried dipoles, sensor noise). The area stops growing after the first
minutes; from then on nothing the node holds should grow. Every pose and reading goes to a ``Mapper`` built from
``config/mapper.yaml`` (model on the CPU), driven as the node drives it, as fast as the machine allows: the
messages in stamp order, ``Mapper.process(max_updates=1)`` after each (the update thread's step; the stream never
outruns it here, so no catch-up batch is taken), ``Mapper.diagnostics()`` (every step of the node reads them),
a map every ``node.publish_period`` of simulated time when it changed (``Mapper.grid(predict_unknown=False,
incremental=True)`` and the publication layout, as the node publishes), and a model summary every
``node.model_period`` when the map took data (``encode_summary``, what ``~/model`` sends).

Every simulated minute (``memory_sample_seconds``) the resident memory of the process is read (/proc/self/statm),
with what might grow beside it: the model's state bytes, tiles, visited cells, trajectory points, samples waiting,
and the Python objects the garbage collector tracks. Verdict: the mean RSS over the last tenth of the run against the
mean over the middle tenth (45 %-55 % of the run); within 5 % is level.
"""
from __future__ import annotations

import gc
import math
import time
from typing import Any, Callable

import numpy as np

from gp_mapping.evaluation.common import percentiles, rss_bytes
from gp_mapping.evaluation.speed import shipped_config

LEVEL_RATIO = 1.05  # last / middle decile of the resident memory: at most this is level


def state_bytes(model) -> int:
    return int(sum(t.numel() * t.element_size() for t in model.state_dict().values()))


def _sample(mapper, rss: int) -> dict[str, Any]:
    model = mapper.model
    return {"rss_bytes": int(rss), "state_bytes": state_bytes(model), "tiles": int(getattr(model, "num_tiles", 1)),
            "coverage_cells": len(mapper.coverage), "trajectory_points": int(len(mapper.trajectory)),
            "pending": int(mapper.num_pending), "num_seen": int(model.num_seen), "updates": int(mapper.updates),
            "gc_objects": len(gc.get_objects())}


def run(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    from gp_mapping.mapping import publication
    from gp_mapping.mapping.mapper import Mapper
    from gp_mapping.mapping.merge import MapSource, encode_summary
    from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

    duration, rate = float(plan["memory_seconds"]), float(plan["memory_rate"])
    half = float(plan["memory_area"]) / 2
    speed = float(plan["memory_speed"])
    area = (-half, -half, half, half)
    every = float(plan["memory_sample_seconds"])
    start = time.perf_counter()
    rec = simulate(WorldConfig(area=area), TrajectoryConfig(
        patterns=("random_walk",), area=area, speed=speed, duration=duration, rate=rate,
        random_walk_length=speed * duration + 10.0), SensorConfig(), seed=int(plan["memory_seed"]))
    sim_seconds = time.perf_counter() - start
    config = shipped_config()
    mapper = Mapper(config)
    t = rec.t + 1.7e9  # wall-clock-like stamps
    pos, quat, field = rec.position, rec.orientation_xyzw, rec.field_sensor_tesla
    received = rec.received
    n = len(t)
    t0 = float(t[0])
    publish_period, model_period = float(config.node.publish_period), float(config.node.model_period)
    next_publish, next_model, next_sample = t0 + publish_period, t0 + model_period, t0
    samples: list[dict[str, Any]] = []
    sample_t: list[float] = []
    publish_s: list[float] = []
    summary_bytes: list[int] = []
    summary_seen = -1
    gc.collect()
    wall = time.perf_counter()
    last_log = wall
    for i in range(n):
        now = float(t[i])
        if now >= next_sample:
            sample_t.append(now - t0)
            samples.append(_sample(mapper, rss_bytes()))
            next_sample += every
        mapper.add_pose(now, pos[i], quat[i])
        if received[i]:
            mapper.add_magnetic_field(now, field[i])
        mapper.process(max_updates=1)
        mapper.diagnostics()
        if now >= next_publish:
            next_publish += publish_period * (math.floor((now - next_publish) / publish_period) + 1)
            if mapper.map_changed:
                began = time.perf_counter()
                mapper.mark_published()
                grid = mapper.grid(predict_unknown=False, incremental=True)
                if grid is not None:
                    publication.publication(grid, config.sync.field_unit, config.grid.mean_range,
                                            config.grid.variance_range)
                publish_s.append(time.perf_counter() - began)
        if model_period > 0 and now >= next_model:
            next_model += model_period * (math.floor((now - next_model) / model_period) + 1)
            seen = int(mapper.model.num_seen)
            if seen and seen != summary_seen:
                summary_bytes.append(len(encode_summary(MapSource.from_mapper("memory", mapper))))
                summary_seen = seen
        if time.perf_counter() - last_log >= 60.0:
            last_log = time.perf_counter()
            log(f"  memory: {now - t0:.0f}/{duration:.0f} s simulated, {last_log - wall:.0f} s wall, "
                f"RSS {rss_bytes() / 2 ** 20:.0f} MiB, {mapper.updates} updates, "
                f"{len(mapper.coverage)} cells, {getattr(mapper.model, 'num_tiles', 1)} tiles")
    mapper.process()
    sample_t.append(float(t[-1]) - t0)
    samples.append(_sample(mapper, rss_bytes()))
    wall = time.perf_counter() - wall
    series = {k: [s[k] for s in samples] for k in samples[0]}
    return {"area_m": 2 * half, "duration_s": duration, "rate_hz": rate, "speed_m_s": speed, "samples": n,
            "sample_every_s": every, "sim_seconds": sim_seconds, "wall_seconds": wall,
            "real_time_factor": (float(t[-1]) - t0) / wall if wall > 0 else float("nan"),
            "engine": config.model.engine, "tile_size": config.model.tile_size,
            "num_inducing": config.model.num_inducing, "batch": config.batching.size,
            "publish_period_s": publish_period, "model_period_s": model_period,
            "maps": len(publish_s), "publish": percentiles(np.asarray(publish_s)),
            "model_summaries": len(summary_bytes), "summary_bytes_last": summary_bytes[-1] if summary_bytes else 0,
            "updates": mapper.updates, "num_seen": int(mapper.model.num_seen),
            "series": {"t_s": sample_t, **series},
            "summary": summarise(np.asarray(sample_t), series, duration)}


def _mean_between(x: np.ndarray, v: np.ndarray, lo: float, hi: float) -> float:
    inside = v[(x >= lo) & (x <= hi)]
    return float(inside.mean()) if inside.size else float("nan")


def summarise(t: np.ndarray, series: dict[str, list], duration: float) -> dict[str, Any]:
    """Each quantity's mean over the middle tenth (45-55 % of the run) and the last tenth, and their ratio;
    ``level``: the resident memory's ratio is at most LEVEL_RATIO."""
    out: dict[str, Any] = {"middle_decile_s": [0.45 * duration, 0.55 * duration],
                           "last_decile_s": [0.9 * duration, duration]}
    for key, values in series.items():
        v = np.asarray(values, dtype=np.float64)
        middle = _mean_between(t, v, 0.45 * duration, 0.55 * duration)
        last = _mean_between(t, v, 0.9 * duration, duration)
        ratio = last / middle if middle > 0 else float("nan")
        out[key] = {"middle": middle, "last": last, "ratio": ratio}
    out["rss_ratio"] = out["rss_bytes"]["ratio"]
    out["level"] = bool(out["rss_ratio"] <= LEVEL_RATIO)
    return out


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Memory of a long random walk in a bounded area", ""]
    if "error" in sec:
        return lines + [f"Failed: {sec['error']}", ""]
    s = sec["summary"]
    mib = 2 ** 20
    rss = s["rss_bytes"]
    lines += [f"A random walk over {sec['area_m']:g} m x {sec['area_m']:g} m at {sec['speed_m_s']:g} m/s, "
              f"{sec['duration_s'] / 60:.3g} min of simulated time at {sec['rate_hz']:g} Hz ({sec['samples']} "
              f"readings), through a `Mapper` with the shipped config ({sec['engine']}, M = {sec['num_inducing']}, "
              f"tiles of {sec['tile_size']:g} m, batch {sec['batch']}) driven as the node drives it: one update per "
              f"step, the diagnostics, a map every {sec['publish_period_s']:g} s and a model summary every "
              f"{sec['model_period_s']:g} s of simulated time. Processed as fast as possible: "
              f"{sec['wall_seconds']:.0f} s of wall time ({sec['real_time_factor']:.1f} x real time); resident "
              f"memory sampled every {sec['sample_every_s']:g} s of simulated time.", "",
              f"**Resident memory, last / middle decile: {rss['ratio']:.3f}** ({rss['middle'] / mib:.1f} -> "
              f"{rss['last'] / mib:.1f} MiB; goal <= {LEVEL_RATIO}): "
              f"{'levels off' if s['level'] else 'does NOT level off'}.", "",
              "| quantity | middle decile | last decile | last / middle |", "|:---|---:|---:|---:|"]
    rows = (("resident memory, MiB", "rss_bytes", mib, ".1f"), ("model state, MiB", "state_bytes", mib, ".3f"),
            ("tiles", "tiles", 1, ".1f"), ("visited cells", "coverage_cells", 1, ".0f"),
            ("trajectory points", "trajectory_points", 1, ".0f"), ("samples waiting", "pending", 1, ".0f"),
            ("Python objects tracked by gc", "gc_objects", 1, ".0f"), ("samples in the model", "num_seen", 1, ".0f"))
    for label, key, scale, fmt in rows:
        r = s[key]
        lines.append(f"| {label} | {format(r['middle'] / scale, fmt)} | {format(r['last'] / scale, fmt)} | "
                     f"{_ratio(r['ratio'])} |")
    ser = sec["series"]
    lines += ["", "Every sample (simulated minute):", "", "| minute | RSS MiB | state MiB | tiles | cells | "
              "trajectory points | gc objects |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for k, ts in enumerate(ser["t_s"]):
        lines.append(f"| {ts / 60:.1f} | {ser['rss_bytes'][k] / mib:.1f} | {ser['state_bytes'][k] / mib:.3f} | "
                     f"{ser['tiles'][k]} | {ser['coverage_cells'][k]} | {ser['trajectory_points'][k]} | "
                     f"{ser['gc_objects'][k]} |")
    lines += ["", f"{sec['maps']} maps (median {sec['publish']['median_ms']:.0f} ms), {sec['model_summaries']} model "
              f"summaries (the last {sec['summary_bytes_last'] / 1024:.0f} KiB), {sec['updates']} updates.", ""]
    return lines


def _ratio(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"
