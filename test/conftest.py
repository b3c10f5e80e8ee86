"""Shared fixtures of every test folder (unit/, integration/, real_data/): DDS kept on loopback with a per-run
domain id, and tests marked gpu skipped without CUDA. Shared helpers (paths, ROS harness, the node in a process)
are in support/."""
from __future__ import annotations

import os
import random

import pytest

# Before any rclpy.init() in this process or in a child process started by a test: DDS stays on this machine,
# and each pytest run gets its own domain, so parallel runs (and other ROS systems) never see each other. The
# workers of one `pytest -n N` run (pytest-xdist: `make test` runs one per core) take every other domain from the
# run's own, so a test's "another domain" (its own + 1, test_dds.py) is no worker's.
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and _worker[2:].isdigit():  # the run's domain: the controller's (inherited) or set
    _run_domain = int(os.environ.get("ROS_DOMAIN_ID") or 1 + random.Random(os.getppid()).randint(0, 99))
    os.environ["ROS_DOMAIN_ID"] = str(1 + (_run_domain - 1 + 2 * int(_worker[2:])) % 100)
else:
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random(os.getpid()).randint(1, 100)))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small problems on one torch thread for the module's tests (the two shared cores are not oversubscribed:
    6x faster under load), the thread count restored after them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ros_env() -> dict[str, str]:
    """Environment for child processes that speak DDS: loopback only, this run's domain id."""
    env = dict(os.environ)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    return env


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip on a machine without CUDA."""
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA (run `pytest -m gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
