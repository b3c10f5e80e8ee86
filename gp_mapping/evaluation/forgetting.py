"""Forgetting and bounded cost of the region-block engine (var_gp, Kapoor et al. 2021) against the other engines.

``curve`` (protocol 1 of the accuracy section: Solin et al. 2018 sequence 3 streamed in ``p1_batches`` consecutive
batches): after every batch, the RMSE of |B| (uT) on the test samples of sequences 1, 2, 4 and 5 that lie within
``forget_radius`` of the FIRST batch's path, for var_gp (its shipped settings: each block conditioned on its
``vargp_neighbours`` nearest blocks), var_gp whose revisits refine the frozen blocks, var_gp with M = 512 (no distillation on this recording), var_gp with blocks of
32 conditioned on the 1 nearest block and on all earlier blocks (the paper's full conditioning: the loss of the
bounded-cost approximation on this small map), dual_svgp (full updates), continual_mogp (fast, full every
``fast_full_every``-th) and the streaming sparse GP of Bui et al. (2017). A method forgets when that RMSE
rises after the region was mapped; ``forgetting`` = worst RMSE after batch 1 / RMSE after batch 1, also the
RMSE on all test samples after the last batch and the update latency.

``drive``: a ``vargp_drive_seconds`` (30-minute) lawnmower over the large section's building-sized world
(``large_area``, ``large_dipoles``, 2-D inputs) through the Mapper with var_gp (config/mapper.yaml otherwise),
so blocks keep being opened and distilled; the update latency's last decile over its first (after
``large_warmup_seconds``), the blocks, distillations and the RMSE beside the path.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from gp_mapping.evaluation.accuracy import _engine_method, _osgpr_method, engine_config, protocol1_data
from gp_mapping.evaluation.bench_engine import _summary
from gp_mapping.evaluation.common import percentiles
from gp_mapping.evaluation.growth import _decile_ratio, feed
from gp_mapping.gp import ENGINES

FORGET_RADIUS = 0.1  # m: test samples this close to the first batch's path (1185 of 33625 on the recording)


def _methods(plan: dict) -> list:
    every = int(plan["fast_full_every"])
    var = engine_config(engine="var_gp")
    out = [_engine_method("var_gp", f"VAR-GP, shipped (M = {var.num_inducing}, blocks of {var.vargp_block_size}, "
                          f"{var.vargp_neighbours} nearest)", var, lambda i: "full"),
           _engine_method("dual_svgp_full", "dual SVGP, full updates", engine_config(), lambda i: "full")]
    if not int(plan.get("forget_variants", 1)):  # the quick plan: var_gp as shipped, dual_svgp and Bui et al.
        return out + [_osgpr_method(engine_config(), int(plan["osgpr_iterations"]))]
    out += [_engine_method("var_gp_refine", "VAR-GP, revisits refine the frozen blocks",
                           dataclasses.replace(var, vargp_revisits="refine"), lambda i: "full"),
            _engine_method("var_gp_m512", "VAR-GP, M = 512 (no distillation here)",
                          dataclasses.replace(var, num_inducing=512), lambda i: "full"),
           _engine_method("var_gp_k1", "VAR-GP, blocks of 32, conditioned on the 1 nearest",
                          dataclasses.replace(var, vargp_block_size=32, vargp_neighbours=1, num_inducing=512),
                          lambda i: "full"),
           _engine_method("var_gp_k0", "VAR-GP, blocks of 32, conditioned on all earlier (the paper's)",
                          dataclasses.replace(var, vargp_block_size=32, vargp_neighbours=0, num_inducing=512),
                          lambda i: "full")]
    if "continual_mogp" in ENGINES:
        out.append(_engine_method("continual_mogp", f"continual multi-output GP, fast + full every {every}th",
                                  engine_config(engine="continual_mogp"),
                                  lambda i: "full" if i % every == 0 else "fast"))
    out.append(_osgpr_method(engine_config(), int(plan["osgpr_iterations"])))
    return out


def curve(data_root, plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    from scipy.spatial import cKDTree

    batches, x_test, y_test = protocol1_data(data_root, plan)
    stride = int(plan["test_stride"])
    radius = float(plan.get("forget_radius", FORGET_RADIUS))
    near = cKDTree(batches[0][0]).query(x_test)[0] < radius
    x_near, y_near = x_test[near], y_test[near]
    methods = _methods(plan)
    curves = {m.name: {"batch": [], "rmse_first_region": []} for m in methods}
    start = time.perf_counter()
    for b, (xb, yb) in enumerate(batches):
        for m in methods:
            m.step(xb, yb)
            c = curves[m.name]
            c["batch"].append(b + 1)
            c["rmse_first_region"].append(m.score(x_near, y_near)["rmse"])
        log(f"  forgetting: batch {b + 1}/{len(batches)}: " + ", ".join(
            f"{m.name} {curves[m.name]['rmse_first_region'][-1]:.2f}" for m in methods)
            + f" ({time.perf_counter() - start:.0f} s)")
    results = {}
    for m in methods:
        c = curves[m.name]
        first = c["rmse_first_region"][0]
        results[m.name] = {"label": m.label, "curve": c, "rmse_after_first": first,
                           "rmse_first_region_final": c["rmse_first_region"][-1],
                           "forgetting": max(c["rmse_first_region"][1:] or [first]) / first,
                           "final_ratio": c["rmse_first_region"][-1] / first,
                           "final_rmse_all": m.score(x_test, y_test)["rmse"],
                           "update_latency": _summary(m.seconds, m.cpu_seconds)}
        model = m.model
        if hasattr(model, "num_blocks"):
            results[m.name].update(blocks=model.num_blocks, inducing=model.num_inducing,
                                   distillations=int(model.distillations_t))
    return {"description": f"Solin sequence 3 in {len(batches)} batches; RMSE on the {int(near.sum())} test samples "
                           f"(sequences 1, 2, 4, 5{'' if stride == 1 else f', every {stride}th'}) within "
                           f"{radius:g} m of the first batch's path, after every batch",
            "radius_m": radius, "test_points": int(near.sum()), "methods": results,
            "seconds": time.perf_counter() - start}


def drive(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    """var_gp through the Mapper over the large world (module docstring)."""
    import torch

    from gp_mapping.evaluation.large import _config, _test_points, _world_and_drive
    from gp_mapping.mapping.mapper import Mapper

    sub = dict(plan, large_seconds=float(plan["vargp_drive_seconds"]))
    rec = _world_and_drive(sub, 2, seed=int(plan["large_seed"]))
    test_x, truth, _ = _test_points(rec, sub, 2, np.random.default_rng(1))
    base = _config(sub, 2, False)
    config = dataclasses.replace(base, model=dataclasses.replace(base.model, engine="var_gp",
                                                                 num_inducing=int(plan["vargp_drive_m"])))
    mapper = Mapper(config)
    n = len(rec.t)
    fed = feed(mapper, rec, int(plan["large_sample_every"]), log, "var_gp drive", log_parts=5)
    mapper.flush()
    model = mapper.model
    with torch.no_grad():
        mean = model.predict(test_x)[0].numpy()[:, 0]
    seen = np.asarray(fed["updates"]["num_seen"], float)
    ms, cpu = np.asarray(fed["updates"]["ms"], float), np.asarray(fed["updates"]["cpu_ms"], float)
    lo = min(plan["large_warmup_seconds"] * plan["large_rate"], 0.5 * n)
    out: dict[str, Any] = {"samples": n, "duration_s": float(rec.t[-1] - rec.t[0]), "rate_hz": plan["large_rate"],
                           "area_m": list(plan["large_area"]), "num_inducing": int(plan["vargp_drive_m"]),
                           "processing_s": fed["processing_s"], "updates": len(ms),
                           "update_latency": percentiles(ms / 1e3), "blocks": model.num_blocks,
                           "blocks_opened": int(model.blocks_opened_t), "distillations": int(model.distillations_t),
                           "rmse": float(np.sqrt(np.mean((mean - truth) ** 2))), "curve": fed["updates"]}
    a, b, r = _decile_ratio(seen, ms, lo, float(n))
    out.update(latency_first_decile_ms=a, latency_last_decile_ms=b, latency_ratio=r)
    a, b, r = _decile_ratio(seen, cpu, lo, float(n))
    out.update(cpu_first_decile_ms=a, cpu_last_decile_ms=b, cpu_ratio=r)
    log(f"  var_gp drive: {model.blocks_opened_t} blocks opened, {model.distillations_t} distillations, latency "
        f"last/first decile {r:.2f} (CPU), RMSE {out['rmse']:.3f} uT")
    return out


def run(plan: dict, data_root, why: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if data_root is None:
        out["curve"] = {"skipped": why}
    else:
        out["curve"] = curve(data_root, plan, log)
    out["drive"] = drive(plan, log)
    return out


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Forgetting and bounded cost: VAR-GP region blocks", ""]
    if "error" in sec:
        return lines + [f"Failed: {sec['error']}", ""]
    c = sec.get("curve", {})
    if "skipped" in c:
        lines += [f"Forgetting curve skipped: {c['skipped']}", ""]
    elif c:
        lines += [f"{c['description']}. Forgetting = worst RMSE after batch 1 / RMSE after batch 1 (1.00: never "
                  "worse than when the region was first mapped).", "",
                  "| method | RMSE near batch 1, after it | after the last | forgetting | last / first | RMSE all "
                  "test, last | update median ms | update p95 ms |",
                  "|:---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in c["methods"].values():
            lat = r["update_latency"]
            lines.append(f"| {r['label']} | {r['rmse_after_first']:.2f} | {r['rmse_first_region_final']:.2f} | "
                         f"{r['forgetting']:.2f} | {r['final_ratio']:.2f} | {r['final_rmse_all']:.2f} | "
                         f"{lat['median_ms']:.1f} | {lat['p95_ms']:.1f} |")
        lines += ["", "Curves: `forgetting.png`.", ""]
    d = sec.get("drive")
    if d:
        lines += [f"var_gp through the Mapper: {d['duration_s'] / 60:.0f}-minute lawnmower over "
                  f"{d['area_m'][0]:g} m x {d['area_m'][1]:g} m at {d['rate_hz']:g} Hz ({d['samples']} samples), "
                  f"num_inducing {d['num_inducing']}: {d['blocks_opened']} blocks opened, {d['distillations']} "
                  f"distillations, {d['blocks']} blocks at the end; RMSE beside the path {d['rmse']:.3f} uT.", "",
                  "| update latency | first decile ms | last decile ms | last / first |", "|:---|---:|---:|---:|",
                  f"| wall, median | {d['latency_first_decile_ms']:.1f} | {d['latency_last_decile_ms']:.1f} | "
                  f"{d['latency_ratio']:.2f} |",
                  f"| CPU, median | {d['cpu_first_decile_ms']:.1f} | {d['cpu_last_decile_ms']:.1f} | "
                  f"{d['cpu_ratio']:.2f} |", ""]
    return lines


def plot(sec: dict[str, Any], out) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = sec.get("curve", {})
    if "methods" not in c:
        return []
    fig, ax = plt.subplots(1, 1, figsize=(8, 4.5))
    for r in c["methods"].values():
        ax.plot(r["curve"]["batch"], r["curve"]["rmse_first_region"], marker=".", label=r["label"])
    ax.set_ylabel(f"RMSE within {c['radius_m']:g} m of batch 1's path [uT]")
    ax.set_xlabel("batches streamed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(c["description"], fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "forgetting.png", dpi=110)
    plt.close(fig)
    return ["forgetting.png"]
