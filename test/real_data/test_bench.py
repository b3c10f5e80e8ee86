"""Smoke test of the benchmark harness: `gp-mapping bench --quick` end to end, output structure, finite ratios.

The harness runs once per module (in a child process, one torch thread, about two minutes on two cores);
the accuracy checks skip when the Solin 2018 recording is absent (the harness then records the section as
skipped with the reason, which is checked instead).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from support.paths import REPO_ROOT, SHARED_DATA, shared_data

pytest.importorskip("gpytorch")
pytestmark = pytest.mark.slow

SECTIONS = ("accuracy", "calibration", "speed", "growth", "cuda", "large", "explore", "merge", "forgetting")
STREAMING = ("dual_svgp_full", "dual_svgp_fast", "dual_svgp_fast_only", "bui2017_osgpr", "nearest_neighbour",
             "constant_mean")
OFFLINE = ("offline_svgp", "exact_gp")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "gp_mapping.cli", "bench", "--quick", "--jobs", "2",
                           "--out", str(out)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "json": json.loads((out / "bench.json").read_text()), "md": (out / "bench.md").read_text(),
            "stdout": proc.stdout}


def _ratios(node, path=""):
    """Every value stored under a key that names a ratio, anywhere in the JSON (lists included)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if "ratio" in k.split("_") and not isinstance(v, (dict,)):  # "calibration_*" names no ratio
                yield f"{path}/{k}", v
            else:
                yield from _ratios(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _ratios(v, f"{path}[{i}]")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_quick_bench_writes_every_section_and_finite_ratios(quick_run):
    res = quick_run["json"]
    assert res["quick"] is True
    assert set(res["sections"]) == set(SECTIONS)
    for name, section in res["sections"].items():
        assert "error" not in section, f"section {name} failed: {section.get('error')}"
    for key in ("date", "cpu", "torch", "torch_threads"):
        assert res["machine"][key]
    ratios = list(_ratios(res))
    assert len(ratios) >= 5
    for path, value in ratios:
        values = value if isinstance(value, list) else [value]
        assert values and all(_finite(v) and v > 0 for v in values), f"{path} holds a non-finite ratio: {value}"
    md = quick_run["md"]
    for heading in ("## Speed", "## Cost as the stream grows", "## CUDA", "## Large area", "## Merging maps"):
        assert heading in md
    assert (quick_run["out"] / "growth.png").stat().st_size > 1000


def test_quick_bench_speed_growth_and_cuda_sections(quick_run):
    sec = quick_run["json"]["sections"]
    eng = sec["speed"]["engine"]
    modes = {r["mode"] for r in eng["updates"]}
    assert modes == {"full", "full after warm-up", "fast"}
    for r in eng["updates"]:
        assert r["median_ms"] > 0 and r["p95_ms"] >= r["median_ms"] and r["reps"] >= 3
    assert eng["grids"] and all(g["median_ms"] > 0 and g["cells"] == g["grid"] ** 2 for g in eng["grids"])
    for r in sec["speed"]["replay"]:
        assert r["real_time_factor"] > 0 and r["updates"] > 0 and r["samples"] > 0
    g = sec["growth"]
    assert g["samples"] == int(g["duration_s"] * g["rate_hz"])
    # One RSS and state reading every sample_every samples and at the end; one latency per model update.
    assert g["memory"]["samples"][-1] == g["samples"]
    assert len(g["updates"]["ms"]) == len(g["updates"]["num_seen"]) > 10
    assert g["updates"]["num_seen"][-1] <= g["samples"]
    assert all(b > 0 for b in g["memory"]["rss_bytes"]) and all(b > 0 for b in g["memory"]["state_bytes"])
    import torch

    cuda = sec["cuda"]
    if torch.cuda.is_available():
        assert cuda["updates"] and cuda["device"] == "cuda"
    else:
        assert "CUDA" in cuda["skipped"] or "cuda" in cuda["skipped"]


def test_quick_bench_large_section(quick_run):
    """Tiled and untiled maps of the simulated drive against the exact GP and nearest neighbour; the quick world
    is small, so only the structure and sanity are checked (the full run's numbers are in README)."""
    e = quick_run["json"]["sections"]["large"]["2d"]
    assert e["samples"] == int(quick_run["json"]["plan"]["large_seconds"] * e["rate_hz"])
    assert e["tiled"]["tiles"] > 1 and e["untiled"]["tiles"] == 1
    for name in ("tiled", "untiled", "exact_gp", "nearest_neighbour"):
        assert _finite(e[name]["rmse"]) and 0 < e[name]["rmse"] < 10.0, (name, e[name]["rmse"])
    t = e["tiled"]
    assert len(t["curve"]["ms"]) == t["updates"] > 5 and t["grid"]["known_cells"] > 0
    assert t["memory"]["samples"][-1] == e["samples"] and max(t["memory"]["tiles"]) == t["tiles"]
    # calibration of held-out readings (issue 37): every map and the exact GP, with its reliability curve
    for name in ("tiled", "shipped", "untiled", "exact_gp"):
        s = e[name]["reading_scores"]
        assert _finite(s["nlpd"]) and _finite(s["z_std"]) and s["z_std"] > 0, (name, s)
        assert 0.0 <= s["within_1sd"] <= s["within_2sd"] <= 1.0, (name, s)
        curve = list(s["reliability"].values())
        assert len(curve) == 10 and curve == sorted(curve), (name, curve)
    # the readings differ from the truth by the sensor's noise only (0.1 uT per axis)
    assert abs(e["shipped"]["reading_scores"]["rmse"] - e["shipped"]["rmse"]) < 0.1
    assert "within +-2 SD" in quick_run["md"] and (quick_run["out"] / "large_2d.png").stat().st_size > 1000


def test_quick_bench_accuracy_protocols(quick_run):
    acc = quick_run["json"]["sections"]["accuracy"]
    if not SHARED_DATA.joinpath("solin2018_invensense").exists():
        assert "absent" in acc["skipped"] or "unavailable" in acc["skipped"]
    shared_data("solin2018_invensense")
    from gp_mapping.gp import ENGINES

    expected = STREAMING + OFFLINE + (("continual_mogp",) if "continual_mogp" in ENGINES else ())
    for key, n_batches in (("protocol1", quick_run["json"]["plan"]["p1_batches"]), ("protocol2", None)):
        p = acc[key]
        assert set(expected) <= set(p["methods"]), sorted(p["methods"])
        for name in STREAMING:
            c = p["methods"][name]["curve"]
            assert len(c["rmse"]) == len(c["rmse_ratio"]) == len(c["num_seen"]) >= 2
            assert c["num_seen"][-1] == p["num_train"]
            assert all(_finite(v) and v > 0 for v in c["rmse"])
            if name != "nearest_neighbour":
                assert all(_finite(v) for v in c["nlpd"]), (name, c["nlpd"])
                # every accuracy figure with its calibration (issue 37): coverage of held-out readings, std of z
                assert all(0.0 <= a <= b <= 1.0 for a, b in zip(c["within_1sd"], c["within_2sd"])), name
                assert all(_finite(v) and v > 0 for v in c["z_std"]), (name, c["z_std"])
            else:  # a mean alone states no variance
                assert c["nlpd"][-1] is None and c["within_2sd"][-1] is None
        if n_batches:
            assert p["num_batches"] == n_batches
            assert p["methods"]["dual_svgp_full"]["curve"]["batch"] == list(range(1, n_batches + 1))
        off = p["methods"]["offline_svgp"]
        assert off["rmse_ratio"] == pytest.approx(1.0) and off["nlpd_gap"] == pytest.approx(0.0)
        assert 0.0 < off["within_2sd"] <= 1.0 and _finite(off["z_std"])
        assert p["grid_prediction"]["dual_svgp_full"]["median_ms"] > 0
        assert (quick_run["out"] / f"{key}.png").stat().st_size > 1000
    # Real data, real result: on protocol 2 the gold standard beats the constant-mean floor by a wide margin.
    p2 = acc["protocol2"]["methods"]
    assert p2["offline_svgp"]["rmse"] < 0.5 * p2["constant_mean"]["final_rmse"]
    assert "## Accuracy" in quick_run["md"] and "Protocol 2" in quick_run["md"]


def test_bench_runs_without_the_source_tree(tmp_path, monkeypatch, capsys):
    """An installed package (no bench/, config/, bags/ beside it): the results go to ./bench-results, the shipped
    config is the installed copy or the defaults it equals, and the command runs."""
    import argparse
    import dataclasses

    from gp_mapping import bench_cli
    from gp_mapping.config import MapperConfig, load_config
    from gp_mapping.evaluation import common, speed

    monkeypatch.setattr(common, "SOURCE_ROOT", None)
    monkeypatch.setattr(common.sys, "prefix", str(tmp_path))  # no installed share/gp_mapping either
    monkeypatch.chdir(tmp_path)
    assert common.default_results_dir() == tmp_path / "bench-results"
    assert common.shipped_config_path() is None
    assert speed.shipped_config() == dataclasses.replace(MapperConfig(), model=dataclasses.replace(
        MapperConfig().model, device="cpu"))
    assert load_config(REPO_ROOT / "config" / "mapper.yaml") == MapperConfig()  # what the fallback relies on
    parser = argparse.ArgumentParser(prog="gp-mapping bench")
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--only", "cuda", "--data", str(tmp_path), "--out", str(tmp_path / "out")])
    assert args.data == tmp_path
    assert bench_cli.run(args) == 0
    res = json.loads((tmp_path / "out" / "cuda.json").read_text())  # a partial run keeps bench.json intact
    assert set(res["sections"]) == {"cuda"} and not (tmp_path / "out" / "bench.json").exists()


def test_quick_bench_explore_section(quick_run):
    """The exploration row: every message fed, maps published, memory sampled, the summary's goals evaluated."""
    e = quick_run["json"]["sections"]["explore"]
    plan = quick_run["json"]["plan"]
    assert e["samples"] == int(plan["explore_seconds"] * plan["explore_rate"])
    assert e["num_seen"] > 0.9 * e["samples"] and e["updates"] > 0
    s = e["summary"]
    assert s["maps"] > 0 and 0 < s["map_rate_hz_mean"] <= 1.0 / e["publish_period_s"] + 1e-9
    assert _finite(s["rss_ratio"]) and set(s["pass"]) == {"maps_at_least_0.5_hz", "rss_flat", "at_most_one_batch_behind"}
    compared = e["maps"]["compared"]  # maps drawn again whole: the incremental ones are the same maps
    assert compared["maps"] > 0 and compared["max_mean_diff"] < 1e-6 and compared["max_var_diff_relative"] < 1e-6
    assert "Long exploration" in quick_run["md"] and "drawn again whole" in quick_run["md"]


def test_quick_bench_merge_section(quick_run):
    """Two robots' maps merged against one mapper, and merge times for 1..K sources (the quick world is tiny:
    structure and sanity only; the full run's numbers are in README)."""
    sec = quick_run["json"]["sections"]["merge"]
    h = sec["halves"]
    assert all(_finite(h[k]) and h[k] > 0 for k in ("merged_rmse", "single_rmse", "ratio", "merge_seconds"))
    assert h["global_m"] > 0
    counts = [r["sources"] for r in sec["timing"]]
    assert counts == list(quick_run["json"]["plan"]["merge_sources"])
    assert all(r["closed_form_seconds"] > 0 and r["learned_seconds"] > 0 and _finite(r["rmse_covered"])
               for r in sec["timing"])
    assert "## Merging maps" in quick_run["md"]
    # A building in two sessions, merged tile by tile: the merged map is about the map of the whole drive (quick
    # world: 0.553-0.560 against 0.554 uT when written) and far better than either session (1.29, 1.52).
    ss = sec["sessions"]
    for key in ("closed_form", "learned"):
        assert ss[key]["tiles"] == ss["whole"]["tiles"] and ss[key]["rmse"] <= 1.2 * ss["whole"]["rmse"]
        assert ss[key]["rmse"] < 0.7 * min(ss["first"]["rmse"], ss["second"]["rmse"])
    # every map's readings scored with their variance too (the merged maps' included)
    for key in ("whole", "first", "second", "closed_form", "learned"):
        assert _finite(ss[key]["nlpd"]) and 0.0 < ss[key]["within_2sd"] <= 1.0 and ss[key]["z_std"] > 0, key
    assert "A building in two sessions" in quick_run["md"]
    so = sec["solin_sessions"]  # a real room in two sessions (the quick plan's first 30 s of each sequence)
    if "skipped" not in so:
        keys = ("all", "first", "second", "tiled_closed_form", "tiled_learned", "engine_closed_form", "engine_learned")
        assert all(_finite(so[k]["rmse"]) and so[k]["rmse"] > 0 for k in keys)
        assert all(_finite(so[k]["nlpd"]) and 0.0 < so[k]["within_2sd"] <= 1.0 for k in keys)
        assert so["tiled_closed_form"]["m"] <= so["engine_closed_form"]["m"]
        # sequences 3-4 read 5 uT higher, merged levelled and as they are (the quick cut's sessions may share too
        # little ground for the offset to be measured: it is then 0 and the two merges are one)
        levelled, flat = so["offset_levelled"], so["offset_as_they_are"]
        assert all(_finite(r[k]) for r in (levelled, flat) for k in ("rmse", "nlpd")) and flat["offset"] is None
        assert _finite(levelled["offset"]) and levelled["rmse"] <= flat["rmse"] + 1e-9
        assert "read 5 uT higher" in quick_run["md"]
        assert "A real room in two sessions" in quick_run["md"]


def test_quick_bench_forgetting_section(quick_run):
    """var_gp's section: the forgetting curve near the first batch's path (when the recording is there) and the
    drive that keeps opening and distilling blocks (the quick world is small: structure and sanity only)."""
    sec = quick_run["json"]["sections"]["forgetting"]
    d = sec["drive"]
    assert d["blocks_opened"] > 1 and d["distillations"] >= 1 and d["blocks"] >= 2
    assert d["updates"] > 5 and _finite(d["rmse"]) and 0 < d["rmse"] < 10.0 and _finite(d["latency_ratio"])
    assert "## Forgetting" in quick_run["md"]
    c = sec["curve"]
    if not SHARED_DATA.joinpath("solin2018_invensense").exists():
        assert "skipped" in c
        return
    n = quick_run["json"]["plan"]["p1_batches"]
    assert {"var_gp", "dual_svgp_full", "bui2017_osgpr"} <= set(c["methods"]) and c["test_points"] > 0
    for name, r in c["methods"].items():
        assert r["curve"]["batch"] == list(range(1, n + 1)), name
        assert all(_finite(v) and v > 0 for v in r["curve"]["rmse_first_region"]), name
        assert _finite(r["forgetting"]) and _finite(r["final_rmse_all"]), name
    assert (quick_run["out"] / "forgetting.png").stat().st_size > 1000


def test_merged_report_says_when_each_section_was_measured(tmp_path):
    from gp_mapping.evaluation import harness

    def run(date, sections):
        path = tmp_path / f"{date}.json"
        path.write_text(json.dumps({"quick": False, "machine": {"date": date}, "plan": {}, "total_seconds": 1.0,
                                    "sections": sections, "plots": []}))
        return path

    first = run("2026-01-01T10:00", {"speed": {"a": 1}, "growth": {"b": 1}})
    second = run("2026-01-02T10:00", {"speed": {"a": 2}})
    merged = harness.merge([first, second])
    assert merged["sections"]["speed"] == {"a": 2} and merged["sections"]["growth"] == {"b": 1}
    assert merged["section_dates"] == {"speed": "2026-01-02T10:00", "growth": "2026-01-01T10:00"}
    third = run("2026-01-03T10:00", {"large": {}})
    again = tmp_path / "merged.json"
    again.write_text(json.dumps(merged))
    assert harness.merge([again, third])["section_dates"]["growth"] == "2026-01-01T10:00"  # kept through a re-merge


def test_quick_bench_calibration_section(quick_run):
    # The calibration section scores a reading's predictive distribution: coverage within +-1 / +-2 SD, z-std,
    # a reliability curve, the uncalibrated columns and the peers, and the defaults table judged by the worst case.
    sec = quick_run["json"]["sections"]["calibration"]
    if "skipped" in sec:
        pytest.skip(sec["skipped"])
    assert quick_run["json"]["plan"]["jobs"] == 2  # its streams ran in two worker processes (--jobs 2)
    row = sec["recordings"]["solin_p1"]
    s = row["engines"]["dual_svgp"]
    for key in ("rmse", "nlpd", "within_1sd", "within_2sd", "z_std"):
        assert math.isfinite(s[key])
    assert 0.0 <= s["within_1sd"] <= s["within_2sd"] <= 1.0
    levels = [float(k) for k in s["reliability"]]
    assert levels == sorted(levels) and len(levels) == 10
    assert set(row["peers"]) == {"nearest_neighbour", "offline_svgp", "exact_gp"}
    assert s["nlpd"] < s["uncalibrated"]["nlpd"]  # the calibration helps on protocol 1 (2.5x overconfident raw)
    d = sec["defaults"]
    assert set(d) == {"shipped", "no calibration"}
    assert d["shipped"]["worst_nlpd_gap"] == max(v["nlpd_gap"] for v in d["shipped"]["per_recording"].values())
    assert (quick_run["out"] / "calibration_solin_p1.png").exists()
    # the shipped engine at another batch size too: its own run first, the range spans every run
    b = row["batching"]
    assert list(b["runs"])[0] == str(math.ceil(row["num_train"] / 20)) and len(b["runs"]) == 2
    assert b["runs"][list(b["runs"])[0]]["rmse"] == s["rmse"]
    assert b["rmse_range"] == [min(r["rmse"] for r in b["runs"].values()), max(r["rmse"] for r in b["runs"].values())]
    assert "other batch sizes" in quick_run["md"]


def test_the_memory_section_is_opt_in_and_reports_the_resident_memory_of_a_random_walk():
    """The memory section (issue 38: a 30-minute random walk in a bounded area, resident memory every simulated
    minute, last / middle decile within 5 %) runs only when named, and on a tiny plan reports every sample."""
    from gp_mapping.evaluation import harness, memory

    assert "memory" in harness.OPTIONAL_SECTIONS and "memory" not in harness.SECTIONS
    plan = dict(harness.QUICK, memory_seconds=40.0, memory_rate=10.0, memory_area=4.0, memory_sample_seconds=4.0)
    out = memory.run(plan, lambda message: None)
    series, summary = out["series"], out["summary"]
    assert out["samples"] == 400 and len(series["t_s"]) == 11  # every 4 s from 0, and the end
    assert all(r > 0 for r in series["rss_bytes"]) and series["tiles"][-1] >= 1
    assert summary["rss_ratio"] == summary["rss_bytes"]["ratio"] and _finite(summary["rss_ratio"])
    assert summary["level"] == (summary["rss_ratio"] <= memory.LEVEL_RATIO)
    assert out["updates"] > 0 and out["model_summaries"] > 0
    assert "last / middle decile" in "\n".join(memory.markdown(out))
