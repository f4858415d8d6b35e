"""Gradient clipping by the true global norm over FSDP2 gradients and owned gradients."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .runtime.owned_param import is_dedicated
from .runtime.state import STATE_ATTR


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip all gradients of ``model`` by their global ``norm_type`` norm; return that norm.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` on one process. The norm covers FSDP2
    (DTensor) gradients, owned dedicated gradients (each counted once, on its owner) and any
    plain replicated gradients. Collectives, always in this order on every rank: the DTensor
    norm's reduction, then an all-reduce of the owned part over the data-parallel world.
    """
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        state.finalize_reduces()
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    sharded, plain, owned = [], [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        if is_dedicated(p):
            if p.numel() > 0:  # the owner's master; placeholders have no elements
                owned.append(p.grad)
        elif isinstance(p.grad, DTensor):
            sharded.append(p.grad)
        else:
            plain.append(p.grad)
    grads = sharded + plain + owned
    dtype = torch.float32
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    device = state.device if state is not None else (grads[0].device if grads else "cpu")

    def local_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), device=device, dtype=dtype)
        return torch.nn.utils.get_total_norm(tensors, norm_type, foreach=foreach).to(device, dtype)

    parts = [local_norm(plain)]
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded, norm_type, foreach=foreach)
        parts.append(norm.full_tensor().to(device, dtype))
    if state is not None and state.mesh.world_size > 1:
        owned_norm = local_norm(owned)
        if inf:
            state.comm.all_reduce(owned_norm, op=dist.ReduceOp.MAX)
        else:
            owned_norm = owned_norm.pow(norm_type)
            state.comm.all_reduce(owned_norm)
            owned_norm = owned_norm.pow(1.0 / norm_type)
        parts.append(owned_norm)
    else:
        parts.append(local_norm(owned))
    stacked = torch.stack(parts)
    total_norm = stacked.max() if inf else torch.linalg.vector_norm(stacked, norm_type)

    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"the total norm of order {norm_type} of gradients is non-finite")
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for g in [g.to_local() for g in sharded] + plain + owned:
        g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
    return total_norm
