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

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from ..ops.ns_cost import check_ns_algorithm, column_block_width, orthogonalize_flops

#: Matrices with at most this many elements are "small": all small matrices of one boundary
#: go to a single owner so the boundary issues one collective for them instead of many.
DEFAULT_SMALL_PARAM_NUMEL = 1 << 16

#: Who runs a tensor-parallel matrix's Newton–Schulz (:func:`plan_partition`'s ``tp_ns``)
TP_NS_MODES = ("auto", "owner", "shared")

#: ``tp_ns="auto"``'s exchange rate between a row's traffic and NS FLOPs: the FLOPs one
#: byte of it costs, an H200's achieved bf16 NS rate (≈ 600 TFLOP/s,
#: docs/design_notes.md#shared-newton-schulz-exchange-rate)
#: over the achieved bandwidth of a tp link (≈ 300 GB/s of NVLink)
SHARED_NS_FLOPS_PER_BYTE = 2000


def shared_ns_bytes(shape: Sequence[int], tp_size: int, ns_steps: int = 5) -> int:
    """Bytes one rank of a row moves to share the NS of a ``shape`` matrix over its
    ``tp_size`` ranks (bf16 NS), the planner's estimate: its column block in and its result
    out, then per iteration a ring all-reduce of the float32 m×m Gram matrix (2·(T−1)/T of
    it, what a ring puts on the wire; ``summarize_plan`` counts (T−1)/T, the convention of
    its other phases) and an all-gather of the bf16 m×m update ((T−1)/T of it)."""
    m = min(int(shape[-2]), int(shape[-1]))
    blocks = 2 * m * column_block_width(shape, tp_size) * 2
    return blocks + ns_steps * (tp_size - 1) * m * m * (2 * 4 + 2) // tp_size


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
    #: the NS algorithm the owners were balanced for (see ``plan.cost.NS_ALGORITHMS``): the
    #: costs are its FLOPs, but plain NS's for shared specs (which run plain NS)
    ns_algorithm: str = "plain"
    #: tensor-parallel degree T: slots ``row · T + t``, a row being T consecutive slots
    tp_size: int = 1
    #: per spec: its Newton–Schulz is shared by the T ranks of its owner's row (plain NS on
    #: column blocks, ``newton_schulz.orthogonalize_column_blocks``), not run by the owner
    #: alone; empty: shared by none
    shared: tuple[bool, ...] = ()

    def is_shared(self, i: int) -> bool:
        return bool(self.shared) and self.shared[i]

    def load_per_rank(self) -> list[int]:
        loads = [0] * self.world_size
        for i, (spec, owner, cost) in enumerate(
            zip(self.specs, self.owners, self.costs, strict=True)
        ):
            if owner == SHARDED:
                for k, share in enumerate(_piece_costs(spec, cost, self.world_size)):
                    loads[k] += share
            elif self.is_shared(i):
                row = owner - owner % self.tp_size
                for k in range(row, row + self.tp_size):
                    loads[k] += cost // self.tp_size
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
        for i, (spec, owner) in enumerate(zip(self.specs, self.owners, strict=True)):
            shared = ":shared" if self.is_shared(i) else ""
            h.update(f"|{spec.fqn}:{spec.shape}:{spec.boundary}:{owner}{shared}".encode())
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
    tp_size: int = 1,
    tp_ns: str = "owner",
) -> Plan:
    """Assign an owner slot to every spec (:func:`plan_owners`); with tensor parallelism
    (``world_size`` slots = rows × ``tp_size``) ``tp_ns`` decides who runs Newton–Schulz:

    - ``"owner"``: each matrix's owner alone.
    - ``"shared"``: the T ranks of its owner's row together (each 1/T of it, plain NS on
      column blocks). Rows are balanced by NS cost, then within each row the owners (who keep
      master and momentum) by elements.
    - ``"auto"``: ``"shared"`` where it is estimated faster: its slowest row's NS FLOPs per
      rank plus its traffic (:func:`shared_ns_bytes`, at :data:`SHARED_NS_FLOPS_PER_BYTE`)
      below the owner plan's slowest rank's FLOPs. Whole owners cannot balance fewer
      matrices than slots; sharing moves m×m matrices every iteration, which costs about
      what it saves on square shapes, so sharing pays off only where the owner plan is far
      out of balance.
    """
    if tp_ns not in TP_NS_MODES:
        raise ValueError(f"unknown tp_ns {tp_ns!r}; known: {list(TP_NS_MODES)}")
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide world_size {world_size}")
    owner_plan = plan_owners(
        specs, world_size, small_param_numel=small_param_numel, ns_algorithm=ns_algorithm
    )
    owner_plan = dataclasses.replace(owner_plan, tp_size=tp_size)
    if tp_size == 1 or tp_ns == "owner" or all(s.stacked for s in specs):
        return owner_plan
    shared_plan = _shared_plan(specs, world_size, small_param_numel, ns_algorithm, tp_size)
    if tp_ns == "auto" and _shared_time(shared_plan) >= max(owner_plan.load_per_rank()):
        return owner_plan
    return shared_plan


def _shared_plan(
    specs: Sequence[ParamSpec],
    world_size: int,
    small_param_numel: int,
    ns_algorithm: str,
    tp_size: int,
) -> Plan:
    """``tp_ns="shared"``: rows balanced by NS cost, then within each row the owners (who
    keep master and momentum) by elements."""
    # Shared NS runs the plain iteration whatever ns_algorithm says: cost it so.
    rows = plan_owners(specs, world_size // tp_size, small_param_numel=small_param_numel)
    owners = list(rows.owners)
    row_numel: dict[int, list[int]] = {}
    for i in sorted(range(len(specs)), key=lambda i: (-specs[i].numel, i)):
        if specs[i].stacked:
            continue
        numel = row_numel.setdefault(rows.owners[i], [0] * tp_size)
        t = min(range(tp_size), key=lambda k: (numel[k], k))
        numel[t] += specs[i].numel
        owners[i] = rows.owners[i] * tp_size + t
    shared = tuple(not s.stacked for s in specs)
    return Plan(world_size, tuple(specs), tuple(owners), rows.costs, ns_algorithm, tp_size, shared)


def _shared_time(plan: Plan) -> float:
    """The estimated NS time of a shared plan's slowest row: its slowest rank's FLOPs plus
    the row's traffic at :data:`SHARED_NS_FLOPS_PER_BYTE`."""
    tp_size = plan.tp_size
    row_bytes = [0] * (plan.world_size // tp_size)
    for spec, owner in zip(plan.specs, plan.owners, strict=True):
        if not spec.stacked:
            row_bytes[owner // tp_size] += shared_ns_bytes(spec.shape, tp_size)
    loads = plan.load_per_rank()
    return max(
        max(loads[r * tp_size : (r + 1) * tp_size]) + SHARED_NS_FLOPS_PER_BYTE * row_bytes[r]
        for r in range(len(row_bytes))
    )


def plan_owners(
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
    loads = [0] * world_size
    units = _units(specs, costs, small_param_numel, world_size, loads)
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


def _units(
    specs: Sequence[ParamSpec],
    costs: list[int],
    small_param_numel: int,
    world_size: int,
    loads: list[int],
) -> list[_Unit]:
    """The units to place, by decreasing cost (ties: first appearance): each large matrix
    alone, the small ones of a boundary together; the stacks' shares added to ``loads``."""
    units: list[_Unit] = []
    small_unit_of: dict[str, _Unit] = {}
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
    return units


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
