"""The gradients of a boundary's buckets, out to their owners.

Stage 1 (the shard ranks) reduces each bucket to its column: bucket after bucket with
``collectives="broadcast"`` (:func:`reduce_bucket`), or every bucket at once by one
reduce-scatter with ``"gather"`` (:func:`reduce_gathered`). With replicas stage 2
(:func:`stage2`) reduces each segment on, across replicas, to its global owner. Expert stacks
reduce by their own reduce-scatter (``stack.py``).
"""

from __future__ import annotations

import torch

from .bucket import OwnerBucket, PendingReduce
from .collectives import Collectives, Pending


def reduce_bucket(comm: Collectives, bucket: OwnerBucket, what: str) -> PendingReduce:
    """Stage 1 of one bucket (its own reduce to its column), then stage 2."""
    flat = bucket.pack_grads()
    stage1 = comm.reduce_sum(flat, bucket.owner_shard, "reduce", len(bucket.params), what=what)
    return stage2(comm, bucket, flat, stage1, flat, what)


def reduce_gathered(
    comm: Collectives,
    buckets: list[OwnerBucket],
    slot: int,
    dtype: torch.dtype,
    what: str,
) -> list[PendingReduce]:
    """One reduce-scatter: every bucket packed at its column's slot (padding zeroed);
    this rank receives its column's bucket summed, in a tensor of its own (so the other
    slots are freed once the collective is done)."""
    mesh = comm.mesh
    shards = mesh.shard_size
    flat = torch.empty(shards * slot, dtype=dtype, device=mesh.device)
    by_column = {bucket.owner_shard: bucket for bucket in buckets}
    for column in range(shards):
        region = flat[column * slot : (column + 1) * slot]
        bucket = by_column.get(column)
        used = 0 if bucket is None else bucket.reduce_numel
        if bucket is not None:
            bucket.pack_grads(region[:used])
        if used < slot:
            region[used:].zero_()
    mine = by_column.get(mesh.shard_rank)
    # One rank: nothing to scatter, the packed buffer is the sum.
    out = flat if shards == 1 else torch.empty_like(flat[:slot])
    stage1 = comm.reduce_scatter_slots(
        flat, out, "reduce", sum(len(b.params) for b in buckets), what=what
    )
    if mine is None:
        return [PendingReduce(None, None, [stage1])]
    return [stage2(comm, mine, out[: mine.reduce_numel], stage1, out, what)]


def stage2(
    comm: Collectives,
    bucket: OwnerBucket,
    flat: torch.Tensor,
    stage1: Pending,
    base: torch.Tensor,
    what: str,
) -> PendingReduce:
    """After stage 1 left ``bucket``'s column sum in ``flat`` (a slice of ``base``, on the
    column's ranks): with replicas, each segment to its global owner; what the owner
    unpacks later. The owned gradients become ``owned.grad`` as views, so when they are
    only part of ``base`` (other replicas' segments, a gather slot's padding) they are
    copied out first: otherwise all of ``base`` would stay allocated until the gradients
    are freed, for every boundary at once by the end of backward.

    On CUDA stage 2 and the copy queue behind stage 1 on the reduce stream; without
    streams they need stage 1 done on the host, so they wait for
    :meth:`PendingReduce.complete` (see there why not now)."""

    mesh = comm.mesh

    def rest() -> PendingReduce:
        handles = [stage1]
        if mesh.replicate_size > 1 and bucket.holds_source:
            for segment in bucket.segments:
                handles.append(
                    comm.reduce_sum(
                        segment.of(flat),
                        segment.replica,
                        "reduce_replicate",
                        len(segment.params),
                        group="replicate",
                        what=what,
                    )
                )
        owned = bucket.owned_segment()
        if owned is None:
            return PendingReduce(None, None, handles)
        data = owned.of(flat)
        if owned.numel < base.numel():
            data, done = comm.compact(data, handles)
            handles = [*handles, done]
        return PendingReduce(owned, data, handles)

    if mesh.device.type == "cuda":
        return rest()
    return PendingReduce(None, None, [stage1], rest=rest)
