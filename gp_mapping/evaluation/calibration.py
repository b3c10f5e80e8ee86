"""Calibration: is a map's variance right on data it was never fitted to? (bench section ``calibration``)

Every recording is streamed in order through each engine (the shipped configuration, batches of
``calibration_batch`` readings, spikes dropped by the gate as the Mapper drops them) and then scored on held-out readings of another pass:

* ``solin_p1``: Solin et al. (2018) |B|, sequence 3 streamed, sequences 1, 2, 4, 5 held out;
* ``solin_p2``: the same, sequences 1-4 streamed, sequence 5 held out;
* ``optitrack_magnitude`` / ``optitrack_vector``: Osman et al. (2021), hand-held, 3-D positions, |B| or the
  world-frame vector; the first 70 % streamed (at 50 Hz), the last 30 % held out;
* ``demo``: the bundled demo bag (``bags/demo``, simulated, its ground truth file): the readings' |B| at the
  sensor's (x, y), the lawnmower streamed as the bag holds it (dropouts absent, spikes in), the closing arc of
  the circle that crosses its lanes held out (spikes, a sensor fault the ground truth flags, left out);
* ``sim_world``: a simulated 20 m x 20 m dipole world (0.5 uT sensor noise), a lawnmower streamed and a loop
  over the same ground held out (its noisy readings);
* ``sim_revisit``: the same world, a shorter lawnmower and the first 20 % of the loop streamed, the rest of the
  loop held out (the unit test of a known noise, test/unit/test_calibration.py);
* ``sim_corridor``: a simulated 68 m x 38 m corridor loop walked with a hand-held sensor, 3-D positions with a
  0.15 m track error shared along each lap, four laps streamed and a fifth, 0.5 m to one side, held out
  (:mod:`gp_mapping.evaluation.corridor`).

Scores per method: RMSE, NLPD, the fraction of held-out readings within +-1 and +-2 predictive SDs, the
standard deviation of z = error / SD, and a reliability curve (observed against nominal central coverage at
ten levels). The predictive distribution is that of a *reading* (``predict_reading``: latent variance plus
noise, calibrated where the engine calibrates; gp/calibration.py). Peers in the same run: offline SVGP and the
exact GP (GPyTorch; marginal-likelihood hyperparameters) and nearest neighbour (no variance).

The defaults table streams each candidate setting of the dual SVGP over every recording and ranks candidates
by their *worst* RMSE ratio and NLPD gap to the best peer on any recording (never the mean, never one
recording): a default must hold where it was not tuned.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np
from scipy.special import erfinv

from gp_mapping.config import ModelConfig
from gp_mapping.evaluation.baselines import ExactGPBaseline, KernelSpec, NearestNeighbour, OfflineSVGP, rmse
from gp_mapping.gp import build_model
from gp_mapping.gp.outliers import isolated_spikes

RECORDINGS = ("solin_p1", "solin_p2", "optitrack_magnitude", "optitrack_vector", "demo", "sim_world", "sim_revisit",
              "sim_corridor")
#: the demo drive's closing circle (bags/README.md): its radius [m], and how close to it a position is on it
DEMO_CIRCLE_RADIUS, DEMO_CIRCLE_TOLERANCE = 3.5, 0.02
#: nominal central coverages of the reliability curve
LEVELS = tuple(np.round(np.arange(0.1, 1.0, 0.1), 2)) + (0.95,)


@dataclasses.dataclass
class Recording:
    name: str
    x: np.ndarray       # (N, D) streamed inputs, in recorded order
    y: np.ndarray       # (N, P) streamed targets
    x_test: np.ndarray  # held-out inputs
    y_test: np.ndarray  # held-out readings
    batch: int
    t: np.ndarray | None = None  # (N,) seconds of the streamed readings; passes PASS_GAP apart (None: unknown)


#: seconds between the times of two passes of a recording (Recording.t): an error shared along a pass does not
#: reach the next one (:mod:`gp_mapping.evaluation.time_errors`)
PASS_GAP = 1e6


def passes(*times: np.ndarray) -> np.ndarray:
    """The times of several passes' readings, one after another with PASS_GAP between them (each from 0)."""
    out, start = [], 0.0
    for t in times:
        t = np.asarray(t, dtype=np.float64)
        out.append(t - t[0] + start)
        start = out[-1][-1] + PASS_GAP
    return np.concatenate(out)


def load(name: str, root, plan: dict) -> Recording:
    """One of RECORDINGS (``root``: the shared data folder; sim_world needs none)."""
    from gp_mapping.evaluation.datasets import load_osman2021, load_solin2018

    batch = int(plan.get("calibration_batch", 50))
    if name in ("solin_p1", "solin_p2"):
        train, test = ((3,), (1, 2, 4, 5)) if name == "solin_p1" else ((1, 2, 3, 4), (5,))
        tr = [load_solin2018(root, s) for s in train]
        te = [load_solin2018(root, s) for s in test]
        x = np.vstack([s.xy for s in tr])
        y = np.concatenate([s.magnitude_uT for s in tr])[:, None]
        if name == "solin_p1":  # the dual-GP paper's protocol: 20 batches
            batch = math.ceil(len(x) / 20)
        return Recording(name, x, y, np.vstack([s.xy for s in te]),
                         np.concatenate([s.magnitude_uT for s in te])[:, None], batch, passes(*(s.t for s in tr)))
    if name in ("optitrack_magnitude", "optitrack_vector"):
        rec = load_osman2021(root)
        every = 4  # 200 Hz -> 50 Hz
        cut = int(0.7 * len(rec)) // every
        x, f = rec.position[::every], rec.field_world_uT[::every]
        y = np.linalg.norm(f, axis=1)[:, None] if name == "optitrack_magnitude" else f
        return Recording(name, x[:cut], y[:cut], x[cut:], y[cut:], batch, rec.t[::every][:cut])
    if name == "demo":
        return load_demo(plan.get("calibration_demo_bag"), batch)
    if name in ("sim_world", "sim_revisit"):
        from gp_mapping.sim import SensorConfig, TrajectoryConfig, World, WorldConfig, simulate

        area = (0.0, 0.0, 20.0, 20.0)
        # One world drawn once: simulate() given a WorldConfig draws the world from its own seed, and the two
        # passes have different seeds (their trajectories' and noises').
        world = World.from_config(WorldConfig(area=area, n_dipoles=40, margin=2.0), np.random.default_rng(0))
        sensor = SensorConfig(noise_std=0.5e-6)
        revisit = name == "sim_revisit"  # a shorter lawnmower, then the first 20 % of the loop streamed too
        drive = simulate(world, TrajectoryConfig(patterns=("lawnmower",), area=area, inset=1.0, speed=1.0,
                                                 duration=220.0 if revisit else 400.0, rate=10.0, line_spacing=2.0),
                         sensor, seed=0)
        again = simulate(world, TrajectoryConfig(patterns=("loop",), area=area, inset=20.0 / 6 if revisit else 3.0,
                                                 speed=1.0, duration=80.0 if revisit else 120.0, rate=10.0),
                         sensor, seed=1)

        def magnitude(r):
            return np.linalg.norm(r.field_sensor_tesla, axis=1)[:, None] * 1e6

        x, y = drive.sensor_position[:, :2], magnitude(drive)
        x_test, y_test = again.sensor_position[:, :2], magnitude(again)
        k = len(x_test) // 5 if revisit else 0
        t = passes(drive.t, again.t[:k]) if k else drive.t
        return Recording(name, np.vstack([x, x_test[:k]]), np.vstack([y, y_test[:k]]), x_test[k:], y_test[k:], batch,
                         t)
    if name == "sim_corridor":
        from gp_mapping.evaluation.corridor import recording

        return recording(seed=0, batch=batch)
    raise ValueError(f"unknown recording {name!r}; choose from {', '.join(RECORDINGS)}")


def load_demo(bag, batch: int) -> Recording:
    """The ``demo`` recording from a demo bag's ground truth (``bag``: its folder; None: the checkout's bags/demo).
    Raises FileNotFoundError without one (an installed package has no bags/)."""
    from gp_mapping.evaluation.speed import DEMO_BAG
    from gp_mapping.sim.demo_bag import load_ground_truth

    if bag is None and DEMO_BAG is None:
        raise FileNotFoundError("no bags/demo: not run from the source checkout")
    gt = load_ground_truth(DEMO_BAG if bag is None else bag)
    xy = gt.sensor_position[:, :2]
    on_circle = np.abs(np.hypot(xy[:, 0], xy[:, 1]) - DEMO_CIRCLE_RADIUS) < DEMO_CIRCLE_TOLERANCE
    start = len(xy)  # the last run of positions on the circle: the drive's end
    while start > 0 and on_circle[start - 1]:
        start -= 1
    if start == len(xy) or start == 0:
        raise ValueError(f"{gt.path}: the drive does not end on the {DEMO_CIRCLE_RADIUS} m circle of bags/demo")
    y = np.linalg.norm(gt.field_sensor_ut, axis=1)[:, None]
    present = ~gt.dropped.astype(bool)
    train = present & (np.arange(len(xy)) < start)
    test = present & (np.arange(len(xy)) >= start) & ~gt.is_spike.astype(bool)
    return Recording("demo", xy[train], y[train], xy[test], y[test], batch, gt.t[train])


def scores(mean: np.ndarray, var: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """RMSE, NLPD, coverage within +-1 and +-2 SD, std of z and the reliability curve of Gaussian predictions
    (mean, var (N, P)) of readings y (N, P); every output pooled."""
    var = np.maximum(var, 1e-300)
    err = y - mean
    z = err / np.sqrt(var)
    nlpd = float(np.mean(0.5 * np.log(2 * np.pi * var) + 0.5 * z ** 2))
    half_widths = np.sqrt(2.0) * erfinv(np.asarray(LEVELS))
    return {"rmse": float(np.sqrt(np.mean(err ** 2))), "nlpd": nlpd,
            "within_1sd": float(np.mean(np.abs(z) <= 1.0)), "within_2sd": float(np.mean(np.abs(z) <= 2.0)),
            "z_std": float(np.std(z)),
            "reliability": {f"{lv:g}": float(np.mean(np.abs(z) <= w)) for lv, w in zip(LEVELS, half_widths)}}


#: what a method is scored by on held-out readings (a mean alone: RMSE only), the accuracy and schedules sections'
#: columns
SCORES = ("rmse", "nlpd", "within_1sd", "within_2sd", "z_std")


def reading_scores(mean: np.ndarray, var: np.ndarray | None, y: np.ndarray) -> dict[str, float]:
    """:data:`SCORES` of predictions of readings y (N, P): RMSE; with the variance of a reading, NLPD, within +-1
    / +-2 SD and the std of z (:func:`scores`)."""
    if var is None:
        return {"rmse": rmse(mean, y)}
    s = scores(mean, var, y)
    return {k: s[k] for k in SCORES}


def stream_engine(config: ModelConfig, rec: Recording) -> tuple[Any, float]:
    """The engine built from ``config`` after streaming the recording; and the seconds it took."""
    model = build_model(config, rec.x.shape[1], rec.y.shape[1])
    start = time.perf_counter()
    for i in range(0, len(rec.x), rec.batch):
        x, y = rec.x[i:i + rec.batch], rec.y[i:i + rec.batch]
        keep = ~isolated_spikes(model, x, y, config.spike_gate)  # as the Mapper does (gp/outliers.py)
        stamps = {"t": rec.t[i:i + rec.batch][keep]} if model.wants_stamps and rec.t is not None else {}
        model.update(x[keep], y[keep], **stamps)
    return model, time.perf_counter() - start


def engine_scores(config: ModelConfig, rec: Recording, keep_model: bool = False) -> dict[str, Any]:
    """The engine's scores on the held-out readings (calibrated and not) after streaming ``rec``; with
    ``keep_model`` the streamed engine too, under "model"."""
    model, seconds = stream_engine(config, rec)
    mean, var = model.predict_reading(rec.x_test)
    out = scores(mean.cpu().numpy(), var.cpu().numpy(), rec.y_test)
    _, latent_var = model.predict(rec.x_test)
    raw = scores(mean.cpu().numpy(), latent_var.cpu().numpy() + _noise(model, rec), rec.y_test)
    out.update({"stream_seconds": seconds, "uncalibrated": {k: raw[k] for k in
                                                           ("nlpd", "within_1sd", "within_2sd", "z_std")}})
    if keep_model:
        out["model"] = model
    return out


def _noise(model, rec: Recording) -> np.ndarray:
    """The learned noise variance at the held-out inputs (targets' units): a reading's variance less the
    calibration, for the uncalibrated columns."""
    engines = [slot.engine for slot in model.tiles.values()] if hasattr(model, "tiles") else [model]
    engine = max(engines, key=lambda e: e.num_seen)
    xt = engine._check_x(rec.x_test)
    return (engine._noise_variance(xt) * engine.y_std ** 2).cpu().numpy()


def peer_scores(rec: Recording, config: ModelConfig, plan: dict) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    nn = NearestNeighbour(rec.x, rec.y)
    out["nearest_neighbour"] = {"rmse": float(np.sqrt(np.mean((nn.predict(rec.x_test) - rec.y_test) ** 2)))}
    svgp = OfflineSVGP.from_model_config(config, iterations=int(plan.get("calibration_offline_iterations", 500)),
                                         batch_size=1024, lr=0.05, ngd_lr=0.1, seed=0).fit(rec.x, rec.y)
    out["offline_svgp"] = scores(*svgp.predict_reading(rec.x_test), rec.y_test)
    exact = ExactGPBaseline(KernelSpec.from_model_config(config), max_points=int(plan.get("calibration_exact_points",
                                                                                          2000)),
                            iterations=100, seed=0).fit(rec.x, rec.y)
    out["exact_gp"] = scores(*exact.predict_reading(rec.x_test), rec.y_test)
    return out


#: the shipped engine is streamed again with its batches this much smaller and larger (batching_spread)
BATCH_FACTORS = (0.9, 0.96, 1.04, 1.1)


def batch_sizes(rec: Recording, factors) -> list[int]:
    """The batch sizes of :func:`batching_spread`: the recording's own first, then ``factors`` times it (each
    once)."""
    sizes = [rec.batch]
    for f in factors:
        batch = max(1, int(round(rec.batch * float(f))))
        if batch not in sizes:
            sizes.append(batch)
    return sizes


def batching_spread(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The shipped dual_svgp streamed with batches of several sizes (``runs``: batch size -> its scores, the
    recording's own size first; :func:`batch_sizes`): RMSE, NLPD and +-2 SD per batch size, and their range. The
    online map depends on where the batch boundaries fall (which readings are held, folded, and picked as inducing
    points when, and the hyperparameter steps each update takes), so one run's figure is one draw of it
    (docs/calibration.md, How well it holds)."""
    keys = ("rmse", "nlpd", "within_2sd", "z_std")
    runs = {str(b): {k: s[k] for k in keys} for b, s in runs.items()}
    return {"runs": runs, **{f"{k}_range": [min(r[k] for r in runs.values()), max(r[k] for r in runs.values())]
                             for k in keys}}


def shipped(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig(device="cpu", seed=0), **overrides)


#: engines whose calibration columns the section reports (recordings each streams: smc_experts and var_gp cost
#: the most per reading and skip the 35 k-reading protocol 2)
ENGINES = {"dual_svgp": RECORDINGS, "continual_mogp": RECORDINGS,
           "var_gp": ("solin_p1", "optitrack_magnitude", "optitrack_vector", "demo", "sim_world", "sim_revisit"),
           "smc_experts": ("solin_p1", "optitrack_magnitude", "demo", "sim_world", "sim_revisit")}
def _at_each_m(name: str, overrides: dict) -> dict[str, dict]:
    """A candidate at each M of the ladder: ``name`` at the shipped M, ``name, M = 128`` and ``name, M = 512``."""
    return {name + rung: {**overrides, **m} for rung, m in (("", {}), (", M = 128", {"num_inducing": 128}),
                                                           (", M = 512", {"num_inducing": 512}))}


#: the defaults table's candidates (dual_svgp, name -> overrides of the shipped model section)
CANDIDATES = {"shipped": {}, "no calibration": {"calibration": "none"},
              "lag 2.5 m": {"calibration_lag": 2.5}, "lag 10 m": {"calibration_lag": 10.0},
              "M = 128": {"num_inducing": 128}, "M = 512": {"num_inducing": 512},
              "isotropic": {"lengthscales": "isotropic"}, "per_axis": {"lengthscales": "per_axis"},
              "hyper_lr 0.05": {"hyper_lr": 0.05},
              "records 1024": {"calibration_records": 1024},
              "hyper_points 256": {"hyper_points": 256}, "matern32": {"kernel": "matern32"},
              "one scale": {"kernel_scales": 1},
              "noise floor 0": {"noise_floor": 0.0}, "noise floor 0.04": {"noise_floor": 0.04},
              "noise floor 0.25": {"noise_floor": 0.25}, "memory objective": {"hyper_objective": "memory"},
              # the calibration's factor c on the floor's part (shipped 2026-11-30, off since 2026-12-01)
              "noise factor": {"calibration_noise_factor": True},
              "memory objective, floor 0.04": {"hyper_objective": "memory", "noise_floor": 0.04},
              "no slope term": {"calibration_slope": False},
              "consensus step 0.5": {"tile_consensus_step": 0.5},
              "consensus step 0.5, M = 128": {"tile_consensus_step": 0.5, "num_inducing": 128},
              "consensus step 0.5, M = 512": {"tile_consensus_step": 0.5, "num_inducing": 512},
              "consensus step 1": {"tile_consensus_step": 1.0},
              "lengthscale 0.7 m": {"lengthscale": 0.7}, "lengthscale 1.4 m": {"lengthscale": 1.4},
              "lengthscale 2 m": {"lengthscale": 2.0},
              # every full update takes its whole step budget: no threshold on one step's gain, which makes the
              # end point jump with the batching (docs/calibration.md, One run is one draw)
              "hyper_tol 0": {"hyper_tol": 0.0},
              # white noise alone, the engine before model.time_error became the default (2026-12-02), at each M
              **_at_each_m("white noise", {"time_error": False}),
              # both errors a hand-held walk shares along a pass: in time (shipped), and its track's read through
              # the slope (docs/calibration.md, Both errors of a walk together)
              **_at_each_m("position noise 0.05 m", {"position_noise": 0.05}),
              # every update full (the shipped schedule waits for 150 samples, chosen on Solin protocol 2 alone:
              # docs/calibration.md, The update schedule by the worst case)
              **_at_each_m("every update full", {"full_update_samples": 1}),
              # each folded reading a site of its own (e's variance added to its noise), the engine before
              # model.correlated_folds became the default (docs/calibration.md, A pass's error counted once)
              **_at_each_m("folds one by one", {"correlated_folds": False})}


def run(plan: dict, root, log: Callable[[str], None]) -> dict[str, Any]:
    """The section: peers and engines per recording, the shipped engine's batching spread, session offsets and
    the defaults table. Every stream is its own task; with ``plan["jobs"]`` above 1 the tasks run in that many
    worker processes (each with this process's torch threads), which changes no number: every engine and peer
    is seeded."""
    names = _chosen(plan, "calibration_recordings", RECORDINGS)
    factors = _batch_factors(plan)
    engines = [e for e in ENGINES if e in _chosen(plan, "calibration_engines", tuple(ENGINES))]
    candidates = [c for c in CANDIDATES if c in _chosen(plan, "calibration_candidates", tuple(CANDIDATES))]
    parts = _chosen(plan, "calibration_parts", PARTS)
    rungs = _ladder_rungs(candidates)  # the M ladder's selected rungs (ladder_batching)
    recs = {}
    for name in names:
        try:
            recs[name] = load(name, root, plan)
        except Exception as err:  # a missing recording skips its column, with the reason
            log(f"  {name}: skipped ({err})")
    tasks: list[tuple[str, str | None, Any]] = []
    for name, rec in recs.items():
        log(f"  {name}: {len(rec.x)} streamed, {len(rec.x_test)} held out")
        tasks.append(("peers", name, None))
        tasks += [("engine", name, e) for e in engines if name in ENGINES[e]]
        if "dual_svgp" in engines and factors:
            tasks += [("batch", name, b) for b in batch_sizes(rec, factors)[1:]]
        tasks += [("candidate", name, c) for c in candidates if not (c == "shipped" and "dual_svgp" in engines)]
        if "ladder_batching" in parts and "dual_svgp" in engines:
            tasks += [("candidate_batch", name, (c, b)) for c in rungs if c != "shipped"
                      for b in batch_sizes(rec, factors)[1:]]
    if "solin_p2" in names and "sessions" in parts:
        tasks.append(("sessions", None, None))
    done = run_tasks(tasks, plan, root, int(plan.get("jobs", 1)), log)

    out: dict[str, Any] = {"recordings": {}, "defaults": {}}
    for name, rec in recs.items():
        row: dict[str, Any] = {"num_train": len(rec.x), "num_test": len(rec.x_test),
                               "peers": done[("peers", name, None)], "engines": {}}
        for engine in engines:
            if ("engine", name, engine) in done:
                row["engines"][engine] = done[("engine", name, engine)]
        if "dual_svgp" in row["engines"] and factors:
            row["batching"] = batching_spread({b: done[("batch", name, b)] if b != rec.batch
                                               else row["engines"]["dual_svgp"] for b in batch_sizes(rec, factors)})
            log(f"  {name} batching: " + ", ".join(f"{b}: {r['rmse']:.3f}"
                                                   for b, r in row["batching"]["runs"].items()))
        if "ladder_batching" in parts and "dual_svgp" in row["engines"] and len(rungs) > 1:
            sizes = batch_sizes(rec, factors)
            row["ladder_batching"] = ladder_over_batchings({
                cand: {b: _rung_at(done, row, rec, name, cand, b) for b in sizes} for cand in rungs})
        out["recordings"][name] = row
    if ("sessions", None, None) in done:
        out["sessions"] = done[("sessions", None, None)]
    for cand in candidates if recs else ():  # no recording loaded: no table to judge a candidate by
        per = {}
        for name in recs:
            row = out["recordings"][name]
            task = ("candidate", name, cand)
            s = done[task] if task in done else row["engines"]["dual_svgp"]  # "shipped" is the engine's row
            best_rmse = min(p["rmse"] for p in row["peers"].values())
            best_nlpd = min(p["nlpd"] for p in row["peers"].values() if "nlpd" in p)
            per[name] = {**{k: s[k] for k in ("rmse", "nlpd", "within_2sd", "z_std")},
                         "rmse_ratio": s["rmse"] / best_rmse, "nlpd_gap": s["nlpd"] - best_nlpd}
        out["defaults"][cand] = {"per_recording": per,
                                 "worst_rmse_ratio": max(v["rmse_ratio"] for v in per.values()),
                                 "worst_nlpd_gap": max(v["nlpd_gap"] for v in per.values()),
                                 "worst_coverage_miss": max(abs(v["within_2sd"] - 0.95) for v in per.values())}
        log(f"  candidate {cand}: worst RMSE ratio {out['defaults'][cand]['worst_rmse_ratio']:.3f}, worst NLPD gap "
            f"{out['defaults'][cand]['worst_nlpd_gap']:+.3f}")
    return out


#: the section's optional parts (plan key calibration_parts): the session runs, and the M ladder streamed at every
#: batch size of the batching spread (ladder_over_batchings)
PARTS = ("sessions", "ladder_batching")


def _chosen(plan: dict, key: str, choices: tuple) -> tuple:
    """The plan's selection ``key`` of ``choices`` (absent or None: all of them); a name not among them is an
    error that says what there is to choose from."""
    value = plan.get(key)
    if value is None:
        return tuple(choices)
    unknown = [v for v in value if v not in choices]
    if unknown:
        raise ValueError(f"{key}: unknown {unknown}; choose from {list(choices)}")
    return tuple(value)


def _batch_factors(plan: dict) -> tuple:
    """The plan's calibration_batch_factors (absent or None: BATCH_FACTORS); each must be a positive number."""
    value = plan.get("calibration_batch_factors")
    if value is None:
        return BATCH_FACTORS
    if not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in value):
        raise ValueError(f"calibration_batch_factors: {list(value)} are not all positive numbers")
    return tuple(value)


#: a worker's plan, data folder and recordings (run_task; set by _start_worker, or by run_tasks in this process)
_WORKER: dict[str, Any] = {"recordings": {}}


def task_context() -> tuple[dict, Any, dict]:
    """What a task runner of run_tasks reads, in a worker or in this process: the plan, the data folder and a
    cache of what the worker has loaded or made (recordings), kept between its tasks."""
    return _WORKER["plan"], _WORKER["root"], _WORKER["recordings"]


def _start_worker(plan: dict, root, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)  # the parent's: a reduction's order, and so its last digits, follow the threads
    _WORKER.update(plan=plan, root=root, recordings={})


def run_task(task: tuple[str, str | None, Any]) -> Any:
    """One stream of the section (run's tasks): ("peers", recording, None), ("engine", recording, engine),
    ("batch", recording, batch size), ("candidate", recording, candidate), ("candidate_batch", recording,
    (candidate, batch size)) or ("sessions", None, None)."""
    kind, name, arg = task
    plan, root, loaded = task_context()
    if kind == "sessions":
        return session_offsets(root, lambda message: None)
    if name not in loaded:
        loaded[name] = load(name, root, plan)
    rec = loaded[name]
    if kind == "peers":
        return peer_scores(rec, shipped(), plan)
    if kind == "engine":
        return engine_scores(shipped(engine=arg), rec)
    if kind == "batch":
        return engine_scores(shipped(), dataclasses.replace(rec, batch=arg))
    if kind == "candidate":
        return engine_scores(shipped(**CANDIDATES[arg]), rec)
    if kind == "candidate_batch":
        candidate, batch = arg
        return engine_scores(shipped(**CANDIDATES[candidate]), dataclasses.replace(rec, batch=batch))
    raise ValueError(f"unknown task {task!r}")


def _task_line(task: tuple[str, str | None, Any], result: Any) -> str:
    kind, name, arg = task
    if kind == "sessions":
        return "  sessions: " + "; ".join(f"{label}: offsets {np.round(r['learned_offsets'], 2).tolist()}, "
                                          f"RMSE {r['rmse']:.3f}" for label, r in result["runs"].items())
    if kind == "peers":
        return f"  {name} peers: " + ", ".join(f"{p} {s['rmse']:.3f}" for p, s in result.items())
    if kind == "candidate_batch":
        what = f"candidate {arg[0]}, batches of {arg[1]}"
    else:
        what = {"engine": arg, "batch": f"dual_svgp, batches of {arg}", "candidate": f"candidate {arg}"}[kind]
    return f"  {name} {what}: " + _line(result)


def run_tasks(tasks: list[tuple[str, str | None, Any]], plan: dict, root, jobs: int,
              log: Callable[[str], None], runner: Callable[[Any], Any] | None = None,
              describe: Callable[[Any, Any], str] | None = None) -> dict[tuple[str, str | None, Any], Any]:
    """Each task's result (``runner``, a module-level function: run_task unless said), computed here one after
    another (``jobs`` 1) or in ``jobs`` worker processes (spawned: a forked child of a process whose torch has
    started threads can hang), each running as many torch threads as this process; each result is logged as
    ``describe`` (_task_line unless said) writes it. A runner reads the plan and data folder from task_context."""
    runner, describe = runner or run_task, describe or _task_line
    done: dict[tuple[str, str | None, Any], Any] = {}
    if jobs <= 1:
        saved = dict(_WORKER)
        _WORKER.update(plan=plan, root=root, recordings={})
        try:
            for task in tasks:
                done[task] = runner(task)
                log(describe(task, done[task]))
        finally:
            _WORKER.clear()
            _WORKER.update(saved)
        return done
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start_worker, initargs=(plan, root, torch.get_num_threads())) as pool:
        futures = {pool.submit(runner, task): task for task in tasks}
        try:
            for future in as_completed(futures):
                task = futures[future]
                done[task] = future.result()
                log(describe(task, done[task]))
        except BaseException:  # a failed task fails the section: the queued ones are not run
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return done


def session_offsets(root, log: Callable[[str], None], offset: float = 5.0) -> dict[str, Any]:
    """Sequences 1-4 of the Solin recording streamed as four sessions, with ``offset`` uT added to sequence 2
    or not, with the session offsets learned (Engine.start_session) or not; sequence 5 held out. Returns each
    run's learned offsets and held-out scores."""
    from gp_mapping.evaluation.datasets import load_solin2018

    seqs = [load_solin2018(root, s) for s in (1, 2, 3, 4)]
    test = load_solin2018(root, 5)
    out: dict[str, Any] = {"offset_added": offset, "runs": {}}
    for label, added, sessions in (("no offset", 0.0, False), ("no offset, sessions", 0.0, True),
                                   ("offset", offset, False), ("offset, sessions", offset, True)):
        model = build_model(shipped(), 2, 1)
        learned = [0.0]
        for k, seq in enumerate(seqs):
            if sessions and k > 0:
                model.start_session()
            y = seq.magnitude_uT[:, None] + (added if k == 1 else 0.0)
            for i in range(0, len(y), 50):
                model.update(seq.xy[i:i + 50], y[i:i + 50])
            if sessions and k > 0:
                learned.append(float(model.session_offset()[0]))
        mean, var = model.predict_reading(test.xy)
        out["runs"][label] = {"learned_offsets": learned,
                              **scores(mean.cpu().numpy(), var.cpu().numpy(), test.magnitude_uT[:, None])}
        log(f"  sessions, {label}: offsets {np.round(learned, 2).tolist()} " + _line({**out['runs'][label],
                                                                                       "uncalibrated": None}))
    runs = out["runs"]
    out["recovered_offset"] = runs["offset, sessions"]["learned_offsets"][1] - runs["no offset, sessions"][
        "learned_offsets"][1]
    return out


def _line(s: dict) -> str:
    if s.get("uncalibrated") is None:
        return f"RMSE {s['rmse']:.3f} NLPD {s['nlpd']:.3f} +-2SD {s['within_2sd']:.3f} z-std {s['z_std']:.2f}"
    return (f"RMSE {s['rmse']:.3f} NLPD {s['nlpd']:.3f} +-2SD {s['within_2sd']:.3f} z-std {s['z_std']:.2f} "
            f"(uncalibrated NLPD {s['uncalibrated']['nlpd']:.3f} +-2SD {s['uncalibrated']['within_2sd']:.3f})")


#: the defaults table's candidates that differ from the shipped engine by M alone, and the shipped one: (name, M)
#: in increasing M
M_LADDER = tuple(sorted([("shipped", ModelConfig.num_inducing)] + [
    (name, overrides["num_inducing"]) for name, overrides in CANDIDATES.items() if set(overrides) == {"num_inducing"}],
    key=lambda rung: rung[1]))
#: issue 37's bar: a larger M maps no worse than this RMSE ratio and NLPD gap to the next smaller one
M_RMSE_RATIO, M_NLPD_GAP = 1.01, 0.02


def inducing_ladder(defaults: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per recording, RMSE and NLPD at each M of M_LADDER (the defaults table's candidates) and whether each
    larger M maps no worse than the next smaller one (RMSE within M_RMSE_RATIO, NLPD within M_NLPD_GAP); {} when
    the table lacks a rung."""
    if not all(name in defaults for name, _ in M_LADDER):
        return {}
    out = {}
    for rec in defaults["shipped"]["per_recording"]:
        rungs = [defaults[name]["per_recording"].get(rec) for name, _ in M_LADDER]
        if any(r is None for r in rungs):
            continue
        out[rec] = {"rmse": [r["rmse"] for r in rungs], "nlpd": [r["nlpd"] for r in rungs],
                    "holds": larger_m_holds(rungs)}
    return out


def _rung_at(done: dict, row: dict[str, Any], rec: Recording, name: str, candidate: str, batch: int
             ) -> dict[str, Any]:
    """The scores of the M ladder's rung ``candidate`` streamed in batches of ``batch`` (run's tasks): the shipped
    rung is the engine's row and the batching spread's runs, another rung its defaults candidate's row at the
    recording's own batch size and a candidate_batch task at the others."""
    if candidate == "shipped":
        return row["engines"]["dual_svgp"] if batch == rec.batch else done[("batch", name, batch)]
    return done[("candidate", name, candidate)] if batch == rec.batch else done[("candidate_batch", name,
                                                                                   (candidate, batch))]


def _ladder_rungs(candidates) -> list[str]:
    """The M_LADDER rungs among the selected ``candidates`` (the shipped one always), in increasing M."""
    return [name for name, _ in M_LADDER if name == "shipped" or name in candidates]


def ladder_over_batchings(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """The M ladder streamed at every batch size of the batching spread (``runs``: rung name, in increasing M ->
    batch size -> scores). One run is one draw of the batching (batching_spread), and on some recordings the draws
    spread wider than the ladder's bar, so the ladder is also judged paired, at each batch size, and on the
    median over the batch sizes of each rung's RMSE and NLPD."""
    keys = ("rmse", "nlpd", "within_2sd")
    names = list(runs)
    batches = [b for b in runs[names[0]] if all(b in runs[n] for n in names)]
    table = {n: {str(b): {k: runs[n][b][k] for k in keys} for b in batches} for n in names}
    median = {n: {k: float(np.median([table[n][str(b)][k] for b in batches])) for k in keys} for n in names}
    per_batch = {str(b): larger_m_holds([table[n][str(b)] for n in names]) for b in batches}
    return {"rungs": names, "runs": table, "median": median, "holds_at_median": larger_m_holds(list(median.values())),
            "holds_per_batch": per_batch}


def larger_m_holds(rungs: list[dict[str, Any]]) -> bool:
    """Whether each of ``rungs`` (scores at increasing M) maps no worse than the one before it: RMSE within
    M_RMSE_RATIO and NLPD within M_NLPD_GAP."""
    return all(b["rmse"] <= M_RMSE_RATIO * a["rmse"] and b["nlpd"] <= a["nlpd"] + M_NLPD_GAP
               for a, b in zip(rungs, rungs[1:]))


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Calibration: a reading's predictive distribution on held-out passes", "",
             "Predictive distribution of a reading (latent variance plus noise, calibrated prequentially where the "
             "engine does; gp/calibration.py). +-1/+-2 SD: fraction of held-out readings inside (ideal 0.683 / "
             "0.954); z-std: standard deviation of error / SD (ideal 1). Uncalibrated: the same engine's latent "
             "variance plus learned noise. Reliability curves: `calibration_<recording>.png`.", ""]
    if "skipped" in sec or "error" in sec:
        return lines + [f"Skipped: {sec['skipped']}" if "skipped" in sec else f"Failed: {sec['error']}", ""]
    for name, row in sec.get("recordings", {}).items():
        lines += [f"### {name}: {row['num_train']} streamed, {row['num_test']} held out", "",
                  "| method | RMSE | NLPD | +-1 SD | +-2 SD | z-std | uncal. NLPD | uncal. +-2 SD | uncal. z-std |",
                  "|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for engine, s in row["engines"].items():
            u = s["uncalibrated"]
            lines.append(f"| {engine} | {s['rmse']:.3f} | {s['nlpd']:.3f} | {s['within_1sd']:.3f} | "
                         f"{s['within_2sd']:.3f} | {s['z_std']:.2f} | {u['nlpd']:.3f} | {u['within_2sd']:.3f} | "
                         f"{u['z_std']:.2f} |")
        for peer, s in row["peers"].items():
            if "nlpd" in s:
                lines.append(f"| {peer} | {s['rmse']:.3f} | {s['nlpd']:.3f} | {s['within_1sd']:.3f} | "
                             f"{s['within_2sd']:.3f} | {s['z_std']:.2f} | - | - | - |")
            else:
                lines.append(f"| {peer} | {s['rmse']:.3f} | - | - | - | - | - | - | - |")
        lines.append("")
    spread = {name: row["batching"] for name, row in sec.get("recordings", {}).items() if "batching" in row}
    if spread:
        lines += ["### The shipped dual_svgp with other batch sizes", "",
                  "The same streams cut into batches of other sizes (the recording's own first); each cell RMSE / "
                  "NLPD / +-2 SD. One run's figure is one draw of this spread.", "",
                  "| recording | runs (batch: RMSE / NLPD / +-2 SD) | RMSE range | NLPD range | +-2 SD range |",
                  "|:---|:---|---:|---:|---:|"]
        for name, b in spread.items():
            cells = "; ".join(f"{k}: {r['rmse']:.3f} / {r['nlpd']:.3f} / {r['within_2sd']:.3f}"
                              for k, r in b["runs"].items())
            lines.append(f"| {name} | {cells} | {b['rmse_range'][0]:.3f}-{b['rmse_range'][1]:.3f} | "
                         f"{b['nlpd_range'][0]:.3f}-{b['nlpd_range'][1]:.3f} | "
                         f"{b['within_2sd_range'][0]:.3f}-{b['within_2sd_range'][1]:.3f} |")
        lines.append("")
    ses = sec.get("sessions")
    if ses:
        lines += [f"### Session offsets: Solin sequences 1-4 as four sessions, {ses['offset_added']:g} uT added to "
                  "sequence 2 or not; sequence 5 held out", "",
                  "| run | learned offsets of sessions 2-4 | RMSE | NLPD | +-2 SD | z-std |", "|:---|:---|---:|---:|---:|---:|"]
        for label, r in ses["runs"].items():
            offs = ", ".join(f"{v:+.2f}" for v in r["learned_offsets"][1:]) or "-"
            lines.append(f"| {label} | {offs} | {r['rmse']:.3f} | {r['nlpd']:.3f} | {r['within_2sd']:.3f} | "
                         f"{r['z_std']:.2f} |")
        lines += ["", f"Offset recovered for sequence 2 (with the offset less without it): "
                  f"{ses['recovered_offset']:+.2f} uT.", ""]
    if sec.get("defaults"):
        names = list(next(iter(sec["defaults"].values()))["per_recording"])
        lines += ["### Defaults by the worst case (dual_svgp)", "",
                  "Each cell: RMSE ratio to the best peer / NLPD gap to the best GP peer / +-2 SD coverage. A "
                  "candidate is judged by its worst column.", "",
                  "| candidate | " + " | ".join(names) + " | worst RMSE ratio | worst NLPD gap | worst coverage miss |",
                  "|:---|" + "---:|" * (len(names) + 3)]
        for cand, d in sec["defaults"].items():
            cells = [f"{d['per_recording'][n]['rmse_ratio']:.2f} / {d['per_recording'][n]['nlpd_gap']:+.2f} / "
                     f"{d['per_recording'][n]['within_2sd']:.2f}" for n in names]
            lines.append(f"| {cand} | " + " | ".join(cells) + f" | {d['worst_rmse_ratio']:.2f} | "
                         f"{d['worst_nlpd_gap']:+.2f} | {d['worst_coverage_miss']:.2f} |")
        lines.append("")
        ladder = inducing_ladder(sec["defaults"])
        if ladder:
            sizes = " / ".join(str(m) for _, m in M_LADDER)
            lines += [f"### More inducing points (dual_svgp, M = {sizes})", "",
                      f"A larger M must map no worse than the next smaller one: RMSE within "
                      f"{100 * (M_RMSE_RATIO - 1):.0f} %, NLPD within {M_NLPD_GAP} nats.", "",
                      f"| recording | RMSE at M = {sizes} | NLPD at M = {sizes} | holds |", "|:---|---:|---:|:---|"]
            for rec, r in ladder.items():
                lines.append(f"| {rec} | " + " / ".join(f"{v:.3f}" for v in r["rmse"]) + " | "
                             + " / ".join(f"{v:.3f}" for v in r["nlpd"]) + f" | {'yes' if r['holds'] else 'no'} |")
            lines.append("")
    over = {name: row["ladder_batching"] for name, row in sec.get("recordings", {}).items()
            if "ladder_batching" in row}
    if over:
        lines += _ladder_over_batchings_lines(over)
    return lines


def _ladder_over_batchings_lines(over: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table of the ladder at every batch size (ladder_over_batchings, per recording)."""
    lines = ["### More inducing points at every batch size (dual_svgp)", "",
             "The M ladder streamed at each batch size of the batching spread above: each rung's median over the "
             "batch sizes, whether the ladder holds on the medians (the same bar as above), and at how many batch "
             "sizes it holds when each is compared with itself.", "",
             "| recording | M | median RMSE | median NLPD | median +-2 SD | holds at the medians | "
             "holds per batch size |", "|:---|:---|---:|---:|---:|:---|:---|"]
    for rec, r in over.items():
        med = [r["median"][n] for n in r["rungs"]]
        per = r["holds_per_batch"]
        sizes = " / ".join(str(dict(M_LADDER)[n]) for n in r["rungs"])
        lines.append(f"| {rec} | {sizes} | " + " / ".join(f"{m['rmse']:.3f}" for m in med) + " | "
                     + " / ".join(f"{m['nlpd']:.3f}" for m in med) + " | "
                     + " / ".join(f"{m['within_2sd']:.3f}" for m in med) + f" | "
                     f"{'yes' if r['holds_at_median'] else 'no'} | {sum(per.values())} of {len(per)} "
                     f"({', '.join(b for b, ok in per.items() if not ok) or 'none'} not) |")
    return lines + [""]


def reliability_diagram(curves: list[tuple[str, dict[str, Any]]], title: str, path) -> None:
    """A reliability diagram (observed against nominal central coverage) of ``curves`` ([(label, scores)], scores
    as :func:`scores` gives them; those without a reliability curve are left out), written to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "k:", lw=1, label="ideal")
    for label, s in curves:
        if "reliability" in s:
            ax.plot([float(k) for k in s["reliability"]], list(s["reliability"].values()), "o-", ms=3, label=label)
    ax.set_xlabel("nominal central coverage")
    ax.set_ylabel("observed coverage (held out)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot(sec: dict[str, Any], out) -> list[str]:
    """One reliability diagram per recording (every method)."""
    written = []
    for name, row in sec.get("recordings", {}).items():
        path = out / f"calibration_{name}.png"
        reliability_diagram([*row["engines"].items(), *row["peers"].items()], name, path)
        written.append(path.name)
    return written
