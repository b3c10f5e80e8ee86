"""The package builds as a ROS 2 user builds it: ``colcon build`` in a workspace, then the installed commands run.

colcon-common-extensions and colcon-ros come from requirements-dev.txt. The build runs in this test's Python
(``python -m colcon``), as a venv with ``--system-site-packages`` does on a robot (README "On a robot"). A few
seconds: the source is copied without the bags and benchmark results, and an ament_python build only copies.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

pytest.importorskip("colcon_core", reason="colcon is not installed (requirements-dev.txt installs it)")
pytest.importorskip("colcon_ros", reason="colcon-ros is not installed (requirements-dev.txt installs it)")

SKIP = shutil.ignore_patterns(".git", ".venv", "build", "install", "log", "out", "bags", "results", "__pycache__",
                              "*.egg-info", ".pytest_cache")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("ros2_ws")
    shutil.copytree(REPO_ROOT, ws / "src" / "gp_mapping", ignore=SKIP)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)  # the installed package must be found through the workspace, not the checkout
    proc = subprocess.run([sys.executable, "-m", "colcon", "build", "--packages-select", "gp_mapping",
                           "--event-handlers", "console_direct-"], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ws


def _installed_env(ws: Path) -> dict[str, str]:
    """The environment `source install/setup.bash` gives, with this Python's bin first (an active venv)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(["bash", "-c", "source install/setup.bash >/dev/null && env -0"], cwd=ws, env=env,
                         capture_output=True, timeout=60, check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def test_installed_commands_run(workspace):
    lib = workspace / "install" / "gp_mapping" / "lib" / "gp_mapping"
    env = _installed_env(workspace)
    for command, expected in (("mapper", "Gaussian-process magnetic-field mapping node"),
                              ("localizer", "Particle-filter localizer on a saved magnetic-field map"),
                              ("lifecycle_localizer", "--autostart"), ("gp-mapping", "replay")):
        script = lib / command
        assert script.is_file() and os.access(script, os.X_OK), f"{script} missing or not executable"
        assert script.read_text().startswith("#!/usr/bin/env python3"), "scripts must run in the active Python"
        proc = subprocess.run([str(script), "--help"], cwd=workspace, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert expected in proc.stdout
        # the code it ran is the installed copy, not the checkout
    proc = subprocess.run([sys.executable, "-c", "import gp_mapping; print(gp_mapping.__file__)"], cwd=workspace,
                          env=env, capture_output=True, text=True, timeout=60, check=True)
    assert str(workspace / "install") in proc.stdout


def test_colcon_finds_only_gp_mapping_in_the_repository(workspace):
    """interfaces/tf2_msgs (the development venv's TFMessage bindings) is never built in a robot's workspace,
    where the distribution's tf2_msgs is: colcon does not look inside a package's folder."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "colcon", "list", "--names-only"], cwd=workspace, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["gp_mapping"]


def test_share_files_are_installed(workspace):
    share = workspace / "install" / "gp_mapping" / "share"
    assert (share / "ament_index" / "resource_index" / "packages" / "gp_mapping").is_file()
    pkg = share / "gp_mapping"
    for rel in ("package.xml", "config/mapper.yaml", "config/gp_mapping.rviz", "rosdep/gp_mapping.yaml"):
        assert (pkg / rel).is_file(), rel
    launch = sorted(p.name for p in (REPO_ROOT / "launch").glob("*.launch.py"))
    assert launch and sorted(p.name for p in (pkg / "launch").glob("*.launch.py")) == launch


def test_installed_tool_replays_a_bag(workspace, tmp_path):
    """What README "On a robot" runs as `ros2 run gp_mapping gp-mapping replay BAG --out DIR`: the installed
    script maps a short simulated bag with the installed package."""
    import yaml

    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import write_demo_bag

    area = (-1.5, -1.5, 1.5, 1.5)
    rec = sim.simulate(sim.WorldConfig(area=area, n_dipoles=2),
                       sim.TrajectoryConfig(patterns=("lawnmower",), area=area, speed=1.0, rate=10.0, duration=6.0),
                       sim.SensorConfig(), seed=3)
    bag = tmp_path / "bag"
    write_demo_bag(bag, rec, ground_truth=False)
    config = tmp_path / "params.yaml"
    config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "model": {"learn_hyperparameters": False, "num_inducing": 32, "device": "cpu"}, "batching": {"size": 30},
        "node": {"publish_period": 5.0}}}}))
    script = workspace / "install" / "gp_mapping" / "lib" / "gp_mapping" / "gp-mapping"
    out = tmp_path / "out"
    proc = subprocess.run([str(script), "replay", str(bag), "--config", str(config), "--out", str(out),
                           "--no-progress"], cwd=tmp_path, env=_installed_env(workspace), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "map.npz").is_file() and f"wrote {(out / 'map.npz').resolve()}" in proc.stdout
