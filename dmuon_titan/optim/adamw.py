"""The AdamW group's step: ``torch.optim.AdamW``'s state and its functional ``adamw``."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adamw import adamw


def adamw_state(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """``torch.optim.AdamW``'s state for ``p`` (``state``: the optimizer's entry for it),
    created as AdamW creates it."""
    if not state:
        state["step"] = (
            torch.zeros((), dtype=torch.float32, device=p.device)
            if group["fused"]
            else torch.tensor(0.0, dtype=torch.float32)
        )
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def adamw_step(group: dict[str, Any], states: dict[torch.Tensor, dict[str, Any]]) -> None:
    """One AdamW step of ``group``'s parameters that have a gradient (``states``: the
    optimizer's state, by parameter)."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        state = adamw_state(states[p], p, group)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=group["foreach"],
        fused=group["fused"],
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
