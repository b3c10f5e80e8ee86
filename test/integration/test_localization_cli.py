"""``gp-mapping localize``: a map of a simulated survey, a second drive in the same world with drifting odometry
(``gp-mapping demo-bag --drive-seed --odometry-drift``), and the command's files; bad input ends with one line
and exit status 1, as ``replay``."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from gp_mapping import cli
from gp_mapping.localization.cli import POSES_HEADER
from gp_mapping.mapping.state import read_state, write_state
from gp_mapping.sim.demo_bag import load_ground_truth
from support.localization import AREA, SEED, survey_map

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The map (a lawnmower survey of the world of seed 3 through a Mapper, saved) and the second drive's bag."""
    root = tmp_path_factory.mktemp("localize")
    state = survey_map(root)
    drive = root / "drive"
    assert cli.main(["demo-bag", str(drive), "--seed", SEED, "--drive-seed", "8", "--duration", "40",
                     "--patterns", "random_walk", "--odometry-drift", "0.04", "1.0", "--spike-rate", "0",
                     *AREA]) == 0
    return {"root": root, "state": state, "drive": drive}


def _localize(demo, out, *extra):
    return cli.main(["localize", str(demo["drive"]), "--map", str(demo["state"]), "--out", str(out), *extra])


def test_the_drive_bag_has_drifting_odometry_in_the_odom_frame(demo):
    gt = load_ground_truth(demo["drive"])
    odom = gt.odometry_position
    assert np.allclose(odom[0, :2], 0.0)  # the odom frame starts where the robot starts
    # carried into the map frame from the true start, the odometry drifts away from the truth
    from gp_mapping.localization.motion import compose, inverse
    from gp_mapping.mapping.frames import yaw_of

    truth = np.column_stack([gt.position[:, :2], yaw_of(gt.orientation_xyzw)])
    odo = np.column_stack([odom[:, :2], yaw_of(gt.odometry_orientation_xyzw)])
    dr = compose(compose(truth[0], inverse(odo[0])), odo)
    drift = np.hypot(*(dr[:, :2] - truth[:, :2]).T)
    assert drift[-1] > 0.5 and drift[:10].max() < 0.05


def test_localize_writes_poses_summary_and_figure(demo, capsys):
    out = demo["root"] / "out"
    assert _localize(demo, out, "--ground-truth", "/pose", "--particles", "500") == 0
    printed = capsys.readouterr()
    assert "RMSE" in printed.out and "wrote" in printed.out and "Traceback" not in printed.err
    with open(out / "poses.csv") as fh:
        rows = list(csv.reader(fh))
    assert tuple(rows[0]) == POSES_HEADER == ("stamp", "x", "y", "yaw", "sd_x", "sd_y", "sd_yaw")
    data = np.array(rows[1:], dtype=float)
    summary = json.loads((out / "summary.json").read_text())
    assert data.shape == (summary["updates"], 7) and summary["updates"] > 50
    assert np.all(np.diff(data[:, 0]) > 0) and np.all(data[:, 4:] >= 0) and np.all(np.abs(data[:, 3]) <= np.pi)
    # scored against the ground truth: the filter beats the drifting odometry by far
    assert summary["rmse_m"] < 0.3 and summary["final_error_m"] < 0.5
    assert summary["dead_reckoning_rmse_m"] > 2 * summary["rmse_m"]
    assert summary["converged_after_s"] is not None and summary["particles"] == 500
    assert summary["map_frame"] == "map" and summary["field_unit"] == "microtesla" and len(summary["bias"]) == 1
    assert sum(summary["rejected"].values()) <= 2  # a reading or two at the ends without odometry around it
    assert (out / "localization.png").stat().st_size > 10_000
    # the numbers are the poses': the RMSE recomputed from poses.csv and the ground truth
    gt = load_ground_truth(demo["drive"])
    stamps = gt.stamp_ns * 1e-9
    err = np.hypot(data[:, 1] - np.interp(data[:, 0], stamps, gt.position[:, 0]),
                   data[:, 2] - np.interp(data[:, 0], stamps, gt.position[:, 1]))
    assert np.sqrt(np.mean(err ** 2)) == pytest.approx(summary["rmse_m"], rel=1e-3)


def test_initial_pose_global_and_a_config_file(demo, tmp_path):
    gt = load_ground_truth(demo["drive"])
    from gp_mapping.mapping.frames import yaw_of

    x, y = gt.position[0, :2]
    yaw = float(yaw_of(gt.orientation_xyzw[0]))
    cfg = tmp_path / "loc.yaml"
    cfg.write_text("/**:\n  ros__parameters:\n    localizer:\n      num_particles: 300\n      seed: 4\n")
    out = tmp_path / "pose"
    assert _localize(demo, out, "--config", str(cfg), "--initial-pose", str(x), str(y), str(yaw),
                     "--ground-truth", "/pose") == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["particles"] == 300 and s["config"]["seed"] == 4 and s["rmse_m"] < 0.3
    out = tmp_path / "global"
    assert _localize(demo, out, "--global", "--particles", "300") == 0  # no ground truth: no score, still files
    s = json.loads((out / "summary.json").read_text())
    assert "rmse_m" not in s and s["updates"] > 50 and (out / "poses.csv").is_file()


def test_bad_input_ends_with_one_line_and_status_1(demo, tmp_path, capsys):
    other_frame = tmp_path / "world.safetensors"
    state = read_state(demo["state"])
    state.config["grid"]["frame_id"] = "world"
    write_state(other_frame, state)
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("localizer:\n  num_particles: 0\n")
    deep_cfg = tmp_path / "deep.yaml"
    deep_cfg.write_text("[" * 100_000)
    not_a_bag = tmp_path / "x.bag"
    not_a_bag.write_bytes(b"nonsense")
    drive, state_path = str(demo["drive"]), str(demo["state"])
    cases = [
        (["localize", drive, "--map", str(tmp_path / "none.safetensors")], "does not exist"),
        (["localize", str(tmp_path / "nobag"), "--map", state_path], "does not exist"),
        (["localize", str(not_a_bag), "--map", state_path], "not a readable"),
        (["localize", drive, "--map", str(not_a_bag)], "cannot load the map"),
        (["localize", drive, "--map", str(other_frame), "--ground-truth", "/pose"], "frame"),
        (["localize", drive, "--map", state_path, "--config", str(bad_cfg)], "localizer.num_particles"),
        (["localize", drive, "--map", state_path, "--config", str(deep_cfg)], "nested deeper"),
        (["localize", drive, "--map", state_path, "--ground-truth", "/nothing"], "/nothing"),
        (["localize", drive, "--map", state_path, "--odom-topic", "/mag"], "odometry topic /mag"),
        (["localize", drive, "--map", state_path, "--particles", "3"], "localizer.num_particles"),
        (["localize", drive, "--map", state_path, "--out", "/proc/1/x"], "--out"),
    ]
    for argv, needle in cases:
        if "--out" not in argv:
            argv = argv + ["--out", str(tmp_path / "o")]
        assert cli.main(argv) == 1, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("gp-mapping localize: error:"), (argv, err)
        assert needle in lines[0] and "Traceback" not in err, (needle, err)


def test_the_installed_command_fails_cleanly_in_a_process(demo, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gp_mapping.cli", "localize", str(demo["drive"]), "--map",
                           str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("gp-mapping localize: error: map file")
