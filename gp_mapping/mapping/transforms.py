"""The tf tree without ROS: one transform buffer for the offline replay (a whole bag's /tf and /tf_static) and
the live node (its /tf and /tf_static subscriptions), and the rule that gives each magnetometer reading its pose.

:class:`TransformBuffer` holds one edge per child frame. Edges from /tf_static hold for all times; edges from /tf
are interpolated between the two transforms around the asked time (linear translation, slerp rotation) as
tf2's BufferCore does, never extrapolated, and both neighbours must lie within ``max_gap`` seconds (the rule
:mod:`gp_mapping.mapping.sync` applies to pose topics, ``sync.max_pose_gap``). A lookup walks from both frames
up to their common ancestor and composes the edges. A live buffer keeps ``cache_seconds`` of each edge (tf2
keeps 10 s).

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
from gp_mapping.mapping.sync import interpolate_poses


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
    """One parent → child edge of the tf tree: static (one transform for all times) or a time series."""

    def __init__(self, parent: str, child: str, static: bool) -> None:
        self.parent, self.child, self.static = parent, child, static
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

        TransformNotYetError when ``stamp`` is newer than the newest transform, TransformGapError when it is
        older than the oldest one (tf2 does not extrapolate) or when either of the two transforms around it is
        more than ``max_gap`` seconds away (the matching rule of mapping.sync).
        """
        if self._dirty:
            self.freeze()
        if self.static:
            return self.translations[0], self.rotations[0]
        stamps = self.stamps
        if stamps.size == 0 or stamp > stamps[-1]:
            span = f"[{stamps[0]:.3f}, {stamps[-1]:.3f}]" if stamps.size else "(empty)"
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


class TransformBuffer:
    """The tf tree, for looking up ``parent`` → ``child`` at a time (see the module docstring). It keeps every
    transform until :meth:`prune` (the replay reads a whole bag; the live node prunes)."""

    def __init__(self) -> None:
        self._edges: dict[str, _Edge] = {}  # by child: a tf tree gives each frame one parent
        self.rejected = 0  # transforms refused: a non-unit quaternion, a non-finite value, or a second parent

    def add(self, sample: TransformSample, static: bool = False) -> bool:
        """Add one transform; False (and counted in ``rejected``) when it is unusable."""
        parent, child = frame_name(sample.parent), frame_name(sample.child)
        translation = np.asarray(sample.translation, dtype=np.float64)
        rotation = np.asarray(sample.rotation, dtype=np.float64)
        ok = np.all(np.isfinite(translation)) and np.all(np.isfinite(rotation)) and math.isfinite(sample.stamp)
        if not ok or abs(np.linalg.norm(rotation) - 1.0) > 1e-3 or parent == child or not child:
            self.rejected += 1
            return False
        edge = self._edges.get(child)
        if edge is None:
            edge = self._edges[child] = _Edge(parent, child, static)
        elif edge.parent != parent:
            self.rejected += 1  # tf2 would re-parent; a tree with two parents for one frame is broken here
            return False
        edge.add(TransformSample(sample.stamp, parent, child, translation, rotation))
        return True

    def prune(self, keep_after: float) -> None:
        """Drop /tf transforms older than ``keep_after`` (each edge keeps the newest one before it)."""
        for edge in self._edges.values():
            edge.prune(keep_after)

    def freeze(self) -> None:
        """Sort every edge by time (lookups also do it when an edge changed)."""
        for edge in self._edges.values():
            edge.freeze()

    @property
    def frames(self) -> list[str]:
        names = set(self._edges)
        names.update(e.parent for e in self._edges.values())
        return sorted(names)

    def _ancestors(self, frame: str) -> list[str]:
        """``frame`` and its parents up to the root (stops on a loop)."""
        chain = [frame]
        while chain[-1] in self._edges and self._edges[chain[-1]].parent not in chain:
            chain.append(self._edges[chain[-1]].parent)
        return chain

    def _paths(self, parent: str, child: str) -> tuple[list[_Edge], list[_Edge]]:
        """Edges from the common ancestor down to ``parent`` and down to ``child``."""
        parent, child = frame_name(parent), frame_name(child)
        up_parent, up_child = self._ancestors(parent), self._ancestors(child)
        common = next((f for f in up_child if f in up_parent), None)
        if common is None:
            raise TransformError(f"tf frames '{parent}' and '{child}' are not connected "
                                 f"(frames in tf: {', '.join(self.frames) or 'none'})")
        to_parent = [self._edges[f] for f in up_parent[:up_parent.index(common)]]
        to_child = [self._edges[f] for f in up_child[:up_child.index(common)]]
        return to_parent, to_child

    def connected(self, parent: str, child: str) -> bool:
        try:
            self._paths(parent, child)
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
        to_parent, to_child = self._paths(parent, child)

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
        self.buffer = TransformBuffer()
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

    def add_transform(self, sample: TransformSample, static: bool) -> None:
        self.buffer.add(sample, static=static)

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
        on_sensor = bool(sensor) and sensor != self.map_frame and self.buffer.connected(self.map_frame, sensor)
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

