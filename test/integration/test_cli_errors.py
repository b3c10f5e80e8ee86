"""User errors in every CLI command end with one line and exit status 1, never a traceback (issue 38, item 4):
output paths that cannot be written (checked before the work), hostile files, and an error no command named
itself. Long values are quoted by their start."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gp_mapping.cli import main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "bags" / "demo"
UNWRITABLE = "/proc/1/x"  # no file can be made there, as root or not


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    from support.state import fed_mapper, small_config

    path = tmp_path_factory.mktemp("cli") / "map.safetensors"
    fed_mapper(small_config()).save(path)
    return path


def one_line_error(capsys, argv, status=1, contains=""):
    start = time.perf_counter()
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "error:" in lines[0], err
    assert contains in lines[0], lines[0]
    return lines[0], time.perf_counter() - start


def test_unwritable_outputs_are_refused_before_any_work(capsys, state, tmp_path):
    line, seconds = one_line_error(capsys, ["replay", str(DEMO), "--out", UNWRITABLE, "--no-progress"],
                                   contains="--out")
    assert UNWRITABLE in line and seconds < 5.0  # not after a replay of the bag
    line, seconds = one_line_error(capsys, ["replay", str(DEMO), "--out", str(tmp_path / "r"), "--save-state",
                                            UNWRITABLE, "--no-progress"], contains="--save-state")
    assert seconds < 5.0
    one_line_error(capsys, ["replay", str(DEMO), "--out", str(tmp_path / "r"), "--save-state", str(tmp_path),
                            "--no-progress"], contains="is a folder")
    one_line_error(capsys, ["export", str(state), "--out", UNWRITABLE], contains=UNWRITABLE)
    line, seconds = one_line_error(capsys, ["merge", str(state), str(state), "--out", UNWRITABLE], contains="--out")


def test_hostile_inputs_end_with_one_line(capsys, state, tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    one_line_error(capsys, ["replay", str(DEMO), "--config", str(deep), "--out", str(tmp_path / "r")],
                   contains="nested deeper")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    one_line_error(capsys, ["replay", str(DEMO), "--config", str(binary), "--out", str(tmp_path / "r")])
    zip_like = tmp_path / "map.npz"
    zip_like.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    one_line_error(capsys, ["export", str(zip_like), "--out", str(tmp_path / "e")])
    meta = {"format": "gp_mapping.map_state", "schema_version": "2", "config": "{}", "info": "{}", "checksum": ""}
    header = (b'{"__metadata__": ' + json.dumps(meta).encode()
              + b', "model/a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 1e999]}}')
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    one_line_error(capsys, ["merge", str(huge), str(state), "--out", str(tmp_path / "m")], contains="offsets")
    one_line_error(capsys, ["export", str(huge), "--out", str(tmp_path / "e")], contains="offsets")


def test_an_error_no_command_named_is_one_line_with_its_kind(capsys, monkeypatch, state, tmp_path):
    import gp_mapping.export as export

    def broken(path):
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(export, "read_input", broken)
    line, _ = one_line_error(capsys, ["export", str(state), "--out", str(tmp_path / "e")], contains="OverflowError")
    assert "GP_MAPPING_DEBUG" in line
    long_path = str(tmp_path / ("y" * 200_000))
    line, _ = one_line_error(capsys, ["export", long_path, "--out", str(tmp_path / "e")])
    assert len(line) < 2000  # the 200 kB argument is not echoed whole (one_line_error: still one line)


def test_the_installed_command_prints_no_traceback(tmp_path):
    """The real process (console script entry point) for the probe's case."""
    out = subprocess.run([sys.executable, "-m", "gp_mapping.cli", "replay", str(DEMO), "--out", UNWRITABLE,
                          "--no-progress"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr


def test_long_values_are_shortened():
    from gp_mapping.config import ConfigError, config_from_dict, shorten

    assert shorten("x" * 10) == "x" * 10
    cut = shorten("x" * 200_000)
    assert len(cut) < 400 and "200000 characters" in cut
    with pytest.raises(ConfigError) as err:
        config_from_dict({"k" * 100_000: 1})
    assert len(str(err.value)) < 500
    assert np.isfinite(len(str(err.value)))
