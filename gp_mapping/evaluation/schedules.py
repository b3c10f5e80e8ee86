"""The shipped engine against its own schedules and the peers a magnetic-mapping user would pick.

    python -m gp_mapping.evaluation.schedules [--data ROOT] [--out DIR] [--every 1 5 10 20]

On the Solin et al. (2018) recording (the bench's protocols 1 and 2, see :mod:`gp_mapping.evaluation.accuracy`),
the dual SVGP with the shipped configuration (config/mapper.yaml's model section) is run with a full update
every n-th batch for each n of ``--every`` (whatever the batch's size) and with the shipped schedule (a full
update once ``full_update_samples`` samples have arrived), beside the offline SVGP of the same M (GPyTorch, trained on all the
streamed data; and with its inducing inputs fixed, to show what learning them is worth), the reduced-rank GP of Solin & Särkkä (2020) with m = 256 and 1024 basis functions (sequential
Bayesian linear regression, hyperparameters on its exact marginal likelihood) and nearest neighbour. Per
method: RMSE, and NLPD, within +-2 SD and z-std under its predictive distribution of a reading, on the test
sequences after the last batch; update latency (median, p95) and the total time. Results:
``DIR/schedules.json`` and ``DIR/schedules.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from gp_mapping.config import ModelConfig
from gp_mapping.evaluation.calibration import reading_scores
from gp_mapping.evaluation.baselines import NearestNeighbour, OfflineSVGP, ReducedRankGP
from gp_mapping.evaluation.common import default_results_dir, machine_info
from gp_mapping.evaluation.datasets import load_solin2018
from gp_mapping.gp import build_model


def _protocols(root) -> dict[str, tuple]:
    seqs = {i: load_solin2018(root, i) for i in (1, 2, 3, 4, 5)}

    def stack(ids):
        return np.vstack([seqs[i].xy for i in ids]), np.concatenate([seqs[i].magnitude_uT for i in ids])[:, None]

    x1, y1 = stack([3])
    t1 = stack([1, 2, 4, 5])
    x2, y2 = stack([1, 2, 3, 4])
    t2 = stack([5])
    return {"protocol 1": ([(x1[p], y1[p]) for p in np.array_split(np.arange(len(x1)), 20)], t1),
            "protocol 2": ([(x2[i:i + 50], y2[i:i + 50]) for i in range(0, len(x2), 50)], t2)}


def _stream(step, batches) -> tuple[list[float], float]:
    seconds, start = [], time.perf_counter()
    for xb, yb in batches:
        t = time.perf_counter()
        step(xb, yb)
        seconds.append(time.perf_counter() - t)
    return seconds, time.perf_counter() - start


def _row(name, reading, x_test, y_test, seconds, total) -> dict:
    """A method's row: ``reading(x)`` -> mean and variance of a reading (variance None: a mean alone)."""
    ms = np.asarray(seconds) * 1e3 if seconds else np.zeros(1)
    return {"method": name, **{"nlpd": None, "within_2sd": None, "z_std": None},
            **reading_scores(*reading(x_test), y_test),
            "update_median_ms": float(np.median(ms)), "update_p95_ms": float(np.percentile(ms, 95)),
            "total_s": total}


def run(root, every: list[int], log=print) -> dict:
    base = dataclasses.replace(ModelConfig(), device="cpu", seed=0)
    out = {"machine": machine_info(), "config": dataclasses.asdict(base), "protocols": {}}
    for name, (batches, (x_test, y_test)) in _protocols(root).items():
        rows = []
        # Count schedules (every n-th batch full, whatever its size) and the shipped one (full once
        # full_update_samples samples have arrived since the last full update).
        schedules = [(f"dual SVGP, full every {n}", dataclasses.replace(base, full_update_every=n,
                                                                         full_update_samples=1)) for n in every]
        schedules.append((f"dual SVGP, full once {base.full_update_samples} samples arrived (shipped)", base))
        for label, config in schedules:
            model = build_model(config, 2, 1)
            seconds, total = _stream(model.update, batches)
            rows.append(_row(label, lambda x: tuple(t.numpy() for t in model.predict_reading(x)), x_test, y_test,
                             seconds, total))
            log(f"{name}: {rows[-1]}")
        x_all = np.vstack([b[0] for b in batches])
        y_all = np.vstack([b[1] for b in batches])
        area = (*np.vstack([x_all, x_test]).min(0), *np.vstack([x_all, x_test]).max(0))
        for m in (256, 1024):
            rr = ReducedRankGP.from_model_config(base, area, num_basis=m)
            seconds, total = _stream(rr.update, batches)
            rows.append(_row(f"reduced-rank GP (m = {m})", rr.predict_reading, x_test, y_test, seconds, total))
            log(f"{name}: {rows[-1]}")
        # The same offline SVGP with its inducing inputs fixed at a random subset of the data: the online engine
        # places Z by pivoted Cholesky and does not move it by default, so this row shows how much of the gap to
        # the reference is the learned Z.
        for learn_z in (False, True):
            start = time.perf_counter()
            svgp = OfflineSVGP.from_model_config(base, iterations=2000, batch_size=1024, lr=0.05, ngd_lr=0.1,
                                                 seed=0, learn_inducing=learn_z).fit(x_all, y_all)
            label = "2000 it" if learn_z else "2000 it, Z fixed"
            rows.append(_row(f"offline SVGP (M = {base.num_inducing}, {label})", svgp.predict_reading, x_test,
                             y_test, [], time.perf_counter() - start))
        nn = NearestNeighbour(x_all, y_all)
        rows.append(_row("nearest neighbour", lambda x: (nn.predict(x), None), x_test, y_test, [], 0.0))
        ref = rows[-2]["rmse"]
        for r in rows:
            r["rmse_ratio"] = r["rmse"] / ref
        out["protocols"][name] = rows
        log(f"{name}: offline SVGP {ref:.3f}, nearest neighbour {rows[-1]['rmse']:.3f}")
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"{m['date']}, {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} with "
             f"{m['torch_threads']} thread(s), load average {m['load_average_1min']:.1f}; shipped model config "
             f"(M = {results['config']['num_inducing']}).", ""]
    for name, rows in results["protocols"].items():
        lines += [f"**{name}**", "", "| method | RMSE | NLPD | within +-2 SD | z-std | RMSE / offline SVGP | "
                  "update median ms | update p95 ms | total s |", "|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            nl, cover, z = ("-" if r.get(k) is None else format(r[k], f) for k, f in
                            (("nlpd", ".2f"), ("within_2sd", ".3f"), ("z_std", ".2f")))
            lines.append(f"| {r['method']} | {r['rmse']:.3f} | {nl} | {cover} | {z} | {r['rmse_ratio']:.3f} | "
                         f"{r['update_median_ms']:.1f} | {r['update_p95_ms']:.1f} | {r['total_s']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="data root (default GP_MAPPING_DATA or ../shared/data)")
    parser.add_argument("--out", type=Path, default=default_results_dir())
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5, 10, 20])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = run(args.data, args.every)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schedules.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "schedules.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
