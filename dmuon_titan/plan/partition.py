"""Global LPT partition of dedicated matrices over the data-parallel ranks.

Each matrix gets exactly one owner, the rank that runs its momentum + Newton–Schulz + update.
Cost is the FLOPs of the Newton–Schulz algorithm that will run on the shape (plain, or Gram
where ``ns_algorithm`` picks it), so the slowest rank's optimizer step is what we minimize.

A 3-D parameter is a *stack* of matrices (mixture-of-experts: ``[experts, out, in]``), each
orthogonalized on its own. Its ownership grain is the expert: the stack is cut along dim 0
into one contiguous piece per owner slot (:func:`stack_pieces`, ``torch.chunk``'s cut, which
is also ``DTensor``'s ``Shard(0)``), so a 64-expert layer is spread over every rank, and the
pieces move by one all-gather and one reduce-scatter, like FSDP2's. The stacks' loads come
first; the 2-D matrices are placed by LPT on top of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .cost import check_ns_algorithm, orthogonalize_flops

#: Matrices with at most this many elements are "small": all small matrices of one boundary
#: go to a single owner so the boundary issues one collective for them instead of many.
DEFAULT_SMALL_PARAM_NUMEL = 1 << 16

#: ``Plan.owners`` entry of a stack: owned piece by piece, by every slot (:func:`stack_pieces`).
SHARDED = -1


def stack_pieces(num_experts: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` expert range of each owner slot for a stack of ``num_experts``.

    Pieces of ``ceil(num_experts / world_size)`` experts in slot order, the last ones shorter
    or empty: ``torch.chunk``'s cut, the one ``DTensor``'s ``Shard(0)`` uses, so the pieces
    are a ``Shard(0)`` DTensor for distributed checkpoints (which then re-cut them at another
    world size). Padding only at the end keeps the gathered stack one contiguous tensor.
    """
    per_slot = -(-num_experts // world_size)
    return [
        (min(k * per_slot, num_experts), min((k + 1) * per_slot, num_experts))
        for k in range(world_size)
    ]


@dataclass(frozen=True)
class ParamSpec:
    """What the planner knows about one dedicated parameter."""

    fqn: str
    shape: tuple[int, ...]
    boundary: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def stacked(self) -> bool:
        """A stack of matrices (3-D: dim 0 counts them), owned expert by expert."""
        return len(self.shape) == 3


@dataclass(frozen=True)
class Plan:
    """The result of partitioning: owners[i] is the rank that owns specs[i] (:data:`SHARDED`
    for a stack: every slot owns its :func:`stack_pieces` piece)."""

    world_size: int
    specs: tuple[ParamSpec, ...]
    owners: tuple[int, ...]
    costs: tuple[int, ...]
    #: the NS algorithm the costs are FLOPs of (see ``dmuon_titan.plan.cost.NS_ALGORITHMS``)
    ns_algorithm: str = "plain"

    def load_per_rank(self) -> list[int]:
        loads = [0] * self.world_size
        for spec, owner, cost in zip(self.specs, self.owners, self.costs, strict=True):
            if owner == SHARDED:
                for k, share in enumerate(_piece_costs(spec, cost, self.world_size)):
                    loads[k] += share
            else:
                loads[owner] += cost
        return loads

    def imbalance(self) -> float:
        """max/mean NS load over ranks (1.0 is perfect balance)."""
        loads = self.load_per_rank()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def fingerprint(self, *extra: str) -> int:
        """A 63-bit digest of everything that decides a collective (the plan, and ``extra``:
        the caller's other collective-deciding choices); equal inputs, equal digests."""
        h = hashlib.sha256(str(self.world_size).encode())
        for spec, owner in zip(self.specs, self.owners, strict=True):
            h.update(f"|{spec.fqn}:{spec.shape}:{spec.boundary}:{owner}".encode())
        for item in extra:
            h.update(f"|{item}".encode())
        return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


@dataclass
class _Unit:
    cost: int
    order: int  # first position among the specs, for deterministic ties
    members: list[int]
    boundary: str


def plan_partition(
    specs: Sequence[ParamSpec],
    world_size: int,
    *,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
    ns_algorithm: str = "plain",
) -> Plan:
    """Assign an owner to every spec: longest-processing-time-first over NS cost.

    - Cost: FLOPs of Newton–Schulz by ``ns_algorithm`` (``"auto"`` resolves per shape, as the
      optimizer will), see :func:`dmuon_titan.plan.cost.orthogonalize_flops`.
    - Units: every matrix above ``small_param_numel`` is its own unit; the small matrices of one
      boundary form one unit (one owner, one collective).
    - Units are placed by decreasing cost (ties: first appearance) on the least-loaded rank,
      preferring ranks that hold nothing of the same boundary yet, so a boundary's broadcasts
      come from several owners and its NS work runs in parallel. The preference is taken only
      when it does not raise the current makespan beyond what plain LPT would reach.
    - Stacks (3-D) are cut by :func:`stack_pieces`, one piece per slot; their loads are
      there before the first unit is placed.
    - Deterministic: a pure function of (fqn, shape, boundary) order and ``world_size``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_ns_algorithm(ns_algorithm)  # also with no specs: the plan records it
    costs = [orthogonalize_flops(s.shape, ns_algorithm) for s in specs]
    units: list[_Unit] = []
    small_unit_of: dict[str, _Unit] = {}
    loads = [0] * world_size
    for i, spec in enumerate(specs):
        if spec.stacked:
            for k, share in enumerate(_piece_costs(spec, costs[i], world_size)):
                loads[k] += share
        elif spec.numel <= small_param_numel:
            unit = small_unit_of.get(spec.boundary)
            if unit is None:
                unit = _Unit(0, i, [], spec.boundary)
                small_unit_of[spec.boundary] = unit
                units.append(unit)
            unit.cost += costs[i]
            unit.members.append(i)
        else:
            units.append(_Unit(costs[i], i, [i], spec.boundary))
    units.sort(key=lambda u: (-u.cost, u.order))

    unit_owner: list[int] = []
    held: dict[tuple[str, int], int] = {}  # (boundary, rank) -> number of units held
    for unit in units:
        best_any = min(range(world_size), key=lambda r: (loads[r], r))
        chosen = best_any
        free = [r for r in range(world_size) if held.get((unit.boundary, r), 0) == 0]
        if free:
            best_free = min(free, key=lambda r: (loads[r], r))
            lpt_makespan = max(max(loads), loads[best_any] + unit.cost)
            if loads[best_free] + unit.cost <= lpt_makespan:
                chosen = best_free
        loads[chosen] += unit.cost
        held[(unit.boundary, chosen)] = held.get((unit.boundary, chosen), 0) + 1
        unit_owner.append(chosen)
    _spread_by_equal_cost_swaps(units, unit_owner, held)

    owners = [SHARDED if spec.stacked else 0 for spec in specs]
    for unit, owner in zip(units, unit_owner, strict=True):
        for i in unit.members:
            owners[i] = owner
    return Plan(world_size, tuple(specs), tuple(owners), tuple(costs), ns_algorithm)


def _piece_costs(spec: ParamSpec, cost: int, world_size: int) -> list[int]:
    """A stack's cost per slot: each slot's share of its experts."""
    experts = spec.shape[0]
    return [
        cost * (stop - start) // max(experts, 1)
        for start, stop in stack_pieces(experts, world_size)
    ]


def _spread_by_equal_cost_swaps(
    units: list[_Unit], unit_owner: list[int], held: dict[tuple[str, int], int]
) -> None:
    """Where a rank holds two units of one boundary, swap one with an equal-cost unit elsewhere.

    Equal cost means the per-rank loads (and so the balance) do not change; each swap removes
    one collision without creating another. Runs in place, deterministically.
    """
    by_cost: dict[int, list[int]] = {}
    for k, unit in enumerate(units):
        by_cost.setdefault(unit.cost, []).append(k)
    for k, unit in enumerate(units):
        r = unit_owner[k]
        if held[(unit.boundary, r)] < 2:
            continue
        for j in by_cost[unit.cost]:
            other, s = units[j], unit_owner[j]
            if s == r or other.boundary == unit.boundary:
                continue
            if held.get((unit.boundary, s), 0) or held.get((other.boundary, r), 0):
                continue
            held[(unit.boundary, r)] -= 1
            held[(other.boundary, s)] -= 1
            held[(unit.boundary, s)] = 1
            held[(other.boundary, r)] = 1
            unit_owner[k], unit_owner[j] = s, r
            break
