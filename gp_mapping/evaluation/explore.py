"""A long exploration through the node's path: do maps keep coming, does memory stay flat, does the model keep up?

The robot drives a lawnmower over ``explore_area`` x ``explore_area`` metres (lanes ``explore_lane`` apart) in
``explore_seconds`` of data time at ``explore_rate`` Hz, over a smooth synthetic field (a few plane waves around
50 uT, 0.1 uT noise). Every pose and reading goes to a ``Mapper`` built from ``config/mapper.yaml`` (model on the
CPU), driven exactly as the node's update thread drives it: per step, a map if a publish tick
(``node.publish_period``) came and the map changed (``Mapper.grid(predict_unknown=False)`` and the
publication layout, as the node publishes), then the messages received so far, then one model update.

Time is emulated, not waited for: the clock starts at the first sample's stamp and advances by the measured CPU
time of every map, feed and update (and jumps ahead to the next message or tick when the thread would sleep), so
the schedule is the one a node whose update thread has a core of its own would follow, without the idle time; a
30-minute exploration takes only the compute, and other processes on a shared machine do not distort it (their
load shows in ``wall_seconds`` only). Messages arrive at their stamps (no transport delay); the executor's own
message handling is not counted.

Recorded: the emulated time of every map (rate per minute, longest gap), the samples received and not yet in the
model after each step (how many full batches the model is behind), the resident memory every emulated 10 s
(last / first decile after ``explore_warmup_seconds``), the publish and update wall times, the map sizes.

Maps are drawn as the node draws them, incrementally (``Mapper.grid(incremental=True)``: only cells whose tiles
changed are re-predicted). Every ``explore_compare_every``-th map is also drawn whole from the same state, outside
the emulated clock: the CPU times of both draws of those maps (the grid alone, without the messages), and their
largest difference (mean in field units, variance relative to the largest variance of that map), say what the
incremental draw saves and that it is the same map.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import time
from typing import Any, Callable

import numpy as np

from gp_mapping.evaluation.common import percentiles, rss_bytes
from gp_mapping.evaluation.speed import shipped_config

RSS_EVERY_S = 10.0  # emulated seconds between two samples of the resident memory (less in a short run)
Q = np.array([0.0, 0.0, 0.0, 1.0])


def lawnmower(area: float, lane: float, duration: float, rate: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Stamps (N,) and positions (N, 2) of a lawnmower over [-area/2, area/2]^2 covered in ``duration`` seconds
    at ``rate`` Hz; returns them and the speed [m/s]."""
    lanes = int(math.floor(area / lane)) + 1
    corners = []
    for k in range(lanes):
        y = -area / 2 + k * lane
        xs = (-area / 2, area / 2) if k % 2 == 0 else (area / 2, -area / 2)
        corners += [(xs[0], y), (xs[1], y)]
    corners = np.array(corners)
    seg = np.linalg.norm(np.diff(corners, axis=0), axis=1)
    cum = np.concatenate([[0.0], np.cumsum(seg)])
    n = int(round(duration * rate))
    t = np.arange(n) / rate
    speed = cum[-1] / duration
    s = np.minimum(t * speed, cum[-1])
    xy = np.stack([np.interp(s, cum, corners[:, 0]), np.interp(s, cum, corners[:, 1])], axis=1)
    return t, xy, speed


def field_ut(xy: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A smooth field magnitude [uT] with structure on 3-30 m scales, plus 0.1 uT noise."""
    x, y = xy[:, 0], xy[:, 1]
    f = (50.0 + 2.0 * np.sin(x / 7.0) * np.cos(y / 5.0) + 1.5 * np.sin((x + 2 * y) / 13.0)
         + 1.0 * np.cos((3 * x - y) / 29.0) + 0.5 * np.sin(x / 3.1 + y / 4.3))
    return f + 0.1 * rng.standard_normal(f.shape)


def run(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    from gp_mapping.mapping import publication
    from gp_mapping.mapping.mapper import Mapper

    duration, rate = float(plan["explore_seconds"]), float(plan["explore_rate"])
    t, xy, speed = lawnmower(float(plan["explore_area"]), float(plan["explore_lane"]), duration, rate)
    rng = np.random.default_rng(int(plan.get("explore_seed", 0)))
    b_tesla = field_ut(xy, rng) * 1e-6
    t = t + 1.7e9  # wall-clock-like stamps
    config = shipped_config()
    if plan.get("explore_window"):
        config = dataclasses.replace(config, grid=dataclasses.replace(config.grid,
                                                                      window=list(plan["explore_window"])))
    mapper = Mapper(config)
    # The emulated clock advances by the CPU time of this thread (what the work costs on a core of its own, as
    # the node's update thread has with one torch thread); wall times on a shared machine add the others' load.
    cost = time.thread_time
    batch = int(config.batching.size)
    period = float(config.node.publish_period)
    n = t.shape[0]
    t0 = float(t[0])
    now = t0
    next_tick = t0 + period
    publish_due = False
    fed = 0
    map_times: list[float] = []
    publish_s: list[float] = []
    map_cells: list[int] = []
    known_cells: list[int] = []
    compare_every = int(plan.get("explore_compare_every") or 0)
    compared: dict[str, list[float]] = {"incremental_s": [], "whole_s": [], "mean_diff": [], "var_diff": []}
    update_s: list[float] = []
    behind_batches: list[int] = []
    behind_seconds: list[float] = []
    rss_t: list[float] = []
    rss: list[int] = []
    next_rss = t0
    gc.collect()
    wall = time.perf_counter()
    last_log = t0
    while now < t0 + duration:
        if now >= next_tick:  # the publish timer ticked (once per tick, however late)
            publish_due = True
            next_tick += period * (math.floor((now - next_tick) / period) + 1)
        worked = False
        if publish_due and mapper.map_changed:
            start = cost()
            mapper.mark_published()
            grid = mapper.grid(predict_unknown=False, incremental=True)
            drawn = cost() - start
            if grid is not None:
                publication.publication(grid, config.sync.field_unit, config.grid.mean_range,
                                        config.grid.variance_range)
                map_cells.append(grid.spec.num_cells)
                known_cells.append(int(grid.known.sum()))
            spent = cost() - start
            now += spent
            publish_s.append(spent)
            map_times.append(now - t0)
            publish_due = False
            worked = True
            if grid is not None and compare_every and len(map_times) % compare_every == 0:
                _compare_with_whole(mapper, grid, drawn, cost, compared)
        received = int(np.searchsorted(t, now, side="right"))
        if received > fed:
            start = cost()
            for i in range(fed, received):
                mapper.add_pose(float(t[i]), (xy[i, 0], xy[i, 1], 0.0), Q)
                mapper.add_magnetic_field(float(t[i]), (float(b_tesla[i]), 0.0, 0.0), "magnetometer")
            fed = received
            now += cost() - start
        start = cost()
        done = mapper.process(max_updates=1)
        if done:
            spent = cost() - start
            now += spent
            update_s.append(spent)
            worked = True
        seen = int(mapper.model.num_seen)
        behind = fed - seen
        behind_batches.append(behind // batch)
        newest_in_model = mapper.last_stamp if math.isfinite(mapper.last_stamp) else t0
        behind_seconds.append(max(0.0, min(now, t[fed - 1] if fed else t0) - newest_in_model))
        if now >= next_rss:
            rss_t.append(now - t0)
            rss.append(rss_bytes())
            next_rss += min(RSS_EVERY_S, duration / 200)
        if now - last_log >= duration / 10:
            last_log = now
            log(f"  explore: {now - t0:.0f}/{duration:.0f} s emulated, {time.perf_counter() - wall:.0f} s wall, "
                f"{len(map_times)} maps, {mapper.updates} updates, behind {behind} samples, "
                f"RSS {rss_bytes() / 2 ** 20:.0f} MiB")
        if not worked:  # the thread would sleep: until the message that completes a batch, or the next tick
            need = max(1, batch - (fed - seen))
            events = [next_tick, t0 + duration]
            if fed < n:
                events += [float(t[min(n - 1, fed + need - 1)]), float(t[fed])]
            later = [e for e in events if e > now]
            now = min(later) if later else now + 1.0 / rate
    wall = time.perf_counter() - wall
    return {"area_m": float(plan["explore_area"]), "lane_m": float(plan["explore_lane"]), "duration_s": duration,
            "rate_hz": rate, "samples": n, "speed_m_s": speed, "path_m": speed * duration,
            "window_m": list(config.grid.window), "resolution_m": config.grid.resolution,
            "publish_period_s": period, "batch": batch, "full_update_every": config.model.full_update_every,
            "wall_seconds": wall, "updates": mapper.updates, "num_seen": int(mapper.model.num_seen),
            "coverage_cells": len(mapper.coverage),
            "maps": {"times_s": map_times, "cells": map_cells, "known_cells": known_cells,
                     "publish": percentiles(np.asarray(publish_s)),
                     "compared": {"every": compare_every, "maps": len(compared["whole_s"]),
                                  "incremental": percentiles(np.asarray(compared["incremental_s"])),
                                  "whole": percentiles(np.asarray(compared["whole_s"])),
                                  "max_mean_diff": float(max(compared["mean_diff"], default=0.0)),
                                  "max_var_diff_relative": float(max(compared["var_diff"], default=0.0))}},
            "update": percentiles(np.asarray(update_s)),
            "behind": {"batches": behind_batches[::max(1, len(behind_batches) // 2000)],
                       "max_full_batches": int(max(behind_batches, default=0)),
                       "max_seconds": float(max(behind_seconds, default=0.0))},
            "memory": {"t_s": rss_t, "rss_bytes": rss},
            "summary": summarise(map_times, behind_batches, behind_seconds, rss_t, rss, duration,
                                 float(plan["explore_warmup_seconds"]))}


def _compare_with_whole(mapper, grid, incremental_s: float, cost, out: dict[str, list[float]]) -> None:
    """Draw the map just published again, whole, from the same state: its CPU time and the differences."""
    start = cost()
    whole = mapper.grid(predict_unknown=False)
    out["whole_s"].append(cost() - start)
    out["incremental_s"].append(incremental_s)
    mean_diff = var_diff = 0.0
    for name, (mean, var) in grid.layers.items():
        whole_mean, whole_var = whole.layers[name]
        if not np.array_equal(np.isnan(mean), np.isnan(whole_mean)):
            raise AssertionError(f"the incremental map's layer {name!r} has other known cells than the whole one")
        cells = np.isfinite(whole_mean)
        if cells.any():
            mean_diff = max(mean_diff, float(np.max(np.abs(mean[cells] - whole_mean[cells]))))
            scale = max(float(np.max(whole_var[cells])), 1e-300)
            var_diff = max(var_diff, float(np.max(np.abs(var[cells] - whole_var[cells]))) / scale)
    out["mean_diff"].append(mean_diff)
    out["var_diff"].append(var_diff)


def summarise(map_times, behind_batches, behind_seconds, rss_t, rss, duration, warmup) -> dict[str, Any]:
    times = np.asarray(map_times, dtype=np.float64)
    minute = 60.0 if duration >= 120.0 else duration / 2
    edges = np.arange(0.0, duration + 1e-9, minute)
    per_window = np.histogram(times, bins=edges)[0] / minute if edges.size > 1 else np.array([0.0])
    gaps = np.diff(np.concatenate([[0.0], times])) if times.size else np.array([duration])
    rt, r = np.asarray(rss_t, dtype=np.float64), np.asarray(rss, dtype=np.float64)
    lo = min(warmup, 0.5 * duration)
    span = duration - lo
    first = r[(rt >= lo) & (rt <= lo + 0.1 * span)]
    last = r[rt >= duration - 0.1 * span]
    a = float(first.mean()) if first.size else float("nan")
    b = float(last.mean()) if last.size else float("nan")
    out = {"maps": int(times.size), "map_rate_hz_mean": float(times.size / duration),
           "map_rate_hz_min_per_window": float(per_window.min()), "window_s": minute,
           "longest_gap_s": float(gaps.max()),
           "max_full_batches_behind": int(max(behind_batches, default=0)),
           "max_seconds_behind": float(max(behind_seconds, default=0.0)),
           "warmup_s": lo, "rss_first_decile_mib": a / 2 ** 20, "rss_last_decile_mib": b / 2 ** 20,
           "rss_ratio": b / a if a > 0 else float("nan")}
    out["pass"] = {"maps_at_least_0.5_hz": out["map_rate_hz_min_per_window"] >= 0.5,
                   "rss_flat": bool(out["rss_ratio"] <= 1.2),
                   "at_most_one_batch_behind": out["max_full_batches_behind"] <= 1}
    return out


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Long exploration through the node's path", ""]
    if "error" in sec:
        return lines + [f"Failed: {sec['error']}", ""]
    s = sec["summary"]
    ok = lambda v: "yes" if v else "NO"  # noqa: E731
    lines += [f"Lawnmower over {sec['area_m']:.0f} m x {sec['area_m']:.0f} m (lanes {sec['lane_m']:.0f} m apart, "
              f"{sec['path_m']:.0f} m at {sec['speed_m_s']:.2f} m/s), {sec['duration_s'] / 60:.3g} min at "
              f"{sec['rate_hz']:g} Hz ({sec['samples']} samples), shipped config (window {sec['window_m'][0]:g} m x "
              f"{sec['window_m'][1]:g} m at {sec['resolution_m']:g} m, batch {sec['batch']}, publish every "
              f"{sec['publish_period_s']:g} s); the node's update-thread schedule emulated with the measured CPU time "
              f"of each step ({sec['wall_seconds']:.0f} s of wall time for the run).", "",
              "| quantity | value | goal | met |", "|:---|---:|:---|:---|",
              f"| maps, lowest rate over a {s['window_s']:.0f} s window | {s['map_rate_hz_min_per_window']:.2f} Hz "
              f"(mean {s['map_rate_hz_mean']:.2f}, {s['maps']} maps, longest gap {s['longest_gap_s']:.1f} s) | "
              f">= 0.5 Hz | {ok(s['pass']['maps_at_least_0.5_hz'])} |",
              f"| resident memory after {s['warmup_s']:.0f} s, last / first decile | {s['rss_ratio']:.3f} "
              f"({s['rss_first_decile_mib']:.0f} -> {s['rss_last_decile_mib']:.0f} MiB) | <= 1.2 | "
              f"{ok(s['pass']['rss_flat'])} |",
              f"| full batches waiting for the model, most | {s['max_full_batches_behind']} (newest sample in the "
              f"model at most {s['max_seconds_behind']:.1f} s old) | <= 1 | "
              f"{ok(s['pass']['at_most_one_batch_behind'])} |",
              f"| map publication, median / p95 | {sec['maps']['publish']['median_ms']:.0f} / "
              f"{sec['maps']['publish']['p95_ms']:.0f} ms ({int(np.median(sec['maps']['known_cells'] or [0]))} known "
              f"of {int(np.median(sec['maps']['cells'] or [0]))} cells, median) | | |",
              *_comparison_rows(sec['maps'].get('compared')),
              f"| model update, median / p95 | {sec['update']['median_ms']:.0f} / {sec['update']['p95_ms']:.0f} ms "
              f"| | |", ""]
    return lines


def _comparison_rows(compared: dict | None) -> list[str]:
    if not compared or not compared.get("maps"):
        return []
    inc, whole = compared["incremental"], compared["whole"]
    ratio = whole["median_ms"] / inc["median_ms"] if inc["median_ms"] > 0 else math.inf
    return [f"| maps drawn again whole ({compared['maps']}, one in {compared['every']}): incremental against whole, "
            f"median / p95 | {inc['median_ms']:.0f} / {inc['p95_ms']:.0f} against {whole['median_ms']:.0f} / "
            f"{whole['p95_ms']:.0f} ms ({ratio:.1f}x); largest difference: mean {compared['max_mean_diff']:.1e} uT, "
            f"variance {compared['max_var_diff_relative']:.1e} of the map's largest | | |"]
