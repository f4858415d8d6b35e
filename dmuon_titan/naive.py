"""The naive baseline: Muon on plain FSDP2, every rank gathering every matrix.

Every parameter stays on FSDP2. For each Muon matrix, every rank all-gathers the momentum
direction, runs Newton–Schulz on the whole matrix (redundantly, N times over the world) and
keeps its own shard of the result. Same update rule as :class:`dmuon_titan.Muon`, so it is the
reference DMuon is checked against inside torchtitan, and the slow baseline it is timed
against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from . import ns
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

    def _muon_step(self, group: dict[str, Any]) -> None:
        coefficients = ns.normalize_coefficients(group["ns_coefficients"])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            direction = ns.momentum_direction(
                p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"]
            )
            full = direction.full_tensor() if isinstance(direction, DTensor) else direction
            self.timer.start("ns")
            ortho = ns.zeropower_via_newtonschulz(
                full, coefficients, group["ns_steps"], group["eps"], group["ns_dtype"]
            )
            self.timer.stop("ns")
            local = p
            if isinstance(p, DTensor):
                ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
                ortho, local = ortho.to_local(), p.to_local()
            ns.apply_update(
                local,
                ortho,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"],
                shape=p.shape,
            )

    @torch.no_grad()
    def materialize_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if not group["use_muon"]:
                    self._adamw_state(p, group)
                elif "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
