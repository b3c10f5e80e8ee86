"""Simulated recordings unlike the bench's (bench section ``variants``, run only when named).

The calibration section's defaults were chosen on seven recordings; this section asks whether the shipped engine
holds on recordings that none of them resembles. Each variant is a 20 m x 20 m dipole world (the
calibration section's ``sim_world`` generator, its own seed per variant) mapped by a lawnmower and scored on a
loop over the same ground, with one thing changed:

* ``pose_drift``: the track the mapper is given is off by a smooth error, an Ornstein-Uhlenbeck process per axis
  (0.2 m standard deviation, 10 s correlation), the same for neighbouring readings of a pass and another on the
  test pass, as a real localisation's is;
* ``large_drift``: the same, 0.5 m and 20 s;
* ``quiet_sensor_drift``: a 0.05 uT sensor on a track 0.1 m off (the noise that the map sees is almost all pose
  error);
* ``heading_offset``: a 0.1 uT sensor with a 1.2 uT sensor-frame offset, so |B| changes with the heading;
* ``rough_world``: 80 shallow objects (0.3-1 m deep), detail shorter than the lane spacing;
* ``smooth_world``: deep objects (2-5 m), a field smoother than any recording's;
* ``sparse_lanes``: lanes 4 m apart, a 0.1 m track error;
* ``vector_3d``: the world-frame vector with the sensor's height moving +-0.3 m, a 0.1 m track error.

Per variant: the shipped dual SVGP at each M of the calibration section's inducing ladder, whether each larger M
maps no worse than the next smaller one (the same bar as there), and the peers of the calibration section
(nearest neighbour, offline SVGP, exact GP) with RMSE, NLPD, the share within +-2 SD and the std of z. A variant
with a track error also runs the dual SVGP with ``model.position_noise`` set to that error's standard deviation
(learned from there), as a user who knows the localisation's error would set it.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from scipy.spatial.transform import Rotation

from gp_mapping.evaluation import calibration

AREA = (0.0, 0.0, 20.0, 20.0)
RATE = 10.0  # Hz, both passes
#: variant -> what differs from the base world (0.5 uT noise, exact track, |B|, lanes 2 m apart)
VARIANTS: dict[str, dict[str, Any]] = {
    "pose_drift": {"track_error": (0.2, 10.0)},
    "large_drift": {"track_error": (0.5, 20.0)},
    "quiet_sensor_drift": {"noise_ut": 0.05, "track_error": (0.1, 10.0)},
    "heading_offset": {"noise_ut": 0.1, "offset_ut": (1.0, -0.6, 0.4)},
    "rough_world": {"world": {"depth_range": (0.3, 1.0), "n_dipoles": 80}},
    "smooth_world": {"world": {"depth_range": (2.0, 5.0)}},
    "sparse_lanes": {"line_spacing": 4.0, "track_error": (0.1, 10.0)},
    "vector_3d": {"vector": True, "height_amplitude": 0.3, "track_error": (0.1, 10.0)},
}


def track_error(n: int, std: float, correlation_s: float, rng: np.random.Generator, rate: float = RATE,
                axes: int = 2) -> np.ndarray:
    """(n, axes) an error sampled at ``rate`` [Hz] (a horizontal position error at RATE by default): an
    Ornstein-Uhlenbeck process per axis, stationary with standard deviation ``std`` and correlation time
    ``correlation_s`` [s]."""
    out = np.zeros((n, axes))
    if std == 0.0 or n == 0:
        return out
    keep = np.exp(-1.0 / (rate * correlation_s))
    kick = std * np.sqrt(1.0 - keep * keep)
    out[0] = rng.normal(0.0, std, axes)
    for i in range(1, n):
        out[i] = keep * out[i - 1] + rng.normal(0.0, kick, axes)
    return out


def recording(name: str, seed: int, seconds: float = 400.0, batch: int = 50) -> calibration.Recording:
    """Variant ``name`` of VARIANTS: a lawnmower of ``seconds`` streamed, a loop over the same ground (at most
    120 s) held out."""
    from gp_mapping.sim import SensorConfig, TrajectoryConfig, World, WorldConfig, simulate

    spec = VARIANTS[name]
    world = World.from_config(WorldConfig(area=AREA, margin=2.0, **{"n_dipoles": 40, **spec.get("world", {})}),
                              np.random.default_rng(seed))
    sensor = SensorConfig(noise_std=spec.get("noise_ut", 0.5) * 1e-6,
                          bias=tuple(b * 1e-6 for b in spec.get("offset_ut", (0.0, 0.0, 0.0))))
    height = spec.get("height_amplitude", 0.0)
    drive = simulate(world, TrajectoryConfig(patterns=("lawnmower",), area=AREA, inset=1.0, speed=1.0,
                                             duration=seconds, rate=RATE, line_spacing=spec.get("line_spacing", 2.0),
                                             height_amplitude=height), sensor, seed=seed + 1)
    again = simulate(world, TrajectoryConfig(patterns=("loop",), area=AREA, inset=3.0, speed=1.0,
                                             duration=min(120.0, seconds),
                                             rate=RATE, height_amplitude=height), sensor, seed=seed + 2)
    rng = np.random.default_rng(seed + 3)
    dims = 3 if spec.get("vector") or height else 2
    std, correlation_s = spec.get("track_error", (0.0, 1.0))

    def track(r) -> np.ndarray:
        x = r.sensor_position[:, :dims].copy()
        x[:, :2] += track_error(len(x), std, correlation_s, rng)
        return x

    def targets(r) -> np.ndarray:
        if spec.get("vector"):  # the world-frame vector, as the mapper rotates a reading by the sensor's attitude
            return Rotation.from_quat(r.sensor_orientation_xyzw).apply(r.field_sensor_tesla) * 1e6
        return np.linalg.norm(r.field_sensor_tesla, axis=1)[:, None] * 1e6

    return calibration.Recording(name, track(drive), targets(drive), track(again), targets(again), batch, drive.t)


def rung_scores(rec: calibration.Recording, m: int, position_noise: float = 0.0) -> dict[str, float]:
    """The shipped dual SVGP with ``m`` inducing points (and ``position_noise`` [m] where it is above 0) streamed over
    ``rec``: RMSE, NLPD, +-2 SD and z-std on its held-out loop."""
    overrides = {"position_noise": position_noise} if position_noise > 0 else {}
    s = calibration.engine_scores(calibration.shipped(num_inducing=m, **overrides), rec)
    return {key: s[key] for key in ("rmse", "nlpd", "within_2sd", "z_std")}


def run_task(task: tuple[str, str, Any]) -> Any:
    """One stream of the section (run's tasks, calibration.run_tasks): ("rung", variant, (seed, M, position
    noise)) or ("peers", variant, seed). A worker makes each variant's recording once (the plan's
    variants_seconds)."""
    kind, name, arg = task
    seed = arg[0] if kind == "rung" else arg
    plan, _, made = calibration.task_context()
    if (name, seed) not in made:
        made[(name, seed)] = recording(name, seed=seed, seconds=float(plan.get("variants_seconds", 400.0)))
    rec = made[(name, seed)]
    if kind == "rung":
        return rung_scores(rec, arg[1], arg[2])
    if kind == "peers":
        return calibration.peer_scores(rec, calibration.shipped(), plan)
    raise ValueError(f"unknown task {task!r}")


def _task_line(task: tuple[str, str, Any], result: Any) -> str:
    kind, name, arg = task
    if kind == "peers":
        return f"  {name} peers: " + ", ".join(f"{p} {s['rmse']:.3f}" for p, s in result.items())
    _, m, noise = arg
    label = f", position_noise {noise:g}" if noise > 0 else ""
    return (f"  {name} M={m}{label}: RMSE {result['rmse']:.3f} NLPD {result['nlpd']:.3f} +-2 SD "
            f"{result['within_2sd']:.3f}")


def run(plan: dict, log: Callable[[str], None]) -> dict[str, Any]:
    """The section: each variant's ladder (and with position noise where it has a track error) and its peers.
    Every stream is a task of calibration.run_tasks, in ``plan["jobs"]`` worker processes where that is above 1;
    every engine and peer is seeded, so the numbers do not depend on it."""
    names = tuple(plan.get("variants", VARIANTS))
    peers = bool(plan.get("variants_peers", True))
    sizes = [m for _, m in calibration.M_LADDER]
    seeds = {name: 100 * (k + 1) for k, name in enumerate(names)}  # each variant's own world and drive
    noises = {name: _position_noises(name, bool(plan.get("variants_position_noise", True))) for name in names}
    tasks: list[tuple[str, str, Any]] = []
    for name in names:
        tasks += [("rung", name, (seeds[name], m, noise)) for noise in noises[name] for m in sizes]
        tasks += [("peers", name, seeds[name])] if peers else []
    done = calibration.run_tasks(tasks, plan, None, int(plan.get("jobs", 1)), log, runner=run_task,
                                 describe=_task_line)
    out: dict[str, Any] = {"variants": {}}
    for name in names:
        streamed, held_out = _sizes(name, seeds[name], float(plan.get("variants_seconds", 400.0)))
        row: dict[str, Any] = {"streamed": streamed, "held_out": held_out}
        for noise in noises[name]:
            rungs = {str(m): done[("rung", name, (seeds[name], m, noise))] for m in sizes}
            holds = calibration.larger_m_holds(list(rungs.values()))
            if noise == 0.0:
                row["dual_svgp"], row["ladder_holds"] = rungs, holds
            else:
                row["position_noise"] = {"track_error_sd": noise, **rungs, "ladder_holds": holds}
        if peers:
            row["peers"] = done[("peers", name, seeds[name])]
        out["variants"][name] = row
    return out


def _position_noises(name: str, with_known_error: bool) -> list[float]:
    """The position noises [m] a variant's ladder runs with: 0 (the shipped engine) and, for a variant with a track
    error, that error's standard deviation (as a user who knows it would set model.position_noise)."""
    error_sd = VARIANTS[name].get("track_error", (0.0, 1.0))[0]
    return [0.0] + ([error_sd] if error_sd > 0 and with_known_error else [])


def _sizes(name: str, seed: int, seconds: float) -> tuple[int, int]:
    """Readings streamed and held out of a variant's recording."""
    rec = recording(name, seed=seed, seconds=seconds)
    return len(rec.x), len(rec.x_test)


def _ladder_cells(rungs: dict[str, dict[str, float]], sizes: list[str], holds: bool) -> str:
    """A ladder's table cells: RMSE, NLPD, +-2 SD and z-std at each M of ``sizes``, then whether it holds."""
    def joined(key: str, fmt: str) -> str:
        return " / ".join(format(rungs[m][key], fmt) for m in sizes)

    return (f"{joined('rmse', '.3f')} | {joined('nlpd', '.3f')} | {joined('within_2sd', '.3f')} | "
            f"{joined('z_std', '.2f')} | {'yes' if holds else 'no'}")


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Variants: simulated recordings unlike the bench's", "",
             "The shipped dual SVGP at each M of the calibration section's ladder on simulated worlds that differ "
             "from every bench recording (gp_mapping/evaluation/variants.py says how); a lawnmower streamed, a loop "
             "over the same ground held out. Larger M ok: each larger M within "
             f"{100 * (calibration.M_RMSE_RATIO - 1):.0f} % RMSE and {calibration.M_NLPD_GAP} nats NLPD of the next "
             "smaller one.", ""]
    if "skipped" in sec or "error" in sec:
        return lines + [f"Skipped: {sec['skipped']}" if "skipped" in sec else f"Failed: {sec['error']}", ""]
    sizes = list(next(iter(sec["variants"].values()))["dual_svgp"])
    lines += ["| variant | RMSE at M = " + " / ".join(sizes) + " | NLPD | +-2 SD | z-std | larger M ok | "
              "nearest neighbour | offline SVGP RMSE / NLPD | exact GP RMSE / NLPD |",
              "|:---|---:|---:|---:|---:|:---:|---:|---:|---:|"]
    for name, row in sec["variants"].items():
        p = row.get("peers", {})

        def peer(method: str) -> str:
            return f"{p[method]['rmse']:.3f} / {p[method]['nlpd']:.3f}" if method in p else "-"

        nn = f"{p['nearest_neighbour']['rmse']:.3f}" if "nearest_neighbour" in p else "-"
        lines.append(f"| {name} | {_ladder_cells(row['dual_svgp'], sizes, row['ladder_holds'])} | {nn} | "
                     f"{peer('offline_svgp')} | {peer('exact_gp')} |")
    known = {name: row["position_noise"] for name, row in sec["variants"].items() if "position_noise" in row}
    if known:
        lines += ["", "With `model.position_noise` set to the world's track error (learned from there; "
                  "docs/calibration.md, Position noise):", "",
                  "| variant | position noise [m] | RMSE at M = " + " / ".join(sizes) + " | NLPD | +-2 SD | z-std | "
                  "larger M ok |", "|:---|---:|---:|---:|---:|---:|:---:|"]
        for name, k in known.items():
            lines.append(f"| {name} | {k['track_error_sd']:g} | {_ladder_cells(k, sizes, k['ladder_holds'])} |")
    return lines + [""]
