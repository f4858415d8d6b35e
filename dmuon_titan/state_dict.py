"""FQN-keyed state dicts in two forms.

``full=True`` (default): what a single-device model and optimizer would hold. ``get_*`` gather
on every rank (FSDP2 DTensors via ``full_tensor``, dedicated matrices by a broadcast from their
owner) and return CPU copies; ``set_*`` take the same full dicts on every rank and keep only
what each rank stores, without any collective.

``full=False``: the distributed-checkpoint (DCP) form, live tensors and no collectives. FSDP2
entries are DTensors; a dedicated matrix (and its momentum) appears **only on its owner**, as a
plain full tensor. DCP treats a plain tensor present on several ranks as replicated and saves
whichever copy its deduplication picks (it silently saved a non-owner's placeholder when we
tried), so the key must exist on the owner alone; a re-partitioned model (another world size)
then loads each matrix on its new owner. An expert stack (3-D), owned piece by piece, is a
``Shard(0)`` DTensor of the pieces on every rank (weights and momentum), which DCP re-cuts
when the world size changes. The optimizer form is flattened like torchtitan's
(``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``).

Every key and shape is checked before anything is written; errors name the offending key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .api import clean_fqn, wait_all_replicate_broadcasts
from .optim.muon import Muon
from .runtime.mesh import grid_device_mesh
from .runtime.owned_param import DedicatedParam
from .runtime.state import STATE_ATTR, DMuonState


def _state(model: nn.Module) -> DMuonState | None:
    return getattr(model, STATE_ATTR, None)


def _dedicated_by_fqn(state: DMuonState | None) -> dict[str, DedicatedParam]:
    return {p.fqn: p for p in state.params} if state else {}


def _cpu_copy(value: torch.Tensor) -> torch.Tensor:
    """A CPU snapshot that never aliases live training state."""
    return value.detach().to("cpu", copy=True)


def _full(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return _cpu_copy(value)


def _broadcast_from_owner(
    state: DMuonState, p: DedicatedParam, value: torch.Tensor | None, column_has_it: bool
):
    """``value`` on every rank, as a CPU tensor. It is on the global owner, and on every rank
    of the owner's shard column when ``column_has_it`` (weights, after a drain)."""
    comm = state.comm
    if state.mesh.tp_size > 1:  # only the owner has it whole: its row, column, replicas
        return _broadcast_from_tp_owner(state, p, value)
    have = p.is_owner or (column_has_it and p.holds_weight)
    if have:
        buf = value.detach().to(state.device).contiguous()
    else:
        buf = torch.empty(p.shape, dtype=p.orig_dtype, device=state.device)
    if not column_has_it and p.holds_weight:  # the owner's column peers first (replicas)
        comm.broadcast(buf, p.owner_replica, "state_dict", group="replicate").wait()
    comm.broadcast(buf, p.owner_shard, "state_dict", group="unshard").wait()
    return _cpu_copy(buf)


def _broadcast_from_tp_owner(state: DMuonState, p: DedicatedParam, value: torch.Tensor | None):
    """``value`` (whole, on the owner) on every rank, as a CPU tensor, under tensor
    parallelism: from the owner over its row's tp group, then over the shard groups of its
    replica, then across replicas (each rank joins the steps on its path)."""
    comm, mesh = state.comm, state.mesh
    if p.is_owner:
        buf = value.detach().to(state.device).contiguous()
    else:
        buf = torch.empty(p.shape, dtype=p.orig_dtype, device=state.device)
    if p.in_owner_row:
        comm.broadcast(buf, p.owner_tp_rank, "state_dict", group="tp").wait()
    if mesh.replicate_rank == p.owner_replica:
        comm.broadcast(buf, p.owner_shard, "state_dict", group="unshard").wait()
    comm.broadcast(buf, p.owner_replica, "state_dict", group="replicate").wait()
    return _cpu_copy(buf)


def _gather_stack(state: DMuonState, p: DedicatedParam, piece: torch.Tensor | None):
    """A stack's whole ``[experts, ...]`` tensor on every rank, as a CPU tensor, from each
    rank's ``piece`` (``None`` where it holds none): one all-gather over the grid, and with
    expert parallelism one more over the expert mesh."""
    grid = state.mesh.grid_size
    local = p.unsharded_shape
    per_slot = -(-local[0] // grid) * p.shape[1:].numel()
    buf = torch.zeros(grid * per_slot, dtype=p.orig_dtype, device=state.device)
    if piece is not None and piece.numel():
        start = state.mesh.grid_rank * per_slot
        buf[start : start + piece.numel()].copy_(piece.reshape(-1))
    state.comm.all_gather_slots(buf, "state_dict", group="grid_unshard").wait()
    mine = buf[: local.numel()]
    if local != p.shape:  # equal shares (the degree divides the expert count)
        whole = torch.empty(p.numel, dtype=p.orig_dtype, device=state.device)
        torch.distributed.all_gather_into_tensor(whole, mine, group=p.expert_mesh.get_group())
        mine = whole
    return _cpu_copy(mine.view(p.shape))


def _stack_dtensor(state: DMuonState, p: DedicatedParam, piece: torch.Tensor | None):
    """The DCP form of a stack (or of its momentum): this rank's ``piece`` as its ``Shard(0)``
    of the whole (an empty piece where it holds no expert); the whole tensor on one rank."""
    if piece is None:
        piece = torch.zeros(p.owned_shape, dtype=p.orig_dtype, device=state.device)
    if state.mesh.world_size == 1:
        return piece.detach()
    mesh = getattr(state, "_grid_mesh", None)
    if mesh is None:
        mesh = state._grid_mesh = grid_device_mesh(state.mesh)
    placements = [Shard(0)] * mesh.ndim  # (expert coordinate, then grid rank) with EP
    return DTensor.from_local(
        piece.detach(),
        mesh,
        placements,
        run_check=False,
        shape=p.shape,
        stride=torch.empty(p.shape, device="meta").stride(),
    )


def _shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: a DTensor with its placements (each rank slices its
    own piece, no collective), or a plain tensor on its device."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


# ---------------------------------------------------------------------- helpers
def _load_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into the live ``target`` (nothing to do when DCP loaded it in place)."""
    if value is target:
        return
    if isinstance(target, DTensor):
        if isinstance(value, DTensor):
            if value.placements != target.placements:
                value = value.full_tensor()
            else:
                target.to_local().copy_(value.to_local())
                return
        target.to_local().copy_(_shard_like(target, value).to_local())
    else:
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.data_ptr() != target.data_ptr() or value.device != target.device:
            target.copy_(value)


def _load_piece(p: DedicatedParam, value: torch.Tensor, full: bool, into=None) -> None:
    """This rank's piece of a stack from ``value``: the whole stack (full form) or its DCP
    form (a DTensor, usually loaded in place already)."""
    target = p.owned if into is None else into
    if full:
        start, stop = p.piece
        value = value[start:stop]
    elif isinstance(value, DTensor):
        value = value.to_local()
    if value.data_ptr() != target.data_ptr() or value.device != target.device:
        target.detach().copy_(value)


def _check_keys(kind: str, expected: dict, given: dict, strict: bool) -> None:
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if unexpected or (strict and missing):
        raise ValueError(
            f"{kind} state dict mismatch: missing keys {missing[:20]}, unexpected keys "
            f"{unexpected[:20]}"
        )


def _check_shape(kind: str, key: str, value, shape: tuple[int, ...]) -> None:
    if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{kind} state dict key {key!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
        )


# ---------------------------------------------------------------------- model
def _model_entries(model: nn.Module, full: bool):
    """key -> (live tensor, DedicatedParam or None), the keys this rank's form holds."""
    dedicated = _dedicated_by_fqn(_state(model))
    entries = {}
    for name, value in model.state_dict(keep_vars=True).items():
        key = clean_fqn(name)
        p = dedicated.get(key)
        if p is None:
            entries[key] = (value, None)
        elif p.stacked and not full:
            entries[key] = (_stack_dtensor(_state(model), p, p.owned), p)
        elif full or p.is_owner:
            entries[key] = (p.owned, p)
    return entries


@torch.no_grad()
def get_model_state_dict(model: nn.Module, *, full: bool = True) -> dict[str, torch.Tensor]:
    """Model state dict (parameters and persistent buffers); see the module doc for ``full``."""
    state = _state(model)
    if state is not None:
        wait_all_replicate_broadcasts(model)
        state.ensure_replicas_synced()
    result: dict[str, torch.Tensor] = {}
    for key, (value, p) in _model_entries(model, full).items():
        if not full:
            result[key] = value.detach()
        elif p is None:
            result[key] = _full(value)
        elif p.stacked:
            result[key] = _gather_stack(state, p, p.owned)
        else:
            value = p.owned if p.holds_weight else None
            result[key] = _broadcast_from_owner(state, p, value, column_has_it=True)
    return result


@torch.no_grad()
def set_model_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True, *, full: bool = True
) -> None:
    """Load a state dict of the given form (a full one may come from a single-device model)."""
    if _state(model) is not None:
        wait_all_replicate_broadcasts(model)  # (a step in flight still writes the weights)
    entries = _model_entries(model, full)
    _check_keys("model", entries, state_dict, strict)
    for key, (target, p) in entries.items():
        if key in state_dict:
            _check_shape("model", key, state_dict[key], p.shape if p else target.shape)
    for key, (target, p) in entries.items():
        if key not in state_dict or (p is not None and not p.holds_weight):
            continue
        if p is not None and p.stacked:
            _load_piece(p, state_dict[key], full)
            continue
        _load_into(target.detach() if p is None else target, state_dict[key])
    state = _state(model)
    if state is not None:
        # The full form reached every replica's column rank; the owner-only form only the
        # owners, who now send it to their replicas (and with TP to their tp-shard copies).
        if full and state.mesh.tp_size == 1:
            state.mark_replicas_synced()
        else:
            state.sync_replicas()


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
    # FSDP2 leaves the root's unsharded parameters registered after a forward without
    # backward (an evaluation): the optimizer holds the sharded ones, so register those again.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    optimizer.follow_model()
    optimizer.step_graph.wait()  # (a step in flight still writes its state)


def _sharded_optimizer_entries(model: nn.Module, optimizer: Muon):
    """Flattened key -> live value, and param-group key -> (group, hyper-parameter name)."""
    optimizer.materialize_state()
    fqns = _param_fqns(model)
    state = _state(model)
    dedicated = {id(p.owned): p for p in state.params} if state else {}
    values: dict[str, Any] = {}
    group_keys: dict[str, tuple[dict, str]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = fqns[id(p)]
            d = dedicated.get(id(p))
            if d is not None and d.stacked:  # every rank: its piece (maybe empty)
                momentum = optimizer.state[p].get("momentum_buffer") if d.is_owner else None
                values[f"state.{fqn}.momentum_buffer"] = _stack_dtensor(state, d, momentum)
            elif d is None or d.is_owner:
                for k, v in optimizer.state[p].items():
                    values[f"state.{fqn}.{k}"] = v
            for k, v in group.items():
                if k != "params":
                    values[f"param_groups.{fqn}.{k}"] = v
                    group_keys[f"param_groups.{fqn}.{k}"] = (group, k)
    return values, group_keys


@torch.no_grad()
def get_optimizer_state_dict(
    model: nn.Module, optimizer: Muon, *, full: bool = True
) -> dict[str, Any]:
    """Optimizer state dict; see the module doc for ``full``.

    Full form: ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`` on CPU.
    """
    _check_optimizer(model, optimizer)
    if not full:
        return dict(_sharded_optimizer_entries(model, optimizer)[0])
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
        if group["use_muon"] and state is not None:
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
        state.comm.all_reduce(have)
        for p, present in zip(state.params, have.tolist(), strict=True):
            if present:
                buf = optimizer.state[p.owned]["momentum_buffer"] if p.is_owner else None
                if p.stacked:
                    momentum = _gather_stack(state, p, buf)
                else:
                    momentum = _broadcast_from_owner(state, p, buf, column_has_it=False)
                result_state[p.fqn] = {"momentum_buffer": momentum}
    return {"state": result_state, "param_groups": groups}


@torch.no_grad()
def set_optimizer_state_dict(
    model: nn.Module, optimizer: Muon, state_dict: dict[str, Any], *, full: bool = True
) -> None:
    """Load an optimizer state dict of the given form (a full one from any world size)."""
    _check_optimizer(model, optimizer)
    if not full:
        _set_sharded_optimizer_state_dict(model, optimizer, state_dict)
    else:
        _set_full_optimizer_state_dict(model, optimizer, state_dict)


def _set_sharded_optimizer_state_dict(model: nn.Module, optimizer: Muon, state_dict: dict) -> None:
    values, group_keys = _sharded_optimizer_entries(model, optimizer)
    _check_keys("optimizer", values, state_dict, strict=True)
    for key, target in values.items():
        if isinstance(target, torch.Tensor):
            _check_shape("optimizer", key, state_dict[key], target.shape)
    for key, target in values.items():
        value = state_dict[key]
        if key in group_keys:
            group, name = group_keys[key]
            group[name] = value
        elif isinstance(target, DTensor) and isinstance(value, DTensor):
            if value.to_local().data_ptr() != target.to_local().data_ptr():
                target.to_local().copy_(value.to_local())
        elif isinstance(target, torch.Tensor):
            _load_into(target, value)


def _set_full_optimizer_state_dict(model: nn.Module, optimizer: Muon, state_dict: dict) -> None:
    """Load a full optimizer state dict (keyed by fqn) into ``optimizer``."""
    by_fqn = _full_optimizer_params(model, optimizer, state_dict)
    saved_groups = state_dict["param_groups"]
    dedicated = _dedicated_by_fqn(_state(model))
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    for fqn, saved in state_dict["state"].items():
        p = by_fqn[fqn]
        d = dedicated.get(fqn)
        if d is not None:
            momentum = _full_dedicated_momentum(fqn, saved, d)
            if momentum is not None:
                new_state[p] = {
                    "momentum_buffer": momentum.to(device=p.device, dtype=p.dtype).clone()
                }
            continue
        new_state[p] = _full_plain_entry(optimizer, fqn, saved, p)
    optimizer.state.clear()
    optimizer.state.update(new_state)
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        for k, v in saved.items():
            if k != "params":
                group[k] = v


def _full_optimizer_params(
    model: nn.Module, optimizer: Muon, state_dict: dict
) -> dict[str, torch.Tensor]:
    """fqn -> parameter, once a full optimizer state dict's layout is checked against ours."""
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
    return by_fqn


def _full_dedicated_momentum(fqn: str, saved: dict, d: DedicatedParam) -> torch.Tensor | None:
    """This rank's part of a dedicated matrix's saved momentum (``None`` unless its owner)."""
    if set(saved) != {"momentum_buffer"} or tuple(saved["momentum_buffer"].shape) != tuple(d.shape):
        raise ValueError(f"optimizer state for {fqn!r} is not a {tuple(d.shape)} momentum buffer")
    if not d.is_owner:
        return None
    momentum = saved["momentum_buffer"]
    if d.stacked:
        momentum = momentum[d.piece[0] : d.piece[1]]
    return momentum


def _full_plain_entry(optimizer: Muon, fqn: str, saved: dict, p: torch.Tensor) -> dict[str, Any]:
    """A parameter's optimizer state from its full saved entry, laid out like ``p``."""
    entry = {}
    for k, v in saved.items():
        if isinstance(v, torch.Tensor) and v.ndim > 0:  # shaped like the parameter
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
    return entry
