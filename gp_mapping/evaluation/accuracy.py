"""Accuracy on the Solin et al. (2018) recording: |B| over (x, y), engines against baselines, per batch.

Protocol 1 (the dual-GP paper's): stream sequence 3 in 20 consecutive batches (recorded order); after every
batch, test on sequences 1, 2, 4 and 5. Protocol 2: stream sequences 1-4 in batches of ``batch_seconds`` of
recording (one second in the full run); test on sequence 5 every ``eval_every`` batches and after the last.

Methods (same M and kernel everywhere; targets standardised inside each model):
* streaming, scored after every evaluated batch: the dual SVGP engine in three schedules (``full``: every
  update full; ``fast``: fast conditioning with a full update every ``fast_full_every``-th batch, as a robot
  runs it; ``fast only``: one full update on the first batch, then only fast conditioning: Z and the
  hyperparameters frozen), the continual multi-output GP when registered (fast schedule: its full update
  runs variational EM and costs seconds), the VAR-GP region blocks when registered (full updates), the streaming
  sparse GP of Bui et al. (2017), nearest neighbour and constant mean (both refitted on all data seen so far);
* offline, trained once on all streamed data: batch SVGP (GPyTorch, the gold standard) and the exact GP
  (on a seeded subsample when the data do not fit the plan's size). Their scores are constant lines.

The ratio reported is online RMSE / offline-SVGP RMSE (the offline model trained on the whole stream, so
early batches, which have seen less, read above 1 by construction; the last batch is the like-for-like
ratio) and the NLPD gap online - offline (NLPD can be negative, so a ratio would mislead).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch

from gp_mapping.evaluation.calibration import SCORES, reading_scores
from gp_mapping.evaluation.baselines import (ConstantMean, ExactGPBaseline, KernelSpec, NearestNeighbour,
                                             OfflineSVGP, ReducedRankGP, StreamingSparseGP)
from gp_mapping.evaluation.bench_engine import _summary
from gp_mapping.config import GridConfig, ModelConfig
from gp_mapping.evaluation.datasets import load_solin2018
from gp_mapping.gp import ENGINES, build_model

HSGP_BASIS = (256, 1024)  # the reduced-rank GP's basis sizes (magnetic SLAM uses m = 256-1024)
SAMPLE_RATE_HZ = 50.0
TILE = GridConfig().tile_size  # the shipped default


def engine_config(**overrides) -> ModelConfig:
    """The engine as the benchmarks run it: the shipped configuration (config/mapper.yaml's model section, the
    ModelConfig defaults) on the CPU; the offline baselines get the same M and kernel."""
    return dataclasses.replace(ModelConfig(device="cpu", seed=0), **overrides)


def plan_config(plan: dict, **overrides) -> ModelConfig:
    """engine_config at the plan's ``accuracy_num_inducing`` (the quick plan's smaller M; absent or None: the
    shipped M), for every method of a protocol and the offline baselines alike."""
    m = plan.get("accuracy_num_inducing")
    return engine_config(**({"num_inducing": int(m)} if m else {}), **overrides)


# ------------------------------------------------------------------------------------------------ methods

class _Streaming:
    """A streaming method: ``step(x, y)`` conditions on a batch; ``reading(x)`` -> mean and variance of a reading
    (None: a mean alone); ``score(x, y)`` -> :data:`SCORES`."""

    def __init__(self, name: str, label: str, step: Callable, reading: Callable):
        self.name, self.label = name, label
        self._step, self._reading = step, reading
        self.model: Any = None  # the fitted model, for the grid timing (None for the refitted floors)
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []

    def step(self, x: np.ndarray, y: np.ndarray) -> None:
        start, start_cpu = time.perf_counter(), time.process_time()
        self._step(x, y)
        self.seconds.append(time.perf_counter() - start)
        self.cpu_seconds.append(time.process_time() - start_cpu)

    def score(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return reading_scores(*self._reading(x), y)


def _engine_method(name: str, label: str, config: ModelConfig, schedule: Callable[[int], str]) -> _Streaming:
    model = build_model(config, input_dims=2, output_dims=1)
    count = [0]

    def step(x, y):
        model.update(x, y, mode=schedule(count[0]))
        count[0] += 1

    method = _Streaming(name, label, step, lambda x: tuple(t.cpu().numpy() for t in model.predict_reading(x)))
    method.model = model
    return method


def _osgpr_method(config: ModelConfig, iterations: int) -> _Streaming:
    model = StreamingSparseGP.from_model_config(config, iterations=iterations, seed=config.seed)
    method = _Streaming("bui2017_osgpr", f"Bui et al. 2017 OSGPR-VFE ({iterations} L-BFGS it/batch)",
                        model.update, model.predict_reading)
    method.model = model
    return method


class _Refit(_Streaming):
    """Nearest neighbour / constant mean on all data seen so far (refitted when scored)."""

    def __init__(self, name: str, label: str):
        super().__init__(name, label, self._append, None)
        self.xs: list[np.ndarray] = []
        self.ys: list[np.ndarray] = []

    def _append(self, x, y):
        self.xs.append(x)
        self.ys.append(y)

    def score(self, x, y):
        xs, ys = np.vstack(self.xs), np.vstack(self.ys)
        if self.name == "nearest_neighbour":
            return reading_scores(NearestNeighbour(xs, ys).predict(x), None, y)
        # A Gaussian with the training mean and variance: the NLPD any map must beat.
        mean = ConstantMean(ys).predict(x)
        return reading_scores(mean, np.full_like(mean, ys.var()), y)


def _hsgp_method(config: ModelConfig, area, num_basis: int) -> _Streaming:
    model = ReducedRankGP.from_model_config(config, area, num_basis=num_basis)
    method = _Streaming(f"hsgp_{num_basis}", f"reduced-rank GP, Solin & Sarkka 2020 (m = {num_basis})",
                        model.update, model.predict_reading)
    method.model = model
    return method


def streaming_methods(plan: dict, notes: list[str], area=None) -> list[_Streaming]:
    """The streaming methods; ``area`` (xmin, ymin, xmax, ymax) of train and test data places the reduced-rank
    GP's box (its basis is fixed before the data come)."""
    cfg = plan_config(plan)
    every = int(plan["fast_full_every"])
    methods = [
        _engine_method("dual_svgp_full", "dual SVGP, full updates", cfg, lambda i: "full"),
        _engine_method("dual_svgp_fast", f"dual SVGP, fast + full every {every}th", cfg,
                       lambda i: "full" if i % every == 0 else "fast"),
        _engine_method("dual_svgp_fast_only", "dual SVGP, fast only (after a first full)", cfg,
                       lambda i: "full" if i == 0 else "fast"),
    ]
    if "continual_mogp" in ENGINES:
        try:
            # Its full update (variational EM with hyperparameter learning) costs seconds: run as the robot
            # would, fast (E-step only) with a full update every fast_full_every-th batch.
            methods.append(_engine_method("continual_mogp", f"continual multi-output GP, fast + full every {every}th",
                                          plan_config(plan, engine="continual_mogp"),
                                          lambda i: "full" if i % every == 0 else "fast"))
        except Exception as err:  # a registered engine that cannot be built is reported, not fatal
            notes.append(f"continual_mogp is registered but could not be built: {type(err).__name__}: {err}")
    else:
        notes.append("continual_mogp is not registered in gp_mapping.gp.ENGINES: skipped")
    if "var_gp" in ENGINES:  # region blocks (Kapoor et al. 2021), every update full (its closed form is cheap)
        methods.append(_engine_method("var_gp", "VAR-GP, region blocks, full updates", plan_config(plan, engine="var_gp"),
                                      lambda i: "full"))
    methods.append(_osgpr_method(cfg, int(plan["osgpr_iterations"])))
    if area is not None:
        methods.extend(_hsgp_method(cfg, area, m) for m in plan.get("hsgp_basis", HSGP_BASIS))
    methods.append(_Refit("nearest_neighbour", "nearest neighbour (data so far)"))
    methods.append(_Refit("constant_mean", "constant mean (data so far)"))
    return methods


def offline_methods(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, plan: dict
                    ) -> dict[str, dict[str, Any]]:
    """Offline SVGP and exact GP on all streamed data, scored once, with their training time."""
    cfg = plan_config(plan)
    out: dict[str, dict[str, Any]] = {}
    svgp = OfflineSVGP.from_model_config(cfg, iterations=int(plan["offline_iterations"]), batch_size=1024,
                                         lr=0.05, ngd_lr=0.1, seed=0).fit(x, y)
    out["offline_svgp"] = {"label": f"offline SVGP (GPyTorch, {plan['offline_iterations']} it)",
                           **reading_scores(*svgp.predict_reading(x_test), y_test), "train_seconds": svgp.train_seconds,
                           "model": svgp}
    exact = ExactGPBaseline(KernelSpec.from_model_config(cfg), max_points=int(plan["exact_points"]),
                            iterations=int(plan["exact_iterations"]), seed=0).fit(x, y)
    label = f"exact GP ({'subsample ' if exact.subsampled else ''}n={exact.n_used})"
    out["exact_gp"] = {"label": label, **reading_scores(*exact.predict_reading(x_test), y_test),
                       "train_seconds": exact.train_seconds,
                       "n_used": exact.n_used, "subsampled": exact.subsampled, "model": exact}
    return out


# ---------------------------------------------------------------------------------------------- protocols

def _stack(seqs) -> tuple[np.ndarray, np.ndarray]:
    return np.vstack([s.xy for s in seqs]), np.concatenate([s.magnitude_uT for s in seqs])[:, None]


def run_protocol(name: str, batches: list[tuple[np.ndarray, np.ndarray]], x_test: np.ndarray, y_test: np.ndarray,
                 eval_every: int, plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    """Stream the batches through every streaming method, score after every ``eval_every``-th batch and after
    the last, then train the offline models on everything; per-batch ratios against the offline SVGP."""
    notes: list[str] = []
    x_all = np.vstack([xb for xb, _ in batches] + [x_test])
    area = (*x_all.min(0), *x_all.max(0))
    methods = streaming_methods(plan, notes, area)
    curves: dict[str, dict[str, list]] = {m.name: {"batch": [], "num_seen": [], **{k: [] for k in SCORES}}
                                          for m in methods}
    seen = 0
    start = time.perf_counter()
    for b, (xb, yb) in enumerate(batches):
        seen += xb.shape[0]
        last = b == len(batches) - 1
        for m in methods:
            m.step(xb, yb)
        if (b + 1) % eval_every == 0 or last:
            for m in methods:
                s = m.score(x_test, y_test)
                c = curves[m.name]
                c["batch"].append(b + 1)
                c["num_seen"].append(seen)
                for k in SCORES:
                    c[k].append(s.get(k))
        if ((b + 1) % max(1, len(batches) // 5) == 0 or last) and curves["dual_svgp_full"]["rmse"]:
            log(f"  {name}: batch {b + 1}/{len(batches)}, dual full RMSE {curves['dual_svgp_full']['rmse'][-1]:.2f} "
                f"(at batch {curves['dual_svgp_full']['batch'][-1]}; {time.perf_counter() - start:.0f} s)")
    x_all = np.vstack([xb for xb, _ in batches])
    y_all = np.vstack([yb for _, yb in batches])
    offline = offline_methods(x_all, y_all, x_test, y_test, plan)
    log(f"  {name}: offline SVGP RMSE {offline['offline_svgp']['rmse']:.2f} "
        f"({offline['offline_svgp']['train_seconds']:.0f} s), exact GP {offline['exact_gp']['rmse']:.2f}")
    ref_rmse, ref_nlpd = offline["offline_svgp"]["rmse"], offline["offline_svgp"]["nlpd"]
    results: dict[str, Any] = {}
    for m in methods:
        c = curves[m.name]
        c["rmse_ratio"] = [r / ref_rmse for r in c["rmse"]]
        c["nlpd_gap"] = [None if v is None else v - ref_nlpd for v in c["nlpd"]]
        results[m.name] = {"label": m.label, "kind": "streaming", "curve": c, "final_rmse": c["rmse"][-1],
                           "final_nlpd": c["nlpd"][-1], "final_within_2sd": c["within_2sd"][-1],
                           "final_z_std": c["z_std"][-1], "final_rmse_ratio": c["rmse_ratio"][-1],
                           "final_nlpd_gap": c["nlpd_gap"][-1]}
        if m.name not in ("nearest_neighbour", "constant_mean"):
            results[m.name]["update_latency"] = _summary(m.seconds, m.cpu_seconds)
    for key, o in offline.items():
        results[key] = {k: v for k, v in o.items() if k != "model"}
        results[key]["kind"] = "offline"
        results[key]["rmse_ratio"] = o["rmse"] / ref_rmse
        results[key]["nlpd_gap"] = o["nlpd"] - ref_nlpd
    models = {m.name: m.model for m in methods if m.model is not None}
    models.update({k: o["model"] for k, o in offline.items()})
    return {"name": name, "num_batches": len(batches), "num_train": int(x_all.shape[0]),
            "num_test": int(x_test.shape[0]), "num_inducing": plan_config(plan).num_inducing,
            "eval_every": eval_every, "notes": notes, "methods": results,
            "seconds": time.perf_counter() - start, "_models": models}


def protocol1_data(data_root, plan: dict) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Protocol 1's stream and test set: sequence 3 in ``plan['p1_batches']`` consecutive batches; sequences 1, 2, 4
    and 5 (every ``plan['test_stride']``-th sample) to test on."""
    x_test, y_test = _stack([load_solin2018(data_root, s) for s in (1, 2, 4, 5)])
    stride = int(plan["test_stride"])
    x, y = _stack([load_solin2018(data_root, 3)])
    parts = np.array_split(np.arange(x.shape[0]), int(plan["p1_batches"]))
    return [(x[p], y[p]) for p in parts], x_test[::stride], y_test[::stride]


def protocol1(data_root, plan: dict, log) -> dict[str, Any]:
    batches, x_test, y_test = protocol1_data(data_root, plan)
    stride = int(plan["test_stride"])
    out = run_protocol("protocol 1", batches, x_test, y_test, 1, plan, log)
    out["description"] = (f"stream sequence 3 in {plan['p1_batches']} consecutive batches; test on sequences "
                          "1, 2, 4, 5 after every batch" + (f" (every {stride}th sample)" if stride > 1 else ""))
    return out


def protocol2(data_root, plan: dict, log) -> dict[str, Any]:
    seqs = [load_solin2018(data_root, s) for s in (1, 2, 3, 4)]
    test = load_solin2018(data_root, 5)
    batch = int(round(plan["p2_batch_seconds"] * SAMPLE_RATE_HZ))
    limit = plan.get("p2_seconds_per_sequence")
    batches = []
    for s in seqs:  # batches within each recording (a batch never spans two recordings)
        x, y = _stack([s])
        if limit is not None:  # the quick plan: only the start of each recording
            n = int(np.searchsorted(s.t, s.t[0] + float(limit)))
            x, y = x[:n], y[:n]
        batches += [(x[i:i + batch], y[i:i + batch]) for i in range(0, x.shape[0], batch)]
    stride = int(plan["test_stride"])
    out = run_protocol("protocol 2", batches, test.xy[::stride], test.magnitude_uT[::stride, None],
                       int(plan["p2_eval_every"]), plan, log)
    out["description"] = (f"stream sequences 1-4{'' if limit is None else f' (first {limit:g} s of each)'} in "
                          f"{plan['p2_batch_seconds']:g}-second batches ({batch} samples); test on sequence 5"
                          f"{'' if stride == 1 else f' (every {stride}th sample)'} every {plan['p2_eval_every']} "
                          "batches")
    return out


def grid_prediction_times(models: dict[str, Any], area: tuple[float, float, float, float], cells: int,
                          reps: int) -> dict[str, dict]:
    """Time one ``cells`` x ``cells`` map redraw (mean and variance of every cell) for each fitted model, through
    the node's tiled code path (``predict_grid``); baselines are wrapped to return tensors."""
    from gp_mapping.mapping.grid import GridSpec, predict_grid

    width = max(area[2] - area[0], area[3] - area[1])
    spec = GridSpec(origin_x=area[0], origin_y=area[1], resolution=width / cells, width=cells, height=cells)
    out = {}
    for name, model in models.items():
        if name == "exact_gp":
            continue  # GPyTorch's exact predictive materialises the test covariance: not a map redraw path
        target = model if isinstance(model, torch.nn.Module) else _TensorPredictor(model)
        predict_grid(target, GridSpec(area[0], area[1], width / 16, 16, 16), TILE)  # warm-up
        seconds, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            predict_grid(target, spec, TILE)
            seconds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[name] = dict(_summary(seconds, cpu), cells=spec.num_cells)
    return out


class _TensorPredictor:
    """A numpy baseline seen through the engine's predict contract (tensors) for ``predict_grid``."""

    device = torch.device("cpu")

    def __init__(self, model):
        self.model = model

    def predict(self, x: torch.Tensor):
        mean, var = self.model.predict(x.cpu().numpy())
        return torch.as_tensor(mean), torch.as_tensor(var)
