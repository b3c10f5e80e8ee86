"""GP engines for magnetic-field mapping (pure PyTorch, no ROS, no I/O).

Every engine is a :class:`~gp_mapping.gp.base.Engine` (a ``torch.nn.Module``: ``update(x, y, mode=None) -> dict``,
``predict(x) -> (mean, var)``, ``log_predictive_density(x, y)``, ``num_seen``, ``device`` and a tensors-only
``state_dict``); it is built from the ``model`` section of the configuration (:class:`ModelConfig`) by
:func:`build_model`, which looks the engine up by name. Nothing here imports from the package outside ``gp/``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from .base import Engine, IncrementalPrediction, Recyclable, resolve_device
from .config import ModelConfig, section_from_dict
from .continual_mogp import ContinualMOGP
from .dual_svgp import DualSVGP
from .errors import ConfigError, GPNumericalError, ModelInputError
from .likelihoods import BernoulliLikelihood, GaussianLikelihood, StudentTLikelihood
from .smc_experts import SMCExperts
from .tiles import TiledModel, can_tile
from .var_gp import VARGP

EngineFactory = Callable[[ModelConfig, int, int], Any]

#: engine name (``model.engine``) -> factory(model_config, input_dims, output_dims)
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: make a factory available as ``model.engine: <name>``."""
    def decorate(factory: EngineFactory) -> EngineFactory:
        if name in ENGINES:
            raise ValueError(f"GP engine {name!r} is already registered")
        ENGINES[name] = factory
        return factory
    return decorate


register_engine("dual_svgp")(DualSVGP)
register_engine("continual_mogp")(ContinualMOGP)
register_engine("smc_experts")(SMCExperts)
register_engine("var_gp")(VARGP)


def build_model(model_config: ModelConfig | Mapping[str, Any], input_dims: int, output_dims: int):
    """The engine ``model_config.engine`` names, for ``input_dims`` inputs and ``output_dims`` outputs.

    ``model_config`` is a ModelConfig, or a mapping of its keys (validated like the YAML). A bad setting is a
    ConfigError naming the ModelConfig field; the caller that read it from a file names the file's key
    (``err.under("model.")``).
    """
    if isinstance(model_config, Mapping):
        model_config = section_from_dict(ModelConfig, model_config)
    try:
        factory = ENGINES[model_config.engine]
    except KeyError:
        raise ConfigError(f"unknown engine {model_config.engine!r}; registered: {', '.join(sorted(ENGINES))}",
                          "engine") from None
    # Local submaps: tiles of this engine (gp/tiles/) over the plane. Engines that cover a growing map their
    # own way (smc_experts, var_gp) and 1-D inputs (a series, not a map) are not tiled.
    if model_config.tile_size > 0 and can_tile(factory) and int(input_dims) >= 2:
        return TiledModel(model_config, int(input_dims), int(output_dims), factory)
    return factory(model_config, int(input_dims), int(output_dims))


def warm_up() -> None:
    """Load now what torch loads on the engines' first optimiser: ``torch.optim`` imports ``torch._dynamo`` the
    first time an optimiser is made, about 2.5 s of Python on a small CPU (10 s on two cores while a node takes
    1 kHz of messages). A live node calls this before data arrive, so its first update does not stall."""
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


__all__ = ["BernoulliLikelihood", "ConfigError", "ContinualMOGP", "DualSVGP", "ENGINES", "Engine", "GPNumericalError",
           "GaussianLikelihood", "IncrementalPrediction", "ModelConfig", "ModelInputError", "Recyclable", "SMCExperts", "StudentTLikelihood", "TiledModel",
           "VARGP", "build_model", "register_engine", "resolve_device", "warm_up"]
