"""/diagnostics of the gp_mapping nodes, and the mapping node's logging of what it refused.

``/diagnostics`` (diagnostic_msgs/DiagnosticArray, every :data:`DIAGNOSTICS_PERIOD` s of node clock): one status per
node, its values as key/value strings (:func:`diagnostic_array`), published with a log line per change of level
(:class:`NodeStatus`, shared by the nodes). The localizer node's status (ESS, innovations, convergence, offset)
is documented in :mod:`gp_mapping.ros.localizer_node`. The mapping node's: messages received, samples
accepted, rejected by reason (``rejected/<reason>`` from the Mapper, ``node/rejected/<reason>`` from the node; the
table is in docs/reliability.md), update latency, map size, errors. Its level
(:mod:`gp_mapping.mapping.health`): WARN for a magnetometer or pose stream silent ``node.stale_after`` s (STALE after
``node.stale_level_after``) or slower than ``node.expected_mag_rate`` / ``node.expected_pose_rate``, for more than
``node.max_refused_share`` of the readings refused or the model falling behind over ``node.diagnostics_window``;
ERROR when updates fail or the map cannot be predicted or published; the message names each reason. A change of
level is logged once, and a summary of new refusals at most every :data:`LOG_THROTTLE_S` seconds.
"""
from __future__ import annotations

import math
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from gp_mapping.config import shorten
from gp_mapping.mapping.health import OK, WARN, Health, HealthMonitor, Tick
from gp_mapping.mapping.sync import SAMPLE_REJECTION_REASONS

DIAGNOSTICS_PERIOD = 1.0  # seconds (node clock), the usual rate of /diagnostics
LOG_THROTTLE_S = 5.0  # seconds between two log lines about refused input, failed updates or dropped backlog


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Nested dicts -> ``{"a/b": value}``."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def format_value(value: Any) -> str:
    """A diagnostics value as text; floats round-trip (stamps need every digit)."""
    return repr(value) if isinstance(value, float) else str(value)


def diagnostic_array(stamp: Any, name: str, level: int, message: str, values: dict[str, Any]) -> DiagnosticArray:
    """One node's status for /diagnostics: ``level`` as diagnostic_msgs' (OK 0, WARN 1, ERROR 2, STALE 3),
    ``values`` formatted with :func:`format_value`, stamped ``stamp``."""
    status = DiagnosticStatus(name=name, hardware_id="gp_mapping", level=bytes([level]), message=message)
    status.values = [KeyValue(key=k, value=format_value(v)) for k, v in values.items()]
    msg = DiagnosticArray(status=[status])
    msg.header.stamp = stamp
    return msg


def with_reasons(health: Health, reasons: list[tuple[int, str]], ok_message: str) -> Health:
    """``health`` (the streams' and refusals' levels of :class:`HealthMonitor`) with a node's own ``reasons``
    added: the level is the worst, the message names every reason, worst first, or is ``ok_message``."""
    every = sorted([*health.reasons, *reasons], key=lambda r: -r[0])
    if not every:
        return Health(OK, ok_message, [])
    return Health(every[0][0], "; ".join(text for _, text in every), every)


class NodeStatus:
    """Mixin of a gp_mapping node: its /diagnostics publisher (:meth:`_setup_status`), a throttled log line naming
    the refusal counters that grew (:meth:`_log_refusals`), and :meth:`_publish_status`, which logs each change of
    level once and publishes the status."""

    _logged_level = OK

    def _setup_status(self) -> None:
        self._logged_counts: dict[str, int] = {}  # refusal counts at the last log line about them
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)

    def _log_refusals(self, values: dict[str, Any]) -> None:
        """One throttled warning naming every refusal / drop / failure counter that grew since the last one."""
        keys = [k for k in values if k.startswith(("rejected/", "node/rejected/"))]
        keys += ["dropped_overflow", "dropped_spikes", "failed_updates", "reanchors", "teleports", "pauses",
                 "field_frame_relatches"]
        grown = {k: int(values[k]) - self._logged_counts.get(k, 0) for k in keys if k in values}
        grown = {k: v for k, v in grown.items() if v > 0}
        if not grown:
            return
        text = ", ".join(f"{k.split('/')[-1]} +{v}" for k, v in grown.items())
        error = values.get("last_error") or ""
        line = f"input refused or dropped since the last report: {text}" + (
            f"; last update error: {error}" if error else "")
        if any(self._logged_counts.get(k, 0) == 0 for k in grown):
            # a reason not reported before is logged at once: throttled, a refusal in the last seconds before the
            # node stops would never reach the log (the throttle only holds back repeats)
            logged = self.get_logger().warning(line)
        else:
            logged = self.get_logger().warning(line, throttle_duration_sec=LOG_THROTTLE_S)
        if logged:  # rclpy returns whether the line was emitted; counts stay until one is
            self._logged_counts.update({k: int(values[k]) for k in keys if k in values})

    def _publish_status(self, health: Health, values: dict[str, Any]) -> None:
        """Log a change of level once, naming why, and publish the status with ``values``."""
        values["node/health"] = health.level_name
        if health.level != self._logged_level:  # one line per change of level, naming why
            self._logged_level = health.level
            line = f"diagnostics {health.level_name}: {shorten(health.message, 1000)}"
            if health.level == OK:  # (rclpy: one severity per call site)
                self.get_logger().info(line)
            else:
                self.get_logger().warning(line)
        self._diag_pub.publish(diagnostic_array(self.get_clock().now().to_msg(), f"{self.get_name()}: gp_mapping",
                                                health.level, health.message, values))


class MapperDiagnostics(NodeStatus):
    """Mixin of the mapping node: its counters, the errors it survives (:meth:`_report`), its /diagnostics."""

    def _setup_diagnostics(self) -> None:
        self._counts: dict[str, int] = {"mag_messages": 0, "pose_messages": 0, "tf_messages": 0, "updates": 0,
                                        "maps_published": 0, "errors": 0, "stamps_from_clock": 0}
        self._last_error = ""
        self._logged_field_frame = ""
        self._health: HealthMonitor | None = None
        self._setup_status()

    def _start_health(self) -> None:
        """Silence counts from activation."""
        self._health = HealthMonitor(self.config.node, self._now() or 0.0)

    def _report(self, message: str) -> None:
        """An error that the node survives: logged (throttled) and shown as ERROR in the diagnostics."""
        message = shorten(message, 1000)
        self._last_error = message
        self._counts["errors"] += 1
        self.get_logger().error(message, throttle_duration_sec=5.0)

    def _log_field_frame(self, frame: str) -> None:
        """Log the magnetometer frame the mapper holds whenever it changes (learned, re-latched, reset)."""
        if frame == self._logged_field_frame:
            return
        self._logged_field_frame = frame
        if frame:
            how = "configured" if self.config.sync.field_frame else "learned; sync.field_frame fixes it"
            self.get_logger().info(f"magnetometer frame '{frame}' held ({how}): readings in another frame are "
                                   "refused as field_frame_mismatch")

    def _health_now(self, mapper_diag: dict[str, Any], inbox: int) -> Health:
        """The levels of gp_mapping.mapping.health for this tick (node clock)."""
        now = self._now()
        if self._health is None:
            self._health = HealthMonitor(self.config.node, now or 0.0)
        self._health.settings = self.config.node
        rejected = mapper_diag.get("rejected", {})
        refused = {k: int(rejected.get(k, 0)) for k in SAMPLE_REJECTION_REASONS}
        if self._tf is not None:
            refused.update({k: int(v) for k, v in self._tf.rejected.items()})
        tick = Tick(now=now if now is not None else 0.0,
                    messages={"magnetometer": self._counts["mag_messages"],
                              "pose": self._counts["pose_messages"] + self._tf_dynamic_messages},
                    last_seen=dict(self._last_seen), accepted=int(mapper_diag.get("accepted", 0)), refused=refused,
                    pending=int(mapper_diag.get("pending", 0)) + inbox, updates=int(mapper_diag.get("updates", 0)),
                    failed_updates=int(mapper_diag.get("failed_updates", 0)),
                    update_error=shorten(mapper_diag.get("last_error") or "", 300), node_error=self._last_error,
                    batch_size=self.config.batching.size)
        if now is None:  # sim time before the first /clock: only the errors can be judged
            tick.last_seen = {k: tick.now for k in tick.last_seen}
        return self._health.observe(tick)

    def _values(self, mapper_diag: dict[str, Any], inbox: int) -> dict[str, Any]:
        """The key/values of the node's status: the Mapper's diagnostics and the node's own ``node/...``."""
        values: dict[str, Any] = {}
        flatten("", mapper_diag, values)
        values.update({f"node/{k}": v for k, v in self._counts.items()})
        values.update({f"node/rejected/{k}": v for k, v in self._node_rejected.items()})
        if self._tf is not None:  # read without a lock: counters only grow, a stale value is one second old
            values.update({f"node/rejected/{k}": v for k, v in self._tf.rejected.items()})
            values["node/tf_waiting"] = self._tf.waiting
            values["node/tf_from_sensor_frame"] = self._tf.from_sensor_frame
            values["node/tf_from_base_frame"] = self._tf.from_base_frame
            values["node/tf_rejected_transforms"] = self._tf.buffer.rejected
            values.update({f"node/tf_rejected/{k}": v for k, v in self._tf.buffer.rejected_by_reason.items()})
            values["node/tf_reparents"] = self._tf.buffer.reparents
        values["node/inbox"] = inbox
        lat = self._latency
        values["node/update_latency_last_s"] = lat["last"]
        values["node/update_latency_mean_s"] = lat["sum"] / lat["count"] if lat["count"] else math.nan
        values["node/update_latency_max_s"] = lat["max"]
        values["node/publish_latency_last_s"] = self._publish_seconds
        if self.config.node.model_period > 0:
            for key in ("sent", "parts", "reduced", "too_large", "failed", "bytes"):
                values[f"node/model_summaries_{key}" if key != "bytes" else "node/model_summary_bytes"] = \
                    self._model[key]
        if self.config.node.checkpoint_interval_s > 0:
            values["node/checkpoint_path"] = str(self.checkpoint_path)
            values["node/checkpoints_written"] = self._checkpoint["written"]
            values["node/checkpoints_failed"] = self._checkpoint["failed"]
            values["node/checkpoint_seconds_last"] = self._checkpoint["seconds"]
        return values

    def _publish_diagnostics(self) -> None:
        mapper_diag = self._mapper_diagnostics  # as of the update thread's last step: never waits for an update
        inbox = self.backlog
        values = self._values(mapper_diag, inbox)
        self._log_refusals(values)
        self._log_field_frame(str(mapper_diag.get("field_frame", "")))
        health = self._health_now(mapper_diag, inbox)
        if health.level == OK and self._counts["mag_messages"] and not self._counts["updates"]:
            health = Health(WARN, "receiving data, no map update yet", [(WARN, "receiving data, no map update yet")])
        self._publish_status(health, values)


class LocalizerDiagnostics(NodeStatus):
    """Mixin of the localizer node: the errors it survives (:meth:`_report`) and its /diagnostics: the filter's
    counters and health (:meth:`gp_mapping.localization.Localizer.diagnostics`: readings, updates, skipped,
    ``rejected/<reason>``, ``ess``, ``nis_mean``, ``converged``, ``bias``, ``bias_std``, ``particles``), the pose
    and its standard deviations, the map, and the node's ``node/<counter>`` and ``node/rejected/<reason>``. Levels:
    the streams (magnetometer, odometry) and the refused share as the mapping node's
    (:class:`~gp_mapping.mapping.health.HealthMonitor` with the ``localizer.*`` thresholds), and WARN without an
    initial pose, while not converged (position standard deviation above ``localizer.converged_std``) and with
    more than half of the particles' weight off the map."""

    def _start_health(self) -> None:
        """Silence counts from activation."""
        self._health = HealthMonitor(self.config.node, self._now() or 0.0, prefix="localizer.")

    def _report(self, message: str) -> None:
        self._last_error = shorten(message, 1000)
        self._counts["errors"] += 1
        self.get_logger().error(self._last_error, throttle_duration_sec=5.0)

    def _publish_diagnostics(self) -> None:
        loc = self.localizer
        diag = loc.diagnostics()
        values: dict[str, Any] = {}
        flatten("", diag, values)
        values.update({f"node/{k}": v for k, v in self._counts.items()})
        values.update({f"node/rejected/{k}": v for k, v in self._node_rejected.items()})
        values.update({"map": self.map.source, "map_frame": self.map.frame_id, "map_target": self.map.target,
                       "initialised": loc.filter.initialised, "last_error": self._last_error})
        est = loc.last_estimate
        if est is not None:
            values.update({"pose/x": float(est.pose[0]), "pose/y": float(est.pose[1]), "pose/yaw": float(est.pose[2]),
                           **{f"std/{a}": float(s) for a, s in zip(("x", "y", "yaw"), est.std)}})
        self._log_refusals(values)
        # The refused share: readings refused by the filter (those before an initial pose have their own reason).
        refused = {k: v for k, v in diag["rejected"].items() if k.startswith("reading_")}
        waiting = refused.pop("reading_before_init", 0)
        tick = Tick(now=self._now() or 0.0, last_seen=dict(self._last_seen),
                    messages={"magnetometer": self._counts["mag_messages"],
                              "odometry": self._counts["odom_messages"] + self._counts["tf_messages"]},
                    accepted=diag["readings"] - waiting - sum(refused.values()), refused=refused, pending=0,
                    updates=diag["updates"], failed_updates=0, node_error=self._last_error, batch_size=1)
        reasons = []
        if not loc.filter.initialised:
            reasons.append((WARN, "no initial pose: waiting for /initialpose (or localizer.initial_pose, "
                                  "localizer.global_start)"))
        elif est is not None and not est.converged:
            reasons.append((WARN, f"not converged: position standard deviation {max(est.std[:2]):.2f} m above "
                                  f"localizer.converged_std {self.config.filter.converged_std:g} m"))
        if est is not None and diag["off_map_weight"] > 0.5:
            reasons.append((WARN, f"{100.0 * diag['off_map_weight']:.0f} % of the particles' weight is off the map's "
                                  "known cells"))
        ok = "converged" if est is not None else "initialised, waiting for the first filter update"
        self._publish_status(with_reasons(self._health.observe(tick), reasons, ok), values)
