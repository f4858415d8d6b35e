"""Gradient clipping by the true global norm over FSDP2 gradients and owned gradients."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .runtime.owned_param import dedicated_of, is_dedicated
from .runtime.state import STATE_ATTR, DMuonState


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module | Sequence[nn.Module],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    defer_owned: bool = False,
) -> torch.Tensor:
    """Clip all gradients of ``model`` by their global ``norm_type`` norm; return that norm.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` on one process. The norm covers FSDP2
    (DTensor) gradients, owned dedicated gradients (each counted once, on its owner) and any
    plain replicated gradients.

    Under pipeline parallelism pass this rank's model parts (a list: their dedicated
    matrices over one data-parallel mesh) and ``pp_mesh``: the stages' norms are combined
    over it, as torchtitan's ``clip_grad_norm_`` does. Collectives, always in this order on
    every rank: the DTensor norm's reduction, an all-reduce of the owned part over the
    data-parallel world (where a part has dedicated matrices), one over ``pp_mesh``.

    ``defer_owned``: where it can (:meth:`DMuonState.defer_grad_scale
    <dmuon_titan.runtime.state.DMuonState.defer_grad_scale>`: one rank, float32
    gradients, one DMuon optimizer that may capture its step), leave the owned gradients as
    they are, the factor owed: the captured step multiplies each gradient as its momentum pass
    reads it (one pass over them less); an eager step, the next clip or the next forward
    multiplies them first, ``Muon.zero_grad`` drops it. The weights are the same, bit for
    bit, but until then the owned ``.grad`` read unclipped, and one replaced or changed in
    place meanwhile is an error at the next of those: for a loop that steps (or zeroes the
    gradients through the optimizer) right after clipping, as torchtitan's.
    """
    models = [model] if isinstance(model, nn.Module) else list(model)
    states = [s for m in models if (s := getattr(m, STATE_ATTR, None)) is not None]
    params = [p for m in models for p in m.parameters()]
    return clip_grads_(
        params, states, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, defer_owned
    )


@dataclasses.dataclass
class _Grads:
    """The gradients of one clip, by kind: FSDP2/EP DTensors (``sharded``); this process's
    whole gradients in parameter order (``local``, for the one-norm case) and the same apart
    (``plain`` and the owners' ``owned``, with their ``masters``), for the norms combined
    across processes and for the deferral; every gradient's dtype (placeholders' too: every
    rank then combines its norms in one dtype)."""

    sharded: list = dataclasses.field(default_factory=list)
    local: list = dataclasses.field(default_factory=list)
    plain: list = dataclasses.field(default_factory=list)
    owned: list = dataclasses.field(default_factory=list)
    masters: list = dataclasses.field(default_factory=list)
    dtypes: set = dataclasses.field(default_factory=set)


def _sort_grads(parameters: Iterable[torch.Tensor]) -> _Grads:
    grads, seen = _Grads(), set()
    for p in parameters:
        grad = p.grad
        if grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grads.dtypes.add(grad.dtype)
        if is_dedicated(p):
            if p.numel() > 0:  # the owner's master; placeholders have no elements
                grads.local.append(grad)
                grads.owned.append(grad)
                grads.masters.append(p)
        elif isinstance(grad, DTensor):
            grads.sharded.append(grad)
        else:
            grads.local.append(grad)
            grads.plain.append(grad)
    return grads


def _combine(norm: torch.Tensor, norm_type: float, all_reduce) -> torch.Tensor:
    """The norm over processes of per-process ``norm``s, by ``all_reduce(tensor, op=)``."""
    if math.isinf(norm_type):
        all_reduce(norm, op=dist.ReduceOp.MAX)
        return norm
    norm = norm.pow(norm_type)
    all_reduce(norm, op=dist.ReduceOp.SUM)
    return norm.pow(1.0 / norm_type)


def _sharded_norms(sharded: list, norm_type: float, foreach, device, dtype) -> list:
    """One norm per device mesh of the DTensor gradients (expert stacks left on AdamW live
    on the expert meshes, the rest on FSDP's: one norm over both is not defined)."""
    by_mesh: dict = {}  # (DeviceMesh compares by its ranks and dimension names)
    for grad in sharded:
        by_mesh.setdefault(grad.device_mesh, []).append(grad)
    return [
        torch.nn.utils.get_total_norm(same, norm_type, foreach=foreach)
        .full_tensor()
        .to(device, dtype)
        for same in by_mesh.values()
    ]


def _total_norm(grads: _Grads, states: list[DMuonState], norm_type: float, foreach):
    """The global norm of every gradient of the clip, combined over the processes that hold
    parts of it (decided by what is the same on every rank: an owner and a rank without
    owned matrices join the same all-reduce)."""
    dtype = functools.reduce(torch.promote_types, grads.dtypes, torch.float32)
    if states:
        device = states[0].device
    elif grads.sharded:
        device = grads.sharded[0].to_local().device
    else:
        device = grads.local[0].device if grads.local else torch.device("cpu")

    def local_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), device=device, dtype=dtype)
        return torch.nn.utils.get_total_norm(tensors, norm_type, foreach=foreach).to(device, dtype)

    multi_rank = bool(states and states[0].mesh.world_size > 1)
    if not (grads.sharded or multi_rank) and len(grads.dtypes) <= 1:
        # Nothing to combine across processes and one dtype: one norm over them all, as
        # torch.nn.utils.clip_grad_norm_ takes it (for float32 and float64 gradients the same
        # value, bit for bit; one foreach launch: at small scale the clip's host time counts).
        return local_norm(grads.local), device
    parts = [local_norm(grads.plain)]
    parts += _sharded_norms(grads.sharded, norm_type, foreach, device, dtype)
    owned_norm = local_norm(grads.owned)
    if multi_rank:  # (every rank, owner or not)
        owned_norm = _combine(owned_norm, norm_type, states[0].comm.all_reduce)
    parts.append(owned_norm)
    stacked = torch.stack(parts)
    inf = math.isinf(norm_type)
    return (stacked.max() if inf else torch.linalg.vector_norm(stacked, norm_type)), device


def _settle(states: list[DMuonState]) -> None:
    """The owners' gradients as a norm must see them: every reduce arrived, a clip's factor
    still owed applied (the norm is then of clipped gradients)."""
    for state in states:
        state.finalize_reduces()
        state.apply_deferred_grad_scale()


@torch.no_grad()
def global_grad_norm(
    model: nn.Module, norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The norm :func:`clip_grad_norm_` would clip by, nothing scaled: for a loop that logs
    it without clipping (every rank gets the same value; the same collectives as the clip)."""
    states = [s for s in (getattr(model, STATE_ATTR, None),) if s is not None]
    _settle(states)
    return _total_norm(_sort_grads(model.parameters()), states, float(norm_type), foreach)[0]


@torch.no_grad()
def clip_grads_(
    parameters: Iterable[torch.Tensor],
    states: list[DMuonState],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    defer_owned: bool = False,
) -> torch.Tensor:
    """:func:`clip_grad_norm_` over ``parameters``, whose dedicated ones belong to ``states``
    (each finalized first)."""
    _settle(states)
    if len({state.mesh.world_size for state in states}) > 1:
        raise ValueError(
            "clip_grad_norm_: the model parts' dedicated matrices are on different meshes"
        )
    norm_type = float(norm_type)
    grads = _sort_grads(parameters)
    total_norm, _ = _total_norm(grads, states, norm_type, foreach)
    if pp_mesh is not None and pp_mesh.size() > 1:
        group = pp_mesh.get_group()
        total_norm = _combine(
            total_norm, norm_type, lambda t, op: dist.all_reduce(t, op=op, group=group)
        )
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"the total norm of order {norm_type} of gradients is non-finite")
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    owned = _defer_owned(grads.masters, clip_coef, states) if defer_owned else grads.owned
    _multiply([g.to_local() for g in grads.sharded] + grads.plain + owned, clip_coef, foreach)
    return total_norm


def _multiply(grads: list[torch.Tensor], clip_coef: torch.Tensor, foreach) -> None:
    """One foreach multiply per (device, dtype), as torch's clip_grads_with_norm_ does: a
    Python loop over every gradient costs milliseconds of host time at small scale."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (g_device, g_dtype), same in by_kind.items():
        coef = clip_coef.to(device=g_device, dtype=g_dtype)
        if foreach is False:
            for g in same:
                g.mul_(coef)
        else:
            torch._foreach_mul_(same, coef)


def _defer_owned(
    masters: list[torch.Tensor], clip_coef: torch.Tensor, states: list[DMuonState]
) -> list[torch.Tensor]:
    """Leave ``clip_coef`` owed on the owned ``masters`` (of ``states``) whose state allows
    it (:meth:`DMuonState.defer_grad_scale`); the gradients still to multiply now."""
    if len(states) == 1:  # (the usual case: no lookup per matrix)
        by_state = {id(states[0]): (states[0], masters)}
    else:
        by_state: dict[int, tuple[DMuonState, list[torch.Tensor]]] = {}
        for p in masters:
            state = dedicated_of(p).state_ref()
            by_state.setdefault(id(state), (state, []))[1].append(p)
    now = []
    for state, mine in by_state.values():
        if state is None or not state.defer_grad_scale(clip_coef, mine):
            now += [p.grad for p in mine]
    return now
