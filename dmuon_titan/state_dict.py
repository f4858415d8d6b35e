"""Full, FQN-keyed state dicts: what a single-device model and optimizer would hold.

``get_*`` gather on every rank (FSDP2 DTensors via ``full_tensor``, dedicated matrices by a
broadcast from their owner) and return CPU tensors; ``set_*`` take the same full dicts on every
rank and keep only what each rank stores, without any collective. Every key and shape is
checked before anything is written, and errors name the offending key.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .api import clean_fqn, wait_all_replicate_broadcasts
from .muon import Muon
from .runtime.owned_param import DedicatedParam
from .runtime.state import STATE_ATTR, DMuonState


def _state(model: nn.Module) -> DMuonState | None:
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        state.adopt_registered()
    return state


def _dedicated_by_fqn(state: DMuonState | None) -> dict[str, DedicatedParam]:
    return {p.fqn: p for p in state.params} if state else {}


def _cpu_copy(value: torch.Tensor) -> torch.Tensor:
    """A CPU snapshot that never aliases live training state."""
    return value.detach().to("cpu", copy=True)


def _full(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return _cpu_copy(value)


def _broadcast_from_owner(state: DMuonState, p: DedicatedParam, value: torch.Tensor | None):
    """``value`` (full, on the owner) on every rank, as a CPU tensor."""
    if p.is_owner:
        buf = value.detach().to(state.device).contiguous()
    else:
        buf = torch.empty(p.shape, dtype=p.orig_dtype, device=state.device)
    state.comm.broadcast(buf, p.owner, "state_dict").wait()
    return _cpu_copy(buf)


def _shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: a DTensor with its placements (each rank slices its
    own piece, no collective), or a plain tensor on its device."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


# ---------------------------------------------------------------------- model
@torch.no_grad()
def get_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full model state dict (parameters and persistent buffers) on every rank, on CPU."""
    state = _state(model)
    if state is not None:
        wait_all_replicate_broadcasts(model)
    dedicated = _dedicated_by_fqn(state)
    result: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        key = clean_fqn(name)
        p = dedicated.get(key)
        if p is None:
            result[key] = _full(value)
        else:
            result[key] = _broadcast_from_owner(state, p, p.owned if p.is_owner else None)
    return result


def _expected_model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    dedicated = _dedicated_by_fqn(_state(model))
    shapes = {}
    for name, value in model.state_dict().items():
        key = clean_fqn(name)
        shapes[key] = tuple(dedicated[key].shape) if key in dedicated else tuple(value.shape)
    return shapes


@torch.no_grad()
def set_model_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Load a full state dict (as from :func:`get_model_state_dict` or a single-device model)."""
    expected = _expected_model_shapes(model)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if strict and (missing or unexpected):
        raise ValueError(
            f"model state dict mismatch: missing keys {missing}, unexpected keys {unexpected}"
        )
    for key, shape in expected.items():
        if key in state_dict and tuple(state_dict[key].shape) != shape:
            raise ValueError(
                f"model state dict key {key!r} has shape {tuple(state_dict[key].shape)}, "
                f"the model expects {shape}"
            )
    dedicated = _dedicated_by_fqn(_state(model))
    for name, target in model.state_dict(keep_vars=True).items():
        key = clean_fqn(name)
        if key not in state_dict:
            continue
        p = dedicated.get(key)
        if p is not None:
            if p.is_owner:
                p.owned.copy_(state_dict[key])
            continue
        value = _shard_like(target, state_dict[key])
        if isinstance(target, DTensor):
            target.to_local().copy_(value.to_local())
        else:
            target.copy_(value)


# ---------------------------------------------------------------------- optimizer
def _param_fqns(model: nn.Module) -> dict[int, str]:
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = clean_fqn(name)
    state = _state(model)
    if state is not None:
        for p in state.params:
            names[id(p.owned)] = p.fqn
    return names


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, Muon):
        raise ValueError(f"expected a dmuon_titan.Muon optimizer, got {type(optimizer).__name__}")
    if optimizer._dmuon is not _state(model):
        raise ValueError("the optimizer was built for a different model")


@torch.no_grad()
def get_optimizer_state_dict(model: nn.Module, optimizer: Muon) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``, full, on CPU."""
    _check_optimizer(model, optimizer)
    state = _state(model)
    fqns = _param_fqns(model)
    result_state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [fqns[id(p)] for p in group["params"]],
            }
        )
        if group["use_muon"]:
            continue
        for p in group["params"]:
            if p in optimizer.state:
                result_state[fqns[id(p)]] = {
                    k: _full(v) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
    if state is not None:
        # Only owners know whether a momentum buffer exists; agree on that first.
        have = torch.tensor(
            [1 if p.is_owner and p.owned in optimizer.state else 0 for p in state.params],
            dtype=torch.int32,
            device=state.device,
        )
        if state.world_size > 1:
            dist.all_reduce(have, group=state.comm.group)
        for p, present in zip(state.params, have.tolist(), strict=True):
            if present:
                buf = optimizer.state[p.owned]["momentum_buffer"] if p.is_owner else None
                result_state[p.fqn] = {"momentum_buffer": _broadcast_from_owner(state, p, buf)}
    return {"state": result_state, "param_groups": groups}


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizer: Muon, state_dict: dict[str, Any]) -> None:
    """Load a full optimizer state dict from :func:`get_optimizer_state_dict` (any world size)."""
    _check_optimizer(model, optimizer)
    if set(state_dict) != {"state", "param_groups"}:
        raise ValueError(
            f"optimizer state dict must have keys 'state' and 'param_groups', got {sorted(state_dict)}"
        )
    fqns = _param_fqns(model)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer state dict has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    by_fqn: dict[str, torch.Tensor] = {}
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        mine = [fqns[id(p)] for p in group["params"]]
        if list(saved["params"]) != mine:
            diff = sorted(set(saved["params"]) ^ set(mine))
            raise ValueError(
                f"optimizer state dict param_groups[{i}] lists other parameters than the "
                f"optimizer (differing: {diff[:10]})"
            )
        by_fqn.update(zip(mine, group["params"], strict=True))
    unknown = sorted(set(state_dict["state"]) - set(by_fqn))
    if unknown:
        raise ValueError(f"optimizer state dict has state for unknown parameters {unknown}")

    dedicated = _dedicated_by_fqn(_state(model))
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    for fqn, saved in state_dict["state"].items():
        p = by_fqn[fqn]
        d = dedicated.get(fqn)
        if d is not None:
            if set(saved) != {"momentum_buffer"} or tuple(saved["momentum_buffer"].shape) != tuple(
                d.shape
            ):
                raise ValueError(
                    f"optimizer state for {fqn!r} is not a {tuple(d.shape)} momentum buffer"
                )
            if d.is_owner:
                new_state[p] = {
                    "momentum_buffer": saved["momentum_buffer"]
                    .to(device=p.device, dtype=p.dtype)
                    .clone()
                }
            continue
        entry = {}
        for k, v in saved.items():
            if k in ("exp_avg", "exp_avg_sq"):
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(
                        f"optimizer state {fqn!r}.{k} has shape {tuple(v.shape)}, expected {tuple(p.shape)}"
                    )
                entry[k] = _shard_like(p, v).clone()
            elif isinstance(v, torch.Tensor):
                # AdamW's step counter lives on the device only for the fused kernel.
                fused = bool(optimizer.param_groups[1]["fused"])
                entry[k] = v.to(p.device) if fused else v.clone()
            else:
                entry[k] = v
        new_state[p] = entry
    optimizer.state.clear()
    optimizer.state.update(new_state)
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        for k, v in saved.items():
            if k != "params":
                group[k] = v
