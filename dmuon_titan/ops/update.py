"""Muon's update rule around Newton–Schulz: momentum, the shape-adjusted lr, the update.

The elementwise passes run fused on CUDA (:mod:`dmuon_titan.fused`, which holds their one
eager reference implementation too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .fused import decay_and_update_, decay_and_update_many_, momentum_direction_into

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Muon's shape-dependent learning rate (``torch.optim.Muon``'s ``adjust_lr_fn``).

    ``None``/``"original"``: lr·sqrt(max(1, rows/cols)) (Keller Jordan);
    ``"match_rms_adamw"``: lr·0.2·sqrt(max(rows, cols)) (Moonshot), so AdamW's lr carries over.
    A stack's ``shape`` (3-D) gives each of its matrices the lr of its last two dimensions.
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    # The ratio first, then the product: the same rounding as torch.optim.Muon.
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; known: {list(ADJUST_LR_FNS)}")


def momentum_direction(
    grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool
) -> Tensor:
    """Update the momentum buffer in place and return the direction to orthogonalize, a new
    tensor of ``grad``'s dtype (see :func:`dmuon_titan.fused.momentum_direction_into`)."""
    out = torch.empty_like(grad)
    momentum_direction_into(grad, momentum_buffer, out, momentum, nesterov)
    return out


def apply_update(
    param: Tensor,
    ortho: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    shape: Sequence[int] | None = None,
) -> None:
    """Decoupled weight decay, then the orthogonalized step with the shape-adjusted lr.

    ``shape`` is the full matrix shape when ``param``/``ortho`` are one shard of it.
    """
    step = adjusted_lr(lr, adjust_lr_fn, param.shape if shape is None else shape)
    decay_and_update_(param, ortho, 1 - lr * weight_decay, step)


def apply_updates(
    params: list[Tensor],
    orthos: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
) -> None:
    """:func:`apply_update` for same-shape whole matrices at once (foreach passes); the
    ``orthos`` in the parameters' dtype and layout."""
    step = adjusted_lr(lr, adjust_lr_fn, params[0].shape)
    decay_and_update_many_(params, orthos, 1 - lr * weight_decay, step)
