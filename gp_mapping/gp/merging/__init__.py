"""Merging maps without their data (recyclable GPs): the math, apart from the engines.

- :mod:`.sources`: a local map as a Gaussian pseudo-likelihood on its inducing values (:class:`Source`, from an
  engine's ``recyclable_summary()``), the frame it is moved by (:class:`RigidTransform`), :class:`MergeError`;
- :mod:`.recyclable`: the ensemble bound and the merge (:func:`merge`), the merged map as a dual SVGP
  (:func:`merged_engine`, :func:`load_merged`).

Tiled maps merge tile by tile with this merge (``gp/tiles/merge.py``); maps, state files and the merger node
build on it above ``gp/`` (``mapping/merge.py``, ``merge_cli.py``, ``ros/merger_node.py``).
"""
from .recyclable import (COMPRESSING_STEPS, MergeResult, RawData, RecyclableMerge, explains_sources, initial_inducing,
                         initial_kernel, load_merged, merge, merged_engine)
from .sources import MergeError, RigidTransform, Source, dual_sum, sites_from_moments, source_from_engine

__all__ = ["COMPRESSING_STEPS", "MergeError", "MergeResult", "RawData", "RecyclableMerge", "RigidTransform", "Source",
           "dual_sum", "explains_sources", "initial_inducing", "initial_kernel", "load_merged", "merge",
           "merged_engine", "sites_from_moments", "source_from_engine"]
