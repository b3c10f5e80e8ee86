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
