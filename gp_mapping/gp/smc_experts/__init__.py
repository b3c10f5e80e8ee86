"""The SMC mixture of GP experts (``model.engine: smc_experts``): the engine in :mod:`.model`; its experts' GPs in
:mod:`.experts`, their gate in :mod:`.gating`, their memories in :mod:`.memory`; the Dirichlet-process and sampling
primitives in :mod:`.dp_mixture`."""
from .model import SMCExperts

__all__ = ["SMCExperts"]
