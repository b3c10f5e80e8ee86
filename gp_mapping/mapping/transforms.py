"""The tf tree without ROS: one transform buffer for the offline replay (a whole bag's /tf and /tf_static) and
the live node (its /tf and /tf_static subscriptions), and the rule that gives each magnetometer reading its pose.

:class:`TransformBuffer` holds the history of each child frame's edge to its parent. Edges from /tf_static hold
for all times; edges from /tf are interpolated between the two transforms around the asked time (linear
translation, slerp rotation) as tf2's BufferCore does, never extrapolated, and both neighbours must lie within
``max_gap`` seconds (the rule :mod:`gp_mapping.mapping.sync` applies to pose topics, ``sync.max_pose_gap``). A
lookup walks from both frames up to their common ancestor *at the asked time* and composes the edges. A live
buffer keeps ``cache_seconds`` of each edge (tf2 keeps 10 s).

The tree follows tf2's rules. A child whose parent changes is re-parented from the new transform's stamp on (the
latest parent wins, as tf2's TF_REPARENT; counted in ``reparents``, one notice per distinct change): a lookup
at a later time goes through the new parent, one at an earlier time through the old one, and never
interpolates across the change. A transform is refused (counted in ``rejected`` and by reason in
``rejected_by_reason``) when it is unusable (a non-finite value, a quaternion whose norm is not 1, an empty
frame name), names one frame as its own parent, makes the fixed frame (the map frame, ``grid.frame_id``) a
child, closes a loop with the current tree, or changes a parent at a time already covered by the current one.
Nothing refused ever enters the tree, so the correct chain that keeps arriving is used as soon as it does.

:class:`TfPoseMatcher` is the live node's use of it: readings wait until the transforms around their stamp have
arrived, then each gets the pose of the magnetometer in the map frame, or is refused and counted.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from gp_mapping.mapping.frames import normalize_quaternion, quaternion_inverse, quaternion_multiply, rotate_vectors
from gp_mapping.mapping.poses import interpolate_poses


class TransformError(ValueError):
    """A transform between two frames cannot be looked up (frames not connected, or no transform at a time)."""


class TransformNotYetError(TransformError):
    """The asked time is newer than the newest transform of an edge: it may still arrive (live buffers)."""


class TransformGapError(TransformError):
    """The transforms around the asked time are farther from it than ``max_gap``, or it is older than them."""


def frame_name(name: str) -> str:
    """tf2 frame ids carry no leading slash (ROS 1 bags often have '/base_link')."""
    return name.lstrip("/")


@dataclass(frozen=True)
class TransformSample:
    """One tf edge: ``rotation`` maps ``child`` vectors into ``parent``; ``translation`` is the child origin."""

    stamp: float
    parent: str
    child: str
    translation: np.ndarray  # (3,) [m]
    rotation: np.ndarray     # (4,) [x, y, z, w]


Transform = tuple[np.ndarray, np.ndarray]  # (translation (3,), rotation [x, y, z, w])
IDENTITY: Transform = (np.zeros(3), np.array([0.0, 0.0, 0.0, 1.0]))


def compose(a: Transform, b: Transform) -> Transform:
    """``T_a * T_b`` of two (translation, rotation) transforms: apply ``b`` first, then ``a``."""
    return a[0] + rotate_vectors(a[1], b[0]), normalize_quaternion(quaternion_multiply(a[1], b[1]))


def invert(a: Transform) -> Transform:
    """``T^-1`` of a (translation, rotation) transform."""
    q_inv = quaternion_inverse(a[1])
    return -rotate_vectors(q_inv, a[0]), q_inv


class _Edge:
    """One parent → child edge of the tf tree over a span of time: static (one transform for all times) or a
    time series. ``until`` is the stamp from which a later parent took the child over (inf while it is the
    child's current parent)."""

    def __init__(self, parent: str, child: str, static: bool, since: float = -math.inf) -> None:
        self.parent, self.child, self.static = parent, child, static
        self.since, self.until = since, math.inf
        self._stamps: list[float] = []
        self._translations: list[np.ndarray] = []
        self._rotations: list[np.ndarray] = []
        self._dirty = False
        self.stamps = np.zeros(0)
        self.translations = np.zeros((0, 3))
        self.rotations = np.zeros((0, 4))

    def add(self, s: TransformSample) -> None:
        if self.static:  # a later /tf_static message replaces the transform
            self._stamps, self._translations, self._rotations = [s.stamp], [s.translation], [s.rotation]
        else:
            self._stamps.append(s.stamp)
            self._translations.append(s.translation)
            self._rotations.append(s.rotation)
        self._dirty = True

    def freeze(self) -> None:
        order = np.argsort(np.asarray(self._stamps), kind="stable")
        self.stamps = np.asarray(self._stamps, dtype=np.float64)[order]
        self.translations = np.asarray(self._translations, dtype=np.float64).reshape(-1, 3)[order]
        self.rotations = normalize_quaternion(np.asarray(self._rotations, dtype=np.float64).reshape(-1, 4)[order])
        self._stamps = self.stamps.tolist()
        self._translations, self._rotations = list(self.translations), list(self.rotations)
        self._dirty = False

    def prune(self, keep_after: float) -> None:
        """Drop transforms older than ``keep_after``, keeping the newest one before it (for interpolation)."""
        if self.static or not self._stamps:
            return
        if self._dirty:
            self.freeze()
        cut = max(int(np.searchsorted(self.stamps, keep_after, side="left")) - 1, 0)
        if cut:
            del self._stamps[:cut], self._translations[:cut], self._rotations[:cut]
            self._dirty = True

    @property
    def newest(self) -> float:
        """Stamp of the newest transform (inf for a static edge)."""
        if self.static:
            return math.inf
        return max(self._stamps) if self._stamps else -math.inf

    def at(self, stamp: float, max_gap: float) -> Transform:
        """Transform at ``stamp``: linear / spherical interpolation between the two transforms around it.

        TransformNotYetError when ``stamp`` is newer than the newest transform (and the edge is still the
        child's current one), TransformGapError when it is older than the oldest one (tf2 does not extrapolate),
        when either of the two transforms around it is more than ``max_gap`` seconds away (the matching rule of
        mapping.sync), or when it falls after this edge's last transform but before a new parent took over.
        """
        if self._dirty:
            self.freeze()
        if self.static:
            return self.translations[0], self.rotations[0]
        stamps = self.stamps
        if stamps.size == 0 or stamp > stamps[-1]:
            span = f"[{stamps[0]:.3f}, {stamps[-1]:.3f}]" if stamps.size else "(empty)"
            if math.isfinite(self.until):  # superseded: no transform of this parent will ever cover it
                raise TransformGapError(f"tf {self.parent} -> {self.child} has no transform at {stamp:.3f} s "
                                        f"(recorded span {span}; {self.child} was re-parented at "
                                        f"{self.until:.3f} s)")
            raise TransformNotYetError(f"tf {self.parent} -> {self.child} has no transform at {stamp:.3f} s "
                                       f"(recorded span {span}; no extrapolation)")
        if stamp < stamps[0]:
            raise TransformGapError(f"tf {self.parent} -> {self.child} has no transform at {stamp:.3f} s "
                                    f"(recorded span [{stamps[0]:.3f}, {stamps[-1]:.3f}]; no extrapolation)")
        # The rule of mapping.sync for pose topics, on this edge's transforms.
        pos, quat, _, within, i0, i1 = interpolate_poses(stamps, self.translations, self.rotations,
                                                         np.array([float(stamp)]), max_gap)
        if not within[0]:
            t0, t1 = stamps[i0[0]], stamps[i1[0]]
            raise TransformGapError(f"tf {self.parent} -> {self.child}: the transforms around {stamp:.3f} s are "
                                    f"{stamp - t0:.3f} s before and {t1 - stamp:.3f} s after it "
                                    f"(sync.max_pose_gap {max_gap} s)")
        return pos[0], quat[0]


#: Why a transform is refused (TransformBuffer.rejected_by_reason).
TF_REFUSAL_REASONS = ("invalid", "self_parent", "fixed_frame_child", "loop", "late_reparent")
MAX_NOTICES_KEPT = 1024  # distinct re-parentings / refusals remembered, so each is reported once
MAX_NOTICE_CHARS = 400  # a notice naming hostile frame names of a megabyte is cut there


class TransformBuffer:
    """The tf tree, for looking up ``parent`` → ``child`` at a time (see the module docstring). It keeps every
    transform until :meth:`prune` (the replay reads a whole bag; the live node prunes). ``fixed_frame`` (the
    map frame) is never made a child: a transform that would is refused."""

    def __init__(self, fixed_frame: str | None = None) -> None:
        # By child: the edges to its successive parents, oldest first (a tf tree gives each frame one parent
        # at a time; the last edge is the current one).
        self._history: dict[str, list[_Edge]] = {}
        self.fixed_frame = frame_name(fixed_frame) if fixed_frame else None
        self.rejected = 0  # transforms refused, for any reason of TF_REFUSAL_REASONS
        self.rejected_by_reason = {reason: 0 for reason in TF_REFUSAL_REASONS}
        self.reparents = 0  # children whose parent changed (latest wins)
        self._noticed: set[int] = set()
        self._notices: list[str] = []

    def take_notices(self) -> list[str]:
        """Lines about re-parentings and refused transforms not reported before (each distinct one once)."""
        notices, self._notices = self._notices, []
        return notices

    def _notice(self, key: tuple[str, ...], text: str) -> None:
        digest = hash(key)  # kept small: frame names can be megabytes
        if digest in self._noticed or len(self._noticed) >= MAX_NOTICES_KEPT:
            return
        self._noticed.add(digest)
        self._notices.append(text if len(text) <= MAX_NOTICE_CHARS
                             else f"{text[:MAX_NOTICE_CHARS]}... ({len(text)} characters)")

    def _refuse(self, reason: str, parent: str = "", child: str = "", text: str = "") -> bool:
        self.rejected += 1
        self.rejected_by_reason[reason] += 1
        if text:
            self._notice((reason, parent, child), text)
        return False

    def add(self, sample: TransformSample, static: bool = False) -> bool:
        """Add one transform; False (and counted in ``rejected``) when it is refused (module docstring)."""
        parent, child = frame_name(sample.parent), frame_name(sample.child)
        translation = np.asarray(sample.translation, dtype=np.float64)
        rotation = np.asarray(sample.rotation, dtype=np.float64)
        ok = (translation.shape == (3,) and rotation.shape == (4,) and np.all(np.isfinite(translation))
              and np.all(np.isfinite(rotation)) and math.isfinite(sample.stamp))
        if not ok or abs(np.linalg.norm(rotation) - 1.0) > 1e-3 or not child or not parent:
            return self._refuse("invalid")
        if parent == child:
            return self._refuse("self_parent", parent, child, f"tf: a transform names '{child}' as its own parent; "
                                "refused")
        if child == self.fixed_frame:
            return self._refuse("fixed_frame_child", parent, child,
                                f"tf: {parent} -> {child} would make the map frame '{child}' a child; refused "
                                "(tf2 never lets the fixed frame of a lookup have a parent)")
        edges = self._history.get(child)
        current = edges[-1] if edges else None
        if current is not None and current.parent == parent:  # (a static edge takes the newest transform)
            current.add(TransformSample(sample.stamp, parent, child, translation, rotation))
            return True
        if self._closes_loop(parent, child):
            return self._refuse("loop", parent, child,
                                f"tf: {parent} -> {child} would close a loop ({child} is an ancestor of {parent}); "
                                "refused")
        sample = TransformSample(sample.stamp, parent, child, translation, rotation)
        if current is None:
            edge = _Edge(parent, child, static)
            edge.add(sample)
            self._history[child] = [edge]
            return True
        if static:  # a static transform holds for all times: it replaces the child's history
            edge = _Edge(parent, child, True)
            edge.add(sample)
            self._history[child] = [edge]
        else:
            newest = current.newest if not current.static else -math.inf
            if sample.stamp <= newest:  # out of order: the old parent already covers this time
                return self._refuse("late_reparent", parent, child,
                                    f"tf: {parent} -> {child} at {sample.stamp:.3f} s would re-parent {child} at a "
                                    f"time its parent {current.parent} already covers (up to {newest:.3f} s); "
                                    "refused")
            current.until = sample.stamp
            edge = _Edge(parent, child, False, since=sample.stamp)
            edge.add(sample)
            edges.append(edge)
        self.reparents += 1
        self._notice(("reparent", current.parent, parent, child),
                     f"tf: {child} re-parented from {current.parent} to {parent} at {sample.stamp:.3f} s (the "
                     "latest parent wins, as tf2's TF_REPARENT)")
        return True

    def _closes_loop(self, parent: str, child: str) -> bool:
        """True when ``child`` is ``parent`` or one of its ancestors in the current tree."""
        frame, seen = parent, set()
        while frame not in seen:
            if frame == child:
                return True
            seen.add(frame)
            edges = self._history.get(frame)
            if not edges:
                return False
            frame = edges[-1].parent
        return False

    def prune(self, keep_after: float) -> None:
        """Drop /tf transforms older than ``keep_after`` (each edge keeps the newest one before it), and the
        edges of former parents that ended before it."""
        for child, edges in self._history.items():
            if len(edges) > 1:
                keep = [e for e in edges[:-1] if e.until >= keep_after] + [edges[-1]]
                if len(keep) < len(edges):
                    edges[:] = keep
            for edge in edges:
                edge.prune(keep_after)

    def freeze(self) -> None:
        """Sort every edge by time (lookups also do it when an edge changed)."""
        for edges in self._history.values():
            for edge in edges:
                edge.freeze()

    @property
    def frames(self) -> list[str]:
        names = set(self._history)
        names.update(e.parent for edges in self._history.values() for e in edges)
        return sorted(names)

    def _edge_at(self, frame: str, stamp: float | None) -> _Edge | None:
        """The edge from ``frame`` to its parent at ``stamp`` (None: the current one)."""
        edges = self._history.get(frame)
        if not edges:
            return None
        if stamp is None or len(edges) == 1:
            return edges[-1]
        for edge in reversed(edges):
            if stamp >= edge.since:
                return edge
        return edges[0]

    def _ancestors(self, frame: str, stamp: float | None = None) -> list[_Edge]:
        """The edges from ``frame`` up to its root at ``stamp`` (stops on a loop)."""
        chain, seen = [], {frame}
        edge = self._edge_at(frame, stamp)
        while edge is not None and edge.parent not in seen:
            chain.append(edge)
            seen.add(edge.parent)
            edge = self._edge_at(edge.parent, stamp)
        return chain

    def _paths(self, parent: str, child: str, stamp: float | None = None) -> tuple[list[_Edge], list[_Edge]]:
        """Edges from the common ancestor down to ``parent`` and down to ``child`` (at ``stamp``)."""
        parent, child = frame_name(parent), frame_name(child)
        up_parent, up_child = self._ancestors(parent, stamp), self._ancestors(child, stamp)
        frames_parent = [parent] + [e.parent for e in up_parent]
        frames_child = [child] + [e.parent for e in up_child]
        common = next((f for f in frames_child if f in frames_parent), None)
        if common is None:
            when = "" if stamp is None else f" at {stamp:.3f} s"
            raise TransformError(f"tf frames '{parent}' and '{child}' are not connected{when} "
                                 f"(frames in tf: {', '.join(self.frames) or 'none'})")
        return up_parent[:frames_parent.index(common)], up_child[:frames_child.index(common)]

    def connected(self, parent: str, child: str, stamp: float | None = None) -> bool:
        try:
            self._paths(parent, child, stamp)
        except TransformError:
            return False
        return True

    def check_connected(self, parent: str, child: str) -> None:
        """TransformError naming the frames when ``parent`` and ``child`` have no common tf ancestor."""
        self._paths(parent, child)

    def chain_is_static(self, parent: str, child: str) -> bool:
        up, down = self._paths(parent, child)
        return all(e.static for e in up + down)

    def lookup(self, parent: str, child: str, stamp: float, max_gap: float = math.inf) -> Transform:
        """Pose of ``child`` in ``parent`` at ``stamp``: (translation (3,), rotation [x, y, z, w])."""
        to_parent, to_child = self._paths(parent, child, stamp)

        def down(edges: list[_Edge]) -> Transform:
            # edges run from the frame up to the common ancestor; compose from the ancestor down.
            out = IDENTITY
            for edge in reversed(edges):
                out = compose(out, edge.at(stamp, max_gap))
            return out

        return compose(invert(down(to_parent)), down(to_child))


# ------------------------------------------------------------------------------ a reading's pose from tf


def body_pose_from_tf(buffer: TransformBuffer, map_frame: str, frame: str, stamp: float, max_gap: float,
                      extrinsic: Transform, frame_is_sensor: bool) -> Transform:
    """The body pose in ``map_frame`` at ``stamp`` that, with the config's extrinsic (sensor in body,
    ``sync.sensor_translation`` / ``sync.sensor_rotation``) applied by the sync, places the magnetometer where
    the tf tree says. ``frame`` is the magnetometer's own frame (``frame_is_sensor``: the mount comes from tf,
    ``T_body = T_map_sensor * T_extrinsic^-1``) or the body's (``T_body = T_map_body``). The replay's ``--tf``
    and the live node's ``pose_source: tf`` both use it. Raises TransformError (subclasses say why)."""
    pose = buffer.lookup(map_frame, frame, stamp, max_gap)
    if not frame_is_sensor:
        return pose
    return compose(pose, invert((np.asarray(extrinsic[0], np.float64), normalize_quaternion(extrinsic[1]))))


# ------------------------------------------------------------------------------------- the live node's rule

TF_REJECTION_REASONS = ("tf_missing", "tf_stale")


@dataclass
class _Waiting:
    stamp: float
    field: np.ndarray
    frame_id: str
    receive_time: float | None


class TfPoseMatcher:
    """Gives each magnetometer reading the body pose in ``map_frame`` from the tf tree (the live node's
    ``node.pose_source: tf``).

    The magnetometer's own frame (the reading's ``frame_id``) is looked up when the tree holds it, so the mount
    comes from /tf_static; otherwise ``base_frame`` is, and the config's extrinsic places the sensor. Either
    way the pose handed out is the *body* pose that, with the config's extrinsic ``(sensor_translation,
    sensor_rotation)`` applied by the sync, puts the sensor where tf says: ``T_body = T_map_sensor *
    T_extrinsic^-1``, so the Mapper and its sync stay as they are.

    Readings wait (in arrival order) until every /tf edge of their chain has a transform at or after their
    stamp and their frames are connected. The buffer keeps ``cache_seconds`` of transforms before the oldest
    reading still undecided (tf2 keeps 10 s), so a backlog of messages never loses the transforms it needs. A
    reading is refused as ``tf_missing`` when the newest reading is ``timeout`` seconds newer and its
    transforms still have not come (or its frames are still not connected); as ``tf_stale`` when the
    transforms around it are more than ``max_gap`` apart from it or it is older than the buffer.
    """

    def __init__(self, map_frame: str, base_frame: str, extrinsic: Transform, max_gap: float, timeout: float,
                 cache_seconds: float = 10.0, max_waiting: int = 100_000) -> None:
        self.buffer = TransformBuffer(fixed_frame=map_frame)
        self.cache_seconds = float(cache_seconds)
        self.map_frame, self.base_frame = frame_name(map_frame), frame_name(base_frame)
        self.extrinsic = (np.asarray(extrinsic[0], np.float64), normalize_quaternion(extrinsic[1]))
        self.max_gap, self.timeout, self.max_waiting = float(max_gap), float(timeout), int(max_waiting)
        self._waiting: deque[_Waiting] = deque()
        self._newest = -math.inf
        self._decided = -math.inf  # stamp of the last reading decided
        self.rejected = {reason: 0 for reason in TF_REJECTION_REASONS}
        self.from_sensor_frame = 0  # readings placed by the tree's magnetometer frame (mount from /tf_static)
        self.from_base_frame = 0    # readings placed by base_frame and the config's extrinsic
        self.last_error = ""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def add_transform(self, sample: TransformSample, static: bool) -> bool:
        """Add one transform to the tree; False when the buffer refuses it (counted there, by reason)."""
        return self.buffer.add(sample, static=static)

    def add_field(self, stamp: float, field: Any, frame_id: str, receive_time: float | None = None) -> None:
        if len(self._waiting) >= self.max_waiting:  # bounded: the oldest is given up
            self._waiting.popleft()
            self.rejected["tf_missing"] += 1
        self._waiting.append(_Waiting(float(stamp), np.asarray(field, dtype=np.float64), frame_id, receive_time))
        if math.isfinite(stamp):
            self._newest = max(self._newest, float(stamp))

    def ready(self) -> Iterator[tuple[float, np.ndarray, np.ndarray, _Waiting]]:
        """Decided readings in arrival order: ``(stamp, body position, body orientation, reading)``; refused ones
        are counted and left out. Stops at the first reading whose transforms may still come."""
        try:
            yield from self._decide()
        finally:
            oldest = self._waiting[0].stamp if self._waiting and math.isfinite(self._waiting[0].stamp) \
                else self._decided
            if math.isfinite(oldest):
                self.buffer.prune(oldest - self.cache_seconds)

    def _decide(self) -> Iterator[tuple[float, np.ndarray, np.ndarray, _Waiting]]:
        while self._waiting:
            item = self._waiting[0]
            if not math.isfinite(item.stamp):  # the sync refuses and counts it; no pose to give
                self._waiting.popleft()
                yield item.stamp, np.zeros(3), np.array([0.0, 0.0, 0.0, 1.0]), item
                continue
            try:
                pose = self._pose(item)
            except TransformGapError as err:
                self._refuse("tf_stale", err)
                continue
            except TransformError as err:  # not yet there, or frames not connected (yet)
                if self._newest - item.stamp < self.timeout:
                    return  # may still arrive: this reading and the ones after it wait
                self._refuse("tf_missing", err)
                continue
            self._waiting.popleft()
            self._decided = item.stamp
            yield item.stamp, pose[0], pose[1], item

    def _refuse(self, reason: str, err: Exception) -> None:
        item = self._waiting.popleft()
        if math.isfinite(item.stamp):
            self._decided = item.stamp
        self.rejected[reason] += 1
        self.last_error = str(err)

    def _pose(self, item: _Waiting) -> Transform:
        sensor = frame_name(item.frame_id)
        on_sensor = bool(sensor) and sensor != self.map_frame and self.buffer.connected(self.map_frame, sensor,
                                                                                           item.stamp)
        body = body_pose_from_tf(self.buffer, self.map_frame, sensor if on_sensor else self.base_frame, item.stamp,
                                 self.max_gap, self.extrinsic, frame_is_sensor=on_sensor)
        if on_sensor:
            self.from_sensor_frame += 1
        else:
            self.from_base_frame += 1
        return body

    def clear(self) -> None:
        """Forget the waiting readings (a reset); the tf tree stays (it describes the robot, not the map)."""
        self._waiting.clear()
        self._newest = -math.inf

