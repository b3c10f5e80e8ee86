"""The memory-based dual SVGP engine (``model.engine: dual_svgp``): the engine in :mod:`.model`; the data's sites and
the posterior they give in :mod:`.sites`; where the inducing inputs go and how the old part follows them in
:mod:`.placement`; the hyperparameter (and inducing-input) steps in :mod:`.hyperparameters`; the memory in
:mod:`.memory`; the posterior as a recyclable summary for a merge of maps in :mod:`.recyclable`."""
from .model import DEFAULT_MAX_PENDING, DualSVGP
from .placement import COVER_LOST

__all__ = ["COVER_LOST", "DEFAULT_MAX_PENDING", "DualSVGP"]
