"""Bench section ``merge``: recyclable-GP map merging (gp/merging/, seed 001).

1. Two simulated robots map the west and east halves of one world (|B|, dual SVGP each); their maps are merged
   without their data and compared with one mapper fed both streams (batches interleaved in time) and with each
   half alone: RMSE against the true field on a grid over the whole area.
2. Merge time against the number of sources: K robots (1..16) each map one east-west strip of the world; the
   merge of their maps is timed with the closed-form q(u*) only (no gradient steps) and with ``merge_steps``
   Adam steps on Z* and the kernel, with the merged map's RMSE.
3. Two sessions of a building (``merge_sessions``): the ``large`` section's 2-D drive (its plan keys) cut into
   its first and second half, each mapped with the shipped model section (tiles as shipped), merged tile by tile
   by the package's merge (gp_mapping.mapping.merge.merge_maps) in closed form and with ``merge_steps`` Adam steps
   per tile; against one map of the whole drive and each session alone, RMSE of |B| at the large section's test
   points.
4. Two sessions of a real room (``merge_solin``): Solin et al.'s sequences 1-2 and 3-4, each mapped with the
   shipped config (one tile each), merged tile by tile by merge_maps (closed form, and ``merge_steps`` per tile)
   and as one engine the way maps made with ``model.tile_size: 0`` merge (the sources' inducing points together,
   closed form and ``merge_steps``); against one map of sequences 1-4 and each session alone, RMSE of |B| on
   sequence 5 (protocol 2's test), scored at the first source's level. Then sequences 3-4 read SESSION_OFFSET
   higher (another sensor or day) and are merged levelled (merge_maps' default) and as they are.
   ``merge_solin_seconds`` cuts each sequence (quick). Skipped without the recording.

merge_maps levels the sources (each a session: its constant offset to the first measured where the maps overlap
and removed, gp/merging/levels.py) and fits the merged map's calibration on their records; NLPD, within +-2 SD and
z-std score it. The merges as one engine are made by hand (merge and merged_engine, the sources' records pooled as
merge_maps does; not levelled).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from gp_mapping import sim
from gp_mapping.gp import DualSVGP
from gp_mapping.gp.config import ModelConfig
from gp_mapping.gp.merging import merge, merged_engine, source_from_engine

AREA = (-5.0, -5.0, 5.0, 5.0)
#: what part 4 adds to sequences 3-4 (uT): another sensor's or day's constant offset (the issue's 5 uT)
SESSION_OFFSET = 5.0


def _world(seed: int) -> sim.World:
    return sim.World.from_config(sim.WorldConfig(area=AREA, depth_range=(1.0, 2.5)), np.random.default_rng(seed))


def _drive(world: sim.World, area, seconds: float, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    side = min(area[2] - area[0], area[3] - area[1])
    rec = sim.simulate(world, sim.TrajectoryConfig(area=area, duration=seconds, rate=rate, patterns=("lawnmower",),
                                                   line_spacing=min(0.8, side / 3), inset=min(0.1, side / 4)),
                       sim.SensorConfig(noise_std=0.2e-6), seed=seed)
    return rec.sensor_position[:, :2], np.linalg.norm(rec.field_sensor_tesla, axis=1) * 1e6


def _train(cfg: ModelConfig, x: np.ndarray, y: np.ndarray, batch: int) -> DualSVGP:
    model = DualSVGP(cfg, 2, 1)
    for b in range(0, len(x), batch):
        model.update(x[b:b + batch], y[b:b + batch, None], mode="full")
    return model


def _grid(world: sim.World, resolution: float) -> tuple[np.ndarray, np.ndarray]:
    xs, ys, field = sim.truth_grid(world, (-4.5, -4.5, 4.5, 4.5), resolution, 0.0)
    gx, gy = np.meshgrid(xs, ys)
    return np.column_stack([gx.ravel(), gy.ravel()]), np.linalg.norm(field, axis=2).ravel() * 1e6


def _rmse(model, grid: np.ndarray, truth: np.ndarray) -> float:
    return float(np.sqrt(np.mean((model.predict(grid)[0][:, 0].numpy() - truth) ** 2)))


def _scores(model, x: np.ndarray, truth: np.ndarray, reading: np.ndarray) -> dict[str, float]:
    """RMSE of the map's mean against the true |B| at x (N,), and NLPD, within +-2 SD and z-std of held-out
    readings there (N,) under the map's predictive distribution of a reading (every accuracy figure with its
    calibration)."""
    from gp_mapping.evaluation.baselines import rmse
    from gp_mapping.evaluation.calibration import scores

    mean, var = (t.cpu().numpy() for t in model.predict_reading(x))  # a reading's mean is the latent field's
    s = scores(mean, var, reading[:, None])
    return {"rmse": rmse(mean, truth[:, None]), **{k: s[k] for k in ("nlpd", "within_2sd", "z_std")}}


def run(plan: dict, log: Callable[[str], None], data_root=None, why: str | None = None) -> dict[str, Any]:
    world = _world(plan["merge_seed"])
    grid, truth = _grid(world, plan["merge_resolution"])
    seconds, rate, batch, m = plan["merge_seconds"], plan["merge_rate"], plan["merge_batch"], plan["merge_m"]
    cfg = ModelConfig(device="cpu", tile_size=0.0, num_inducing=m)
    # 1. Two halves.
    xa, ya = _drive(world, (-5.0, -5.0, 0.0, 5.0), seconds, rate, 1)
    xb, yb = _drive(world, (0.0, -5.0, 5.0, 5.0), seconds, rate, 2)
    a, b = _train(cfg, xa, ya, batch), _train(cfg, xb, yb, batch)
    n = min(len(xa), len(xb)) // batch * batch
    xi = np.stack([xa[:n].reshape(-1, batch, 2), xb[:n].reshape(-1, batch, 2)], 1).reshape(-1, 2)
    yi = np.stack([ya[:n].reshape(-1, batch), yb[:n].reshape(-1, batch)], 1).reshape(-1)
    single = _train(ModelConfig(device="cpu", tile_size=0.0, num_inducing=2 * m), xi, yi, batch)
    gcfg = ModelConfig(device="cpu", tile_size=0.0, num_inducing=a.num_inducing + b.num_inducing)
    halves = {"single_rmse": _rmse(single, grid, truth), "half_a_rmse": _rmse(a, grid, truth),
              "half_b_rmse": _rmse(b, grid, truth), "samples": int(len(xa) + len(xb))}
    for label, steps in (("closed_form", 0), ("learned", plan["merge_steps"])):
        res = merge([source_from_engine(a, "A"), source_from_engine(b, "B")], gcfg, steps=steps)
        halves[f"{label}_rmse"] = _rmse(merged_engine(res, gcfg, 1), grid, truth)
        halves[f"{label}_seconds"] = res.seconds
    halves.update(merged_rmse=halves["learned_rmse"], merge_seconds=halves["learned_seconds"],
                  global_m=int(res.z.shape[0]))
    halves["ratio"] = halves["merged_rmse"] / halves["single_rmse"]
    log(f"  halves: merged {halves['learned_rmse']:.3f} uT ({halves['closed_form_rmse']:.3f} closed form), one "
        f"mapper {halves['single_rmse']:.3f} uT (ratio {halves['ratio']:.2f}); halves alone "
        f"{halves['half_a_rmse']:.2f}, {halves['half_b_rmse']:.2f}")
    # 2. Merge time against the number of sources (east-west strips, one robot each).
    kmax = max(plan["merge_sources"])
    edges = np.linspace(AREA[0], AREA[2], kmax + 1)
    strips = []
    for k in range(kmax):
        x, y = _drive(world, (AREA[0], edges[k], AREA[2], edges[k + 1]), plan["merge_strip_seconds"], rate, 10 + k)
        strips.append(source_from_engine(_train(ModelConfig(device="cpu", tile_size=0.0, num_inducing=plan["merge_strip_m"]), x, y,
                                                batch), f"strip{k}"))
    timing = []
    for count in plan["merge_sources"]:
        # The first ``count`` of K strips: a merge of ``count`` maps (covering part of the area when count < K).
        used = strips[:count]
        gm = sum(s.num_inducing for s in used)
        row = {"sources": count, "global_m": gm}
        covered = grid[:, 1] < edges[count]
        for label, steps in (("closed_form", 0), ("learned", plan["merge_steps"])):
            start = time.perf_counter()
            r = merge(used, ModelConfig(device="cpu", tile_size=0.0, num_inducing=gm), steps=steps)
            row[f"{label}_seconds"] = time.perf_counter() - start
            row[f"{label}_rmse_covered"] = float(np.sqrt(np.mean((r.predict(grid[covered])[0][:, 0].numpy()
                                                                  - truth[covered]) ** 2)))
        row["rmse_covered"] = row["learned_rmse_covered"]
        timing.append(row)
        log(f"  {count:2d} sources, M* {gm}: {row['closed_form_seconds']:.2f} s closed form, "
            f"{row['learned_seconds']:.2f} s with {plan['merge_steps']} steps; RMSE {row['closed_form_rmse_covered']:.2f}"
            f" / {row['learned_rmse_covered']:.2f} uT")
    out = {"halves": halves, "timing": timing, "steps": plan["merge_steps"]}
    if plan.get("merge_sessions"):
        out["sessions"] = sessions(plan, log)
    if plan.get("merge_solin"):
        out["solin_sessions"] = (solin_sessions(plan, data_root, log) if data_root is not None
                                 else {"skipped": why or "no data folder"})
    return out


def _shipped_model():
    import dataclasses

    from gp_mapping.evaluation.speed import shipped_config

    return dataclasses.replace(shipped_config().model, device="cpu")


def _mapped(cfg, parts, batch: int) -> tuple[Any, float]:
    """A model (``build_model``) fed ``parts`` [(x, y), ...] in batches, and its CPU seconds."""
    from gp_mapping.gp import build_model

    model, start = build_model(cfg, int(parts[0][0].shape[1]), 1), time.process_time()
    for xs, ys in parts:
        for b in range(0, len(xs), batch):
            model.update(xs[b:b + batch], ys[b:b + batch])
    return model, time.process_time() - start


def _mapped_sessions(cfg, batch: int, score: Callable[[Any], dict], parts: dict[str, list]
                     ) -> tuple[dict[str, dict], dict[str, Any]]:
    """Each named session [(x, y), ...] mapped (:func:`_mapped`): its row (``score``'s, CPU seconds) and its
    model."""
    rows, models = {}, {}
    for name, session in parts.items():
        models[name], cpu = _mapped(cfg, session, batch)
        rows[name] = {**score(models[name]), "cpu_s": cpu}
    return rows, models


def solin_sessions(plan: dict, data_root, log: Callable[[str], None]) -> dict[str, Any]:
    """Part 4 (module docstring): two sessions of a real room merged, tile by tile and as one engine."""
    from gp_mapping.evaluation.datasets import load_solin2018
    from gp_mapping.gp.merging import Source

    cut = plan.get("merge_solin_seconds")

    def sequence(i: int) -> tuple[np.ndarray, np.ndarray]:
        s = load_solin2018(data_root, i)
        keep = (s.t - s.t[0] <= cut) if cut else np.ones(len(s.t), dtype=bool)
        return s.xy[keep], np.linalg.norm(s.field_uT[keep], axis=1)[:, None]

    cfg, batch = _shipped_model(), 100  # one-second batches of the 100 Hz recording
    test_x, test_y = sequence(5)

    def score(model) -> dict[str, float]:
        # at the first source's level (a merge's map is published at its sources' median level), which
        # sequence 5, read by the same sensor as the others, shares
        y = test_y[:, 0] + float(model.sessions.level()[0])
        return _scores(model, test_x, y, y)

    seqs = {i: sequence(i) for i in (1, 2, 3, 4)}
    out: dict[str, Any] = {"test": "sequence 5", "samples": {str(i): int(len(v[0])) for i, v in seqs.items()},
                           "offset": SESSION_OFFSET}
    rows, models = _mapped_sessions(cfg, batch, score, {name: [seqs[i] for i in ids] for name, ids in (
        ("all", (1, 2, 3, 4)), ("first", (1, 2)), ("second", (3, 4)))})
    out.update(rows)
    first, second = models["first"], models["second"]
    second_offset, _ = _mapped(cfg, [(x, y + SESSION_OFFSET) for x, y in (seqs[3], seqs[4])], batch)
    xy = [np.vstack([seqs[i][0] for i in ids]) for ids in ((1, 2), (3, 4))]  # where each session's readings are
    engines = [Source.from_summary(m.recyclable_summary(), name=n) for n, m in (("1-2", first), ("3-4", second))]
    records = [first.calibration_records(), second.calibration_records()]
    m_sum = sum(s.num_inducing for s in engines)
    for label, steps in (("closed_form", 0), ("learned", int(plan["merge_steps"]))):
        start = time.process_time()
        mapper, result = _merge_maps(cfg, {"1-2": (first, xy[0]), "3-4": (second, xy[1])}, tiled_steps=steps)
        out[f"tiled_{label}"] = {**score(mapper.model), "cpu_s": time.process_time() - start,
                                 "m": result.num_inducing, "offset": float(result.levels.offsets[1, 0])}
        start = time.process_time()
        res = merge(engines, cfg, num_inducing=m_sum, steps=steps)
        engine = merged_engine(res, cfg, 1)  # one engine (tile_size 0), as the untiled path makes it
        engine.pool_calibration(records)  # as merge_maps does (sources of one level: not levelled here)
        out[f"engine_{label}"] = {**score(engine), "cpu_s": time.process_time() - start, "m": res.num_inducing}
    # Sequences 3-4 read SESSION_OFFSET higher (another sensor or day): levelled as merge_maps does by default,
    # and merged as they are (levels=False, `gp-mapping merge --same-level`).
    for label, levels in (("offset_levelled", True), ("offset_as_they_are", False)):
        start = time.process_time()
        mapper, result = _merge_maps(cfg, {"1-2": (first, xy[0]), "3-4 +offset": (second_offset, xy[1])},
                                     levels=levels)
        out[label] = {**score(mapper.model), "cpu_s": time.process_time() - start, "m": result.num_inducing,
                      "offset": float(result.levels.offsets[1, 0]) if result.levels is not None else None}
    log(f"  Solin sessions: merged tile by tile {out['tiled_closed_form']['rmse']:.3f} uT (closed form), "
        f"{out['tiled_learned']['rmse']:.3f} ({plan['merge_steps']} steps); as one engine "
        f"{out['engine_closed_form']['rmse']:.3f} / {out['engine_learned']['rmse']:.3f}; one map of 1-4 "
        f"{out['all']['rmse']:.3f}; sessions alone {out['first']['rmse']:.3f}, {out['second']['rmse']:.3f}")
    return out


def _merge_maps(cfg, models: dict[str, tuple[Any, np.ndarray]], **kwargs):
    """The package's merge of maps (gp_mapping.mapping.merge.merge_maps: levelled, calibrated on the sources'
    records) of engines by name, each given with the (N, 2) positions of its readings, as the map of a Mapper with
    the shipped config and ``cfg`` that visited them."""
    import dataclasses

    from gp_mapping.evaluation.speed import shipped_config
    from gp_mapping.mapping.mapper import Mapper
    from gp_mapping.mapping.merge import MapSource, merge_maps

    config = dataclasses.replace(shipped_config(), model=cfg)
    sources = []
    for name, (model, xy) in models.items():
        mapper = Mapper(config, model=model)
        mapper.coverage.add(xy)
        sources.append(MapSource.from_mapper(name, mapper))
    return merge_maps(sources, **kwargs)


def sessions(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    """Part 3 (module docstring): a building mapped in two sessions with the shipped tiles, merged tile by tile."""
    from gp_mapping.evaluation import large

    rec = large._world_and_drive(plan, 2, seed=int(plan["large_seed"]))
    test_x, truth, reading = large._test_points(rec, plan, 2, np.random.default_rng(1))
    x = rec.sensor_position[:, :2]
    y = np.linalg.norm(rec.field_sensor_tesla, axis=1)[:, None] * 1e6
    cfg, batch = _shipped_model(), int(plan["large_batch"])

    def score(model) -> dict[str, float]:
        return _scores(model, test_x, truth, reading)

    half = len(x) // 2 // batch * batch
    out: dict[str, Any] = {"samples": int(len(x)), "area_m": list(plan["large_area"]),
                           "tiles": f"{cfg.tile_size:g} m, M = {cfg.num_inducing}, memory {cfg.memory_size}"}
    rows, models = _mapped_sessions(cfg, batch, score, {name: [(x[cut], y[cut])] for name, cut in (
        ("whole", slice(None)), ("first", slice(0, half)), ("second", slice(half, None)))})
    for name, row in rows.items():
        out[name] = {**row, "tiles": models[name].num_tiles}
    halves = {"first": (models["first"], x[:half]), "second": (models["second"], x[half:])}
    for label, steps in (("closed_form", 0), ("learned", int(plan["merge_steps"]))):
        start = time.process_time()
        mapper, result = _merge_maps(cfg, halves, tiled_steps=steps)
        out[label] = {**score(mapper.model), "tiles": mapper.model.num_tiles, "cpu_s": time.process_time() - start,
                      "max_m": result.num_inducing, "offset": float(result.levels.offsets[1, 0])}
    out["ratio"] = out["learned"]["rmse"] / out["whole"]["rmse"]
    log(f"  sessions: merged {out['learned']['rmse']:.3f} uT ({out['closed_form']['rmse']:.3f} closed form), "
        f"whole drive {out['whole']['rmse']:.3f}, sessions alone {out['first']['rmse']:.3f}, "
        f"{out['second']['rmse']:.3f}")
    return out


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Merging maps (recyclable GPs)", ""]
    if "error" in sec:
        return lines + [f"Failed: {sec['error']}", ""]
    h = sec["halves"]
    closed = h.get("closed_form_rmse", math.nan)  # absent from reports written before it was measured
    lines += ["Two simulated robots on the west and east halves of one world (|B|, RMSE against the true field over "
              f"the whole area, uT; merged with M* = both sources' M, {sec['steps']} Adam steps, and in closed form):",
              "",
              "| merged | merged, closed form | one mapper fed both | merged / one mapper | west half alone | "
              "east half alone | merge s |",
              "|---:|---:|---:|---:|---:|---:|---:|",
              f"| {h['merged_rmse']:.3f} | {closed:.3f} | {h['single_rmse']:.3f} | {h['ratio']:.2f} | "
              f"{h['half_a_rmse']:.2f} | {h['half_b_rmse']:.2f} | {h['merge_seconds']:.2f} |", "",
              f"Merge time against the number of sources (strips of the world; M* = sum of the sources' M; "
              f"learned: {sec['steps']} Adam steps on Z* and the kernel):", "",
              "| sources | M* | closed form s | learned s | RMSE on the covered area, closed form / learned |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['sources']} | {r['global_m']} | {r['closed_form_seconds']:.2f} | {r['learned_seconds']:.2f} | "
              f"{r.get('closed_form_rmse_covered', math.nan):.2f} / {r['rmse_covered']:.2f} |" for r in sec["timing"]]
    lines += [""]
    ss = sec.get("sessions")
    if ss:
        lines += [f"A building in two sessions (the large section's 2-D drive, {ss['area_m'][0]:g} m x "
                  f"{ss['area_m'][1]:g} m, {ss['samples']} samples, cut in two halves in time; shipped tiles "
                  f"{ss['tiles']}), merged tile by tile; RMSE of |B| at the large section's test points, uT, and "
                  "NLPD, within +-2 SD and z-std of held-out readings there (the large section's; a merged map "
                  "calibrated on its sources' records); CPU seconds:", "",
                  "| map | RMSE | NLPD | within +-2 SD | z-std | tiles | CPU s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for key, label in (("whole", "one map of the whole drive"), ("first", "first session alone"),
                           ("second", "second session alone"), ("closed_form", "merged, closed form"),
                           ("learned", f"merged, {sec['steps']} Adam steps per tile")):
            lines.append(f"| {label} | {ss[key]['rmse']:.3f} | {_calibration_cells(ss[key])} | {ss[key]['tiles']} | "
                         f"{ss[key]['cpu_s']:.1f} |")
        lines += ["", f"Merged / whole drive: {ss['ratio']:.3f}; largest merged tile M = {ss['learned']['max_m']}.",
                  ""]
    so = sec.get("solin_sessions")
    if so and "skipped" in so:
        lines += [f"Solin sessions skipped: {so['skipped']}", ""]
    elif so:
        lines += ["A real room in two sessions (Solin et al. 2018: sequences 1-2 and 3-4, each mapped with the shipped "
                  "config, one tile each; RMSE of |B| on sequence 5, uT, NLPD, within +-2 SD and z-std of its "
                  "readings, a merged map calibrated on its sources' records; CPU seconds of the mapping or the "
                  "merge):",
                  "", "| map | RMSE | NLPD | within +-2 SD | z-std | M | CPU s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for key, label in (("all", "one map of sequences 1-4"), ("first", "sequences 1-2 alone"),
                           ("second", "sequences 3-4 alone"), ("tiled_closed_form", "merged tile by tile, closed form"),
                           ("tiled_learned", f"merged tile by tile, {sec['steps']} Adam steps"),
                           ("engine_closed_form", "merged as one engine (M = both sources'), closed form"),
                           ("engine_learned", f"merged as one engine (M = both sources'), {sec['steps']} Adam steps"),
                           ("offset_levelled", f"3-4 read {so.get('offset', SESSION_OFFSET):g} uT higher: merged "
                                               "tile by tile, levelled"),
                           ("offset_as_they_are", f"3-4 read {so.get('offset', SESSION_OFFSET):g} uT higher: merged "
                                                  "as they are")):
            row = so.get(key)
            if row is None:  # a report written before the row was measured
                continue
            lines.append(f"| {label} | {row['rmse']:.3f} | {_calibration_cells(row)} | {row.get('m', '')} | "
                         f"{row['cpu_s']:.1f} |")
        offsets = [f"{so[k]['offset']:+.2f} uT {what}" for k, what in (
            ("tiled_closed_form", "between the sessions as recorded"), ("offset_levelled", "with the offset added"))
            if so.get(k, {}).get("offset") is not None]
        lines += ["", "Offset of 3-4 to 1-2 measured by the merge: " + "; ".join(offsets) + ".", ""] if offsets \
            else [""]
    return lines


def _calibration_cells(row: dict[str, Any]) -> str:
    """NLPD | within +-2 SD | z-std of a row ('-' in reports written before they were measured)."""
    if "nlpd" not in row:
        return "- | - | -"
    return f"{row['nlpd']:.3f} | {row['within_2sd']:.3f} | {row['z_std']:.2f}"
