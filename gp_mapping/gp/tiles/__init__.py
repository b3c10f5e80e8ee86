"""Local submaps: a map covered by overlapping tiles of any tileable engine (``model.tile_size`` > 0).

- :mod:`.layout`: the lattice, which tiles hold a point, the blending weights (:class:`TileLayout`);
- :mod:`.shared`: what the tiles share, their hyperparameters and target unit; which engines can be tiled;
- :mod:`.model`: the tiled map, an engine itself (:class:`TiledModel`);
- :mod:`.merge`: merging tiled maps tile by tile (:func:`merge_tiled`).
"""
from .layout import TileLayout, parse_tile_key, smootherstep, tile_key
from .merge import TiledMergeResult, merge_tiled, moved_tile
from .model import TiledModel, TiledSummary
from .shared import can_tile, shared_hyperparameter_names

__all__ = ["TileLayout", "TiledMergeResult", "TiledModel", "TiledSummary", "can_tile", "merge_tiled", "moved_tile",
           "parse_tile_key", "shared_hyperparameter_names", "smootherstep", "tile_key"]
