"""Large areas: a long simulated drive over a building-sized world, tiled (local submaps) against one global engine.

World: ``large_area`` (100 m x 60 m in the full plan) with ``large_dipoles`` steel objects (gp_mapping.sim). The
robot drives a lawnmower over it (rows ``large_line_spacing`` apart at ``large_speed``) for ``large_seconds``
(30 minutes), sampled at ``large_rate``; when the lawnmower ends, the path is driven again from its start, so
the last part of the drive revisits mapped ground (samples grow, the area does not). 2-D inputs (x, y) and 3-D
inputs (x, y, z, the sensor's height wobbling by ``large_height_amplitude``).

Every pose and reading goes through a ``Mapper`` (config/mapper.yaml, batches of ``large_batch``) three times:
with the plan's tiles (``model.tile_size`` = ``large_tile``, ``tile_overlap`` = ``large_overlap``,
``num_inducing`` = ``large_m`` per tile), with the shipped model section as it is (its tiles and M), and without
tiles (one engine, ``num_inducing`` = ``large_untiled_m``). Recorded per update: wall
and CPU time, the number of tiles; every ``large_sample_every`` samples the process RSS and the bytes of the
model state. Accuracy: RMSE of |B| (uT) at test points beside the path (every ``large_test_every``-th sample,
moved sideways by up to 0.3 m; truth from the simulated world), for both online maps and:

* ``exact_gp``: the offline reference. An offline SVGP with as many inducing points as all tiles together
  (thousands) is out of reach on a CPU, so, as the issue allows, an exact GP on a seeded subsample of
  ``large_exact_points`` samples: hyperparameters by marginal likelihood on ``large_exact_hyper_points`` of
  them (``large_exact_iterations`` Adam steps, GPyTorch), then exact conditioning on the whole subsample.
* ``nearest_neighbour`` on every sample.

Calibration (issue 37): at the same test points, a held-out reading as the drive's sensor would take it there (the
true field plus the sensor's white noise, ``SensorConfig.noise_std`` per axis, seeded; the drive's sensor has no
bias, soft iron or spikes), scored against each map's predictive distribution of a reading
(``Engine.predict_reading``; the exact GP: latent variance plus its learned noise): NLPD, within +-1 and +-2 SD,
the std of z and a reliability curve (:func:`gp_mapping.evaluation.calibration.scores`), plotted by :func:`plot`.

Cost against growth: latency and CPU time of the last tenth of the updates over the first tenth (after the
first ``large_warmup_seconds`` of data); memory at the end of the first pass (all ground covered once) against the
end of the drive (ground revisited) and against the number of tiles.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from gp_mapping.evaluation.common import percentiles
from gp_mapping.evaluation.growth import _decile_ratio, feed


def _world_and_drive(plan: dict, dims: int, seed: int):
    from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

    w, h = plan["large_area"]
    area = (0.0, 0.0, float(w), float(h))
    traj = TrajectoryConfig(patterns=("lawnmower",), area=area, inset=1.0, speed=plan["large_speed"],
                            duration=float(plan["large_seconds"]), rate=float(plan["large_rate"]),
                            line_spacing=plan["large_line_spacing"], min_turn_radius=1.0, lookahead=1.0,
                            height_amplitude=plan["large_height_amplitude"] if dims == 3 else 0.0,
                            wobble_frequency=0.2)
    world = WorldConfig(area=area, n_dipoles=int(plan["large_dipoles"]), margin=2.0)
    return simulate(world, traj, SensorConfig(), seed=seed)


def _test_points(rec, plan: dict, dims: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Test inputs beside the path, the true |B| there and a held-out reading of it (uT): the drive's sensor noise
    added to the true vector before its magnitude is taken, as the drive's own readings are."""
    idx = np.arange(0, len(rec.t), int(plan["large_test_every"]))
    pos = rec.sensor_position[idx].copy()
    d = np.gradient(rec.sensor_position[:, :2], axis=0)[idx]
    normal = np.column_stack([-d[:, 1], d[:, 0]]) / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-12)
    pos[:, :2] += normal * rng.uniform(-0.3, 0.3, size=(len(idx), 1))
    field = rec.world.field(pos)
    truth = np.linalg.norm(field, axis=1) * 1e6
    reading = np.linalg.norm(field + rng.normal(scale=rec.sensor.noise_std, size=field.shape), axis=1) * 1e6
    return pos[:, :dims], truth, reading


def _config(plan: dict, dims: int, tiled: bool | str, engine: str | None = None):
    """The shipped config with the plan's tiles (``tiled`` True), one engine (False) or its own model section
    ('shipped'); ``engine`` 'var_gp': one VAR-GP with ``large_vargp_m`` inducing points over all its region
    blocks (its own block settings as shipped)."""
    from gp_mapping.evaluation.speed import shipped_config
    import dataclasses

    cfg = shipped_config()
    if tiled == "shipped":
        return dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, input_dims=dims),
                                   batching=dataclasses.replace(cfg.batching, mode="count",
                                                                size=int(plan["large_batch"])),
                                   grid=dataclasses.replace(cfg.grid, resolution=0.25, max_cells=10_000_000))
    m = int(plan["large_m"] if tiled else plan["large_untiled_m"])
    if engine is not None:
        m = int(plan["large_vargp_m"])
    model = dataclasses.replace(cfg.model, device="cpu", num_inducing=m, engine=engine or cfg.model.engine,
                                memory_size=int(plan["large_memory"]),
                                tile_size=float(plan["large_tile"]) if tiled else 0.0,
                                tile_overlap=float(plan["large_overlap"]))
    return dataclasses.replace(cfg, model=model, sync=dataclasses.replace(cfg.sync, input_dims=dims),
                               batching=dataclasses.replace(cfg.batching, mode="count", size=int(plan["large_batch"])),
                               grid=dataclasses.replace(cfg.grid, resolution=0.25, max_cells=10_000_000))


def _stream(rec, plan: dict, dims: int, tiled: bool | str, test_x: np.ndarray, truth: np.ndarray,
            log: Callable[[str], None], label: str, engine: str | None = None,
            reading: np.ndarray | None = None) -> dict[str, Any]:
    import torch

    from gp_mapping.evaluation.calibration import scores
    from gp_mapping.mapping.mapper import Mapper

    mapper = Mapper(_config(plan, dims, tiled, engine))
    n = len(rec.t)
    fed = feed(mapper, rec, int(plan["large_sample_every"]), log, label, log_parts=5)
    seen, ms, cpu_ms = fed["updates"]["num_seen"], fed["updates"]["ms"], fed["updates"]["cpu_ms"]
    mapper.flush()
    processing = fed["processing_s"]
    with torch.no_grad():  # a reading's mean is the latent field's: one prediction serves the RMSE and the scores
        reading_mean, reading_var = mapper.model.predict_reading(test_x)
    mean = reading_mean.cpu().numpy()[:, 0]
    grid_start = time.perf_counter()
    window = mapper.grid()  # what the node publishes: the window around the robot
    window_seconds = time.perf_counter() - grid_start
    grid_start = time.perf_counter()
    grid = mapper.grid(full=True)  # the whole map (files)
    grid_seconds = time.perf_counter() - grid_start
    lo = min(plan["large_warmup_seconds"] * plan["large_rate"], 0.5 * n)
    s, m = np.asarray(seen, float), np.asarray(ms, float)
    out = {"processing_s": processing, "updates": len(ms), "update_latency": percentiles(m / 1e3),
           "rmse": float(np.sqrt(np.mean((mean - truth) ** 2))),
           "grid": {"cells": int(grid.spec.num_cells), "seconds": grid_seconds,
                    "known_cells": int(grid.known.sum()), "window_cells": int(window.spec.num_cells),
                    "window_seconds": window_seconds},
           "curve": fed["updates"], "memory": fed["memory"]}
    if reading is not None:  # the map's predictive distribution of a held-out reading (module docstring)
        out["reading_scores"] = scores(reading_mean.cpu().numpy(), reading_var.cpu().numpy(), reading[:, None])
    a, b, r = _decile_ratio(s, m, lo, float(n))
    out.update(latency_first_decile_ms=a, latency_last_decile_ms=b, latency_ratio=r)
    a, b, r = _decile_ratio(s, np.asarray(cpu_ms, float), lo, float(n))
    out.update(cpu_first_decile_ms=a, cpu_last_decile_ms=b, cpu_ratio=r)
    after = s >= lo
    if after.sum() >= 2:
        out["latency_slope_ms_per_10k_samples"] = float(np.polyfit(s[after], m[after], 1)[0] * 1e4)
    out["tiles"] = int(getattr(mapper.model, "num_tiles", 1))
    if tiled:  # the last batch of the drive again, on the final map with all its tiles and with its own only
        b = int(plan["large_batch"])
        out["tile_count"] = tile_count_check(mapper.model, mapper.config.model, rec.sensor_position[-b:, :dims],
                                              np.linalg.norm(rec.field_sensor_tesla[-b:], axis=1)[:, None] * 1e6)
    return out


def tile_count_check(model, model_config, x: np.ndarray, y: np.ndarray, repeats: int = 7) -> dict[str, Any]:
    """Whether an update's cost depends on the number of tiles, with the tiles' fill taken out: the same batch
    (x, y) conditioned on the map's final state twice, once with all its tiles and once with only the tiles the
    update can reach (a state holds any number of tiles): those the batch falls in and those near the path,
    which the calibration's lagged copy of the map holds (TiledModel.tiles_near_path). Interleaved repeats from
    a fresh load each; median CPU ms of the update alone, their ratio, and the largest difference between the
    two maps at the batch's inputs afterwards (0: the other tiles do not enter the update)."""
    import torch

    from gp_mapping.gp import build_model
    from gp_mapping.gp.tiles import tile_key

    if not hasattr(model, "layout"):
        return {}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, members = model.layout.memberships(torch.as_tensor(x, dtype=torch.float64))
    reachable = {tile_key(row) for row in members.tolist()} | model.tiles_near_path()
    few = {k: v for k, v in state.items()
           if not k.startswith("tiles.") or k.split(".", 2)[1] in reachable}
    dims, outs = x.shape[1], y.shape[1]
    cpu: dict[str, list[float]] = {"all": [], "reachable": []}
    maps = {}
    for _ in range(repeats):
        for name, st in (("all", state), ("reachable", few)):
            m = build_model(model_config, dims, outs)
            m.load_state_dict(st)
            c0 = time.process_time()
            m.update(x, y)
            cpu[name].append(1e3 * (time.process_time() - c0))
            maps[name] = (m.num_tiles, m.predict(x)[0])
    diff = float((maps["all"][1] - maps["reachable"][1]).abs().max())
    a, b = float(np.median(cpu["all"])), float(np.median(cpu["reachable"]))
    return {"tiles_all": maps["all"][0], "tiles_reachable": maps["reachable"][0], "reachable": len(reachable),
            "cpu_ms_all": a, "cpu_ms_reachable": b, "ratio": a / b, "max_map_difference": diff,
            "repeats": repeats}


def _first_pass_end(rec, sustain_seconds: float = 10.0) -> int:
    """Index of the sample where the first pass over the area ends: the first sample from which the robot drives
    for ``sustain_seconds`` within 1 m of ground it drove over more than a minute before (crossing an old lane
    on the way back to the start is brief; re-driving a lane is not). The drive's length if that never happens."""
    from scipy.spatial import cKDTree

    p = rec.position[:, :2]
    rate = 1.0 / float(np.median(np.diff(rec.t)))
    old = int(60.0 * rate)
    tree = cKDTree(p)
    revisit = np.array([bool(nb) and min(nb) < i - old for i, nb in enumerate(tree.query_ball_point(p, r=1.0))])
    run = int(sustain_seconds * rate)
    count = 0
    for i, r in enumerate(revisit):
        count = count + 1 if r else 0
        if count >= run:
            return i - run + 1
    return len(p)


def _memory_summary(run: dict, first_pass: int) -> dict[str, float]:
    mem = run["memory"]
    samples = np.asarray(mem["samples"])
    k = int(np.searchsorted(samples, first_pass))
    k = min(max(k, 0), len(samples) - 1)
    out = {"first_pass_samples": int(samples[k]), "end_samples": int(samples[-1])}
    for key in ("rss_bytes", "state_bytes", "tiles"):
        a, b = float(mem[key][k]), float(mem[key][-1])
        out[f"{key}_first_pass"], out[f"{key}_end"] = a, b
    out["state_bytes_per_tile_end"] = out["state_bytes_end"] / max(out["tiles_end"], 1.0)
    out["state_ratio_end_over_first_pass"] = out["state_bytes_end"] / max(out["state_bytes_first_pass"], 1.0)
    out["samples_ratio_end_over_first_pass"] = out["end_samples"] / max(out["first_pass_samples"], 1.0)
    # Growth with the area: RSS against the tiles made, by least squares over the drive.
    tiles = np.asarray(mem["tiles"], float)
    rss = np.asarray(mem["rss_bytes"], float)
    if np.ptp(tiles) > 0:
        slope, icpt = np.polyfit(tiles, rss, 1)
        out["rss_mib_per_tile"] = float(slope / 2 ** 20)
        out["rss_fit_residual_mib"] = float(np.sqrt(np.mean((rss - (slope * tiles + icpt)) ** 2)) / 2 ** 20)
    return out


def growing_ratios(r: dict, first_pass: int, warmup: float) -> dict[str, float]:
    """Latency and CPU time while the map grows: the last tenth of the first pass over the first tenth (both
    after ``warmup`` samples). The drive's last tenth (``latency_ratio``) is on revisited ground, where every
    tile is full (M and memory at their caps) and an update costs more than in tiles still filling."""
    seen = np.asarray(r["curve"]["num_seen"], float)
    out = {}
    for key, name in (("ms", "latency"), ("cpu_ms", "cpu")):
        a, b, ratio = _decile_ratio(seen, np.asarray(r["curve"][key], float), warmup, float(first_pass))
        out[f"{name}_first_decile_ms"], out[f"{name}_last_decile_growing_ms"] = a, b
        out[f"{name}_ratio_growing"] = ratio
    return out


def region_blocks(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    """Tiles against VAR-GP's region blocks (gp/var_gp/: blocks of inducing points conditioned on their nearest
    earlier blocks, the other submap mechanism here) on the first ``large_vargp_seconds`` of the same 2-D drive:
    RMSE beside the path, update CPU time (median; last/first decile after ``large_warmup_seconds``)."""
    sub = {**plan, "large_seconds": float(plan["large_vargp_seconds"])}
    rec = _world_and_drive(sub, 2, seed=int(plan["large_seed"]))
    test_x, truth, _ = _test_points(rec, sub, 2, np.random.default_rng(1))
    out: dict[str, Any] = {"seconds": sub["large_seconds"], "samples": len(rec.t), "var_gp_m": int(plan["large_vargp_m"])}
    for name, tiled, engine in (("tiled", True, None), ("var_gp", False, "var_gp")):
        r = _stream(rec, sub, 2, tiled, test_x, truth, log, f"{name} 2-D, first {sub['large_seconds']:.0f} s", engine)
        cpu = np.asarray(r["curve"]["cpu_ms"], float)
        out[name] = {"rmse": r["rmse"], "cpu_median_ms": float(np.median(cpu)), "cpu_ratio": r["cpu_ratio"],
                     "cpu_first_decile_ms": r["cpu_first_decile_ms"], "cpu_last_decile_ms": r["cpu_last_decile_ms"],
                     "processing_s": r["processing_s"], "grid_seconds": r["grid"]["seconds"]}
    log(f"[large: region blocks] first {sub['large_seconds']:.0f} s: RMSE tiled {out['tiled']['rmse']:.3f}, var_gp "
        f"{out['var_gp']['rmse']:.3f} uT; update CPU median {out['tiled']['cpu_median_ms']:.0f} against "
        f"{out['var_gp']['cpu_median_ms']:.0f} ms")
    return out


def run(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    from gp_mapping.evaluation.baselines import ExactGPBaseline, KernelSpec, NearestNeighbour
    from gp_mapping.evaluation.calibration import scores

    results: dict[str, Any] = {"area_m": list(plan["large_area"]), "seconds": None}
    for dims in plan["large_dims"]:
        t0 = time.perf_counter()
        rec = _world_and_drive(plan, dims, seed=int(plan["large_seed"]))
        rng = np.random.default_rng(1)
        test_x, truth, reading = _test_points(rec, plan, dims, rng)
        x = rec.sensor_position[:, :dims]
        y = np.linalg.norm(rec.field_sensor_tesla, axis=1)[:, None] * 1e6
        path = float(np.sum(np.linalg.norm(np.diff(rec.position[:, :2], axis=0), axis=1)))
        log(f"[large {dims}-D] {len(rec.t)} samples, path {path:.0f} m, {len(test_x)} test points "
            f"({time.perf_counter() - t0:.0f} s to simulate)")
        entry: dict[str, Any] = {"samples": len(rec.t), "duration_s": float(rec.t[-1] - rec.t[0]),
                                 "rate_hz": plan["large_rate"], "path_m": path, "test_points": len(test_x),
                                 "dipoles": int(plan["large_dipoles"]),
                                 "extent_m": (np.ptp(rec.position[:, :2], axis=0)).tolist()}
        shipped = _config(plan, dims, "shipped").model
        entry["plan_tiles"] = f"{plan['large_tile']:g} m, M = {plan['large_m']}, memory {plan['large_memory']}"
        entry["shipped_tiles"] = (f"{shipped.tile_size:g} m, M = {shipped.num_inducing}, memory {shipped.memory_size}"
                                  if shipped.tile_size > 0 else f"no tiles, M = {shipped.num_inducing}")
        for name, tiled in (("tiled", True), ("shipped", "shipped"), ("untiled", False)):
            entry[name] = _stream(rec, plan, dims, tiled, test_x, truth, log, f"{name} {dims}-D", reading=reading)
        first_pass = _first_pass_end(rec)
        warmup = min(plan["large_warmup_seconds"] * plan["large_rate"], 0.5 * first_pass)
        for name in ("tiled", "shipped", "untiled"):
            entry[name]["memory_summary"] = _memory_summary(entry[name], first_pass)
            entry[name]["growing"] = growing_ratios(entry[name], first_pass, warmup)
        nn = NearestNeighbour(x, y)
        entry["nearest_neighbour"] = {"rmse": float(np.sqrt(np.mean((nn.predict(test_x)[:, 0] - truth) ** 2)))}
        # Offline reference: exact GP on a subsample (hyperparameters learned on a part of it).
        cfg = _config(plan, dims, True).model
        start = time.perf_counter()
        hyper = ExactGPBaseline(KernelSpec.from_model_config(cfg), max_points=int(plan["large_exact_hyper_points"]),
                                iterations=int(plan["large_exact_iterations"]), seed=0).fit(x, y)
        h = hyper.hyperparameters()[0]
        lengthscale = float(np.exp(np.mean(np.log(np.asarray(h["lengthscale"], float)))))
        spec = KernelSpec(kernel=cfg.kernel, lengthscales=cfg.lengthscales, constant_kernel=cfg.constant_kernel,
                          lengthscale=lengthscale,
                          signal_variance=float(h["signal_variance"]),
                          constant_variance=float(h.get("constant_variance", 1.0)),
                          noise_variance=float(h["noise_variance"]) / float(np.var(y)))  # standardised units
        exact = ExactGPBaseline(spec, max_points=int(plan["large_exact_points"]), iterations=0, seed=1).fit(x, y)
        em, ev = exact.predict_reading(test_x)
        entry["exact_gp"] = {"rmse": float(np.sqrt(np.mean((em[:, 0] - truth) ** 2))), "n_used": exact.n_used,
                             "hyper_points": hyper.n_used, "hyperparameters": h,
                             "reading_scores": scores(em, ev, reading[:, None]),
                             "seconds": time.perf_counter() - start}
        del exact, hyper  # its factors (~1 GiB) would otherwise count in the next streams' RSS
        ref = entry["exact_gp"]["rmse"]
        for name in ("tiled", "shipped", "untiled"):
            entry[name]["rmse_ratio"] = entry[name]["rmse"] / ref
        entry["nearest_neighbour"]["rmse_ratio"] = entry["nearest_neighbour"]["rmse"] / ref
        log(f"[large {dims}-D] RMSE uT: tiled {entry['tiled']['rmse']:.3f}, shipped {entry['shipped']['rmse']:.3f}, "
            f"untiled {entry['untiled']['rmse']:.3f}, "
            f"exact GP {ref:.3f}, nearest neighbour {entry['nearest_neighbour']['rmse']:.3f}; latency ratio "
            f"tiled {entry['tiled']['latency_ratio']:.2f} (CPU {entry['tiled']['cpu_ratio']:.2f})")
        results[f"{dims}d"] = entry
    if float(plan.get("large_vargp_seconds", 0.0)) > 0:
        from gp_mapping.gp import ENGINES

        if "var_gp" in ENGINES:
            results["region_blocks"] = region_blocks(plan, log)
    return results


def _ratio(value) -> str:
    """A ratio for a table; '-' where there was none (too few updates: NaN, saved as null)."""
    return "-" if value is None or not np.isfinite(value) else f"{value:.2f}"


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Large area: local submaps (tiles) against one global engine", ""]
    if "error" in sec:
        return lines + [f"Failed: {sec['error']}", ""]
    for key in ("2d", "3d"):
        e = sec.get(key)
        if not e:
            continue
        t, u = e["tiled"], e["untiled"]
        ms_t = t["memory_summary"]
        lines += [f"### {key[0]}-D inputs: {e['extent_m'][0]:.0f} m x {e['extent_m'][1]:.0f} m driven, "
                  f"{e['duration_s'] / 60:.0f} min at {e['rate_hz']:g} Hz ({e['samples']} samples, path "
                  f"{e['path_m']:.0f} m, {e['dipoles']} dipoles); {e['test_points']} test points beside the path", "",
                  "| map | RMSE uT | / exact GP | update median ms | latency last/first decile: growing, end | "
                  "CPU: growing, end | "
                  "tiles | state MiB (first pass -> end) | RSS MiB (first pass -> end) | window / full map s |",
                  "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rows = [(f"tiled ({e.get('plan_tiles', 'plan')})", t)]
        if "shipped" in e:  # older reports have no shipped row
            rows.append((f"shipped ({e.get('shipped_tiles', 'config/mapper.yaml')})", e["shipped"]))
        rows.append(("untiled (one engine)", u))
        for name, r in rows:
            m = r["memory_summary"]
            g = r.get("growing") or growing_ratios(r, m["first_pass_samples"], 600.0)
            lines.append(f"| {name} | {r['rmse']:.3f} | {r['rmse_ratio']:.2f} | "
                         f"{r['update_latency']['median_ms']:.0f} | {g['latency_ratio_growing']:.2f}, "
                         f"{r['latency_ratio']:.2f} | {g['cpu_ratio_growing']:.2f}, {r['cpu_ratio']:.2f} | "
                         f"{r['tiles']} | {m['state_bytes_first_pass'] / 2 ** 20:.1f} -> "
                         f"{m['state_bytes_end'] / 2 ** 20:.1f} | {m['rss_bytes_first_pass'] / 2 ** 20:.0f} -> "
                         f"{m['rss_bytes_end'] / 2 ** 20:.0f} | {r['grid']['window_seconds']:.1f} / "
                         f"{r['grid']['seconds']:.1f} |")
        lines += [f"| exact GP ({e['exact_gp']['n_used']}-sample subsample) | {e['exact_gp']['rmse']:.3f} | 1.00 | "
                  f"- | - | - | - | - | - | - |",
                  f"| nearest neighbour (all samples) | {e['nearest_neighbour']['rmse']:.3f} | "
                  f"{e['nearest_neighbour']['rmse_ratio']:.2f} | - | - | - | - | - | - | - |", "",
                  f"First pass: the first {ms_t['first_pass_samples']} samples (every part of the area driven once); "
                  f"the rest revisits it ({ms_t['samples_ratio_end_over_first_pass']:.2f} x the samples). Latency "
                  f"deciles after the first minute: 'growing' = last tenth of the first pass (the map still growing) "
                  f"over the first tenth; 'end' = the drive's last tenth (revisited ground, tiles full). Tiled state "
                  f"per tile at the end {ms_t['state_bytes_per_tile_end'] / 2 ** 10:.0f} KiB; RSS against tiles: "
                  f"{ms_t.get('rss_mib_per_tile', float('nan')):.2f} MiB per tile.", ""]
        tc = t.get("tile_count")
        if tc:
            lines += [f"Cost against the number of tiles, fill taken out: the drive's last batch again on the final "
                      f"map, with all {tc['tiles_all']} tiles {tc['cpu_ms_all']:.1f} ms CPU, with only the "
                      f"{tc['tiles_reachable']} it can reach (its own and those near the path, which the "
                      f"calibration's lagged copy holds) {tc['cpu_ms_reachable']:.1f} ms (ratio "
                      f"{tc['ratio']:.2f}, median of {tc['repeats']}); the maps afterwards differ by at most "
                      f"{tc['max_map_difference']:.2g} uT at its inputs.", ""]
        lines += _calibration_table(e, rows)
    rb = sec.get("region_blocks")
    if rb:
        t, v = rb["tiled"], rb["var_gp"]
        lines += [f"### Tiles against VAR-GP's region blocks: the first {rb['seconds']:.0f} s of the 2-D drive "
                  f"({rb['samples']} samples)", "",
                  "| map | RMSE uT | update CPU median ms | CPU last/first decile | full grid s |",
                  "|:---|---:|---:|---:|---:|",
                  f"| tiles (as above) | {t['rmse']:.3f} | {t['cpu_median_ms']:.0f} | {_ratio(t['cpu_ratio'])} | "
                  f"{t['grid_seconds']:.1f} |",
                  f"| var_gp, M = {rb['var_gp_m']} over its blocks | {v['rmse']:.3f} | {v['cpu_median_ms']:.0f} | "
                  f"{_ratio(v['cpu_ratio'])} | {v['grid_seconds']:.1f} |", ""]
    return lines


def _calibration_table(e: dict[str, Any], rows: list[tuple[str, dict]]) -> list[str]:
    """The maps' predictive distributions of held-out readings (module docstring); empty for older reports."""
    scored = [(name, r["reading_scores"]) for name, r in rows if "reading_scores" in r]
    if not scored:
        return []
    if "reading_scores" in e["exact_gp"]:
        scored.append((f"exact GP ({e['exact_gp']['n_used']}-sample subsample)", e["exact_gp"]["reading_scores"]))
    lines = ["Calibration: a held-out reading at each test point (the true |B| read with the drive's sensor noise), "
             "against each map's predictive distribution of a reading (ideal: 0.68 and 0.95 within +-1 and +-2 SD, "
             "z-std 1).", "",
             "| map | RMSE uT (readings) | NLPD | within +-1 SD | within +-2 SD | z-std |",
             "|:---|---:|---:|---:|---:|---:|"]
    for name, s in scored:
        lines.append(f"| {name} | {s['rmse']:.3f} | {s['nlpd']:.3f} | {s['within_1sd']:.3f} | "
                     f"{s['within_2sd']:.3f} | {s['z_std']:.2f} |")
    return lines + [""]


def plot(sec: dict[str, Any], out) -> list[str]:
    """One reliability diagram per input dimension (held-out readings, every map and the exact GP): large_2d.png,
    large_3d.png."""
    from gp_mapping.evaluation.calibration import reliability_diagram

    written = []
    for key in ("2d", "3d"):
        e = sec.get(key)
        curves = [(name, e[name]["reading_scores"]) for name in ("tiled", "shipped", "untiled", "exact_gp")
                  if e and "reading_scores" in e.get(name, {})]
        if curves:
            path = out / f"large_{key}.png"
            reliability_diagram(curves, f"large area, {key[0]}-D inputs", path)
            written.append(path.name)
    return written
