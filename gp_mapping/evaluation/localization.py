"""Bench section ``localization``: the particle filter of :mod:`gp_mapping.localization` on a real room.

Data: the Solin et al. (2018) wheeled-robot recording (five sequences in one ~6 m x 5 m room, Vicon positions,
calibrated field in the room frame, 50 Hz). For each held-out sequence a map is made from the other four with the
shipped ``config/mapper.yaml`` (the package's default engine), fed through a :class:`~gp_mapping.mapping.mapper.Mapper`
as a robot would feed it; the held-out sequence is then localized on that map:

* Ground truth: the Vicon position, and a heading along the path (the direction of the position smoothed over
  HEADING_SMOOTH_S seconds; the recording has no orientation).
* Odometry: the ground truth's increments (body frame, 50 Hz) with a scale error (SCALE_ERROR, sign by seed), a
  slow heading drift (DRIFT_DEG_S, sign by seed) and white noise on every increment, integrated from the origin of
  an odom frame; so the dead reckoning drifts by metres over a sequence.
* Readings: the recording's real magnetometer, |B| for the magnitude map (and, for the vector map, the room-frame
  vector turned into the body frame by the ground-truth heading).

Rows (5 odometry seeds each, 1000 particles unless said): the filter on the GP map from a known start; dead
reckoning alone; the same filter on a nearest-neighbour map (each cell the reading of the nearest mapped sample,
its variance the nearest-neighbour predictor's leave-one-out error) and with the map's variance ignored (a fixed
reading variance, the median of the GP map's); the map's errors taken as independent from update to update
(``correlated_map_error`` off, the filter before the correlated error state); global localization (particles uniform over the known cells);
a constant 5 uT offset added to the readings, with the bias state on and off; the cost of one filter update at
500, 1000 and 2000 particles (one thread, the grid lookup). The map's own accuracy on the held-out readings
comes with its NLPD and +-2 SD coverage (of a reading: latent + noise), as every accuracy figure here does.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from gp_mapping.localization import Localizer, LocalizerConfig, MagneticMap
from gp_mapping.localization.field_map import reading_moments
from gp_mapping.localization.motion import compose, inverse

HEADING_SMOOTH_S = 0.5      # Gaussian smoothing of the positions before their direction is the heading [s]
HEADING_MIN_SPEED = 0.05    # below this speed the heading is interpolated between moving stretches [m/s]
SCALE_ERROR = 0.03          # odometry scale error (sign by seed)
DRIFT_DEG_S = 0.3           # heading drift [deg/s] (sign by seed)
TRANS_NOISE = 0.02          # white noise on every increment: this fraction of its length [m/m]
YAW_NOISE = 0.002           # and this much heading [rad] per increment (50 Hz)
BIAS_OFFSET_UT = 5.0        # the offset added to the readings in the bias rows [uT]
CONVERGED_M = 0.5           # global localization has converged once the error stays below this [m]
SEEDS = (0, 1, 2, 3, 4)


# ------------------------------------------------------------------------------------------------- data

def ground_truth(seq) -> tuple[np.ndarray, np.ndarray]:
    """``(t (N,), poses (N, 3))`` of a Solin2018Sequence: its positions and the heading along its path."""
    from scipy.ndimage import gaussian_filter1d

    t, xy = seq.t, seq.xy
    dt = float(np.median(np.diff(t)))
    smooth = gaussian_filter1d(xy, HEADING_SMOOTH_S / dt, axis=0, mode="nearest")
    v = np.gradient(smooth, t, axis=0)
    moving = np.linalg.norm(v, axis=1) > HEADING_MIN_SPEED
    if moving.sum() < 2:
        raise ValueError(f"sequence {seq.sequence} hardly moves: no heading can be derived")
    yaw = np.interp(t, t[moving], np.unwrap(np.arctan2(v[moving, 1], v[moving, 0])))
    return t, np.column_stack([xy, (yaw + math.pi) % (2 * math.pi) - math.pi])


def synthetic_odometry(t: np.ndarray, poses: np.ndarray, seed: int, scale_error: float = SCALE_ERROR,
                       drift_deg_s: float = DRIFT_DEG_S, trans_noise: float = TRANS_NOISE,
                       yaw_noise: float = YAW_NOISE) -> np.ndarray:
    """Odometry ``(N, 3)`` in an odom frame starting at the origin: the increments of ``poses`` with a scale error,
    a heading drift (each of the given size, the sign drawn by ``seed``) and white noise, integrated."""
    rng = np.random.default_rng(seed)
    scale = 1.0 + scale_error * rng.choice([-1.0, 1.0])
    drift = math.radians(drift_deg_s) * rng.choice([-1.0, 1.0])
    inc = compose(inverse(poses[:-1]), poses[1:])  # body-frame increments
    step = np.hypot(inc[:, 0], inc[:, 1])
    noisy = np.column_stack([inc[:, 0] * scale + rng.standard_normal(len(inc)) * trans_noise * step,
                             inc[:, 1] * scale + rng.standard_normal(len(inc)) * trans_noise * step,
                             inc[:, 2] + drift * np.diff(t) + rng.standard_normal(len(inc)) * yaw_noise])
    odom = np.zeros_like(poses)
    for i in range(1, len(poses)):
        odom[i] = compose(odom[i - 1], noisy[i - 1])
    return odom


def dead_reckoning(odom: np.ndarray, start) -> np.ndarray:
    """The odometry carried into the map frame from a known start pose."""
    return compose(compose(np.asarray(start, dtype=np.float64), inverse(odom[0])), odom)


def body_frame_field(field_room: np.ndarray, yaw: np.ndarray) -> np.ndarray:
    """Room-frame vectors ``(N, 3)`` as a level sensor heading ``yaw`` reads them."""
    c, s = np.cos(yaw), np.sin(yaw)
    return np.column_stack([c * field_room[:, 0] + s * field_room[:, 1], -s * field_room[:, 0] + c * field_room[:, 1],
                            field_room[:, 2]])


# ------------------------------------------------------------------------------------------------- the map

def build_mapper(root, sequences, target: str = "magnitude"):
    """A Mapper with the shipped config (``sync.target`` = ``target``) fed the given Solin sequences in time
    order (identity orientation: the field is in the room frame), one after another, flushed."""
    from gp_mapping.evaluation.datasets import load_solin2018
    from gp_mapping.evaluation.speed import shipped_config
    from gp_mapping.mapping.mapper import Mapper

    cfg = shipped_config("cpu")
    cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, target=target))
    mapper = Mapper(cfg)
    offset = 0.0
    for s in sequences:
        seq = load_solin2018(root, s)
        t = seq.t - seq.t[0] + offset
        for i in range(len(t)):
            mapper.add_pose(float(t[i]), (float(seq.xy[i, 0]), float(seq.xy[i, 1]), 0.0), (0.0, 0.0, 0.0, 1.0))
            mapper.add_magnetic_field(float(t[i]), seq.field_uT[i] * 1e-6)
            mapper.process()
        offset = float(t[-1]) + 10.0  # a pause between sequences, as between two sessions
    mapper.flush()
    return mapper


def map_accuracy(model, xy: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """RMSE, NLPD (the engine's log predictive density of a reading) and the share of held-out readings inside
    +-2 SD of a reading (latent + noise), per output averaged, of ``model`` at inputs ``xy`` (N, 2), targets
    ``y`` (N, P)."""
    import torch

    x = torch.as_tensor(xy, dtype=torch.float64)
    with torch.no_grad():
        mean, var = (a.numpy() for a in reading_moments(model, x, with_slope=True))  # a new pass
        lpd = model.log_predictive_density(x, torch.as_tensor(y, dtype=torch.float64)).numpy()
    err = mean - y
    return {"rmse": float(np.sqrt(np.mean(err ** 2))), "nlpd": float(-np.mean(lpd)),
            "coverage_2sd": float(np.mean(np.abs(err) <= 2.0 * np.sqrt(var))),
            "mean_sd": float(np.mean(np.sqrt(var)))}


def nearest_neighbour_map(train_xy: np.ndarray, train_y: np.ndarray, like: MagneticMap) -> tuple[MagneticMap, dict]:
    """A map of the same grid and known cells as ``like`` whose every cell holds the target of the nearest
    training sample, and whose reading variance is the nearest-neighbour predictor's leave-one-out squared error
    (each training sample predicted by its nearest *other* sample), one number per output. Returns the map and
    that variance."""
    from scipy.spatial import cKDTree

    tree = cKDTree(train_xy)
    _, idx = tree.query(like.spec.cell_centres())
    mean = train_y[idx].reshape(like.spec.shape + (train_y.shape[1],))
    _, loo = tree.query(train_xy, k=2)
    var = np.mean((train_y[loo[:, 1]] - train_y) ** 2, axis=0)
    full = np.broadcast_to(var, mean.shape).copy()
    return (MagneticMap(spec=like.spec, mean=mean, var=full, known=like.known, frame_id=like.frame_id,
                        field_unit=like.field_unit, target=like.target, source="nearest neighbour"),
            {"loo_variance": var.tolist()})


# ------------------------------------------------------------------------------------------------- the filter

def localize(fmap: MagneticMap, t: np.ndarray, odom: np.ndarray, field_tesla: np.ndarray, config: LocalizerConfig,
             start=None) -> dict[str, Any]:
    """Run a Localizer over the streams (odometry then the reading at each instant); ``start`` a pose (Gaussian
    initialisation, ``initial_std``) or None (global). Returns the update stamps, estimates, standard deviations,
    offsets, the median update time and the diagnostics."""
    loc = Localizer(fmap, config)
    if start is None:
        loc.initialise_global()
    else:
        loc.initialise(start)
    stamps, poses, stds, bias = [], [], [], []
    for i in range(len(t)):
        loc.add_odometry_2d(t[i], odom[i, 0], odom[i, 1], odom[i, 2])
        for e in loc.add_magnetic_field(t[i], field_tesla[i]):
            stamps.append(e.stamp)
            poses.append(e.pose)
            stds.append(e.std)
            bias.append(e.bias)
    loc.finish()
    return {"stamps": np.array(stamps), "poses": np.array(poses).reshape(-1, 3), "stds": np.array(stds).reshape(-1, 3),
            "bias": np.array(bias).reshape(len(stamps), -1), "diagnostics": loc.diagnostics()}


def trajectory_errors(stamps: np.ndarray, poses: np.ndarray, t: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Position errors [m] of estimates at ``stamps`` against the truth interpolated there."""
    tx = np.interp(stamps, t, truth[:, 0])
    ty = np.interp(stamps, t, truth[:, 1])
    return np.hypot(poses[:, 0] - tx, poses[:, 1] - ty)


def converged_after(stamps: np.ndarray, err: np.ndarray, threshold: float = CONVERGED_M) -> float | None:
    """Seconds from the first stamp until the error stays below ``threshold`` to the end; None if it never does."""
    above = np.flatnonzero(err >= threshold)
    if above.size == 0:
        return 0.0
    if above[-1] == len(err) - 1:
        return None
    return float(stamps[above[-1] + 1] - stamps[0])


def run_summary(run: dict[str, Any], t: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    """RMSE, largest and final error, convergence of one run."""
    err = trajectory_errors(run["stamps"], run["poses"], t, truth)
    return {"rmse_m": float(np.sqrt(np.mean(err ** 2))), "max_error_m": float(err.max()),
            "final_error_m": float(err[-1]), "converged_after_s": converged_after(run["stamps"], err),
            "updates": int(len(err)), "median_update_ms": run["diagnostics"]["median_update_ms"],
            "bias_final": [float(v) for v in run["bias"][-1]] if len(run["bias"]) else []}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and worst over seeds of the per-run numbers."""
    out: dict[str, Any] = {"runs": rows}
    for key in ("rmse_m", "max_error_m", "final_error_m"):
        values = np.array([r[key] for r in rows], dtype=np.float64)
        out[f"{key}_mean"] = float(values.mean())
        out[f"{key}_worst"] = float(values.max())
    conv = [r.get("converged_after_s") for r in rows]
    out["converged"] = int(sum(c is not None for c in conv))
    times = [c for c in conv if c is not None]
    out["converged_after_s_median"] = float(np.median(times)) if times else None
    return out


def update_cost(fmap: MagneticMap, t: np.ndarray, odom: np.ndarray, field_tesla: np.ndarray, start,
                particles: int, config: LocalizerConfig, updates: int = 300) -> dict[str, float]:
    """Median and 95th percentile [ms] of one filter update (motion, lookup, weights, offsets, estimate,
    resampling when due) at ``particles`` particles, over the first ``updates`` updates of a run."""
    cfg = dataclasses.replace(config, num_particles=particles)
    loc = Localizer(fmap, cfg)
    loc.initialise(start)
    seconds = []
    for i in range(len(t)):
        loc.add_odometry_2d(t[i], odom[i, 0], odom[i, 1], odom[i, 2])
        begin = time.perf_counter()
        out = loc.add_magnetic_field(t[i], field_tesla[i])
        if out:
            seconds.append(time.perf_counter() - begin)
            if len(seconds) >= updates:
                break
    a = np.asarray(seconds) * 1e3
    return {"particles": particles, "median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95)),
            "updates": int(a.size)}


# ------------------------------------------------------------------------------------------------- the section

def run(plan: dict, root, why: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    """The section (module docstring). ``plan`` keys (all optional): ``loc_test_sequences`` (held-out sequences;
    each gets its own map of the others), ``loc_seeds``, ``loc_particles``, ``loc_vector`` (also a vector map on
    the first held-out sequence). A global start draws the config's ``max_particles`` (KLD-sampling brings the
    count down to ``loc_particles`` as the cloud gathers)."""
    if root is None:
        return {"skipped": why or "no data folder"}
    import torch

    from gp_mapping.evaluation.datasets import load_solin2018

    torch.set_num_threads(1)
    tests = tuple(plan.get("loc_test_sequences", (5, 1, 2, 3, 4)))
    seeds = tuple(plan.get("loc_seeds", SEEDS))
    particles = int(plan.get("loc_particles", 1000))
    base = LocalizerConfig(num_particles=particles)
    out: dict[str, Any] = {
        "data": "Solin et al. (2018) wheeled robot, 5 sequences, 50 Hz", "tests": list(tests), "seeds": list(seeds),
        "particles": particles, "global_particles": base.max_particles, "config": dataclasses.asdict(base),
        "odometry": {"scale_error": SCALE_ERROR, "drift_deg_s": DRIFT_DEG_S, "trans_noise": TRANS_NOISE,
                     "yaw_noise_rad": YAW_NOISE, "rate_hz": 50},
        "bias_offset_uT": BIAS_OFFSET_UT, "sequences": {}}
    for k, test in enumerate(tests):
        train = tuple(s for s in (1, 2, 3, 4, 5) if s != test)
        start_time = time.perf_counter()
        mapper = build_mapper(root, train)
        build_s = time.perf_counter() - start_time
        fmap = MagneticMap.from_mapper(mapper, source=f"Solin {'+'.join(map(str, train))}")
        seq = load_solin2018(root, test)
        t, truth = ground_truth(seq)
        field_t = seq.field_uT * 1e-6
        acc = map_accuracy(mapper.model, seq.xy, seq.magnitude_uT[:, None])
        train_xy = np.vstack([load_solin2018(root, s).xy for s in train])
        train_y = np.concatenate([load_solin2018(root, s).magnitude_uT for s in train])[:, None]
        nn_map, nn_info = nearest_neighbour_map(train_xy, train_y, fmap)
        nn_err = nn_map.lookup(seq.xy)[0][:, 0] - seq.magnitude_uT
        nn_var = nn_info["loo_variance"][0]
        nn_acc = {"rmse": float(np.sqrt(np.mean(nn_err ** 2))),
                  "nlpd": float(np.mean(0.5 * (np.log(2 * math.pi * nn_var) + nn_err ** 2 / nn_var))),
                  "coverage_2sd": float(np.mean(np.abs(nn_err) <= 2 * math.sqrt(nn_var))), "mean_sd": math.sqrt(nn_var)}
        fixed_var = float(np.median(fmap.var[fmap.known][:, 0]))
        rows: dict[str, list] = {name: [] for name in ("gp", "dead_reckoning", "nearest_neighbour", "fixed_noise",
                                                        "independent", "global", "bias_on", "bias_off")}
        offset = field_t * (1.0 + BIAS_OFFSET_UT / np.linalg.norm(seq.field_uT, axis=1))[:, None]  # |B| + 5 uT
        for seed in seeds:
            odom = synthetic_odometry(t, truth, seed)
            cfg = dataclasses.replace(base, seed=seed)
            dr = dead_reckoning(odom, truth[0])
            dr_err = np.hypot(dr[:, 0] - truth[:, 0], dr[:, 1] - truth[:, 1])
            rows["dead_reckoning"].append({"rmse_m": float(np.sqrt(np.mean(dr_err ** 2))),
                                           "max_error_m": float(dr_err.max()), "final_error_m": float(dr_err[-1])})
            cases = (("gp", fmap, cfg, field_t, truth[0]),
                     ("nearest_neighbour", nn_map, cfg, field_t, truth[0]),
                     ("fixed_noise", fmap, dataclasses.replace(cfg, use_map_variance=False, fixed_variance=fixed_var),
                      field_t, truth[0]),
                     ("independent", fmap, dataclasses.replace(cfg, correlated_map_error=False), field_t, truth[0]),
                     ("global", fmap, cfg, field_t, None),
                     ("bias_on", fmap, cfg, offset, truth[0]),
                     ("bias_off", fmap, dataclasses.replace(cfg, bias_prior_std=0.0), offset, truth[0]))
            for name, m, c, f, start in cases:
                rows[name].append(run_summary(localize(m, t, odom, f, c, start), t, truth))
        result = {"train": list(train), "samples": int(len(t)), "duration_s": float(t[-1] - t[0]),
                  "path_m": float(np.sum(np.hypot(*np.diff(seq.xy, axis=0).T))), "map_build_s": build_s,
                  "map": {"gp": acc, "nearest_neighbour": nn_acc, "grid_cells": int(fmap.spec.num_cells),
                          "known_cells": int(fmap.known.sum()), "resolution_m": fmap.spec.resolution,
                          "fixed_variance": fixed_var},
                  "rows": {name: aggregate(r) for name, r in rows.items()}}
        if k == 0:
            odom = synthetic_odometry(t, truth, seeds[0])
            result["cost"] = [update_cost(fmap, t, odom, field_t, truth[0], n, base) for n in (500, 1000, 2000)]
            if plan.get("loc_vector", True):
                result["vector"] = vector_rows(root, train, seq, t, truth, seeds, base)
        out["sequences"][str(test)] = result
        r = result["rows"]
        log(f"  Solin {test} on a map of {'+'.join(map(str, train))} (map {acc['rmse']:.2f} uT, NLPD {acc['nlpd']:.2f}, "
            f"2 SD {acc['coverage_2sd']:.0%}): GP filter RMSE {r['gp']['rmse_m_mean']:.2f} m (worst seed "
            f"{r['gp']['rmse_m_worst']:.2f}, max {r['gp']['max_error_m_worst']:.2f}), dead reckoning "
            f"{r['dead_reckoning']['rmse_m_mean']:.2f}, NN map {r['nearest_neighbour']['rmse_m_mean']:.2f}, fixed "
            f"noise {r['fixed_noise']['rmse_m_mean']:.2f}, global {r['global']['converged']}/{len(seeds)}, 5 uT "
            f"offset {r['bias_on']['rmse_m_mean']:.2f} / {r['bias_off']['rmse_m_mean']:.2f} m (bias state on / off)")
    return out


def vector_rows(root, train, seq, t, truth, seeds, base: LocalizerConfig) -> dict[str, Any]:
    """The vector map of the same sequences: the filter from a known start and from a global start, the readings
    the level body-frame field (room-frame field turned by the ground-truth heading)."""
    mapper = build_mapper(root, train, target="vector")
    fmap = MagneticMap.from_mapper(mapper, source="vector")
    acc = map_accuracy(mapper.model, seq.xy, seq.field_uT)
    body = body_frame_field(seq.field_uT, truth[:, 2]) * 1e-6
    known, glob = [], []
    for seed in seeds:
        odom = synthetic_odometry(t, truth, seed)
        cfg = dataclasses.replace(base, seed=seed)
        known.append(run_summary(localize(fmap, t, odom, body, cfg, truth[0]), t, truth))
        glob.append(run_summary(localize(fmap, t, odom, body, cfg, None), t, truth))
    return {"map": acc, "known_start": aggregate(known), "global": aggregate(glob)}


# ------------------------------------------------------------------------------------------------- report

def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def markdown(sec: dict[str, Any]) -> list[str]:
    """The section's part of the bench report."""
    lines = ["## Localization on a magnetic map (Solin et al. 2018 recording)", ""]
    if "skipped" in sec or "error" in sec:
        return lines + [f"Skipped: {sec['skipped']}" if "skipped" in sec else f"Failed: {sec['error']}", ""]
    od = sec["odometry"]
    lines += [f"Each held-out sequence is localized on a map of the other four (shipped config/mapper.yaml, |B|), "
              f"{sec['particles']} particles ({sec['global_particles']} at a global start, fewer by KLD-sampling as the "
              f"cloud gathers), {len(sec['seeds'])} odometry seeds, from the true start pose unless said; max m: the "
              f"worst seed's largest error. Odometry: ground-truth increments at {od['rate_hz']} Hz with a {od['scale_error']:.0%} scale "
              f"error, a {od['drift_deg_s']} deg/s heading drift and white noise ({od['trans_noise']:.0%} of each "
              f"step, {od['yaw_noise_rad']} rad). Errors are the filter's position against Vicon at every update; "
              "mean over seeds (worst seed). Map rows: held-out readings, the predictive distribution of a reading "
              "(latent + noise).", "",
              "| held out | map RMSE uT | map NLPD | map 2 SD | NN map RMSE uT | GP filter RMSE m | max m | final m "
              "| dead reckoning RMSE m | max m | final m | NN-map filter RMSE m | fixed-noise filter RMSE m | "
              "independent-error filter RMSE m | max m | global converged | global after s | +5 uT bias on RMSE m | "
              "max m | bias off RMSE m | bias estimate uT |",
              "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for test, r in sec["sequences"].items():
        m, rows = r["map"], r["rows"]
        g, dr, nn, fx, ind, gl, on, off = (rows[k] for k in ("gp", "dead_reckoning", "nearest_neighbour",
                                                             "fixed_noise", "independent", "global", "bias_on",
                                                             "bias_off"))
        bias = [run["bias_final"][0] for run in on["runs"] if run["bias_final"]]
        lines.append(
            f"| {test} | {m['gp']['rmse']:.2f} | {m['gp']['nlpd']:.2f} | {m['gp']['coverage_2sd']:.0%} | "
            f"{m['nearest_neighbour']['rmse']:.2f} | {g['rmse_m_mean']:.2f} ({g['rmse_m_worst']:.2f}) | "
            f"{g['max_error_m_worst']:.2f} | {g['final_error_m_mean']:.2f} | {dr['rmse_m_mean']:.2f} "
            f"({dr['rmse_m_worst']:.2f}) | {dr['max_error_m_mean']:.2f} | {dr['final_error_m_mean']:.2f} | {nn['rmse_m_mean']:.2f} "
            f"({nn['rmse_m_worst']:.2f}) | {fx['rmse_m_mean']:.2f} ({fx['rmse_m_worst']:.2f}) | "
            f"{ind['rmse_m_mean']:.2f} ({ind['rmse_m_worst']:.2f}) | {ind['max_error_m_worst']:.2f} | "
            f"{gl['converged']}/{len(gl['runs'])} | {_f(gl['converged_after_s_median'], '.0f')} | "
            f"{on['rmse_m_mean']:.2f} ({on['rmse_m_worst']:.2f}) | {on['max_error_m_worst']:.2f} | "
            f"{off['rmse_m_mean']:.2f} ({off['rmse_m_worst']:.2f}) "
            f"| {_f(float(np.mean(bias)) if bias else None)} |")
    first = next(iter(sec["sequences"].values()))
    if "cost" in first:
        lines += ["", "Cost of one filter update (motion, bilinear lookup, weights and offsets, estimate, resampling "
                  "when due), one CPU thread:", "", "| particles | median ms | p95 ms |", "|--:|--:|--:|"]
        lines += [f"| {c['particles']} | {c['median_ms']:.3f} | {c['p95_ms']:.3f} |" for c in first["cost"]]
    if "vector" in first:
        v = first["vector"]
        lines += ["", f"Vector map (x, y, z in the room frame) of the same sequences, held-out "
                  f"{next(iter(sec['sequences']))}: map RMSE {v['map']['rmse']:.2f} uT per component, NLPD "
                  f"{v['map']['nlpd']:.2f}, 2 SD {v['map']['coverage_2sd']:.0%}; readings turned into a level body "
                  f"frame by the true heading. Known start: RMSE {v['known_start']['rmse_m_mean']:.2f} m (worst "
                  f"{v['known_start']['rmse_m_worst']:.2f}, max {v['known_start']['max_error_m_worst']:.2f}); global: "
                  f"converged {v['global']['converged']}/{len(v['global']['runs'])}, RMSE "
                  f"{v['global']['rmse_m_mean']:.2f} m."]
    return lines + [""]
