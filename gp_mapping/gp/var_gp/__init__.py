"""The VAR-GP engine (``model.engine: var_gp``): the engine in :mod:`.model`, its region blocks in :mod:`.blocks`, the
factors of a set of blocks in :mod:`.factors`."""
from .factors import ar_joint, block_kl
from .model import VARGP

__all__ = ["VARGP", "ar_joint", "block_kl"]
