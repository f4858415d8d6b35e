"""The plan's report: who owns what and what it costs per step, as
``dmuon_titan.summarize_plan`` returns it.

Accounting only: it reads a model's DMuon state (duck-typed, no runtime import) and does
arithmetic on shapes, dtypes and mesh sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.ns_cost import shared_ns_moved_bytes


def plan_report(
    state,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_steps: int = 5,
    ns_preconditioner: str = "frobenius",
) -> dict[str, Any]:
    """``dmuon_titan.summarize_plan`` of a model's DMuon ``state`` (its root state, read for
    the plan, the mesh, the parameters and the boundaries' layout)."""
    plan, mesh = state.plan, state.mesh
    return {
        "world_size": mesh.world_size,
        "shard_size": mesh.shard_size,
        "replicate_size": mesh.replicate_size,
        "tp_size": mesh.tp_size,
        "rank": mesh.slot,
        "reshard_after_forward": state.reshard_after_forward,
        "num_params": len(state.params),
        "params": [
            {
                "fqn": p.fqn,
                "shape": list(p.shape),
                "owner": "sharded" if p.stacked else p.owner,
                "shared_ns": p.shared_ns,
                "boundary": state.groups[p.boundary_index].path,
                "ns_flops": cost,
            }
            for p, cost in zip(state.params, plan.costs, strict=True)
        ],
        "boundaries": [
            {
                "path": g.path or "<root>",
                "params": len(g.params),
                "owners": sorted({p.owner for p in g.params if not p.stacked}),
                "stacks": len(g.stacks),
                "collectives": g.collectives,
            }
            for g in state.groups
        ],
        "ns_flops_per_rank": plan.load_per_rank(),
        "imbalance": plan.imbalance(),
        "bytes_per_rank_per_step": _bytes_per_step(
            state, param_dtype, reduce_dtype, ns_dtype, ns_steps, ns_preconditioner
        ),
    }


def _bytes_per_step(
    state,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_steps: int = 5,
    ns_preconditioner: str = "frobenius",
) -> dict[str, float]:
    """Bytes each collective phase moves per rank and step, averaged over every rank (the
    convention of :class:`~dmuon_titan.runtime.collectives.CommStats`).

    With tensor parallelism (degree T) every rank moves its tp shard of each matrix (L =
    numel / T elements) in the data-parallel phases, and the owners' rows exchange the rest:
    ``tp_gather`` (gradient shards to the owner) and ``tp_scatter`` (the updated master's
    shards back) each carry (T - 1) · L elements per matrix, over R · S · T ranks.
    ``tp_ns``: :func:`~dmuon_titan.ops.ns_cost.shared_ns_moved_bytes` of each matrix whose
    Newton–Schulz its row shares, over R · S · T ranks."""
    shard, replicas, tp = state.mesh.shard_size, state.mesh.replicate_size, state.mesh.tp_size

    def param_size(p) -> int:
        return (param_dtype or p.param_dtype).itemsize

    def reduce_size(p) -> int:
        return (reduce_dtype or param_dtype or p.reduce_dtype).itemsize

    stage1_param_bytes, stage1_reduce_bytes, grid_param_bytes, grid_reduce_bytes = _boundary_bytes(
        state, param_size, reduce_size
    )
    matrices = [p for p in state.params if not p.stacked]
    reduce_bytes = sum(p.unsharded_numel * reduce_size(p) for p in matrices)
    master_bytes = sum(p.unsharded_numel * p.orig_dtype.itemsize for p in matrices)
    world = shard * replicas * tp
    in_shard = (shard - 1) / shard
    across = (replicas - 1) / (replicas * shard)
    forward = stage1_param_bytes * in_shard + grid_param_bytes
    per_step = {
        "forward_broadcast": forward,
        "backward_rebroadcast": forward if state.reshard_after_forward else 0.0,
        "reduce": stage1_reduce_bytes * in_shard + grid_reduce_bytes,
        "reduce_replicate": reduce_bytes * across,
        "replicate_broadcast": master_bytes * across,
        "tp_gather": (tp - 1) * reduce_bytes / world,
        "tp_scatter": (tp - 1) * master_bytes / world,
    }
    sums = 8 if ns_dtype == torch.float64 else 4
    per_step["tp_ns"] = (
        sum(
            shared_ns_moved_bytes(
                p.shape, tp, ns_dtype.itemsize, sums, ns_steps, ns_preconditioner == "frobenius"
            )
            for p in matrices
            if p.shared_ns
        )
        / world
    )
    per_step["total"] = sum(per_step.values())
    return per_step


def _boundary_bytes(state, param_size, reduce_size) -> tuple[float, float, float, float]:
    """(weights, gradients) bytes the boundaries' data-parallel collectives carry per step
    within a shard group, then (weights, gradients) of the expert stacks over their grid."""
    shard = state.mesh.shard_size
    stage1_param_bytes, stage1_reduce_bytes = 0, 0
    grid_param_bytes, grid_reduce_bytes = 0, 0  # stacks: over the whole grid, padding included
    for g in state.groups:
        for stack in g.stacks:  # (n - 1) / n of what an all-gather of n slots carries
            share = (stack.grid_size - 1) / stack.grid_size
            grid_param_bytes += share * stack.grid_size * stack.slot_numel * param_size(stack.param)
            grid_reduce_bytes += (
                share * stack.grid_size * stack.slot_numel * reduce_size(stack.param)
            )
        if g.gathered:  # what the collectives carry, padding included (flags excluded)
            p0 = g.params[0]  # one dtype per gathered boundary (checked at lazy init)
            stage1_param_bytes += shard * g.slot_numel * param_size(p0)
            stage1_reduce_bytes += (shard * g.reduce_slot_numel - len(g.params)) * reduce_size(p0)
        else:
            stage1_param_bytes += sum(
                p.unsharded_numel * param_size(p) for b in g.buckets for p in b.params
            )
            stage1_reduce_bytes += sum(
                p.unsharded_numel * reduce_size(p) for b in g.buckets for p in b.params
            )
    return stage1_param_bytes, stage1_reduce_bytes, grid_param_bytes, grid_reduce_bytes
