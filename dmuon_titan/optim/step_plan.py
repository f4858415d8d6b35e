"""The step plan: which of this step's Muon matrices run together, and on which path.

Pure functions over tensors' shapes and dtypes (no process group, no optimizer): the paths
of a step (:class:`StepPaths`: expert stacks, Newton–Schulz shared by a tensor-parallel row,
the 2-D matrices stepped eagerly or as a captured graph), the Newton–Schulz batches
(:func:`ns_chunks`), and the streams a captured step's batches run on (:func:`chunk_lanes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

#: Plain NS (cuBLAS, ``ns_algorithm="plain"``) of a matrix this large already runs near the
#: matmul rate alone and measured slower batched, so such matrices go one at a time; with the
#: symmetric kernel ("gram"/"auto") both measured the same and those stay batched
#: (docs/design_notes.md#batched-newton-schulz).
PLAIN_NS_UNBATCHED_NUMEL = 4096 * 4096


@dataclasses.dataclass
class StepPaths:
    """This rank's Muon matrices of one step, by path."""

    #: 2-D matrices stepped here, eagerly or (``captured``) as one graph
    matrices: list[torch.Tensor]
    #: expert stacks (3-D) this rank steps
    stacks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: matrices this rank owns whose Newton–Schulz its tensor-parallel row shares
    shared: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: the row's shared Newton–Schulz (None: nothing shared; when set, every rank joins it)
    shared_ns: Any = None
    #: whether ``matrices`` run as the captured step
    captured: bool = False
    #: their momentum buffers (``captured`` only), in ``matrices``' order
    buffers: list[torch.Tensor] | None = None
    #: the step graph's key and the gradients' addresses, when already computed
    key: tuple | None = None
    addresses: list[int] | None = None


def split_paths(
    params: list[torch.Tensor], stepped: set[int], shared_ns: Any, is_shared
) -> StepPaths:
    """:class:`StepPaths` of the Muon-group ``params`` this rank steps (ids in ``stepped``)
    that have a gradient (torch.optim skips the others); ``is_shared(p)``: whether ``p``'s
    Newton–Schulz is the row's (asked only with a ``shared_ns``)."""
    todo = [p for p in params if p.grad is not None and id(p) in stepped]
    stacks = [p for p in todo if p.ndim == 3]
    matrices = [p for p in todo if p.ndim == 2]
    shared = []
    if shared_ns is not None:
        shared = [p for p in matrices if is_shared(p)]
        matrices = [p for p in matrices if not is_shared(p)]
    return StepPaths(matrices, stacks, shared, shared_ns)


def ns_chunks(
    params: Sequence[torch.Tensor],
    max_numel: int,
    unbatched_numel: int | None = None,
    merge_transposes: bool = False,
) -> list[list[torch.Tensor]]:
    """Split ``params`` into batches of same (full) shape and dtype, each of at most
    ``max_numel`` elements (at least one matrix); ``max_numel == 0``: one matrix per batch,
    and so for matrices of ``unbatched_numel`` elements or more. Order: shapes by first
    appearance, params in their order within a shape. ``merge_transposes``: 2-D matrices of
    transposed shapes batch together, each shape's matrices consecutive (the one that
    appears first, first); the order is then a fixed point (chunking the chunks' concatenation
    gives them back)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        shape = tuple(p.shape)
        kind = tuple(sorted(shape)) if merge_transposes and len(shape) == 2 else shape
        by_kind.setdefault((kind, p.dtype), []).append(p)
    if merge_transposes:  # (a stable sort by each shape's first appearance)
        for kind, same in by_kind.items():
            first = {}
            for p in same:
                first.setdefault(tuple(p.shape), len(first))
            by_kind[kind] = sorted(same, key=lambda p: first[tuple(p.shape)])
    chunks = []
    for (shape, _), same in by_kind.items():
        per_chunk = ns_batch_size(
            max(1, int(torch.Size(shape).numel())), max_numel, unbatched_numel
        )
        chunks.extend(same[i : i + per_chunk] for i in range(0, len(same), per_chunk))
    return chunks


def chunk_lanes(costs: Sequence[float], lanes: int) -> list[int]:
    """The lane (0 … ``lanes`` - 1) of each chunk of the given costs, taken in order: each
    to the lane with the least cost so far (the lowest such lane). Each lane runs its
    chunks in their order; lanes run side by side."""
    loads = [0.0] * max(1, lanes)
    placed = []
    for cost in costs:
        lane = min(range(len(loads)), key=loads.__getitem__)
        loads[lane] += cost
        placed.append(lane)
    return placed


def ns_batch_size(matrix_numel: int, max_numel: int, unbatched_numel: int | None) -> int:
    """How many same-shape matrices of ``matrix_numel`` elements one batched Newton–Schulz
    takes: as many as fit in ``max_numel`` elements (at least one; one if 0), one for
    matrices of ``unbatched_numel`` elements or more."""
    if unbatched_numel is not None and matrix_numel >= unbatched_numel:
        return 1
    return max(1, max_numel // matrix_numel) if max_numel else 1


def runs(
    chunk: list[torch.Tensor], batch: torch.Tensor
) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
    """(the matrices, their part of ``batch`` seen in their shape) for each run of one shape
    in ``chunk``: ``batch`` is NS's (a 3-D batch, or one 2-D matrix), wide, so a tall run's
    part is a transposed view."""
    batch = batch if batch.ndim == 3 else batch[None]
    start = 0
    while start < len(chunk):
        stop = start + 1
        while stop < len(chunk) and chunk[stop].shape == chunk[start].shape:
            stop += 1
        yield chunk[start:stop], shaped_as(batch[start:stop], chunk[start].shape)
        start = stop


def shaped_as(view: torch.Tensor, shape) -> torch.Tensor:
    """``view`` (a matrix or a batch of them, NS's wide layout) seen as matrices of
    ``shape``: itself, or its transpose for a tall ``shape``."""
    return view if tuple(view.shape[-2:]) == tuple(shape[-2:]) else view.mT
