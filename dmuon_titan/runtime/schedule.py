"""The order in which every rank issues a step's collectives, whatever its own data did.

A collective must be issued by every rank of its process group, in the same order. Which hook
boundaries run on a rank, and how often, can depend on that rank's data (an expert that gets
no tokens, a branch taken by some samples only), so no collective may be tied to a boundary's
own hooks firing. Instead one **schedule**, the same on every rank, lists the boundaries'
*forward entries* (a boundary that runs twice per forward has two); each rank walks it:

- **forward**: reaching a boundary's entry issues the entries before it too. Entries a rank
  passes over (boundaries that did not run there) still join their collectives, and what they
  brought stays usable until the end of that forward, in case the boundary runs out of order;
- **backward**: re-broadcasts (Z3) in :attr:`Schedule.backward_unshard` order, reduces in
  :attr:`Schedule.reduce` order. A rank issues a boundary's reduce once its own gradients are
  final (all arrived, or the boundary did not run there: it contributes zeros), or at the end
  of backward; never out of order.

The first step walks a guess (plan order: the boundaries in parameter registration order).
At the end of the first backward every rank's recorded forward sequence is gathered and
:func:`merge_sequences` turns them into the schedule of every later step: a pure function, so
every rank derives the same one.

Everything here is pure: boundary indices in, boundary indices out.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


class ScheduleError(RuntimeError):
    """A boundary ran in a way no rank-consistent schedule can serve (see the message)."""


@dataclass(frozen=True)
class Schedule:
    """The forward entries of one step, and the backward orders derived from them."""

    #: boundary index of each forward entry, in order; repeats for boundaries run twice
    forward: tuple[int, ...]
    #: False for the first step's plan-order guess; True once recorded on every rank
    recorded: bool = False
    backward_unshard: tuple[int, ...] = field(init=False)
    reduce: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        # Backward meets a boundary at its last forward use first (Z3 re-broadcast) and its
        # gradients are final after its first forward use's backward (the reduce).
        last = {b: i for i, b in enumerate(self.forward)}
        first: dict[int, int] = {}
        for i, b in enumerate(self.forward):
            first.setdefault(b, i)
        object.__setattr__(
            self, "backward_unshard", tuple(sorted(last, key=last.__getitem__, reverse=True))
        )
        object.__setattr__(
            self, "reduce", tuple(sorted(first, key=first.__getitem__, reverse=True))
        )

    def next_entry(self, boundary: int, start: int) -> int | None:
        """Index of ``boundary``'s first forward entry at or after ``start``, if any."""
        for i in range(start, len(self.forward)):
            if self.forward[i] == boundary:
                return i
        return None


def plan_order_schedule(num_boundaries: int) -> Schedule:
    """The first step's guess: every boundary once, in plan (registration) order."""
    return Schedule(tuple(range(num_boundaries)), recorded=False)


def merge_sequences(sequences: Sequence[Sequence[int]], num_boundaries: int) -> Schedule:
    """One forward schedule that contains every rank's sequence as a subsequence, if any does.

    Entries are (boundary, occurrence) pairs: a rank that ran a boundary twice contributes two.
    Each rank's sequence orders its consecutive entries, and a boundary's occurrences are
    ordered among themselves; the schedule is a topological order of those constraints, ties
    (and boundaries no rank ran, which stay in the schedule so that a later step may run them)
    going to the lower boundary index. Contradicting orders (a cycle) are broken the same way.
    """
    successors: dict[tuple[int, int], set[tuple[int, int]]] = {}
    indegree: dict[tuple[int, int], int] = {}

    def node(entry: tuple[int, int]) -> None:
        if entry not in indegree:
            indegree[entry] = 0
            successors[entry] = set()

    def edge(a: tuple[int, int], b: tuple[int, int]) -> None:
        if b not in successors[a]:
            successors[a].add(b)
            indegree[b] += 1

    for boundary in range(num_boundaries):
        node((boundary, 0))
    for sequence in sequences:
        seen: dict[int, int] = {}
        previous = None
        for boundary in sequence:
            if not 0 <= boundary < num_boundaries:
                raise ValueError(f"boundary index {boundary} out of range {num_boundaries}")
            occurrence = seen.get(boundary, 0)
            seen[boundary] = occurrence + 1
            entry = (boundary, occurrence)
            node(entry)
            if occurrence:
                edge((boundary, occurrence - 1), entry)
            if previous is not None:
                edge(previous, entry)
            previous = entry

    ready = [entry for entry, degree in indegree.items() if degree == 0]
    heapq.heapify(ready)
    placed: set[tuple[int, int]] = set()
    order: list[int] = []
    while len(placed) < len(indegree):
        if not ready:  # a cycle: contradicting orders on different ranks
            entry = min(e for e in indegree if e not in placed)
        else:
            entry = heapq.heappop(ready)
            if entry in placed:
                continue
        placed.add(entry)
        order.append(entry[0])
        for after in successors[entry]:
            indegree[after] -= 1
            if indegree[after] == 0 and after not in placed:
                heapq.heappush(ready, after)
    return Schedule(tuple(order), recorded=True)


@dataclass
class ForwardCursor:
    """One forward pass's position in :attr:`Schedule.forward`.

    ``consumed``: entries before it have been reached (run here, or passed over);
    ``issued``: entries before it have had their collectives issued (a boundary's own
    pre-forward issues up to its entry, a prefetch one further).
    """

    training: bool
    consumed: int = 0
    issued: int = 0


@dataclass
class BackwardCursor:
    """One backward's positions in :attr:`Schedule.backward_unshard` and :attr:`Schedule.reduce`."""

    unshard_issued: int = 0
    reduce_issued: int = 0
