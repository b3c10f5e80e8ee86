"""Reading recorded bags with the ``rosbags`` library: ROS 1 (``.bag``) and ROS 2 (a rosbag2 folder, or a bare
``.db3`` / ``.mcap`` file) recordings without a ROS installation. :class:`Bag` lists topics and delivers decoded
messages in bag-time order; :func:`choose_pose_source` picks where the pose comes from: a pose topic
(``PoseStamped``, ``Odometry`` or ``PoseWithCovarianceStamped``) or the bag's tf tree.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from gp_mapping.bag.decode import MAGNETIC_FIELD, POSE_TYPES, TF_TYPES, _frame, decode_magnetic_field
from gp_mapping.bag.errors import (BagNotFoundError, CorruptBagError, NoMagneticFieldError, NoPoseSourceError,
                                   NoTransformChainError, NotABagError, TopicError)
from gp_mapping.bag.ros2 import ros2_typestore
from gp_mapping.bag.tf import TransformBuffer, transform_buffer_from_bag  # noqa: F401
from gp_mapping.mapping import transforms

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

        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise BagNotFoundError(f"bag {self.path} does not exist")
        storage = _resolve_bag_path(self.path)
        typestore = ros2_typestore()
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
        buffer = transform_buffer_from_bag(bag, tf_topics)
        try:
            buffer.check_connected(parent, child)
        except transforms.TransformError as err:  # a bag problem, named as the others are (a BagError)
            raise NoTransformChainError(f"{bag.path}: {err}") from None
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
        buffer = transform_buffer_from_bag(bag, tf_topics)
        parent, child = _frame(map_frame), _frame(mag_frame)
        if buffer.connected(parent, child):
            return PoseSource("tf", parent=parent, child=child), buffer
        raise NoPoseSourceError(
            f"no pose source in {bag.path}: no {', '.join(POSE_TYPES)} topic, and the tf tree does not connect "
            f"'{parent}' to the magnetometer frame '{child}' (frames in tf: {', '.join(buffer.frames) or 'none'}); "
            "pass --pose-topic TOPIC or --tf PARENT CHILD")
    raise NoPoseSourceError(f"no pose source in {bag.path}: it has no {', '.join(POSE_TYPES)} topic and no "
                            f"/tf; {bag.describe_topics()}")

