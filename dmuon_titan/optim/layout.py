"""Where the Muon matrices live, as the optimizer sees them: which parameters form the Muon
group, which ones this rank updates, how a matrix's momentum direction reaches the
Newton–Schulz input, and which tensor its update lands in.

Two layouts: :class:`OwnedLayout`, DMuon's (each matrix whole on its owner), and
:class:`GatheredLayout`, the naive baseline's (every matrix an FSDP2 shard, gathered whole on
every rank for Newton–Schulz). :class:`~dmuon_titan.optim.muon.Muon` takes one and runs the
same step over either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..ops import fused, newton_schulz, update
from ..runtime.owned_param import is_dedicated
from ..runtime.state import STATE_ATTR, DMuonState


class MatrixLayout(Protocol):
    """What the optimizer asks of a layout."""

    #: the DMuon state of the model (None: a model without dedicated parameters)
    dmuon: DMuonState | None
    #: whether this rank updates whole plain matrices (so foreach passes over several apply)
    whole_matrices: bool

    def split(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(Muon group, AdamW group) of ``model``'s trainable parameters."""

    def stepped(self, muon_params: list[torch.Tensor], owned: set[int]) -> set[int]:
        """ids of the Muon-group parameters this rank updates (``owned``: the follower's)."""

    def write_direction(
        self,
        p: torch.Tensor,
        buffer: torch.Tensor,
        group: dict[str, Any],
        out: torch.Tensor,
        grad_address: torch.Tensor | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """Momentum step of ``p`` (its momentum ``buffer``), its whole direction into ``out``."""

    def target(self, p: torch.Tensor, ortho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tensor this rank updates, its part of the orthogonalized ``ortho``)."""


class OwnedLayout:
    """DMuon's layout: every dedicated matrix whole on its owner (the Muon group), every
    other trainable parameter in the AdamW group."""

    whole_matrices = True

    def __init__(self, model: nn.Module) -> None:
        self.dmuon: DMuonState | None = getattr(model, STATE_ATTR, None)

    def split(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dedicated = [p.owned for p in self.dmuon.params] if self.dmuon else []
        others = [p for p in model.parameters() if p.requires_grad and not is_dedicated(p)]
        return dedicated, others

    def stepped(self, muon_params: list[torch.Tensor], owned: set[int]) -> set[int]:
        return owned

    def write_direction(self, p, buffer, group, out, grad_address=None, grad_scale=None) -> None:
        """One fused pass on a GPU (eagerly, the cast happens in lerp's store, rounding once
        as a copy would). For a float16 ``out`` the direction is normalized first, in full
        precision (float16's range). ``grad_address``, ``grad_scale``: see
        :func:`~dmuon_titan.ops.fused.momentum_direction_into`."""
        if out.dtype == torch.float16 and p.grad.dtype != torch.float16:
            direction = update.momentum_direction(
                p.grad, buffer, group["momentum"], group["nesterov"]
            )
            newton_schulz.normalize_into(direction, out, group["eps"])
            return
        fused.momentum_direction_into(
            p.grad, buffer, out, group["momentum"], group["nesterov"], grad_address, grad_scale
        )

    def target(self, p: torch.Tensor, ortho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return p, ortho


class GatheredLayout:
    """The naive baseline's layout: the Muon group chosen by ``predicate(fqn, param)`` among
    FSDP2 parameters; every rank gathers each direction whole, runs Newton–Schulz on it and
    keeps its own shard of the result."""

    whole_matrices = False
    dmuon = None

    def __init__(
        self,
        predicate: Callable[[str, torch.Tensor], bool],
        clean_fqn: Callable[[str], str],
    ) -> None:
        self.predicate, self.clean_fqn = predicate, clean_fqn

    def split(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        muon, others = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if self.predicate(self.clean_fqn(name), p):
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon parameter {self.clean_fqn(name)!r} is not 2-D: {tuple(p.shape)}"
                    )
                muon.append(p)
            else:
                others.append(p)
        return muon, others

    def stepped(self, muon_params: list[torch.Tensor], owned: set[int]) -> set[int]:
        return {id(p) for p in muon_params}  # every rank steps every matrix

    def write_direction(self, p, buffer, group, out, grad_address=None, grad_scale=None) -> None:
        # (grad_address, grad_scale: a captured step's, and this layout is never captured)
        direction = update.momentum_direction(p.grad, buffer, group["momentum"], group["nesterov"])
        out.copy_(direction.full_tensor() if isinstance(direction, DTensor) else direction)

    def target(self, p: torch.Tensor, ortho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(p, DTensor):
            return p, ortho
        ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
        return p.to_local(), ortho.to_local()
