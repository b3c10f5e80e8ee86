"""`gp-mapping bench [--quick]`: the benchmark harness of the source tree (``bench/`` beside this package).

The harness is not installed with the package (it needs the repository's ``bench/``, ``config/`` and
``bags/`` and the recordings in ``../shared/data``), so this command runs only from a checkout: it puts the
repository root on ``sys.path`` and hands over to ``bench.harness``. From an installed package without the
source tree it stops with a message saying so.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]


class BenchUnavailableError(RuntimeError):
    """The benchmark harness (bench/harness.py of the source tree) is not beside this package."""


def _harness():
    if not (SOURCE_ROOT / "bench" / "harness.py").is_file():
        raise BenchUnavailableError(
            f"gp-mapping bench needs the gp_mapping source tree (bench/harness.py beside the gp_mapping package); "
            f"none at {SOURCE_ROOT}. Clone the repository and run `pip install -e .` (or `make bench`) there.")
    if str(SOURCE_ROOT) not in sys.path:
        sys.path.insert(0, str(SOURCE_ROOT))
    from bench import harness

    return harness


def add_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        _harness().add_arguments(parser)
    except BenchUnavailableError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")  # before the options are parsed: none exist here


def run(args: argparse.Namespace) -> int:
    try:
        harness = _harness()
    except BenchUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return harness.main_with_args(args)
