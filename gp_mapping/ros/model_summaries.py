"""The mapping node's model summaries: what a merger node merges, sent on ``~/model``.

Every ``node.model_period`` seconds (0: never) the node sends its model's recyclable summary
(:func:`gp_mapping.mapping.merge.encode_summary`: safetensors bytes in a std_msgs/UInt8MultiArray, latched) if the
map took data since the last one. A summary over ``node.model_max_bytes`` is never stopped for good; it is sent in
the first of these forms that fits:

1. whole, float64;
2. a tiled map: in parts, one per period, each as many tiles as fit (those that took data first,
   :class:`gp_mapping.mapping.merge.TileRotation`; the merger puts them together), float64, then float32;
   a map of one engine: whole in float32;
3. the same with the map-wide parts (visited cells, trajectory) coarsened, one level after another
   (:func:`gp_mapping.mapping.merge.reduced`).

A form's size is measured where it is cheap (the map-wide parts: encoded without tiles) and estimated per tile
(:func:`gp_mapping.mapping.merge.tile_summary_bytes`, a little over); whatever is sent is checked against the
limit. A summary that fits in none is counted (``too_large``) and logged, and tried again at the next period.
"""
from __future__ import annotations

from std_msgs.msg import UInt8MultiArray

from gp_mapping.mapping.merge import MapSource, TileRotation, encode_summary, reduced, tile_summary_bytes
from gp_mapping.ros.publishers import MAP_QOS

MODEL_TOPIC = "~/model"  # the model summary a merger node merges (std_msgs/UInt8MultiArray: safetensors bytes)
MAX_REDUCTION_LEVELS = 8  # coarsenings of the map-wide parts tried (visited cells at up to 256 x their resolution)


class ModelSummaries:
    """Mixin of the mapping node: the ~/model publisher and :meth:`publish_model` (on the update thread)."""

    def _setup_model_summaries(self) -> None:
        self._model_pub = self.create_publisher(UInt8MultiArray, MODEL_TOPIC, MAP_QOS)
        self._model = {"sent": 0, "parts": 0, "reduced": 0, "too_large": 0, "failed": 0, "bytes": 0, "num_seen": -1}
        self._model_form = "whole"  # how the last summary went (a change is logged once)
        self._tile_rotation = TileRotation()  # which tiles the next part of a large tiled map's summary carries

    def _sends_model_summaries(self) -> bool:
        """Whether ~/model is on: ``node.model_period`` > 0 and a model that has a recyclable summary."""
        from gp_mapping.gp import Recyclable

        return self.config.node.model_period > 0 and isinstance(self.mapper.model, Recyclable)

    def publish_model(self) -> bool:
        """Send the model summary on ~/model if the map took data since the last one (on the update thread), in the
        first form that fits ``node.model_max_bytes`` (see the module docstring); parts of a tiled map go on while
        the map stands still, so a merger that starts late completes it. Returns whether one was sent."""
        limit = self.config.node.model_max_bytes
        with self._lock:
            seen = int(self.mapper.model.num_seen)
            if seen == 0:
                return False
            try:
                chosen = self._fitting_summary(limit, seen)
            except Exception as err:
                self._model["failed"] += 1
                self._report(f"model summary failed: {type(err).__name__}: {err}")
                return False
        if chosen is None:
            return False
        data, form, part, samples = chosen
        if data is None:
            self._model["too_large"] += 1
            self.get_logger().warning(
                f"~/model: the model summary does not fit node.model_max_bytes = {limit} even reduced ({form}); not "
                "sent this time, tried again at the next period (raise node.model_max_bytes, or merge the saved map "
                "with gp-mapping merge)", throttle_duration_sec=60.0)
            return False
        msg = UInt8MultiArray()
        msg.data = data
        self._model_pub.publish(msg)
        if form != self._model_form:
            self.get_logger().info(f"~/model: the model summary is sent {form} from now on (node.model_max_bytes = "
                                   f"{limit}; {len(data)} bytes)")
            self._model_form = form
        if part is not None:
            self._tile_rotation.sent(part, samples)
            self._model["parts"] += 1
        if form != "whole":
            self._model["reduced"] += 1
        self._model.update(sent=self._model["sent"] + 1, bytes=len(data), num_seen=seen)
        return True

    def _fitting_summary(self, limit: int, seen: int):
        """(bytes or None where nothing fits, the form's description, the part's tiles or None, the tiles' samples)
        of the first form that fits ``limit`` (caller holds ``_lock``); None when there is nothing to send (the map
        of one engine, or a tiled map sent whole, has not changed since the last summary)."""
        mapper, name = self.mapper, self.get_fully_qualified_name()
        model = mapper.model
        tiled = tile_summary_bytes(model) is not None
        unchanged = seen == self._model["num_seen"]
        if not tiled:
            if unchanged:
                return None
            whole = MapSource.from_mapper(name, mapper)
            for precision in ("float64", "float32"):
                for level in range(MAX_REDUCTION_LEVELS + 1) if precision == "float32" else (0,):
                    data = encode_summary(reduced(whole, level), precision)
                    if len(data) <= limit:
                        return data, _form(None, precision, level), None, None
            return None, _form(None, "float32", MAX_REDUCTION_LEVELS), None, None
        samples = model.tile_samples()
        for level in range(MAX_REDUCTION_LEVELS + 1):
            # The map-wide parts, measured: a part that holds no tile (the tile list, cells, trajectory, config).
            overhead = len(encode_summary(reduced(MapSource.from_mapper(name, mapper, tiles=[]), level)))
            for precision in ("float64", "float32"):
                sizes = tile_summary_bytes(model, precision)
                if level == 0 and precision == "float64" and overhead + sum(sizes.values()) <= limit:
                    if unchanged:
                        return None
                    data = encode_summary(MapSource.from_mapper(name, mapper), precision)
                    if len(data) <= limit:
                        return data, "whole", None, None
                if max(sizes.values()) > limit - overhead:
                    continue  # a tile no part of this form can carry: the merger could never finish
                part = self._tile_rotation.choose(samples, sizes, limit - overhead)
                data = encode_summary(reduced(MapSource.from_mapper(name, mapper, tiles=part), level), precision)
                if len(data) <= limit:
                    return data, _form(part, precision, level, len(samples)), part, samples
        return None, _form([], "float32", MAX_REDUCTION_LEVELS, len(samples)), None, None


def _form(part, precision: str, level: int, tiles: int = 0) -> str:
    """How a summary is sent, in words (logs)."""
    words = [] if part is None else [f"in parts ({len(part)} of {tiles} tiles in this one)"]
    if precision != "float64":
        words.append(precision)
    if level:
        words.append(f"visited cells at {2 ** level} x their resolution, every {2 ** level}th trajectory point")
    return ", ".join(words) if words else "whole"
