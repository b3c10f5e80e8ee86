"""The `gp-mapping` command: one entry point, one subcommand per job.

Each subcommand lives in its own module and is imported only when used, so `gp-mapping demo-bag` does not
load rclpy and `gp-mapping node` does not load matplotlib.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, one-line help). Each module exposes add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "demo-bag": ("gp_mapping.sim.demo_bag", "write a simulated ROS 2 bag (MCAP) with ground truth"),
    "replay": ("gp_mapping.replay", "map a recorded bag offline and write map.npz, map.png, the map bag maps/ "
               "(--save-state: the state the node starts from)"),
    "export": ("gp_mapping.export", "write a map state or map.npz as nav2 map_server files (PGM + YAML per layer), "
               "map.npz and map.png"),
    "merge": ("gp_mapping.merge_cli", "merge saved maps (several robots or sessions) into one without their data; "
              "writes merged.safetensors, map.npz, map.png"),
    "node": ("gp_mapping.ros.mapper_node", "run the ROS 2 mapping node (same as `ros2 run gp_mapping mapper`)"),
    "merge-node": ("gp_mapping.ros.merger_node", "run the merger node: merges the maps of mapping nodes from their "
                   "~/model summaries (same as `ros2 run gp_mapping merger`)"),
    "bench": ("gp_mapping.bench_cli", "benchmarks: engines vs baselines (accuracy, latency, growth)"),
    "calibrate": ("gp_mapping.magnetometer_cli", "fit the magnetometer's hard- and soft-iron calibration to a "
                  "calibration drive; writes sync.hard_iron and sync.soft_iron as a parameter file"),
    "localize": ("gp_mapping.localization.cli", "localize a recorded drive on a saved map (particle filter); writes "
                 "poses.csv, summary.json, localization.png"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gp-mapping", description="Gaussian-process magnetic-field mapping.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints the usage error and exits 2
    from gp_mapping.runtime import keep_freed_memory, set_cpu_threads

    keep_freed_memory()  # maps drawn tile by tile no longer page-fault every tile (see gp_mapping.runtime)
    set_cpu_threads()  # one torch thread unless OMP_NUM_THREADS says otherwise (see gp_mapping.runtime)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    command_parser = argparse.ArgumentParser(prog=f"gp-mapping {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(command_parser)
    args, ros_args = command_parser.parse_known_args(argv[1:])
    if ros_args and name not in ("node", "merge-node"):
        command_parser.error(f"unrecognised arguments: {' '.join(ros_args)}")
    args.ros_args = ros_args
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"gp-mapping {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a user error a command did not name itself: one line, never a traceback
        if os.environ.get(DEBUG_ENV):
            raise
        print(user_error_line(f"gp-mapping {name}", err), file=sys.stderr)
        return 1


DEBUG_ENV = "GP_MAPPING_DEBUG"  # set (to anything) to get the traceback of an error instead of its one line


def user_error_line(program: str, err: BaseException) -> str:
    """The one line a command ends with on an error it did not report itself: the error, shortened (a path or
    a value can be megabytes), with its kind when that says more than the message (an OSError names the file)."""
    from gp_mapping.config import shorten

    if isinstance(err, OSError) and err.filename is not None:
        text = f"cannot write or read {err.filename}: {err.strerror or err}"
    else:
        reason = getattr(err, "reason", "")
        text = f"{type(err).__name__}{f' ({reason})' if reason else ''}: {err}"
    return f"{program}: error: {shorten(text, 600)} (set {DEBUG_ENV}=1 for the traceback)".replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
