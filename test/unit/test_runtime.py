"""The executables' process settings (gp_mapping.runtime): applied by `gp-mapping` before any subcommand runs."""
from __future__ import annotations

import platform
import sys

import pytest

from gp_mapping import runtime


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_glibc_takes_the_malloc_settings_and_taking_them_twice_is_harmless():
    assert runtime.keep_freed_memory() is True
    assert runtime.keep_freed_memory() is True


def test_the_command_applies_them_before_a_subcommand_runs(monkeypatch):
    from gp_mapping import cli

    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1) or True)
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    assert calls == [1]


def test_the_command_sets_one_torch_thread_unless_the_user_says_otherwise(monkeypatch):
    """One torch thread by default (gp_mapping.runtime); OMP_NUM_THREADS, where set, is the user's and stays. Run
    in child processes: torch's thread count is process-wide."""
    import os
    import subprocess

    code = ("from gp_mapping import cli, runtime; import torch\n"
            "try:\n    cli.main(['export', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('THREADS', torch.get_num_threads())")

    def threads(env_threads: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        if env_threads is not None:
            env["OMP_NUM_THREADS"] = env_threads
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(next(line for line in out.stdout.splitlines() if line.startswith("THREADS")).split()[1])

    assert threads(None) == runtime.DEFAULT_CPU_THREADS == 1
    assert threads("2") == 2


def test_a_process_that_already_imported_torch_gets_one_thread_too(monkeypatch):
    """The node processes import torch before they start: the threads are set on torch itself."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        runtime.set_cpu_threads()
        assert torch.get_num_threads() == runtime.DEFAULT_CPU_THREADS
        assert "OMP_NUM_THREADS" not in __import__("os").environ
    finally:
        torch.set_num_threads(before)


def test_a_node_process_sets_them_before_ros_starts(monkeypatch):
    from gp_mapping.ros import process

    calls = []
    monkeypatch.setattr(process, "keep_freed_memory", lambda: calls.append("malloc") or True)
    monkeypatch.setattr(process, "set_cpu_threads", lambda: calls.append("threads") or 1)
    # malformed --ros-args: rcl refuses them, so the process ends before any node is made
    assert process.spin_node(["prog", "--ros-args", "-r"], "test", "test", lambda: None) == process.EXIT_BAD_CONFIG
    assert calls == ["malloc", "threads"]
