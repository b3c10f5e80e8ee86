"""The continual multi-output GP engine (``model.engine: continual_mogp``): the engine in :mod:`.model`, its
bounds and E-step in :mod:`.bound`, its inducing inputs in :mod:`.placement`, an update's memo in :mod:`.memo`."""
from .bound import LatentPosterior
from .model import MIXING_LEARNING, ContinualMOGP

__all__ = ["ContinualMOGP", "LatentPosterior", "MIXING_LEARNING"]
