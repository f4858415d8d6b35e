"""The dedicated parameters of one boundary owned in one shard column, and their buffers.

A bucket's full-size weights are one flat buffer (a view into its boundary's storage). Its
gradients travel in a flat *reduce buffer* laid out as :class:`Segment` s, one per owner
replica: the segment's gradients, then one presence flag per parameter. Stage 1 (the shard
ranks) reduces the whole buffer to the bucket's column; with replicas each segment is reduced
once more, across replicas, to its global owner, who turns it into ``owned.grad``
(:func:`finalize`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .collectives import Pending
from .owned_param import DedicatedParam


def common_dtypes(params: list[DedicatedParam], where: str) -> tuple[torch.dtype, torch.dtype]:
    """(param dtype, reduce dtype) shared by ``params``, which must share them to move in one
    buffer; ``where`` names that buffer in the error."""
    dtypes = {(p.param_dtype, p.reduce_dtype) for p in params}
    if len(dtypes) != 1:
        raise ValueError(
            f"dedicated parameters {[p.fqn for p in params]} move in one buffer ({where}) but "
            f"have different mixed-precision dtypes {sorted(map(str, dtypes))}"
        )
    return next(iter(dtypes))


@dataclass(frozen=True)
class Segment:
    """The part of a reduce buffer bound for one owner replica: ``offset``, then the
    gradients of ``params`` (shaped ``shapes``), then one presence flag each.

    ``shapes``: the owner's piece of a stack; ``None`` for a bucket: its parameters'
    full-size (with tensor parallelism: tp-shard) shapes, known once the parallelism placed
    them."""

    replica: int
    params: tuple[DedicatedParam, ...]
    offset: int
    piece_shapes: tuple[torch.Size, ...] | None = None

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        if self.piece_shapes is not None:
            return self.piece_shapes
        return tuple(p.unsharded_shape for p in self.params)

    @property
    def grads_numel(self) -> int:
        if self.piece_shapes is not None:
            return sum(shape.numel() for shape in self.piece_shapes)
        return sum(p.unsharded_numel for p in self.params)

    @property
    def numel(self) -> int:
        return self.grads_numel + len(self.params)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This segment's elements of the reduce buffer ``flat``."""
        return flat[self.offset : self.offset + self.numel]

    def flags(self, data: torch.Tensor) -> torch.Tensor:
        """The presence flags in ``data`` (this segment's elements)."""
        return data[self.grads_numel :]

    def grads(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``data`` (this segment's elements), one per parameter, shaped ``shapes``."""
        views, offset = [], 0
        for shape in self.shapes:
            views.append(data[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return views

    @property
    def owned_here(self) -> bool:
        """Its reduced gradients end on this rank: the owner's (with tensor parallelism its
        row's tp shards, gathered on the owner afterwards)."""
        return self.params[0].in_owner_row


class OwnerBucket:
    """The parameters of one boundary owned in one shard column."""

    def __init__(self, owner_shard: int, params: list[DedicatedParam]) -> None:
        self.owner_shard = owner_shard
        self.params = sorted(params, key=lambda p: (p.owner_replica, p.index))
        self.numel = sum(p.unsharded_numel for p in self.params)
        #: this rank is the bucket's stage-1 source (its shard column)
        self.holds_source = self.params[0].holds_source
        self.segments: list[Segment] = []
        offset = 0
        for replica in sorted({p.owner_replica for p in self.params}):
            members = tuple(p for p in self.params if p.owner_replica == replica)
            self.segments.append(Segment(replica, members, offset))
            offset += self.segments[-1].numel
        #: elements of the bucket's reduce buffer: the gradients plus one flag per parameter
        self.reduce_numel = offset
        #: flat, param dtype: a view into the boundary's weight buffer (``attach``)
        self.buffer: torch.Tensor | None = None

    def resolve_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(param dtype, reduce dtype), the same for every parameter of the bucket."""
        self.param_dtype, self.reduce_dtype = common_dtypes(self.params, "a hook boundary's owner")
        return self.param_dtype, self.reduce_dtype

    def attach(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (``numel`` elements, param dtype) the storage of the full-size
        parameters."""
        self.buffer = buffer
        offset = 0
        for p in self.params:
            p.make_unsharded(buffer[offset : offset + p.unsharded_numel])
            offset += p.unsharded_numel

    @torch.no_grad()
    def fill_from_owned(self) -> None:
        """Column ranks: copy (and cast) the master weights (with tensor parallelism their
        shard copies) into the broadcast buffer."""
        offset = 0
        for p in self.params:
            view = self.buffer[offset : offset + p.unsharded_numel]
            view.view(p.unsharded_shape).copy_(p.source)
            offset += p.unsharded_numel

    @torch.no_grad()
    def pack_grads(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's gradients (zeros where none) plus the presence flags, segment by
        segment, into ``flat`` (``reduce_numel`` elements; new if ``None``).

        The flags are summed by the reduces, so the owner learns whether *any* rank produced a
        gradient, and keeps ``grad=None`` (skipped, as torch.optim does) when none did.
        """
        if flat is None:
            flat = torch.empty(
                self.reduce_numel, dtype=self.reduce_dtype, device=self.buffer.device
            )
        for segment in self.segments:
            data = segment.of(flat)
            flags = segment.flags(data)
            flags.zero_()
            for i, (p, view) in enumerate(zip(segment.params, segment.grads(data), strict=True)):
                grad = p.unsharded.grad
                if grad is not None and hasattr(grad, "to_local"):  # tensor parallelism's
                    grad = grad.to_local()
                # Known here, on the host: if the owner itself had a gradient, the flags
                # need not be read (see finalize).
                p.packed_local_grad = grad is not None
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                    flags[i : i + 1].fill_(1)  # a kernel, not a host-to-device copy
                    p.unsharded.grad = None
        return flat

    def owned_segment(self) -> Segment | None:
        """The segment this rank owns globally, if any."""
        return next((s for s in self.segments if s.owned_here), None)


class PendingReduce:
    """A bucket's reduce in flight: ``handles`` to wait for, and, on the global owner, its
    ``segment`` and the reduced elements ``data``.

    ``rest``: without CUDA streams, the second stage (replicas) and the owner's copy wait for
    the first stage on the host, so they are left for :meth:`complete` at the end of
    backward: a rank blocked inside backward on its own reduce could wait on a peer that is
    itself waiting for this rank's next weight broadcast.
    """

    __slots__ = ("segment", "data", "handles", "rest")

    def __init__(
        self,
        segment: Segment | None,
        data: torch.Tensor | None,
        handles: list[Pending],
        rest: Callable[[], PendingReduce] | None = None,
    ) -> None:
        self.segment, self.data, self.handles, self.rest = segment, data, handles, rest

    def complete(self) -> PendingReduce:
        """Issue what was left for later (in the order the reduces were issued: every rank
        does the same); returns the reduce to wait for."""
        if self.rest is None:
            return self
        for handle in self.handles:
            handle.wait()
        return self.rest()


@torch.no_grad()
def finalize(pending: list[PendingReduce], divide_factor: float, tp_exchange=None) -> int:
    """Wait for ``pending`` (issuing what was left for later first, in order); global owners
    turn their segments into ``owned.grad``. Returns the number of host synchronizations
    (0 or 1). With tensor parallelism (``tp_exchange``, a
    :class:`~dmuon_titan.runtime.tensor_parallel.TensorParallelExchange`) the segments are
    the row's tp shards, gathered on the owners first.

    A matrix gets ``grad`` if any rank produced a gradient for it, else keeps ``None``
    (skipped by the step, as torch.optim does). The owner knows on the host whether it had
    one itself, which settles it in ordinary training with no synchronization at all. Only
    for owned matrices the owner had no gradient for (unused on this rank) are the summed
    presence flags read back: one device-to-host copy, after everything else was issued.
    """
    pending = [item.complete() for item in pending]
    for item in pending:
        for handle in item.handles:
            handle.wait()
    owned = [item for item in pending if item.segment is not None]
    for item in owned:
        if divide_factor != 1:  # the gradients, not the presence flags after them
            item.data[: item.segment.grads_numel].div_(divide_factor)
    unknown = [item for item in owned if not all(p.packed_local_grad for p in item.segment.params)]
    flags = (
        iter(torch.cat([item.segment.flags(item.data) for item in unknown]).tolist())
        if unknown
        else iter(())
    )
    unknown_ids = {id(item) for item in unknown}
    present: dict[int, bool] = {}
    grads: dict[int, torch.Tensor] = {}
    received: dict[int, DedicatedParam] = {}
    for item in owned:
        read = id(item) in unknown_ids
        for p, grad in zip(item.segment.params, item.segment.grads(item.data), strict=True):
            flag = next(flags) if read else None
            present[p.index] = p.packed_local_grad or (flag is not None and flag > 0)
            grads[p.index] = grad
            received[p.index] = p
    if tp_exchange is not None:  # (the tp ranks of a row agree on presence: one forward)
        grads = tp_exchange.gather_grads(grads)
    for index, grad in grads.items():
        p = received[index]
        if not (p.is_owner and present[index]):
            continue
        grad = grad if grad.dtype == p.orig_dtype else grad.to(p.orig_dtype)
        if p.owned.grad is None:
            p.owned.grad = grad
        else:
            p.owned.grad.add_(grad)
    return int(bool(unknown))
