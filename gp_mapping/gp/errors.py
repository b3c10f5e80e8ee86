"""The errors the GP engines raise, in one module so that callers catch them without importing an engine.

Inside ``gp/`` a setting is named as the engine knows it (a :class:`~gp_mapping.gp.config.ModelConfig` field,
``'device'``); the layer that read it from a file names it as the file does (``'model.device'``) with
:meth:`ConfigError.under`.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A setting is unknown or outside what is allowed.

    ``ConfigError(why, key)`` reads "config key 'KEY': WHY" ("unknown config key 'KEY'; WHY" with ``unknown``);
    without a key, just ``why``.
    """

    def __init__(self, why: str, key: str | None = None, *, unknown: bool = False) -> None:
        self.why, self.key, self.unknown = why, key, unknown
        if key is None:
            message = why
        elif unknown:
            message = f"unknown config key '{key}'; {why}"
        else:
            message = f"config key '{key}': {why}"
        super().__init__(message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key as the caller's file names it (``prefix`` + key, e.g. ``'model.'``)."""
        if self.key is None:
            return self
        return type(self)(self.why, prefix + self.key, unknown=self.unknown)


class ModelInputError(ValueError):
    """Inputs or targets given to a model have the wrong shape, type or non-finite values."""


class GPNumericalError(ArithmeticError):
    """A matrix that must be positive definite could not be factorised even with the largest jitter."""
