"""Reading recorded bags for the offline replay, and writing its map bag, with the ``rosbags`` library.

Reads ROS 1 (``.bag``) and ROS 2 (a rosbag2 folder, or a bare ``.db3`` / ``.mcap`` file) recordings without a
ROS installation. Messages are decoded into plain numpy samples in SI units, stamped with their header time
(the bag's receive time only where a header stamp is zero). The pose of the magnetometer comes either from a
pose topic (``PoseStamped``, ``Odometry`` or ``PoseWithCovarianceStamped``) or from the bag's ``/tf`` and
``/tf_static`` tree (:class:`TransformBuffer`). :class:`MapBagWriter` writes the published maps as a ROS 2
MCAP file that ``ros2 bag play`` and RViz take.

Every failure that a user can cause (a missing path, a file that is not a bag, a topic that is absent, of the
wrong type or ambiguous, no pose source, a transform chain that does not exist) raises a :class:`BagError`
subclass whose message says what is wrong and what to pass instead.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from gp_mapping.mapping.frames import FrameError, normalize_quaternion, quaternion_inverse, quaternion_multiply, \
    rotate_vectors, slerp

MAGNETIC_FIELD = "sensor_msgs/msg/MagneticField"
POSE_STAMPED = "geometry_msgs/msg/PoseStamped"
ODOMETRY = "nav_msgs/msg/Odometry"
POSE_WITH_COVARIANCE = "geometry_msgs/msg/PoseWithCovarianceStamped"
# Pose topic types in the order auto-detection prefers them; the value is the node's `node.pose_type` name.
POSE_TYPES = {POSE_STAMPED: "pose_stamped", ODOMETRY: "odometry", POSE_WITH_COVARIANCE: "pose_with_covariance"}
# tf2_msgs on ROS 2 and ROS 1; the old tf/tfMessage of ROS 1 has the same layout.
TF_TYPES = ("tf2_msgs/msg/TFMessage", "tf/msg/tfMessage")
TF_STATIC_TOPIC = "/tf_static"
# Message types of a bag without embedded definitions (rosbag2 before Iron) are taken from this ROS release.
DEFAULT_ROS2_DISTRO = "ROS2_KILTED"


class BagError(Exception):
    """A bag cannot serve the replay: the message says what is wrong and what to do."""


class BagNotFoundError(BagError, FileNotFoundError):
    """The bag path does not exist."""


class NotABagError(BagError):
    """The path exists but is not a ROS 1 bag, a rosbag2 folder, or an MCAP / sqlite3 file rosbags can read."""


class CorruptBagError(NotABagError):
    """The bag opened, but reading or decoding its messages failed part way (truncated or corrupt data, or a
    message type whose definition the bag does not carry). ``messages_read`` were delivered before it."""

    def __init__(self, message: str, messages_read: int = 0) -> None:
        super().__init__(message)
        self.messages_read = messages_read


class TopicError(BagError):
    """A topic the replay needs is absent, has the wrong message type, or cannot be chosen unambiguously."""


class NoMagneticFieldError(TopicError):
    """The bag has no sensor_msgs/MagneticField topic."""


class NoPoseSourceError(TopicError):
    """The bag has neither a pose topic nor a /tf chain from the map frame to the magnetometer frame."""


class TransformError(BagError):
    """A transform between two frames cannot be looked up (frames not connected, or no transform at a time)."""


def _frame(name: str) -> str:
    """tf2 frame ids carry no leading slash (ROS 1 bags often have '/base_link')."""
    return name.lstrip("/")


def _stamp(header, bag_time_ns: int) -> float:
    """Header stamp in seconds; the bag's receive time where the publisher left the stamp at zero."""
    sec, nsec = int(header.stamp.sec), int(header.stamp.nanosec)
    if sec == 0 and nsec == 0:
        return bag_time_ns * 1e-9
    return sec + nsec * 1e-9


# --------------------------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class MagSample:
    """One magnetometer reading, in tesla, in the sensor frame ``frame_id``."""

    stamp: float
    field: np.ndarray  # (3,) [T]; may hold NaN where the driver reported an invalid reading
    frame_id: str


@dataclass(frozen=True)
class PoseSample:
    """Pose of ``child_frame_id`` (the body) in ``frame_id``; orientation rotates body vectors into that frame."""

    stamp: float
    position: np.ndarray     # (3,) [m]
    orientation: np.ndarray  # (4,) [x, y, z, w]
    frame_id: str
    child_frame_id: str


@dataclass(frozen=True)
class TransformSample:
    """One tf edge: ``rotation`` maps ``child`` vectors into ``parent``; ``translation`` is the child origin."""

    stamp: float
    parent: str
    child: str
    translation: np.ndarray  # (3,) [m]
    rotation: np.ndarray     # (4,) [x, y, z, w]


def decode_magnetic_field(msg, bag_time_ns: int) -> MagSample:
    """sensor_msgs/MagneticField → MagSample (tesla, as ROS requires; no unit conversion here)."""
    v = msg.magnetic_field
    return MagSample(_stamp(msg.header, bag_time_ns), np.array([v.x, v.y, v.z], dtype=np.float64),
                     _frame(msg.header.frame_id))


def decode_pose(msg, msgtype: str, bag_time_ns: int) -> PoseSample:
    """PoseStamped, Odometry or PoseWithCovarianceStamped → PoseSample."""
    if msgtype == POSE_STAMPED:
        pose, child = msg.pose, ""
    elif msgtype == ODOMETRY:
        pose, child = msg.pose.pose, _frame(msg.child_frame_id)
    elif msgtype == POSE_WITH_COVARIANCE:
        pose, child = msg.pose.pose, ""
    else:
        raise TopicError(f"message type {msgtype} is not a pose; expected one of {', '.join(POSE_TYPES)}")
    p, q = pose.position, pose.orientation
    return PoseSample(_stamp(msg.header, bag_time_ns), np.array([p.x, p.y, p.z], dtype=np.float64),
                      np.array([q.x, q.y, q.z, q.w], dtype=np.float64), _frame(msg.header.frame_id), child)


def decode_tf(msg, bag_time_ns: int) -> list[TransformSample]:
    """tf2_msgs/TFMessage → one TransformSample per transform in it."""
    out = []
    for ts in msg.transforms:
        t, q = ts.transform.translation, ts.transform.rotation
        out.append(TransformSample(_stamp(ts.header, bag_time_ns), _frame(ts.header.frame_id),
                                   _frame(ts.child_frame_id), np.array([t.x, t.y, t.z], dtype=np.float64),
                                   np.array([q.x, q.y, q.z, q.w], dtype=np.float64)))
    return out


# --------------------------------------------------------------------------------------------- reading


def _resolve_bag_path(path: Path) -> Path:
    """A rosbag2 folder without metadata.yaml but with exactly one storage file is read from that file."""
    if path.is_dir() and not (path / "metadata.yaml").exists():
        storage = sorted(p for p in path.iterdir() if p.suffix in (".mcap", ".db3"))
        if len(storage) == 1:
            return storage[0]
        raise NotABagError(f"{path} is a folder but not a rosbag2 bag: it has no metadata.yaml and "
                           f"{'no' if not storage else len(storage)} .mcap/.db3 files")
    return path


class Bag:
    """An open recording: its topics and types, its time span, and its messages decoded in bag-time order.

    Use as a context manager (``with Bag(path) as bag:``) or call :meth:`close`.
    """

    def __init__(self, path: str | Path) -> None:
        from rosbags.highlevel import AnyReader, AnyReaderError
        from rosbags.typesys import Stores, get_typestore

        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise BagNotFoundError(f"bag {self.path} does not exist")
        storage = _resolve_bag_path(self.path)
        typestore = get_typestore(getattr(Stores, DEFAULT_ROS2_DISTRO))
        try:
            self._reader = AnyReader([storage], default_typestore=typestore)
            self._reader.open()
        except Exception as err:  # noqa: BLE001
            # rosbags reports an unreadable file through several exception types (its reader errors, a missing
            # metadata file, a parser error on a corrupt header); all of them mean "not a bag we can read".
            reason = str(err) if isinstance(err, (AnyReaderError, OSError)) else f"{type(err).__name__}: {err}"
            if "end magic" in reason:  # an MCAP whose recorder died before writing the footer
                reason += (" (the file ends early, as when the recorder was killed; `mcap recover` or "
                           "`ros2 bag reindex` can rebuild a readable file)")
            raise NotABagError(f"{self.path} is not a readable ROS 1 (.bag) or ROS 2 (folder, .mcap, .db3) "
                               f"bag: {reason}") from None
        self.is_ros2 = bool(self._reader.is2)
        self.topics: dict[str, str] = {name: info.msgtype or "" for name, info in self._reader.topics.items()}
        self.counts: dict[str, int] = {name: info.msgcount for name, info in self._reader.topics.items()}

    def __enter__(self) -> "Bag":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._reader.stack is not None:
            self._reader.close()

    @property
    def message_count(self) -> int:
        return int(self._reader.message_count)

    @property
    def start_time(self) -> float:
        """Receive time of the first message [s] (0 for an empty bag)."""
        return self._reader.start_time * 1e-9 if self.message_count else 0.0

    @property
    def duration(self) -> float:
        """Seconds between the first and the last message's receive time."""
        return max(self._reader.end_time - self._reader.start_time, 0) * 1e-9 if self.message_count else 0.0

    def topics_of_type(self, msgtypes: Iterable[str]) -> list[str]:
        wanted = set(msgtypes)
        return sorted(t for t, m in self.topics.items() if m in wanted)

    def describe_topics(self) -> str:
        """``/a (type, N msgs), ...`` for error messages."""
        if not self.topics:
            return "the bag has no topics"
        return "topics in the bag: " + ", ".join(f"{t} ({m}, {self.counts.get(t, 0)} msgs)"
                                                 for t, m in sorted(self.topics.items()))

    def messages(self, topics: Sequence[str]) -> Iterator[tuple[str, int, str, object]]:
        """``(topic, bag_time_ns, msgtype, message)`` for the given topics, merged in bag-time order."""
        wanted = set(topics)
        missing = wanted - set(self.topics)
        if missing:
            raise TopicError(f"topic(s) {', '.join(sorted(missing))} not in {self.path}; {self.describe_topics()}")
        connections = [c for c in self._reader.connections if c.topic in wanted]
        stream = self._reader.messages(connections=connections)
        read, last = 0, None
        while True:
            try:
                item = next(stream, None)
            except Exception as err:  # noqa: BLE001 - rosbags and its codecs raise many types for bad data
                where = f"after {read} messages (last bag time {last * 1e-9:.3f} s)" if last else "at its start"
                raise CorruptBagError(f"{self.path} is truncated or corrupt: reading failed {where}: "
                                      f"{type(err).__name__}: {err}", read) from None
            if item is None:
                return
            conn, bag_time, raw = item
            try:
                msg = self._reader.deserialize(raw, conn.msgtype)
            except Exception as err:  # noqa: BLE001 - unknown type, or bytes that do not fit the definition
                raise CorruptBagError(f"{self.path}: cannot decode a {conn.msgtype} message on {conn.topic} "
                                      f"at bag time {bag_time * 1e-9:.9f} s: {type(err).__name__}: {err}",
                                      read) from None
            read, last = read + 1, bag_time
            yield conn.topic, bag_time, conn.msgtype, msg

    # ---------------------------------------------------------------------------------- topic choice

    def require_type(self, topic: str, msgtypes: Iterable[str], what: str) -> str:
        """The type of ``topic``; TopicError when it is absent or not one of ``msgtypes``."""
        allowed = tuple(msgtypes)
        if topic not in self.topics:
            raise TopicError(f"{what} topic {topic} is not in {self.path}; {self.describe_topics()}")
        if self.topics[topic] not in allowed:
            raise TopicError(f"{what} topic {topic} has type {self.topics[topic]}; expected "
                             f"{' or '.join(allowed)}")
        return self.topics[topic]

    def mag_topic(self, requested: str | None = None) -> str:
        """The MagneticField topic: ``requested`` (checked), or the only one in the bag."""
        if requested:
            self.require_type(requested, (MAGNETIC_FIELD,), "magnetometer")
            return requested
        candidates = self.topics_of_type((MAGNETIC_FIELD,))
        if not candidates:
            raise NoMagneticFieldError(f"{self.path} has no {MAGNETIC_FIELD} topic; {self.describe_topics()}")
        if len(candidates) > 1:
            raise TopicError(f"{self.path} has several {MAGNETIC_FIELD} topics ({', '.join(candidates)}); "
                             "choose one with --mag-topic")
        return candidates[0]

    def first_frame_id(self, topic: str) -> str:
        """header.frame_id of the first message on ``topic`` (empty when the topic has no messages)."""
        for _, _, _, msg in self.messages([topic]):
            return _frame(msg.header.frame_id)
        return ""


@dataclass(frozen=True)
class MagneticFieldSeries:
    """All readings of one MagneticField topic, in tesla, in stamp order of the bag."""

    topic: str
    stamps: np.ndarray  # (N,) [s]
    field: np.ndarray   # (N, 3) [T], NaN kept where the driver wrote NaN
    frame_id: str

    @property
    def non_finite(self) -> int:
        """Number of readings with a NaN or infinite component."""
        return int((~np.isfinite(self.field).all(axis=1)).sum())

    def __len__(self) -> int:
        return self.stamps.shape[0]


def read_magnetic_field(path: str | Path, topic: str | None = None) -> MagneticFieldSeries:
    """Every MagneticField message of ``topic`` (or of the bag's only MagneticField topic)."""
    with Bag(path) as bag:
        topic = bag.mag_topic(topic)
        samples = [decode_magnetic_field(msg, t) for _, t, _, msg in bag.messages([topic])]
    stamps = np.array([s.stamp for s in samples], dtype=np.float64)
    field = np.array([s.field for s in samples], dtype=np.float64).reshape(-1, 3)
    return MagneticFieldSeries(topic, stamps, field, samples[0].frame_id if samples else "")


# --------------------------------------------------------------------------------------------- pose source


@dataclass(frozen=True)
class PoseSource:
    """Where the replay takes the pose from: a pose topic, or the tf chain ``parent`` → ``child``."""

    kind: str            # "topic" or "tf"
    topic: str = ""      # kind "topic": the pose topic
    msgtype: str = ""    # kind "topic": its message type
    parent: str = ""     # kind "tf": the map frame
    child: str = ""      # kind "tf": the frame whose pose is mapped (the magnetometer frame by default)

    def describe(self) -> str:
        if self.kind == "topic":
            return f"{self.topic} ({self.msgtype})"
        return f"/tf chain {self.parent} -> {self.child}"


def choose_pose_source(bag: Bag, *, pose_topic: str | None = None, tf_frames: Sequence[str] | None = None,
                       map_frame: str = "map", mag_frame: str = "") -> tuple[PoseSource, "TransformBuffer | None"]:
    """Pick the pose source, and load the tf buffer when the source is tf.

    ``pose_topic`` wins, then ``tf_frames`` (parent, child). Otherwise the preference is PoseStamped >
    Odometry > PoseWithCovarianceStamped > the /tf chain from ``map_frame`` to ``mag_frame``; two topics of
    the preferred type are ambiguous (TopicError). NoPoseSourceError when nothing fits.
    """
    if pose_topic and tf_frames:
        raise TopicError("give either a pose topic or a tf chain (--tf PARENT CHILD), not both")
    if pose_topic:
        return PoseSource("topic", topic=pose_topic,
                          msgtype=bag.require_type(pose_topic, POSE_TYPES, "pose")), None
    tf_topics = bag.topics_of_type(TF_TYPES)
    if tf_frames:
        parent, child = (_frame(f) for f in tf_frames)
        if not tf_topics:
            raise NoPoseSourceError(f"--tf {parent} {child} was given but {bag.path} has no tf topic "
                                    f"({' or '.join(TF_TYPES)}); {bag.describe_topics()}")
        buffer = TransformBuffer.from_bag(bag, tf_topics)
        buffer.check_connected(parent, child)
        return PoseSource("tf", parent=parent, child=child), buffer
    for msgtype in POSE_TYPES:
        candidates = bag.topics_of_type((msgtype,))
        if len(candidates) > 1:
            raise TopicError(f"{bag.path} has several {msgtype} topics ({', '.join(candidates)}); "
                             "choose one with --pose-topic (or use --tf PARENT CHILD)")
        if candidates:
            return PoseSource("topic", topic=candidates[0], msgtype=msgtype), None
    if tf_topics and not mag_frame:
        raise NoPoseSourceError(f"no pose topic in {bag.path}, and its magnetometer messages carry no frame_id to "
                                "look up in /tf; pass --pose-topic TOPIC or --tf PARENT CHILD")
    if tf_topics:
        buffer = TransformBuffer.from_bag(bag, tf_topics)
        parent, child = _frame(map_frame), _frame(mag_frame)
        if buffer.connected(parent, child):
            return PoseSource("tf", parent=parent, child=child), buffer
        raise NoPoseSourceError(
            f"no pose source in {bag.path}: no {', '.join(POSE_TYPES)} topic, and the tf tree does not connect "
            f"'{parent}' to the magnetometer frame '{child}' (frames in tf: {', '.join(buffer.frames) or 'none'}); "
            "pass --pose-topic TOPIC or --tf PARENT CHILD")
    raise NoPoseSourceError(f"no pose source in {bag.path}: it has no {', '.join(POSE_TYPES)} topic and no "
                            f"/tf; {bag.describe_topics()}")


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
        i = int(np.searchsorted(stamps, stamp, side="left"))  # stamps[i-1] < stamp <= stamps[i]
        if stamps[i] == stamp:
            return self.translations[i], self.rotations[i]
        t0, t1 = stamps[i - 1], stamps[i]
        if stamp - t0 > max_gap or t1 - stamp > max_gap:  # the rule of mapping.sync for pose topics
            raise TransformError(f"tf {self.parent} -> {self.child}: the transforms around {stamp:.3f} s are "
                                 f"{stamp - t0:.3f} s before and {t1 - stamp:.3f} s after it "
                                 f"(sync.max_pose_gap {max_gap} s)")
        w = (stamp - t0) / (t1 - t0)
        translation = (1.0 - w) * self.translations[i - 1] + w * self.translations[i]
        return translation, slerp(self.rotations[i - 1], self.rotations[i], w)


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
    def from_bag(cls, bag: Bag, topics: Sequence[str] | None = None) -> "TransformBuffer":
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


# --------------------------------------------------------------------------------------------- writing

# The live node's map topics (gp_mapping/ros/mapper_node.py, default node name "mapper"), so that
# `ros2 bag play maps.mcap` feeds RViz exactly as the node would.
MAP_NAMESPACE = "/mapper"
OCCUPANCY_GRID = "nav_msgs/msg/OccupancyGrid"
POINT_CLOUD = "sensor_msgs/msg/PointCloud2"
FLOAT64_ARRAY = "std_msgs/msg/Float64MultiArray"
# Column labels of the scale message (one row per layer); the node's conversions use the same layout.
SCALE_COLUMNS = ("mean_offset", "mean_scale", "variance_offset", "variance_scale")


def map_topics(layers: Sequence[str], namespace: str = MAP_NAMESPACE) -> dict[str, tuple[str, str]]:
    """Layer -> (mean topic, variance topic): ``mean``/``variance`` for a magnitude map, else one pair per layer
    (``mean/x`` ... ``mean/norm``), as the node publishes them."""
    if list(layers) == ["magnitude"]:
        return {"magnitude": (f"{namespace}/mean", f"{namespace}/variance")}
    return {name: (f"{namespace}/mean/{name}", f"{namespace}/variance/{name}") for name in layers}


class MapBagError(BagError):
    """The map bag cannot be written (the output exists, or a grid is inconsistent)."""


def _latched_qos() -> list:
    """Reliable + transient-local, depth 1: how the node offers its maps (played back latched for RViz)."""
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    zero = QosTime(0, 0)
    return [Qos(QosHistory.KEEP_LAST, 1, QosReliability.RELIABLE, QosDurability.TRANSIENT_LOCAL, zero, zero,
                QosLiveliness.AUTOMATIC, zero, False)]


def _publishable_known(grid) -> np.ndarray:
    """Known cells whose mean and variance are finite in every layer (the rest are published as unknown)."""
    known = np.asarray(grid.known, dtype=bool).copy()
    for mean, var in grid.layers.values():
        known &= np.isfinite(np.asarray(mean)) & np.isfinite(np.asarray(var))
    return known


class MapBagWriter:
    """Writes map snapshots into one ROS 2 MCAP file, on the node's topics and in the node's message layout.

    Per snapshot, in the node's publishing order: ``/mapper/scale`` (std_msgs/Float64MultiArray: an L x 4
    matrix, one row ``[mean_offset, mean_scale, variance_offset, variance_scale]`` per layer, dims labelled
    ``layer:<names>`` and ``mean_offset,mean_scale,variance_offset,variance_scale;unit:<field unit>``), then
    per layer the nav_msgs/OccupancyGrid pair of :func:`map_topics` (0..100, -1 unknown, encoded by
    :func:`gp_mapping.mapping.grid.encode_occupancy`; a cell value ``c`` decodes as ``offset + scale * c``),
    then ``/mapper/cloud`` (sensor_msgs/PointCloud2, float32 ``x, y, z, mean, variance``, or ``mean_<layer>``
    ... ``variance_<layer>`` for a vector map, one point per known cell). Headers carry the grid's stamp (the
    newest sample in the model), as the node's do; the bag's log time is the replay's bag time. All topics are
    offered reliable + transient local, depth 1, so ``ros2 bag play`` serves them latched to RViz.

    The file is written in a temporary rosbag2 folder beside ``path`` and moved into place on :meth:`close`,
    so a failed replay leaves no half-written file. The MCAP embeds the rosbag2 metadata: ``ros2 bag play
    maps.mcap`` and rosbags' readers take the bare file.
    """

    def __init__(self, path: str | Path, field_unit: str, overwrite: bool = False, mean_range=None,
                 variance_range=None) -> None:
        """``mean_range`` / ``variance_range``: the config's ``grid.mean_range`` / ``grid.variance_range``
        (empty or None: each snapshot's own min..max), as the node encodes them."""
        from rosbags.rosbag2 import CompressionFormat, CompressionMode, StoragePlugin, Writer
        from rosbags.typesys import Stores, get_typestore

        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise MapBagError(f"{self.path} exists already; remove it or choose another output directory")
        self.field_unit = field_unit
        self.mean_range, self.variance_range = mean_range, variance_range
        self.count = 0
        self._tmp = Path(tempfile.mkdtemp(prefix=".maps-", dir=self.path.parent))
        self._ts = get_typestore(getattr(Stores, DEFAULT_ROS2_DISTRO))
        # rosbag2 names the storage file after the bag folder, so the metadata inside names the final file.
        self._writer = Writer(self._tmp / self.path.stem, version=9, storage_plugin=StoragePlugin.MCAP)
        # zstd chunks (MCAP's own compression, read by rosbag2 and rosbags): successive maps are alike.
        self._writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        self._writer.open()
        self._conns: dict[str, Any] = {}

    def _connection(self, topic: str, msgtype: str):
        if topic not in self._conns:
            self._conns[topic] = self._writer.add_connection(topic, msgtype, typestore=self._ts,
                                                             offered_qos_profiles=_latched_qos())
        return self._conns[topic]

    def _put(self, topic: str, msgtype: str, msg, log_ns: int) -> None:
        self._writer.write(self._connection(topic, msgtype), log_ns, self._ts.serialize_cdr(msg, msgtype))

    def __enter__(self) -> "MapBagWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _header(self, stamp_ns: int, frame_id: str):
        T = self._ts.types
        return T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=stamp_ns // 10**9,
                                                                                nanosec=stamp_ns % 10**9),
                                        frame_id=frame_id)

    def _occupancy(self, grid, data: np.ndarray, stamp_ns: int):
        T, spec = self._ts.types, grid.spec
        origin = T["geometry_msgs/msg/Pose"](
            position=T["geometry_msgs/msg/Point"](x=float(spec.origin_x), y=float(spec.origin_y), z=0.0),
            orientation=T["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0))
        info = T["nav_msgs/msg/MapMetaData"](map_load_time=self._header(stamp_ns, "").stamp,
                                             resolution=float(spec.resolution), width=int(spec.width),
                                             height=int(spec.height), origin=origin)
        return T["nav_msgs/msg/OccupancyGrid"](header=self._header(stamp_ns, grid.frame_id), info=info,
                                               data=np.asarray(data, dtype=np.int8))

    def _cloud(self, grid, known: np.ndarray, stamp_ns: int):
        T, spec = self._ts.types, grid.spec
        names = list(grid.layers)
        fields = ["x", "y", "z"] + (["mean", "variance"] if names == ["magnitude"] else
                                    [f"mean_{n}" for n in names] + [f"variance_{n}" for n in names])
        rows, cols = np.nonzero(known)
        columns = [spec.origin_x + (cols + 0.5) * spec.resolution, spec.origin_y + (rows + 0.5) * spec.resolution,
                   np.full(rows.shape, float(grid.height))]
        columns += [np.asarray(grid.layers[n][0])[rows, cols] for n in names]
        columns += [np.asarray(grid.layers[n][1])[rows, cols] for n in names]
        points = np.column_stack(columns).astype("<f4").reshape(-1, len(fields))
        point_field = T["sensor_msgs/msg/PointField"]
        return T["sensor_msgs/msg/PointCloud2"](
            header=self._header(stamp_ns, grid.frame_id), height=1, width=int(points.shape[0]),
            fields=[point_field(name=n, offset=4 * i, datatype=point_field.FLOAT32, count=1)
                    for i, n in enumerate(fields)],
            is_bigendian=False, point_step=4 * len(fields), row_step=4 * len(fields) * int(points.shape[0]),
            data=np.frombuffer(points.tobytes(), dtype=np.uint8), is_dense=True)

    def _scale(self, rows: list[tuple[str, float, float, float, float]]):
        T = self._ts.types
        dim = T["std_msgs/msg/MultiArrayDimension"]
        n = len(rows)
        layout = T["std_msgs/msg/MultiArrayLayout"](
            dim=[dim(label="layer:" + ",".join(r[0] for r in rows), size=n, stride=4 * n),
                 dim(label=",".join(SCALE_COLUMNS) + ";unit:" + self.field_unit, size=4, stride=4)],
            data_offset=0)
        return T["std_msgs/msg/Float64MultiArray"](layout=layout,
                                                   data=np.array([v for r in rows for v in r[1:]], dtype=np.float64))

    def write(self, grid, bag_time: float) -> None:
        """Record one snapshot of ``grid`` (a MapGrid) at ``bag_time`` [s]."""
        from gp_mapping.mapping.grid import encode_occupancy

        for name, value in (("bag time", bag_time), ("grid stamp", grid.stamp)):
            if not (math.isfinite(value) and value >= 0):
                raise MapBagError(f"a snapshot's {name} must be finite and non-negative, got {value!r}")
        log_ns, stamp_ns = int(round(bag_time * 1e9)), int(round(grid.stamp * 1e9))
        known = _publishable_known(grid)
        rows, grids = [], []
        topics = map_topics(list(grid.layers))
        for name, (mean, var) in grid.layers.items():
            m_data, m_off, m_scale = encode_occupancy(np.asarray(mean, dtype=np.float64), known, self.mean_range)
            v_data, v_off, v_scale = encode_occupancy(np.asarray(var, dtype=np.float64), known,
                                                      self.variance_range)
            rows.append((name, m_off, m_scale, v_off, v_scale))
            grids += [(topics[name][0], m_data), (topics[name][1], v_data)]
        # The scale first, as the node publishes it, so a grid always meets the scale that decodes it.
        self._put(f"{MAP_NAMESPACE}/scale", FLOAT64_ARRAY, self._scale(rows), log_ns)
        for topic, data in grids:
            self._put(topic, OCCUPANCY_GRID, self._occupancy(grid, data, stamp_ns), log_ns)
        self._put(f"{MAP_NAMESPACE}/cloud", POINT_CLOUD, self._cloud(grid, known, stamp_ns), log_ns)
        self.count += 1

    def close(self) -> Path:
        """Finish the bag and move the MCAP file to ``path``."""
        self._writer.close()
        storage = self._tmp / self.path.stem / f"{self.path.stem}.mcap"
        shutil.move(str(storage), str(self.path))
        shutil.rmtree(self._tmp, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Drop everything written (nothing appears at ``path``)."""
        try:
            if self._writer.storage is not None:
                self._writer.abort()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)
