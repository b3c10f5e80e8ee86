"""The mapping node's model summaries: what a merger node merges, sent on ``~/model``.

Every ``node.model_period`` seconds (0: never) the node sends its model's recyclable summary
(:func:`gp_mapping.mapping.merge.encode_summary`: safetensors bytes in a std_msgs/UInt8MultiArray, latched) if the
map took data since the last one. A tiled map's summary grows with the map: once it is over
``node.model_max_bytes`` it goes in parts, one per period, each as many tiles as fit (those that took data first,
:class:`gp_mapping.mapping.merge.TileRotation`); the merger puts them together.
"""
from __future__ import annotations

from std_msgs.msg import UInt8MultiArray

from gp_mapping.mapping.merge import (MapSource, TileRotation, encode_summary, summary_overhead_bytes,
                                      tile_summary_bytes)
from gp_mapping.ros.publishers import MAP_QOS

MODEL_TOPIC = "~/model"  # the model summary a merger node merges (std_msgs/UInt8MultiArray: safetensors bytes)


class ModelSummaries:
    """Mixin of the mapping node: the ~/model publisher and :meth:`publish_model` (on the update thread)."""

    def _setup_model_summaries(self) -> None:
        self._model_pub = self.create_publisher(UInt8MultiArray, MODEL_TOPIC, MAP_QOS)
        self._model = {"sent": 0, "parts": 0, "too_large": 0, "failed": 0, "bytes": 0, "num_seen": -1}
        self._tile_rotation = TileRotation()  # which tiles the next part of a large tiled map's summary carries

    def _sends_model_summaries(self) -> bool:
        """Whether ~/model is on: ``node.model_period`` > 0 and a model that has a recyclable summary."""
        from gp_mapping.gp import Recyclable

        return self.config.node.model_period > 0 and isinstance(self.mapper.model, Recyclable)

    def publish_model(self) -> bool:
        """Send the model summary on ~/model if the map took data since the last one (on the update thread).
        Returns whether one was sent; a summary over ``node.model_max_bytes`` is counted and logged, not sent. A
        tiled map's summary (every tile's) grows with the map: once it is over the limit it goes in parts, one
        per period, each as many tiles as fit, those that took data first (merge.TileRotation); parts go on while
        the map stands still, so a merger that starts late completes it. Only a tile too large for a message
        alone stops it (counted, warned once: the map merges from its saved state then)."""
        limit = self.config.node.model_max_bytes
        with self._lock:
            model = self.mapper.model
            seen = int(model.num_seen)
            sizes = tile_summary_bytes(model)
            tiled = sizes is not None
            part = None
            budget = limit - summary_overhead_bytes(self.mapper) if tiled else limit
            if tiled and sum(sizes.values()) > budget:
                if max(sizes.values()) > budget:  # a tile that no part can carry: the merger could never finish
                    return self._tiled_summary_too_large(limit - budget + max(sizes.values()), limit)
                samples = model.tile_samples()
                part = self._tile_rotation.choose(samples, sizes, budget)
            if seen == 0 or (part is None and seen == self._model["num_seen"]):
                return False
            try:
                data = encode_summary(MapSource.from_mapper(self.get_fully_qualified_name(), self.mapper,
                                                            tiles=part))
            except Exception as err:
                self._model["failed"] += 1
                self._report(f"model summary failed: {type(err).__name__}: {err}")
                return False
        if len(data) > limit:
            if tiled:
                return self._tiled_summary_too_large(len(data), limit)
            self._model["too_large"] += 1
            self._report(f"model summary of {len(data)} bytes exceeds node.model_max_bytes = {limit}; not sent")
            return False
        msg = UInt8MultiArray()
        msg.data = data
        self._model_pub.publish(msg)
        if part is not None:
            if not self._model["parts"]:
                self.get_logger().info(
                    f"~/model: the tiled map's summary has outgrown node.model_max_bytes = {limit}; it goes in "
                    f"parts from now on ({len(part)} of {len(sizes)} tiles in this one; the merger puts them "
                    "together)")
            self._tile_rotation.sent(part, samples)
            self._model["parts"] += 1
        self._model.update(sent=self._model["sent"] + 1, bytes=len(data), num_seen=seen)
        return True

    def _tiled_summary_too_large(self, size: int, limit: int) -> bool:
        if not self._model["too_large"]:
            self.get_logger().warning(
                f"~/model: the tiled map's summary does not fit node.model_max_bytes = {limit} even in parts (about "
                f"{size} bytes with the map's visited cells and trajectory); not sent from now on (counted in the "
                "diagnostics): merge the saved map with gp-mapping merge, or raise node.model_max_bytes")
        self._model["too_large"] += 1
        return False
