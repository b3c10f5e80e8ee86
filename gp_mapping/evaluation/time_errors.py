"""Errors that neighbouring readings share: what the marginal likelihood learns with and without them (bench
section ``time_errors``, run when named).

A reading is taken where the localisation says the sensor was, rotated into the map by the attitude it states,
by a sensor whose bias drifts. None of those errors is independent from one reading to the next: a track's
error, an attitude's and a drift are the same for readings a second apart. The GP's likelihood treats every
reading's error as independent. On dense readings it then fits what a pass's own error puts into its readings
as field detail (short lengthscales and a small noise), and the more readings of the same passes it is given,
the surer it is of that detail (docs/calibration.md, "Errors that neighbouring readings share").

This section measures that on every recording of the calibration section (:data:`calibration.RECORDINGS`). For
each one it fits the exact GP (GPyTorch, the marginal likelihood, a seeded subsample of ``time_errors_points``
streamed readings) twice, with the same field kernel (``model.kernel`` and ``model.lengthscales``, one scale):

* ``white noise``: y = f(x) + noise, the model every engine learns under;
* ``error in time``: y = f(x) + e(t) + noise, with e(t) an Ornstein-Uhlenbeck process in the reading's time
  (:class:`~gp_mapping.evaluation.baselines.ExactGPBaseline` with ``time_error``), its variance and timescale
  learned with the rest. Passes of a recording are far apart in time (calibration.PASS_GAP), so their errors
  are independent.

Both are scored on the held-out readings as the calibration section scores them (a held-out reading's
variance: latent + noise + e's variance), and the section reports the hyperparameters each learned: if the
lengthscales grow and the map improves when e(t) is there, the recording has errors that its neighbours share,
and an engine that learns under white noise fits them as field.

Then the shipped ``dual_svgp`` streams each recording as the calibration section streams it (stamps given), with
white noise alone (``model.time_error: false``, the engine before 2026-12-02) and as shipped, with its own e(t), at
M = 128 / 256 / 512 (:data:`ENGINE_RUNS`): what the engine's e(t) learns and maps.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from gp_mapping.evaluation import calibration
from gp_mapping.evaluation.baselines import ExactGPBaseline, KernelSpec

MODELS = {"white noise": False, "error in time": True}
#: the engine's runs: label -> overrides of the shipped model section
ENGINE_RUNS = {"white noise": {"time_error": False}, **{f"time_error, M = {m}": {"num_inducing": m}
                                                        for m in (128, 256, 512)}}


def run(plan: dict, root, log: Callable[[str], None]) -> dict[str, Any]:
    names = tuple(plan.get("time_errors_recordings", calibration.RECORDINGS))
    points, iterations = int(plan.get("time_errors_points", 1500)), int(plan.get("time_errors_iterations", 100))
    spec = KernelSpec.from_model_config(calibration.shipped())
    out: dict[str, Any] = {"points": points, "iterations": iterations, "kernel": spec.kernel,
                           "lengthscales": spec.lengthscales, "recordings": {}}
    for name in names:
        try:
            rec = calibration.load(name, root, plan)
        except Exception as err:  # a missing recording skips its row, with the reason
            log(f"  {name}: skipped ({err})")
            continue
        row: dict[str, Any] = {"num_train": len(rec.x), "num_test": len(rec.x_test), "models": {}}
        for label, time_error in MODELS.items():
            start = time.perf_counter()
            gp = ExactGPBaseline(spec, max_points=points, iterations=iterations, seed=0,
                                 time_error=time_error).fit(rec.x, rec.y, rec.t)
            s = calibration.scores(*gp.predict_reading(rec.x_test), rec.y_test)
            row["models"][label] = {**{k: s[k] for k in ("rmse", "nlpd", "within_2sd", "z_std")},
                                    "hyperparameters": gp.hyperparameters(), "seconds": time.perf_counter() - start}
            log(f"  {name}, {label}: RMSE {s['rmse']:.3f}, NLPD {s['nlpd']:.3f}, +-2 SD {s['within_2sd']:.3f}")
        row["engine"] = {}
        for label in plan.get("time_errors_engine_runs", ENGINE_RUNS):
            overrides = ENGINE_RUNS[label]
            s = calibration.engine_scores(calibration.shipped(**overrides), rec, keep_model=True)
            model = s.pop("model")
            row["engine"][label] = {**{k: s[k] for k in ("rmse", "nlpd", "within_2sd", "z_std", "stream_seconds")},
                                    "noise": engine_noise(model)}
            log(f"  {name}, dual_svgp {label}: RMSE {s['rmse']:.3f}, NLPD {s['nlpd']:.3f}, "
                f"+-2 SD {s['within_2sd']:.3f}")
        out["recordings"][name] = row
    return out


def engine_noise(model) -> dict[str, list[float]]:
    """A dual_svgp map's (or its tiles') learned noise in the targets' units: the white part, and with
    model.time_error e's variance and timescale [s]."""
    engine = getattr(model, "prior", model)  # tiles share the prior engine's likelihood, in the tiles' unit
    unit = (model.scale_std if hasattr(model, "scale_std") else engine.y_std).detach() ** 2
    lik = engine.likelihood
    out = {"white": (lik.white_variance.detach() * unit).tolist()}
    if hasattr(lik, "time_error"):
        out["error_variance"] = (lik.time_error.variance.detach() * unit).tolist()
        out["error_timescale"] = lik.time_error.timescale.detach().tolist()
    return out


def _lengthscales(hyper: list[dict[str, Any]]) -> str:
    """The learned lengthscales of each output, 'horizontal/height' where they differ."""
    return "; ".join("/".join(f"{v:.2f}" for v in dict.fromkeys(h["lengthscale"])) for h in hyper)


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["## Errors that neighbouring readings share (`time_errors`)", ""]
    if "skipped" in sec or "error" in sec:
        return lines + [f"Skipped: {sec['skipped']}" if "skipped" in sec else f"Failed: {sec['error']}", ""]
    lines += [f"The exact GP (marginal likelihood, {sec['points']} streamed readings, {sec['iterations']} Adam steps, "
              f"{sec['kernel']} with {sec['lengthscales']} lengthscales, one scale) under white noise, and with an "
              "error e(t) in the reading's time (an Ornstein-Uhlenbeck process) that neighbouring readings share. "
              "Scored on the calibration section's held-out readings (variance: latent + noise + e's). Lengthscales "
              "[m] per output (horizontal/height); noise and e's variance in the targets' units squared; e's "
              "timescale [s].", "",
              "| recording | model | RMSE | NLPD | +-2 SD | z-std | lengthscales | noise | e variance | e timescale |",
              "|:---|:---|---:|---:|---:|---:|:---|:---|:---|:---|"]
    for name, row in sec["recordings"].items():
        for label, m in row["models"].items():
            h = m["hyperparameters"]
            noise = ", ".join(f"{x['noise_variance']:.3g}" for x in h)
            var = ", ".join(f"{x['error_variance']:.3g}" for x in h) if "error_variance" in h[0] else "-"
            scale = ", ".join(f"{x['error_timescale']:.2g}" for x in h) if "error_timescale" in h[0] else "-"
            lines.append(f"| {name} | {label} | {m['rmse']:.3f} | {m['nlpd']:.3f} | {m['within_2sd']:.3f} | "
                         f"{m['z_std']:.2f} | {_lengthscales(h)} | {noise} | {var} | {scale} |")
    lines += ["", "The shipped `dual_svgp`, streamed as the calibration section streams (stamps given), with white "
              "noise alone (`model.time_error: false`) and as shipped (`model.time_error`) at M = 128 / 256 / 512: "
              "its learned white noise, e's variance (targets' units "
              "squared) and timescale [s].", "",
              "| recording | dual_svgp | RMSE | NLPD | +-2 SD | z-std | white noise | e variance | e timescale |",
              "|:---|:---|---:|---:|---:|---:|:---|:---|:---|"]
    for name, row in sec["recordings"].items():
        for label, m in row.get("engine", {}).items():
            n = m["noise"]
            cells = [", ".join(f"{v:.3g}" for v in n[k]) if k in n else "-"
                     for k in ("white", "error_variance", "error_timescale")]
            lines.append(f"| {name} | {label} | {m['rmse']:.3f} | {m['nlpd']:.3f} | {m['within_2sd']:.3f} | "
                         f"{m['z_std']:.2f} | " + " | ".join(cells) + " |")
    return lines + [""]


__all__ = ["ENGINE_RUNS", "MODELS", "engine_noise", "markdown", "run"]
