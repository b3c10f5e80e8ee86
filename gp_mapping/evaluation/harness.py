"""Run every benchmark section in one process and write ``bench.json``, ``bench.md`` and PNG curves.

    gp-mapping bench [--quick] [--out DIR] [--data DIR] [--threads N] [--only SECTION ...]
    python -m gp_mapping.evaluation.harness [same options]

Sections: ``accuracy`` (protocols 1 and 2 on the Solin 2018 recording; skipped with the reason when the
recording is absent), ``speed`` (engine latency over M, grid prediction, replay real-time factors),
``growth`` (cost against samples seen over a long simulated drive), ``cuda`` (the engine sweep on the
GPU; skipped without CUDA), ``large`` (local submaps against one engine over a 100 m x 60 m simulated building,
30 minutes, 2-D and 3-D inputs), ``explore`` (a 30-minute exploration of 200 m x 200 m at 50 Hz through the
node's update-thread schedule: map rate, resident memory, how far the model falls behind) and ``merge`` (two
robots' maps merged against one mapper; merge time against the number of sources, 1-16) and ``forgetting`` (the
region-block engine var_gp: RMSE near the first batch's path after every batch of protocol 1 against the other
engines and Bui et al., and its update latency over a 30-minute drive that keeps opening blocks). A section that fails is
recorded with its error and the others still run; the
exit status is then 1. Everything in the outputs is regenerated from code on every run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gp_mapping.evaluation.common import default_results_dir, jsonable, machine_info

SECTIONS = ("accuracy", "calibration", "speed", "growth", "cuda", "large", "explore", "merge", "forgetting")
#: sections run only when named (--only): the localization section filters the real recordings for minutes, the
#: memory section drives a 30-minute random walk (issue 38: resident memory must level off), the variants section
#: maps eight simulated worlds at three M each with its peers (an hour on a shared two-core machine), the
#: time_errors section fits two exact GPs per recording (a quarter of an hour)
OPTIONAL_SECTIONS = ("localization", "memory", "variants", "time_errors")
JSON_NAME = "bench.json"
MD_NAME = "bench.md"

#: the calibration section's selections: None in FULL (all of the section's recordings, engines, defaults
#: candidates, batch factors, optional parts; calibration.py), and --set takes a JSON list for them
CALIBRATION_SELECTIONS = tuple(f"calibration_{k}" for k in ("recordings", "engines", "candidates", "batch_factors",
                                                            "parts"))
# Full: the protocols as specified, one-hour drive. Quick: the same code on less work (< 3 minutes): protocol 1 in
# 10 batches, protocol 2 on the first minute of each sequence in 20-second batches, every 4th test sample.
FULL = {
    **dict.fromkeys(CALIBRATION_SELECTIONS),
    "p1_batches": 20, "p2_batch_seconds": 1.0, "p2_eval_every": 10, "fast_full_every": 10,
    "test_stride": 1, "p2_seconds_per_sequence": None,
    "accuracy_num_inducing": None,  # the accuracy section's M for every method (None: the shipped one)
    "offline_iterations": 2000, "exact_points": 2000, "exact_iterations": 100, "osgpr_iterations": 20,
    "grid_cells": 200, "grid_reps": 3,
    "engine": {"ms": (64, 128, 256), "memories": (500,), "full_reps": 10, "fast_reps": 30,
               "grid_sizes": (100, 400), "cell_seconds": 30.0},
    "solin_sequences": (1, 3, 5), "solin_max_seconds": None, "demo_bag": True, "osman_every": (1, 2),
    "drive_seconds": 3600.0, "drive_sample_every": 500,
    **{"large_area": (100.0, 60.0), "large_dipoles": 600, "large_seconds": 1800.0, "large_rate": 10.0,
       "large_speed": 1.2, "large_line_spacing": 4.0, "large_height_amplitude": 0.3, "large_batch": 50,
       "large_tile": 10.0, "large_overlap": 2.0, "large_m": 64, "large_memory": 100, "large_untiled_m": 128,
       "large_exact_points": 6000, "large_exact_hyper_points": 1500, "large_exact_iterations": 50,
       "large_test_every": 6, "large_sample_every": 500, "large_warmup_seconds": 60.0, "large_seed": 0,
       "large_dims": (2, 3), "large_vargp_seconds": 300.0, "large_vargp_m": 4480},
    **{"explore_area": 200.0, "explore_lane": 20.0, "explore_seconds": 1800.0, "explore_rate": 50.0,
       "explore_warmup_seconds": 180.0, "explore_seed": 0, "explore_window": None,
       "explore_compare_every": 10},
    **{"merge_seconds": 120.0, "merge_rate": 10.0, "merge_batch": 50, "merge_m": 64, "merge_steps": 100,
       "merge_sources": (1, 2, 4, 8, 16), "merge_strip_seconds": 60.0, "merge_strip_m": 32, "merge_resolution": 0.25,
       "merge_seed": 3, "merge_sessions": True, "merge_solin": True, "merge_solin_seconds": None},
    **{"forget_radius": 0.1, "forget_variants": 1, "vargp_drive_seconds": 1800.0, "vargp_drive_m": 256},
    **{"memory_seconds": 1800.0, "memory_rate": 50.0, "memory_area": 10.0, "memory_speed": 1.0,
       "memory_sample_seconds": 60.0, "memory_seed": 0},
}
QUICK = {  # a smoke run of every section (make test runs it): small enough to keep the suite's time down
    "calibration_recordings": ("solin_p1",), "calibration_engines": ("dual_svgp",),
    "calibration_candidates": ("shipped", "no calibration"), "calibration_offline_iterations": 50,
    "calibration_parts": (), "calibration_batch_factors": (0.9,),
    "calibration_exact_points": 300,
    "p1_batches": 6, "p2_batch_seconds": 20.0, "p2_eval_every": 3, "fast_full_every": 10,
    "test_stride": 4, "p2_seconds_per_sequence": 60.0,
    "accuracy_num_inducing": 128,  # a smoke run: M = 256 made continual_mogp alone ~40 s of it
    "offline_iterations": 200, "exact_points": 600, "exact_iterations": 20, "osgpr_iterations": 3, "hsgp_basis": [256],
    "grid_cells": 100, "grid_reps": 1,
    "engine": {"ms": (64,), "memories": (500,), "full_reps": 3, "fast_reps": 5, "grid_sizes": (100,),
               "cell_seconds": 4.0},
    "solin_sequences": (1,), "solin_max_seconds": 20.0, "demo_bag": False, "osman_every": (2,),
    "drive_seconds": 60.0, "drive_sample_every": 250,
    **{"large_area": (24.0, 12.0), "large_dipoles": 40, "large_seconds": 60.0, "large_rate": 5.0,
       "large_speed": 1.2, "large_line_spacing": 4.0, "large_height_amplitude": 0.3, "large_batch": 25,
       "large_tile": 8.0, "large_overlap": 2.0, "large_m": 24, "large_memory": 100, "large_untiled_m": 32,
       "large_exact_points": 300, "large_exact_hyper_points": 200, "large_exact_iterations": 5,
       "large_test_every": 6, "large_sample_every": 50, "large_warmup_seconds": 0.0, "large_seed": 0,
       "large_dims": (2,), "large_vargp_seconds": 0.0, "large_vargp_m": 96},
    **{"explore_area": 30.0, "explore_lane": 10.0, "explore_seconds": 30.0, "explore_rate": 50.0,
       "explore_warmup_seconds": 5.0, "explore_seed": 0, "explore_window": None,
       "explore_compare_every": 2},
    **{"merge_seconds": 30.0, "merge_rate": 5.0, "merge_batch": 25, "merge_m": 24, "merge_steps": 10,
       "merge_sources": (1, 2, 4), "merge_strip_seconds": 15.0, "merge_strip_m": 12, "merge_resolution": 0.5,
       "merge_seed": 3, "merge_sessions": True, "merge_solin": True, "merge_solin_seconds": 30.0},
    **{"forget_radius": 0.1, "forget_variants": 0, "vargp_drive_seconds": 60.0, "vargp_drive_m": 32},
    **{"memory_seconds": 120.0, "memory_rate": 20.0, "memory_area": 6.0, "memory_speed": 1.0,
       "memory_sample_seconds": 10.0, "memory_seed": 0},
}


def _data_root(given: Path | None) -> tuple[Path | None, str | None]:
    """The recordings folder, or None and the reason it is unusable."""
    from gp_mapping.evaluation.datasets import DatasetError, load_solin2018, shared_data_root

    try:
        root = Path(given) if given is not None else shared_data_root()
        load_solin2018(root, 1)
        return root, None
    except DatasetError as err:
        return None, f"Solin 2018 recording unavailable: {err}"


def run(plan: dict, sections: tuple[str, ...], data: Path | None, log: Callable[[str], None]) -> dict[str, Any]:
    from gp_mapping.evaluation import accuracy, explore, forgetting, growth, large, merge, speed

    results: dict[str, Any] = {"machine": machine_info(), "plan": plan, "sections": {}}
    root, why = _data_root(data)
    total = time.perf_counter()
    for section in sections:
        start = time.perf_counter()
        log(f"[{section}]")
        try:
            if section == "accuracy":
                if root is None:
                    out: dict[str, Any] = {"skipped": why}
                else:
                    out = {}
                    for key, fn in (("protocol1", accuracy.protocol1), ("protocol2", accuracy.protocol2)):
                        p = fn(root, plan, log)
                        models = p.pop("_models")
                        lo, hi = _area_of(root)
                        p["grid_prediction"] = accuracy.grid_prediction_times(
                            models, (lo[0], lo[1], hi[0], hi[1]), plan["grid_cells"], plan["grid_reps"])
                        out[key] = p
            elif section == "speed":
                out = {"engine": speed.engine_sweep(plan["engine"], "cpu", log),
                       **speed.replay_rows(plan, root, why, "cpu", log)}
            elif section == "growth":
                out = growth.drive(plan["drive_seconds"], plan["drive_sample_every"], log)
            elif section == "cuda":
                out = speed.cuda_section(plan, root, why, log)
            elif section == "large":
                out = large.run(plan, log)
            elif section == "explore":
                out = explore.run(plan, log)
            elif section == "merge":
                out = merge.run(plan, log, root, why)
            elif section == "forgetting":
                out = forgetting.run(plan, root, why, log)
            elif section == "calibration":
                from gp_mapping.evaluation import calibration

                out = calibration.run(plan, root, log) if root is not None else {"skipped": why}
            elif section == "localization":
                from gp_mapping.evaluation import localization

                out = localization.run(plan, root, why, log)
            elif section == "memory":
                from gp_mapping.evaluation import memory

                out = memory.run(plan, log)
            elif section == "variants":
                from gp_mapping.evaluation import variants

                out = variants.run(plan, log)
            elif section == "time_errors":
                from gp_mapping.evaluation import time_errors

                out = time_errors.run(plan, root, log) if root is not None else {"skipped": why}
            else:
                raise ValueError(f"unknown section {section!r}; choose from {', '.join(SECTIONS)}")
        except Exception as err:  # one broken section must not hide the others' numbers
            out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            log(f"  section {section} failed: {out['error']}")
        out["seconds"] = time.perf_counter() - start
        results["sections"][section] = out
    results["total_seconds"] = time.perf_counter() - total
    return results


def _area_of(root: Path) -> tuple[np.ndarray, np.ndarray]:
    from gp_mapping.evaluation.datasets import load_solin2018

    xy = np.vstack([load_solin2018(root, s).xy for s in (1, 2, 3, 4, 5)])
    return xy.min(axis=0), xy.max(axis=0)


# ------------------------------------------------------------------------------------------------- report

def _f(v: Any, fmt: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, fmt)


def _workers(results: dict[str, Any]) -> str:
    jobs = results.get("plan", {}).get("jobs", 1)
    return "" if jobs == 1 else f" with {jobs} worker processes (--jobs)"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    quick = results.get("quick")
    lines = [f"# gp_mapping benchmarks{' (quick plan)' if quick else ''}", "",
             f"Measured {m['date']} on {m['cpu']} ({m['logical_cpus']} logical CPUs, torch {m['torch']}, "
             f"{m['torch_threads']} torch thread{'s' if m['torch_threads'] != 1 else ''}, Python {m['python']}"
             f"{', CUDA: ' + m['cuda'] if m['cuda'] else ', no GPU'}"
             f"{'' if m.get('load_average_1min') is None else ', load average %.1f at the start' % m['load_average_1min']}"
             f"); total {results['total_seconds']:.0f} s{_workers(results)}. "
             "Regenerate with `gp-mapping bench` (bench/README.md explains every number).", ""]
    if results.get("section_dates"):  # a report merged from several runs: when each section was measured
        lines += ["Merged from several runs (`gp-mapping bench --merge`); the date above is the last run's. Sections "
                  "measured: " + ", ".join(f"{name} {date}" for name, date in results["section_dates"].items())
                  + ".", ""]
    sec = results["sections"]
    acc = sec.get("accuracy")
    if acc is not None:
        lines += ["## Accuracy: |B| on the Solin et al. (2018) recording (uT)", ""]
        if "skipped" in acc or "error" in acc:
            lines += [f"Skipped: {acc['skipped']}" if "skipped" in acc else f"Failed: {acc['error']}", ""]
        else:
            for key in ("protocol1", "protocol2"):
                p = acc[key]
                lines += [f"### {p['name'].capitalize()}: {p['description']}", "",
                          f"{p['num_train']} training samples in {p['num_batches']} batches, {p['num_test']} test "
                          f"samples; M = {p.get('num_inducing', '?')} for every sparse GP (the shipped config's). "
                          "NLPD, within +-2 SD and z-std of held-out readings under each method's predictive "
                          "distribution of a reading (the engines' calibrated one). Ratio = RMSE / offline-SVGP "
                          "RMSE; NLPD gap = NLPD - offline-SVGP NLPD (after the last batch).", "",
                          "| method | RMSE | NLPD | within +-2 SD | z-std | RMSE ratio | NLPD gap | update median ms "
                          "| update p95 ms | grid ms | train s |",
                          "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
                grid = p.get("grid_prediction", {})
                for name, r in p["methods"].items():
                    lat = r.get("update_latency") or {}
                    rm = r.get("final_rmse", r.get("rmse"))
                    nl = r.get("final_nlpd", r.get("nlpd"))
                    ratio = r.get("final_rmse_ratio", r.get("rmse_ratio"))
                    gap = r.get("final_nlpd_gap", r.get("nlpd_gap"))
                    g = grid.get(name, {})
                    cover = r.get("final_within_2sd", r.get("within_2sd"))
                    z = r.get("final_z_std", r.get("z_std"))
                    lines.append(f"| {r['label']} | {_f(rm)} | {_f(nl)} | {_f(cover, '.3f')} | {_f(z)} | {_f(ratio)} | "
                                 f"{_f(gap, '+.2f')} | "
                                 f"{_f(lat.get('median_ms'), '.1f')} | {_f(lat.get('p95_ms'), '.1f')} | "
                                 f"{_f(g.get('median_ms'), '.0f')} | {_f(r.get('train_seconds'), '.0f')} |")
                cells = next(iter(grid.values()), {}).get("cells")
                lines += ["", f"Grid ms: one redraw of {cells} cells (mean and variance) through `predict_grid`. "
                          f"Curves: `{key}.png`." + (" Notes: " + "; ".join(p["notes"]) if p["notes"] else ""), ""]
    spd = sec.get("speed")
    if spd is not None:
        lines += ["## Speed", ""]
        if "error" in spd:
            lines += [f"Failed: {spd['error']}", ""]
        else:
            eng = spd["engine"]
            lines += [f"### Engine update latency ({eng['device']}, simulated stream, {eng['batch']} samples = 1 s "
                      "per update, memory full)", "",
                      "| M | M used | memory | mode | median ms | p95 ms | CPU ms | real-time budget used |",
                      "|---:|---:|---:|:---|---:|---:|---:|---:|"]
            for r in eng["updates"]:
                lines.append(f"| {r['M']} | {r['M_used']} | {r['memory_used']} | {r['mode']} | {r['median_ms']:.1f} "
                             f"| {r['p95_ms']:.1f} | {r['cpu_median_ms']:.1f} | {r['budget_used']:.0%} |")
            lines += ["", "| M used | grid | median ms | Mcells/s |", "|---:|:---|---:|---:|"]
            for g in eng["grids"]:
                lines.append(f"| {g['M_used']} | {g['grid']}x{g['grid']} | {g['median_ms']:.1f} | "
                             f"{g['mcells_per_s']:.2f} |")
            lines += [""] + _replay_table(spd, "CPU")
    gr = sec.get("growth")
    if gr is not None:
        lines += ["## Cost as the stream grows", ""]
        if "error" in gr:
            lines += [f"Failed: {gr['error']}", ""]
        else:
            s = gr["summary"]
            lines += [f"{gr['duration_s'] / 60:.0f}-minute simulated drive at {gr['rate_hz']:.0f} Hz "
                      f"({gr['samples']} samples) through the Mapper with config/mapper.yaml (batches of "
                      f"{gr['batching']['size']}, full update every {gr['batching']['full_update_every']}); "
                      f"{gr['processing_s']:.0f} s of processing (x{gr['real_time_factor']:.1f} real time). "
                      f"First decile = the tenth of the drive after the first {s['warmup_samples']} samples.", "",
                      "| quantity | first decile | last decile | last / first |", "|:---|---:|---:|---:|",
                      f"| update latency (wall), median ms | {_f(s['latency_first_decile_ms'], '.1f')} | "
                      f"{_f(s['latency_last_decile_ms'], '.1f')} | {_f(s['latency_ratio'])} |",
                      f"| update CPU time, median ms | {_f(s.get('cpu_first_decile_ms'), '.1f')} | "
                      f"{_f(s.get('cpu_last_decile_ms'), '.1f')} | {_f(s.get('cpu_ratio'))} |",
                      f"| resident memory, MiB | {_f(s['rss_first_decile_mib'], '.0f')} | "
                      f"{_f(s['rss_last_decile_mib'], '.0f')} | {_f(s['rss_ratio'])} |",
                      f"| model state, MiB | {_f(s['state_first_decile_mib'], '.2f')} | "
                      f"{_f(s['state_last_decile_mib'], '.2f')} | {_f(s['state_ratio'])} |", "",
                      f"Latency slope after warm-up: {_f(s.get('latency_slope_ms_per_10k_samples'), '+.3f')} ms per "
                      "10 000 samples. Curves: `growth.png`.", ""]
    # sections whose module writes its own markdown, imported only when the section ran
    for name in ("calibration", "explore", "large", "merge", "forgetting", "localization", "memory", "variants",
                 "time_errors"):
        if sec.get(name) is not None:
            lines += importlib.import_module(f"gp_mapping.evaluation.{name}").markdown(sec[name])
    cu = sec.get("cuda")
    if cu is not None:
        lines += ["## CUDA", ""]
        if "skipped" in cu or "error" in cu:
            lines += [f"Skipped: {cu['skipped']}" if "skipped" in cu else f"Failed: {cu['error']}", ""]
        else:
            lines += [f"Device: {cu['device_name']}.", "", "| M | mode | median ms | p95 ms |",
                      "|---:|:---|---:|---:|"]
            lines += [f"| {r['M']} | {r['mode']} | {r['median_ms']:.1f} | {r['p95_ms']:.1f} |" for r in cu["updates"]]
            lines += ["", "| M | grid | median ms |", "|---:|:---|---:|"]
            lines += [f"| {g['M_used']} | {g['grid']}x{g['grid']} | {g['median_ms']:.1f} |" for g in cu["grids"]]
            lines += [""] + (_replay_table(cu, "CUDA") if "replay" in cu else [])
    return "\n".join(lines)


def _replay_table(section: dict[str, Any], device: str) -> list[str]:
    """The replay real-time factors of the speed section (CPU) or the CUDA section."""
    lines = [f"### Replay real-time factor (shipped config/mapper.yaml, {device})", "",
             "| recording | duration s | processing s | real-time factor | updates | update median ms |",
             "|:---|---:|---:|---:|---:|---:|"]
    for r in section["replay"]:
        lat = r.get("update_latency") or r.get("update_latency_last_100") or {}
        lines.append(f"| {r['recording']} | {r['duration_s']:.0f} | {r['processing_s']:.1f} | "
                     f"{r['real_time_factor']:.1f} | {r['updates']} | {_f(lat.get('median_ms'), '.1f')} |")
    if "replay_solin_skipped" in section:
        lines.append(f"\nSolin replay skipped: {section['replay_solin_skipped']}")
    if "replay_osman_skipped" in section:
        lines.append(f"\nOptiTrack (continual_mogp) replay skipped: {section['replay_osman_skipped']}")
    return lines + [""]


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """protocol1.png, protocol2.png (RMSE and NLPD against samples seen), growth.png, the calibration and large
    sections' reliability diagrams and forgetting.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    acc = results["sections"].get("accuracy", {})
    for key in ("protocol1", "protocol2"):
        p = acc.get(key)
        if not p:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, r in p["methods"].items():
            for ax, metric in zip(axes, ("rmse", "nlpd")):
                if r["kind"] == "streaming":
                    c = r["curve"]
                    pts = [(s, v) for s, v in zip(c["num_seen"], c[metric]) if v is not None]
                    if pts:
                        ax.plot(*zip(*pts), marker="." if len(pts) < 40 else None, label=r["label"])
                elif r.get(metric) is not None:
                    ax.axhline(r[metric], linestyle="--", linewidth=1, label=r["label"], color="k" if
                               name == "offline_svgp" else "grey")
        for ax, metric in zip(axes, ("RMSE [uT]", "NLPD")):
            ax.set_xlabel("training samples seen")
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
        axes[1].set_yscale("symlog")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{p['name']}: {p['description']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{key}.png", dpi=110)
        plt.close(fig)
        written.append(f"{key}.png")
    gr = results["sections"].get("growth", {})
    if "updates" in gr:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        u, mem = gr["updates"], gr["memory"]
        axes[0].plot(u["num_seen"], u["ms"], ",", alpha=0.5, label="wall")
        if u.get("cpu_ms"):
            axes[0].plot(u["num_seen"], u["cpu_ms"], ",", alpha=0.5, label="CPU (this process)")
            axes[0].legend(markerscale=20)
        axes[0].set_ylabel("update latency [ms]")
        axes[1].plot(mem["samples"], np.asarray(mem["rss_bytes"]) / 2 ** 20, label="process RSS")
        axes[1].set_ylabel("resident memory [MiB]")
        ax2 = axes[1].twinx()
        ax2.plot(mem["samples"], np.asarray(mem["state_bytes"]) / 2 ** 20, color="C1", label="model state")
        ax2.set_ylabel("model state [MiB]")
        for ax in axes:
            ax.set_xlabel("samples seen")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{gr['duration_s'] / 60:.0f}-minute simulated drive at 50 Hz through the Mapper", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "growth.png", dpi=110)
        plt.close(fig)
        written.append("growth.png")
    cal = results["sections"].get("calibration", {})
    if cal.get("recordings"):
        from gp_mapping.evaluation import calibration

        written += calibration.plot(cal, out)
    lg = results["sections"].get("large", {})
    if lg and "error" not in lg:
        from gp_mapping.evaluation import large

        written += large.plot(lg, out)
    fg = results["sections"].get("forgetting", {})
    if fg and "error" not in fg:
        from gp_mapping.evaluation import forgetting

        written += forgetting.plot(fg, out)
    return written


def write(results: dict[str, Any], out: Path, stem: str | None = None) -> dict[str, Path]:
    """``bench.json`` / ``bench.md`` in ``out``, or ``<stem>.json`` / ``<stem>.md`` (a run of some sections: it
    must not overwrite the full run's report beside it)."""
    out.mkdir(parents=True, exist_ok=True)
    files = ({"json": out / JSON_NAME, "md": out / MD_NAME} if stem is None
             else {"json": out / f"{stem}.json", "md": out / f"{stem}.md"})
    results["plots"] = plots(results, out)
    files["json"].write_text(json.dumps(jsonable(results), indent=1, allow_nan=False) + "\n")
    files["md"].write_text(markdown(results))
    return files


# ---------------------------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the same sections on less work (under 3 minutes; what the smoke test runs)")
    parser.add_argument("--out", type=Path, default=default_results_dir(),
                        help="output folder (default bench/results in a source checkout, else ./bench-results)")
    parser.add_argument("--data", type=Path, default=None,
                        help="folder holding solin2018_invensense (default $GP_MAPPING_DATA, else ../shared/data beside the "
                             "checkout or the working directory)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the batches are small and cores are often shared)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes for the calibration and variants sections' streams (default 1; each "
                             "runs --threads torch threads, and the numbers do not depend on it)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS + OPTIONAL_SECTIONS, default=None,
                        help="run only these sections; they are written to <sections>.json / .md (e.g. speed.md), "
                             "not over bench.json / bench.md")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                        help="combine the sections of earlier runs' bench.json files (later files win) and write "
                             "the report to --out, running nothing (for sections run in parallel processes)")
    parser.add_argument("--set", nargs="+", default=(), metavar="KEY=VALUE", dest="overrides",
                        help="override numbers of the plan (FULL or QUICK in gp_mapping/evaluation/harness.py), e.g. "
                             "--set p2_batch_seconds=5 osgpr_iterations=10; the plan used is saved in bench.json")
    parser.add_argument("--drive-minutes", type=float, default=None,
                        help="length of the simulated drive of the growth section (default: 60, quick: 1)")


def merge(paths: list[Path]) -> dict[str, Any]:
    """One result from several runs' JSON: the sections of every file (a later file's section wins), each with
    the date of the run it comes from (``section_dates``: the report lists them)."""
    merged: dict[str, Any] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        sections = {**merged.get("sections", {}), **part["sections"]}
        dates = {**merged.get("section_dates", {}),
                 **{name: part.get("section_dates", {}).get(name, part["machine"]["date"])
                    for name in part["sections"]}}
        merged = {**merged, **part, "sections": sections, "section_dates": dates,
                  "total_seconds": merged.get("total_seconds", 0.0) + part["total_seconds"]}
    return merged


def main_with_args(args: argparse.Namespace) -> int:
    if args.merge:
        files = write(merge(args.merge), args.out)
        print(files["md"].read_text())
        return 0
    if args.threads < 1 or args.jobs < 1:
        print("error: --threads and --jobs must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plan = dict(QUICK if args.quick else FULL)
    if args.drive_minutes is not None:
        if not (math.isfinite(args.drive_minutes) and 0.1 <= args.drive_minutes <= 24 * 60):
            print("error: --drive-minutes must be between 0.1 and 1440", file=sys.stderr)
            return 2
        plan["drive_seconds"] = 60.0 * args.drive_minutes
    lists = [k for k, v in plan.items() if isinstance(v, tuple) or k in CALIBRATION_SELECTIONS]
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if sep and key in lists:  # a JSON list, e.g. calibration_candidates='["shipped", "M = 128"]'
            try:
                items = json.loads(value)
            except ValueError:
                items = None
            if not (isinstance(items, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                    for v in items)):
                print(f"error: --set {item!r}: {key} takes a JSON list of names or numbers, e.g. "
                      f"{key}='[\"a\", \"b\"]'", file=sys.stderr)
                return 2
            plan[key] = tuple(items)
            continue
        if not sep or key not in plan or isinstance(plan[key], (dict, tuple, bool)) or plan[key] is None:
            settable = ", ".join(k for k, v in plan.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
            print(f"error: --set {item!r}: expected KEY=VALUE with KEY one of {settable}, or a list "
                  f"({', '.join(lists)}) as KEY=JSON", file=sys.stderr)
            return 2
        try:
            number = type(plan[key])(value)
        except ValueError:
            print(f"error: --set {item!r}: {value!r} is not a {type(plan[key]).__name__}", file=sys.stderr)
            return 2
        if not (math.isfinite(number) and number > 0):
            print(f"error: --set {item!r}: the value must be positive", file=sys.stderr)
            return 2
        plan[key] = number
    plan["jobs"] = args.jobs  # saved with the plan: how the run was spread, not what it measured
    sections = tuple(args.only) if args.only else SECTIONS

    def log(message: str) -> None:
        print(message, flush=True)

    results = run(plan, sections, args.data, log)
    results = {"quick": bool(args.quick), **results}
    files = write(results, args.out, "_".join(sections) if args.only else None)
    print(files["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in files.values())} and {len(results['plots'])} PNG files in {args.out}")
    failed = [s for s, r in results["sections"].items() if "error" in r]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gp_mapping.evaluation.harness",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return main_with_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
