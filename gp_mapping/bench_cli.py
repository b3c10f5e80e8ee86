"""`gp-mapping bench [--quick]`: the benchmark harness (:mod:`gp_mapping.evaluation.harness`), installed with the
package. The real recordings come from ``--data`` or ``$GP_MAPPING_DATA`` (else ``../shared/data`` beside the
checkout or the working directory); the sections that need them are recorded as skipped, with the reason,
without them."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gp_mapping.evaluation import harness

    harness.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from gp_mapping.evaluation import harness

    return harness.main_with_args(args)
