"""The plain and the managed (rclpy lifecycle) form of a gp_mapping node, from one node core.

A node core (the mapper's ``_MapperCore``, the localizer's ``_LocalizerCore``) has the stages of a lifecycle
node: ``_init_core`` (declare and validate the parameters), ``_configure`` (build what the node works with;
:class:`~gp_mapping.ros.process.NodeStartError` when it cannot), ``_activate`` (subscribe, publish, start timers),
``_deactivate``, ``_cleanup`` and ``_stop``. :func:`init_node` makes the plain node (all stages at construction) or
the managed one (parameters only; a lifecycle manager drives the rest through :class:`LifecycleCallbacks`), so
that both forms behave alike and a failure at construction never leaves a half-made node behind.
"""
from __future__ import annotations

from typing import Any

from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn

from gp_mapping.ros.process import NodeStartError


def init_node(node: Any, base: type, name: str, node_kwargs: dict[str, Any], plain: bool) -> None:
    """Construct ``node`` as ``base`` (rclpy's Node or LifecycleNode) named ``name``, then its core's parameters;
    a ``plain`` node is also configured and activated. Whatever fails destroys the node and is raised (a bad
    parameter: NodeStartError)."""
    base.__init__(node, name, **node_kwargs)
    try:
        node._init_core()
        if plain:
            node._configure()
    except BaseException:
        node.destroy_node()
        raise
    if plain:
        node._activate()


class LifecycleCallbacks:
    """The lifecycle callbacks of a managed node core, as nav2's lifecycle manager drives them: ``configure`` runs
    ``_configure`` (a NodeStartError fails the transition with the reason, logged, and ``_configure_failed`` drops
    what was built), ``activate`` runs ``_activate`` then ``_reactivated``, ``deactivate``, ``cleanup`` and
    ``shutdown`` run ``_deactivate``, ``_cleanup`` and ``_stop``, each logging the node's line for it."""

    deactivated_line = "deactivated"
    cleaned_up_line = "cleaned up"

    def _configure_failed(self) -> None:
        """After a failed configure (the node is unconfigured again)."""

    def _reactivated(self) -> None:
        """After an activate (the node may publish again what it kept)."""

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._configure()
        except NodeStartError as err:
            self.get_logger().error(f"configure failed: {err}")
            self._configure_failed()
            return TransitionCallbackReturn.FAILURE
        self.get_logger().info("configured")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._activate()
        self._reactivated()
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._deactivate()
        self.get_logger().info(self.deactivated_line)
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._cleanup()
        self.get_logger().info(self.cleaned_up_line)
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop()
        return TransitionCallbackReturn.SUCCESS
