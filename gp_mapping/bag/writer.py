"""The replay's map bag: the published maps as a ROS 2 bag that ``ros2 bag play`` and RViz take (the map file that
needs rosbags; the others are gp_mapping/mapping/map_files.py's)."""
from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gp_mapping.bag.errors import MapBagError
from gp_mapping.bag.ros2 import latched_qos, ros2_typestore
from gp_mapping.mapping.publication import (FLOAT64_ARRAY, MAP_NAMESPACE, OCCUPANCY_GRID, POINT_CLOUD, Publication,
                                            PublicationError, cloud_topic, map_topics, publication, scale_topic)

# rosbag2's metadata.yaml version 8 (Iron's): every distribution from Humble on reads it. Version 9 (Jazzy's)
# writes offered_qos_profiles as a YAML list, where Humble's reader expects a string and refuses the bag.
METADATA_VERSION = 8


class MapBagWriter:
    """Writes map snapshots into a ROS 2 bag, on the node's topics and in the node's message layout.

    Per snapshot, the messages of :mod:`gp_mapping.mapping.publication` (the layout the node publishes) in the
    node's publishing order on the node's topics under :data:`~gp_mapping.mapping.publication.MAP_NAMESPACE`
    (``/mapper/scale``, the mean and variance grids layer by layer, ``/mapper/cloud``), so ``ros2 bag play
    maps/`` feeds RViz exactly as the node would. Headers carry the grid's stamp (the newest sample in the
    model), as the node's do; the bag's log time is the replay's bag time. All topics are offered reliable +
    transient local, depth 1, so ``ros2 bag play`` serves them latched to RViz.

    ``path`` is a rosbag2 folder (``maps/``: ``metadata.yaml`` and ``maps.mcap`` inside, as ``ros2 bag record``
    lays a bag out, metadata version :data:`METADATA_VERSION`), which ``ros2 bag play maps/`` plays with no flags
    on Humble and later and every rosbag2 reader opens; or, for a ``path`` ending in ``.mcap``, the bare MCAP file
    (the rosbag2 metadata embedded in it: ``ros2 bag play -s mcap maps.mcap`` on Humble, rosbags' readers).

    The bag is written in a temporary folder beside ``path`` and moved into place on :meth:`close`, so a failed
    replay leaves nothing half-written. With ``overwrite`` an earlier map bag at ``path`` is replaced then (a
    folder only when it is a bag: it holds ``metadata.yaml``, or nothing).
    """

    def __init__(self, path: str | Path, field_unit: str, overwrite: bool = False, mean_range=None,
                 variance_range=None) -> None:
        """``mean_range`` / ``variance_range``: the config's ``grid.mean_range`` / ``grid.variance_range``
        (empty or None: each snapshot's own min..max), as the node encodes them."""
        from rosbags.rosbag2 import CompressionFormat, CompressionMode, StoragePlugin, Writer

        self.path = Path(path)
        self.bare = self.path.suffix == ".mcap"
        if self.path.exists() or self.path.is_symlink():
            if not overwrite:
                raise MapBagError(f"{self.path} exists already; remove it or choose another output directory")
            self._check_replaceable()
        self.field_unit = field_unit
        self.mean_range, self.variance_range = mean_range, variance_range
        self.count = 0
        self._tmp = Path(tempfile.mkdtemp(prefix=".maps-", dir=self.path.parent))
        self._ts = ros2_typestore()
        # rosbags names the storage file after the bag folder (maps/maps.mcap), and the metadata names that file.
        self._writer = Writer(self._bag_folder, version=METADATA_VERSION, storage_plugin=StoragePlugin.MCAP)
        # zstd chunks (MCAP's own compression, read by rosbag2 and rosbags): successive maps are alike.
        self._writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        # metadata.yaml's custom_data (rosbag2's free key-value map): what wrote the bag, the unit of the maps.
        self._writer.set_custom_data("gp_mapping.writer", "gp_mapping.bag.MapBagWriter")
        self._writer.set_custom_data("gp_mapping.field_unit", field_unit)
        self._writer.open()
        self._conns: dict[str, Any] = {}

    @property
    def _bag_folder(self) -> Path:
        """The rosbag2 folder being written, in the temporary folder."""
        return self._tmp / (self.path.stem if self.bare else self.path.name)

    def _check_replaceable(self) -> None:
        """MapBagError unless what is at ``path`` is an earlier map bag: a file for a bare MCAP, else a folder with
        ``metadata.yaml`` or an empty one (never someone's other folder)."""
        if self.bare:
            if self.path.is_dir():
                raise MapBagError(f"{self.path} is a folder; the bare map bag is a file")
            return
        if not self.path.is_dir() or self.path.is_symlink():
            raise MapBagError(f"{self.path} exists and is not a folder; the map bag is a rosbag2 folder")
        if not (self.path / "metadata.yaml").is_file() and any(self.path.iterdir()):
            raise MapBagError(f"{self.path} is a folder that is not a bag (no metadata.yaml); it is left alone: "
                              "remove it or choose another output directory")

    def _connection(self, topic: str, msgtype: str):
        if topic not in self._conns:
            self._conns[topic] = self._writer.add_connection(topic, msgtype, typestore=self._ts,
                                                             offered_qos_profiles=latched_qos())
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

    def _cloud(self, grid, points: np.ndarray, fields: list[str], stamp_ns: int):
        T = self._ts.types
        point_field = T["sensor_msgs/msg/PointField"]
        return T["sensor_msgs/msg/PointCloud2"](
            header=self._header(stamp_ns, grid.frame_id), height=1, width=int(points.shape[0]),
            fields=[point_field(name=n, offset=4 * i, datatype=point_field.FLOAT32, count=1)
                    for i, n in enumerate(fields)],
            is_bigendian=False, point_step=4 * len(fields), row_step=4 * len(fields) * int(points.shape[0]),
            data=np.frombuffer(points.tobytes(), dtype=np.uint8), is_dense=True)

    def _scale(self, layout: Publication):
        T = self._ts.types
        dim = T["std_msgs/msg/MultiArrayDimension"]
        n = len(layout.layers)
        rows_label, columns_label = layout.scale_labels
        dims = T["std_msgs/msg/MultiArrayLayout"](
            dim=[dim(label=rows_label, size=n, stride=4 * n), dim(label=columns_label, size=4, stride=4)],
            data_offset=0)
        return T["std_msgs/msg/Float64MultiArray"](layout=dims, data=np.array(layout.scale_data, dtype=np.float64))

    def write(self, grid, bag_time: float) -> None:
        """Record one snapshot of ``grid`` (a MapGrid) at ``bag_time`` [s]."""
        for name, value in (("bag time", bag_time), ("grid stamp", grid.stamp)):
            if not (math.isfinite(value) and value >= 0):
                raise MapBagError(f"a snapshot's {name} must be finite and non-negative, got {value!r}")
        log_ns, stamp_ns = int(round(bag_time * 1e9)), int(round(grid.stamp * 1e9))
        try:
            layout = publication(grid, self.field_unit, self.mean_range, self.variance_range)
        except PublicationError as err:
            raise MapBagError(f"the map cannot be written: {err}") from err
        topics = map_topics(list(grid.layers), MAP_NAMESPACE)
        # The scale first, as the node publishes it, so a grid always meets the scale that decodes it.
        self._put(scale_topic(MAP_NAMESPACE), FLOAT64_ARRAY, self._scale(layout), log_ns)
        for layer in layout.layers:
            mean_topic, variance_topic = topics[layer.name]
            self._put(mean_topic, OCCUPANCY_GRID, self._occupancy(grid, layer.mean_data, stamp_ns), log_ns)
            self._put(variance_topic, OCCUPANCY_GRID, self._occupancy(grid, layer.variance_data, stamp_ns), log_ns)
        self._put(cloud_topic(MAP_NAMESPACE), POINT_CLOUD,
                  self._cloud(grid, layout.cloud, layout.cloud_fields, stamp_ns), log_ns)
        self.count += 1

    def close(self) -> Path:
        """Finish the bag and move it to ``path`` (replacing an earlier map bag there); returns ``path``."""
        self._writer.close()
        if self.bare:
            shutil.move(str(self._bag_folder / f"{self.path.stem}.mcap"), str(self.path))
        else:
            if self.path.exists():
                self._check_replaceable()  # still an earlier map bag: it goes, the new one takes its place
                shutil.move(str(self.path), str(self._tmp / "previous"))
            shutil.move(str(self._bag_folder), str(self.path))
        shutil.rmtree(self._tmp, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Drop everything written (nothing appears at ``path``)."""
        try:
            if self._writer.storage is not None:
                self._writer.abort()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)

