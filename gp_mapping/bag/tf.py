"""A bag's tf tree (``/tf`` and ``/tf_static``): :class:`TransformBuffer` looks up ``parent`` -> ``child`` at any
recorded time, interpolating each edge with the rule the sync applies to pose topics
(:func:`gp_mapping.mapping.sync.interpolate_poses`), without extrapolation, as tf2's BufferCore does."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from gp_mapping.bag.decode import TF_STATIC_TOPIC, TF_TYPES, TransformSample, _frame, decode_tf
from gp_mapping.bag.errors import TransformError
from gp_mapping.mapping.frames import FrameError, normalize_quaternion, quaternion_inverse, quaternion_multiply, \
    rotate_vectors
from gp_mapping.mapping.sync import interpolate_poses


class _Edge:
    """One parent → child edge of the tf tree: static (one transform for all times) or a time series."""

    def __init__(self, parent: str, child: str, static: bool) -> None:
        self.parent, self.child, self.static = parent, child, static
        self._stamps: list[float] = []
        self._translations: list[np.ndarray] = []
        self._rotations: list[np.ndarray] = []
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

    def freeze(self) -> None:
        order = np.argsort(np.asarray(self._stamps), kind="stable")
        self.stamps = np.asarray(self._stamps, dtype=np.float64)[order]
        self.translations = np.asarray(self._translations, dtype=np.float64).reshape(-1, 3)[order]
        self.rotations = normalize_quaternion(np.asarray(self._rotations, dtype=np.float64).reshape(-1, 4)[order])

    def at(self, stamp: float, max_gap: float) -> tuple[np.ndarray, np.ndarray]:
        """Transform at ``stamp``: linear / spherical interpolation between the two transforms around it.

        TransformError when ``stamp`` is outside the recorded span (tf2 does not extrapolate) or when either
        of the two transforms is more than ``max_gap`` seconds away (the matching rule of mapping.sync).
        """
        if self.static:
            return self.translations[0], self.rotations[0]
        stamps = self.stamps
        if stamps.size == 0 or stamp < stamps[0] or stamp > stamps[-1]:
            span = f"[{stamps[0]:.3f}, {stamps[-1]:.3f}]" if stamps.size else "(empty)"
            raise TransformError(f"tf {self.parent} -> {self.child} has no transform at {stamp:.3f} s "
                                 f"(recorded span {span}; no extrapolation)")
        # The rule of mapping.sync for pose topics, on this edge's transforms.
        pos, quat, _, within, i0, i1 = interpolate_poses(stamps, self.translations, self.rotations,
                                                         np.array([float(stamp)]), max_gap)
        if not within[0]:
            t0, t1 = stamps[i0[0]], stamps[i1[0]]
            raise TransformError(f"tf {self.parent} -> {self.child}: the transforms around {stamp:.3f} s are "
                                 f"{stamp - t0:.3f} s before and {t1 - stamp:.3f} s after it "
                                 f"(sync.max_pose_gap {max_gap} s)")
        return pos[0], quat[0]


def compose(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``T_a * T_b`` of two (translation, rotation) transforms: apply ``b`` first, then ``a``."""
    return a[0] + rotate_vectors(a[1], b[0]), normalize_quaternion(quaternion_multiply(a[1], b[1]))


def invert(a: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``T^-1`` of a (translation, rotation) transform."""
    q_inv = quaternion_inverse(a[1])
    return -rotate_vectors(q_inv, a[0]), q_inv


IDENTITY = (np.zeros(3), np.array([0.0, 0.0, 0.0, 1.0]))


class TransformBuffer:
    """The whole tf tree of a bag, for looking up ``parent`` → ``child`` at any recorded time.

    Edges from /tf_static hold for all times; edges from /tf are interpolated between their two nearest
    transforms (as tf2's BufferCore does, without extrapolation). A lookup walks from both frames up to their
    common ancestor and composes the edges, so any two connected frames can be asked for.
    """

    def __init__(self) -> None:
        self._edges: dict[str, _Edge] = {}  # by child: a tf tree gives each frame one parent
        self.rejected = 0  # transforms refused: a non-unit quaternion, a non-finite value, or a second parent

    @classmethod
    def from_bag(cls, bag, topics: Sequence[str] | None = None) -> "TransformBuffer":
        buffer = cls()
        for topic, bag_time, _, msg in bag.messages(list(topics) if topics else bag.topics_of_type(TF_TYPES)):
            for sample in decode_tf(msg, bag_time):
                buffer.add(sample, static=topic.endswith(TF_STATIC_TOPIC))  # also /robot1/tf_static
        buffer.freeze()
        return buffer

    def add(self, sample: TransformSample, static: bool = False) -> None:
        sample = dataclasses.replace(sample, parent=_frame(sample.parent), child=_frame(sample.child))
        ok = np.all(np.isfinite(sample.translation)) and np.all(np.isfinite(sample.rotation))
        if not ok or abs(np.linalg.norm(sample.rotation) - 1.0) > 1e-3 or sample.parent == sample.child:
            self.rejected += 1
            return
        edge = self._edges.get(sample.child)
        if edge is None:
            edge = self._edges[sample.child] = _Edge(sample.parent, sample.child, static)
        elif edge.parent != sample.parent:
            self.rejected += 1  # tf2 would re-parent; a bag with two parents for one frame is broken here
            return
        edge.add(sample)

    def freeze(self) -> None:
        """Sort every edge by time; call after the last :meth:`add` and before lookups."""
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
        parent, child = _frame(parent), _frame(child)
        up_parent, up_child = self._ancestors(parent), self._ancestors(child)
        common = next((f for f in up_child if f in up_parent), None)
        if common is None:
            raise TransformError(f"tf frames '{parent}' and '{child}' are not connected "
                                 f"(frames in the bag's tf: {', '.join(self.frames) or 'none'})")
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

    def lookup(self, parent: str, child: str, stamp: float, max_gap: float = math.inf
               ) -> tuple[np.ndarray, np.ndarray]:
        """Pose of ``child`` in ``parent`` at ``stamp``: (translation (3,), rotation [x, y, z, w])."""
        to_parent, to_child = self._paths(parent, child)

        def down(edges: list[_Edge]) -> tuple[np.ndarray, np.ndarray]:
            # edges run from the frame up to the common ancestor; compose from the ancestor down.
            out = IDENTITY
            for edge in reversed(edges):
                out = compose(out, edge.at(stamp, max_gap))
            return out

        return compose(invert(down(to_parent)), down(to_child))



def is_identity_extrinsic(translation: Sequence[float], rotation: Sequence[float], tol: float = 1e-9) -> bool:
    """True when a sensor extrinsic (translation, [x, y, z, w]) is the identity (q and -q alike)."""
    try:
        q = normalize_quaternion(rotation)
    except FrameError:
        return False
    return bool(np.all(np.abs(np.asarray(translation, dtype=np.float64)) <= tol) and abs(abs(q[3]) - 1.0) <= tol)

