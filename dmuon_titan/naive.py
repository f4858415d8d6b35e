"""The naive baseline: Muon on plain FSDP2, every rank gathering every matrix.

Every parameter stays on FSDP2. For each Muon matrix, every rank all-gathers the momentum
direction, runs Newton–Schulz on the whole matrix (redundantly, N times over the world) and
keeps its own shard of the result. Same update rule as :class:`dmuon_titan.Muon`, so it is the
reference DMuon is checked against inside torchtitan, and the slow baseline it is timed
against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .api import clean_fqn
from .muon import Muon


class NaiveMuon(Muon):
    """``Muon`` with the Muon group chosen by ``predicate(fqn, param)`` among FSDP2 params.

    Takes the same arguments as :class:`~dmuon_titan.Muon` after ``predicate``.
    """

    def __init__(
        self, model: nn.Module, predicate: Callable[[str, torch.Tensor], bool], *args, **kwargs
    ) -> None:
        self._predicate = predicate
        super().__init__(model, *args, **kwargs)

    def _split_params(self, model: nn.Module):
        muon, others = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if self._predicate(clean_fqn(name), p):
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon parameter {clean_fqn(name)!r} is not 2-D: {tuple(p.shape)}"
                    )
                muon.append(p)
            else:
                others.append(p)
        return muon, others

    def _stepped_ids(self) -> set[int]:
        return {id(p) for p in self.param_groups[0]["params"]}  # every rank steps every matrix

    def _gather(self, direction: torch.Tensor) -> torch.Tensor:
        return direction.full_tensor() if isinstance(direction, DTensor) else direction

    def _write_direction(
        self, p: torch.Tensor, group, out: torch.Tensor, grad_address=None, grad_scale=None
    ) -> None:
        # (grad_address, grad_scale: a captured step's, and this path is never captured: no
        # DMuon state)
        out.copy_(self._gather(self._direction(p, group)))

    def _scatter(self, param: torch.Tensor, ortho: torch.Tensor):
        if not isinstance(param, DTensor):
            return param, ortho
        ortho = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None)
        return param.to_local(), ortho.to_local()
