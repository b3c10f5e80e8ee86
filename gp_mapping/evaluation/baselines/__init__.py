"""Reference predictors that the online engine is judged against.

* :class:`NearestNeighbour` and :class:`ConstantMean`: the floor any map must beat by a wide margin.
* :class:`OfflineSVGP`: the gold standard for a sparse map, a batch SVGP (GPyTorch) with the same number
  of inducing points and the same kernel as the engine, trained on all data at once.
* :class:`ExactGPBaseline`: the exact GP (GPyTorch ExactGP, Cholesky), on a random subsample when the data
  are too many for an O(N^3) factorisation.
* :class:`StreamingSparseGP`: the streaming sparse GP of Bui, Nguyen and Turner (2017), OSGPR-VFE, the
  streaming baseline every seed paper compares against (written here from the paper; the engine's kernels).

The GP baselines share the engine's interface: ``predict(x) -> (mean, var)`` of the latent f in the units
of y, and ``log_predictive_density(x, y)``. Targets are standardised inside, as the engine does. GPyTorch is

The package: the scores and input checks (:mod:`.metrics`), the simple baselines (:mod:`.simple`), what the GP
baselines share (:mod:`.gp_base`), the offline GPs (:mod:`.offline`), the streaming sparse GP (:mod:`.streaming`)
and the reduced-rank GP (:mod:`.reduced_rank`).
"""
from .gp_base import KERNELS, BaselineScores, KernelSpec
from .metrics import BaselineError, gaussian_log_density, nlpd, rmse
from .offline import ExactGPBaseline, OfflineSVGP
from .reduced_rank import ReducedRankGP
from .simple import ConstantMean, NearestNeighbour
from .streaming import StreamingSparseGP

__all__ = ["KERNELS", "BaselineError", "BaselineScores", "ConstantMean", "ExactGPBaseline", "KernelSpec",
           "NearestNeighbour", "OfflineSVGP", "ReducedRankGP", "StreamingSparseGP", "gaussian_log_density", "nlpd",
           "rmse"]
