"""The process around a gp_mapping node: start ROS, build the node, spin it until Ctrl-C or shutdown, close it,
and say how it ended in the exit status. The mapper, the merger and any later node run through :func:`spin_node`.

Exit status: :data:`EXIT_OK` after a clean stop, :data:`EXIT_BAD_CONFIG` when ROS refuses the arguments or the
node cannot start (:class:`NodeStartError`: a bad parameter, an unreadable initial map, a model that cannot be
built), :data:`EXIT_FAILURE` for a command's other failures.
"""
from __future__ import annotations

import faulthandler
import sys
from typing import Any, Callable

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

from gp_mapping.runtime import keep_freed_memory, set_cpu_threads

EXIT_OK, EXIT_FAILURE, EXIT_BAD_CONFIG = 0, 1, 2


class NodeStartError(RuntimeError):
    """The node cannot start (a bad parameter, an unreadable initial map, a mapper that cannot be built)."""


def spin_node(argv: list[str], program: str, logger_name: str, make_node: Callable[[], Any],
              prepare: Callable[[Any], bool] | None = None) -> int:
    """The process around a gp_mapping node: start ROS with ``argv``, build the node (a NodeStartError is a bad
    configuration, exit 2), ``prepare`` it (False: exit 2), spin until Ctrl-C or shutdown, ``close()`` it, exit 0."""
    keep_freed_memory()  # the published maps are drawn tile by tile (see gp_mapping.runtime)
    set_cpu_threads()  # a shared CPU: one torch thread unless OMP_NUM_THREADS says otherwise (gp_mapping.runtime)
    faulthandler.enable()  # a crash in a C extension (rclpy, torch) leaves every thread's Python stack in the log
    try:
        rclpy.init(args=argv)
    except Exception as err:  # rcl refuses malformed --ros-args or an unparsable params file
        print(f"gp_mapping {program}: cannot start ROS: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        try:
            node = make_node()
        except NodeStartError as err:  # at once: a bad parameter does not wait for any warm-up
            rclpy.logging.get_logger(logger_name).fatal(str(err))
            return EXIT_BAD_CONFIG
        if prepare is not None and not prepare(node):
            node.destroy_node()
            return EXIT_BAD_CONFIG
        # Single-threaded: every callback is short (the mapper's updates run on the node's own thread). rclpy's
        # MultiThreadedExecutor took about 400 of 30 000 messages under a 1 kHz flood on two cores.
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        sys.unraisablehook = quiet_interrupts_in_finalizers
        try:
            executor.spin()
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        except RuntimeError:  # rclpy's SIGINT handler can invalidate the context under the executor's wait
            if rclpy.ok():
                raise
        finally:
            executor.shutdown()
            node.close()
        return EXIT_OK
    finally:
        rclpy.try_shutdown()


def quiet_interrupts_in_finalizers(unraisable: Any) -> None:
    """``sys.unraisablehook`` of the node's process: a Ctrl-C that lands while Python runs a finalizer (an rclpy
    Future's ``__del__``) cannot be raised there and was printed as a traceback on a clean stop; the node is
    stopping anyway, so it is dropped. Anything else is reported as usual."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(unraisable)


def add_config_argument(parser: Any) -> None:
    """A node command's ``--config FILE`` (an argparse parser)."""
    parser.add_argument("--config", metavar="FILE",
                        help="parameter file (same as --ros-args --params-file FILE; later --ros-args win)")


def node_command(argv: list[str] | None, program: str, description: str,
                 lifecycle: bool = False) -> tuple[list[str], bool]:
    """The command line of a node's console script (``ros2 run gp_mapping <program> [--config FILE] [--autostart]
    [--ros-args ...]``): its own options parsed (``--help``, ``--config``; ``--autostart`` for a ``lifecycle``
    node), everything after ``--ros-args`` left to ROS. Returns the ROS argv (the config as a params file first)
    and whether to bring a lifecycle node up without a manager."""
    import argparse

    from rclpy.utilities import remove_ros_args

    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog=program, description=description)
    add_config_argument(parser)
    if lifecycle:  # "--autostart" alone, or with true / false (what a launch argument gives)
        parser.add_argument("--autostart", nargs="?", const="true", default="false", choices=("true", "false"),
                            type=str.lower, help="configure and activate without a manager")
    args = parser.parse_args(remove_ros_args(argv)[1:])
    return with_config(argv[:1], args.config, argv[1:]), getattr(args, "autostart", "false") == "true"


def bring_up(node: Any) -> bool:
    """Configure and activate a lifecycle node without a manager (``--autostart``); False when configure fails
    (the node said why), which ends the process with :data:`EXIT_BAD_CONFIG`."""
    from rclpy.lifecycle import TransitionCallbackReturn

    if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
        return False
    node.trigger_activate()
    return True


def with_config(program: list[str], config: str | None, rest: list[str]) -> list[str]:
    """ROS argv with ``config`` as a params file placed first, so later ``--ros-args`` override its values."""
    if not config:
        return program + rest
    return program + ["--ros-args", "--params-file", str(config), "--"] + rest
