"""Keeping the Muon group on the dedicated parameters the model holds now.

``to_empty`` (a meta model) replaces every plain parameter object; FSDP2's keep theirs. An
optimizer built before ``to_empty`` would otherwise step the discarded meta tensors: the
dedicated slots are followed (their state moves along).
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.state import DMuonState


class DedicatedFollower:
    """Follows the dedicated slots of one model for one optimizer's Muon group."""

    def __init__(self, dmuon: DMuonState | None) -> None:
        self.dmuon = dmuon
        #: ids of the matrices this rank owns, as :meth:`follow` last found them (None: not yet)
        self.owned: set[int] | None = None
        #: (module slots, attribute, parameter) per dedicated matrix, as :meth:`follow` last
        #: left the Muon group (None: not yet)
        self._followed: list[tuple[dict, str, torch.Tensor]] | None = None

    def follow(self, held: list[torch.Tensor], state: dict[torch.Tensor, Any]) -> bool:
        """Point ``held`` (the Muon group's params) at the dedicated parameters the model
        holds now, moving their ``state`` along; whether anything had to be looked at again
        (the usual step finds every slot as it was, at a fraction of the host time)."""
        if self.dmuon is None or self._still_followed(held):
            return False
        owned = set()
        for i, p in enumerate(self.dmuon.params):
            current = p.owned
            if held[i] is not current:
                if held[i] in state:
                    state[current] = state.pop(held[i])
                held[i] = current
            if p.is_owner:
                owned.add(id(current))
        self.owned = owned
        self._followed = [
            (p.module._parameters, p.attr, held[i]) for i, p in enumerate(self.dmuon.params)
        ]
        return True

    def _still_followed(self, held: list[torch.Tensor]) -> bool:
        """Whether every dedicated slot still holds the parameter :meth:`follow` last put in
        the Muon group."""
        followed = self._followed
        if followed is None:
            return False
        return len(held) == len(followed) and all(
            slots.get(attr) is param and current is param
            for (slots, attr, param), current in zip(followed, held, strict=True)
        )


def check_not_meta(params: list[torch.Tensor], names: dict[int, str]) -> None:
    """An AdamW parameter still on the meta device is an error naming it."""
    for p in params:
        if p.is_meta:
            name = names.get(id(p), f"of shape {tuple(p.shape)}")
            raise RuntimeError(
                f"Muon: parameter {name!r} (AdamW group) is still on the meta device: "
                "build the optimizer after model.to_empty(...) (FSDP2 parameters survive "
                "to_empty, parameters of modules without fully_shard do not)"
            )
