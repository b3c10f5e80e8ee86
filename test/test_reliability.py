"""Issue 20: no permanent lockouts, bounded memory under every parameter and trajectory, maps that keep coming.

State files checked before their payload is read; the magnetometer frame latch; pauses told from bad stamps;
the published window (a teleport of 50 km keeps publishing, the known-cell mask bounded by the window); the
node's small items (publish_period lower bound, an integer for a float parameter, a clean stop mid-publish)."""
from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch

from gp_mapping.config import ConfigError, config_from_dict
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import MapStateError, read_state

torch.set_num_threads(1)
Q = [0.0, 0.0, 0.0, 1.0]
B = [20e-6, -5e-6, -42e-6]


def small_config(**sections):
    base = {"model": {"num_inducing": 16, "memory_size": 50, "hyper_steps": 2, "device": "cpu"},
            "batching": {"size": 20}, "grid": {"resolution": 0.5, "tile_size": 4096}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


# ------------------------------------------------------------------------------------------- state files


def _timed_refusal(path, match):
    start = time.perf_counter()
    with pytest.raises(MapStateError, match=match) as err:
        read_state(path)
    seconds = time.perf_counter() - start
    assert str(path) in str(err.value)
    return seconds


def test_dev_zero_is_refused_at_once_as_not_a_regular_file():
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero on this system")
    assert _timed_refusal("/dev/zero", r"not a regular file") < 1.0


def test_a_10_gb_sparse_file_is_refused_at_once_for_its_size(tmp_path):
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as fh:
        fh.truncate(10 * 1024**3)
    assert _timed_refusal(path, r"10\.0 GiB.*larger than") < 1.0


def test_header_length_and_header_are_checked_before_the_payload(tmp_path):
    # A plausible size but a header length of zero (the start of a sparse or zeroed file).
    zeros = tmp_path / "zeros.safetensors"
    zeros.write_bytes(bytes(4096))
    assert _timed_refusal(zeros, r"header length 0") < 1.0
    # A header length larger than the file.
    long = tmp_path / "long.safetensors"
    long.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    _timed_refusal(long, r"header of 1000000 bytes")
    # A header that is JSON but declares tensors beyond the end of the file.
    header = b'{"__metadata__": {"format": "gp_mapping.map_state", "schema_version": "1"}, ' \
             b'"model/a": {"dtype": "F64", "shape": [1000000000], "data_offsets": [0, 8000000000]}}'
    lying = tmp_path / "lying.safetensors"
    lying.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    assert _timed_refusal(lying, r"declares 8000000000 bytes of tensors.*holds 64") < 1.0


def test_a_directory_and_a_missing_file_are_refused_by_name(tmp_path):
    _timed_refusal(tmp_path, r"not a regular file")
    _timed_refusal(tmp_path / "absent.safetensors", r"cannot read")


def test_a_good_state_file_still_loads(tmp_path):
    mapper = Mapper(small_config())
    for k in range(60):
        t = 0.1 * k
        mapper.add_pose(t, [0.1 * k, 0.0, 0.0], Q)
        mapper.add_magnetic_field(t, B, "mag")
    mapper.flush()
    path = tmp_path / "good.safetensors"
    mapper.save(path)
    loaded = Mapper.load(path)
    assert loaded.diagnostics()["num_seen"] == mapper.diagnostics()["num_seen"] == 60
