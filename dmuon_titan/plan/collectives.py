"""How one boundary's dedicated weights and gradients travel in the shard group.

A boundary's matrices are grouped by owner column into buckets (``runtime/group.py``). Two
ways to move them, chosen per boundary from facts every rank shares (bucket sizes, group size):

- ``"broadcast"``: one broadcast from each bucket's owner (weights in) and one reduce to it
  (gradients out), one bucket after another. A ring broadcast or reduce of S elements keeps
  every link busy for about S / bandwidth, in one direction: the boundary costs Σ S_b.
- ``"gather"``: each bucket padded to the largest, B = max S_b, and laid out at its owner's
  slot of one buffer of ``group_size`` × B elements; one all-gather (weights) and one
  reduce-scatter (gradients) move it, every rank sending its slot at once. A ring all-gather
  keeps every link busy for about (n − 1) · B / bandwidth, in both directions, padding
  included.

``"auto"`` takes ``"gather"`` when (n − 1) · B < Σ S_b: on 2 ranks whenever the boundary has
a bucket on each rank (llama3-8B: 138.4 M and 79.7 M elements per block, 0.63× the broadcast
cost), rarely beyond 4 ranks, where padding to the largest bucket outweighs using all links.
"""

from __future__ import annotations

from collections.abc import Sequence

from .partition import Plan

BOUNDARY_COLLECTIVES = ("auto", "broadcast", "gather")


def check_boundary_collectives(collectives: str) -> None:
    if collectives not in BOUNDARY_COLLECTIVES:
        raise ValueError(
            f"collectives must be one of {list(BOUNDARY_COLLECTIVES)}, got {collectives!r}"
        )


def link_cost(bucket_numels: Sequence[int], group_size: int, collectives: str) -> int:
    """Elements that cross the busiest link direction to move one boundary by
    ``collectives`` (``"broadcast"`` or ``"gather"``)."""
    if group_size <= 1 or not bucket_numels:
        return 0
    if collectives == "broadcast":
        return sum(bucket_numels)
    if collectives == "gather":
        return (group_size - 1) * max(bucket_numels)
    raise ValueError(f"collectives must be 'broadcast' or 'gather', got {collectives!r}")


def choose_boundary_collectives(
    bucket_numels: Sequence[int], group_size: int, collectives: str
) -> str:
    """``"broadcast"`` or ``"gather"`` for a boundary whose owner columns hold buckets of
    ``bucket_numels`` elements, in a shard group of ``group_size`` ranks (see module doc)."""
    check_boundary_collectives(collectives)
    if collectives != "auto":
        return collectives
    gather = link_cost(bucket_numels, group_size, "gather")
    return "gather" if gather < link_cost(bucket_numels, group_size, "broadcast") else "broadcast"


def boundary_collectives(plan: Plan, shard_size: int, collectives: str) -> dict[str, str]:
    """``"broadcast"`` or ``"gather"`` for every boundary of ``plan`` (in first-appearance
    order) for a shard group of ``shard_size`` ranks: its buckets are its matrices grouped by
    owner column (``(owner // tp_size) % shard_size``: slots are ``(r · S + s) · T + t``).
    Stacks are not in buckets: they move by an
    all-gather and a reduce-scatter of their own, whatever the boundary's choice (a boundary
    of stacks alone is ``"broadcast"``, with no bucket to move)."""
    check_boundary_collectives(collectives)
    columns: dict[str, dict[int, int]] = {}
    for spec, owner in zip(plan.specs, plan.owners, strict=True):
        if spec.stacked:
            columns.setdefault(spec.boundary, {})
            continue
        sizes = columns.setdefault(spec.boundary, {})
        column = (owner // plan.tp_size) % shard_size
        sizes[column] = sizes.get(column, 0) + spec.numel
    return {
        boundary: choose_boundary_collectives(list(sizes.values()), shard_size, collectives)
        for boundary, sizes in columns.items()
    }
