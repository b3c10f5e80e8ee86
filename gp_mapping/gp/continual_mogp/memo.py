"""The memo of one update of the continual multi-output GP: factors and solves computed without a gradient are
kept for the rest of the update, keyed by the objects they came from and those objects' versions."""
from __future__ import annotations

import torch
from torch import nn


class UpdateMemo:
    """Mixin of :class:`~.model.ContinualMOGP`: ``self._memo`` is a dict while ``update()`` runs, else None."""

    _memo: dict | None

    def _memoised(self, name: str, refs: tuple, versions: tuple, compute):
        """compute(), or its value from earlier in this update when computed without a gradient from the same
        objects (``refs``, held by the entry so that their ids stay theirs) in the same state (``versions``:
        their in-place modification counters). An update asks for the same factors many times: every E-step,
        placement and continual prior of every latent."""
        memo = self._memo
        if memo is None or torch.is_grad_enabled():
            return compute()
        hit = self._memo_lookup(name, refs, versions)
        if hit is not None:
            return hit
        value = compute()
        self._memo_store(name, refs, versions, value)
        return value

    def _memo_lookup(self, name: str, refs: tuple, versions: tuple):
        """The memo's value for these objects in this state, or None."""
        if self._memo is None:
            return None
        hit = self._memo.get((name, tuple(id(r) for r in refs), versions))
        return hit[1] if hit is not None and all(a is b for a, b in zip(hit[0], refs)) else None

    def _memo_store(self, name: str, refs: tuple, versions: tuple, value) -> None:
        memo = self._memo
        while len(memo) >= 64:  # bounded; the oldest go first (factors of hyperparameters the M-step has left)
            del memo[next(iter(memo))]
        memo[(name, tuple(id(r) for r in refs), versions)] = (refs, value)

    def _parameters_of(self, module: nn.Module) -> list[nn.Parameter]:
        """module.parameters(), listed once per update: the memo's keys ask for them thousands of times, and
        walking the module tree each time cost ~5 % of an update."""
        params = self._memo_lookup("parameters", (module,), ())
        if params is None:
            params = list(module.parameters())
            if self._memo is not None:  # (with gradients too: a list of parameters holds no graph)
                self._memo_store("parameters", (module,), (), params)
        return params
