"""One expert stack of a boundary: a 3-D parameter owned piece by piece over its grid.

Every slot keeps the master of its own experts (``DedicatedParam.piece``, cut by
:func:`~dmuon_titan.plan.partition.stack_pieces`) and steps them. The full-size stack (with
expert parallelism: this rank's EP share of it) is one buffer of one equal slot per grid
rank, each rank's experts at its slot, padded at the end: one all-gather fills it (forward,
and again before backward under Z3) and the stack is a plain contiguous view of it, with no
copy out. Gradients go back by one reduce-scatter; each slot carries its experts' gradient
sum and one presence flag.
"""

from __future__ import annotations

import torch

from ..plan.partition import stack_pieces
from .bucket import PendingReduce, Segment
from .collectives import Collectives, Pending
from .owned_param import DedicatedParam


class ExpertStack:
    """The collectives and buffer of one stacked :class:`DedicatedParam`."""

    def __init__(self, param: DedicatedParam, grid_size: int, grid_rank: int) -> None:
        self.param = param
        self.grid_size = grid_size
        self.grid_rank = grid_rank
        experts = param.unsharded_shape[0]
        #: [start, stop) per grid rank, within the experts this rank computes with
        self.pieces = stack_pieces(experts, grid_size)
        #: elements of one matrix (expert) of the stack
        self.matrix_numel = param.shape[1:].numel()
        experts_per_slot = -(-experts // grid_size)
        #: weights per grid rank in the gathered buffer (a piece, padded to the longest)
        self.slot_numel = experts_per_slot * self.matrix_numel
        #: gradients per grid rank in the reduce buffer: the slot, then the presence flag
        self.reduce_slot_numel = self.slot_numel + 1
        self.buffer: torch.Tensor | None = None

    def lazy_init(self, device: torch.device) -> None:
        p = self.param
        self.buffer = torch.empty(
            self.grid_size * self.slot_numel, dtype=p.param_dtype, device=device
        )
        p.make_unsharded(self.buffer[: p.unsharded_shape.numel()])

    def unshard(self, comm: Collectives, phase: str, what: str) -> Pending:
        """Copy (and cast) this rank's master piece into its slot; all-gather the slots."""
        p = self.param
        if p.holds_weight:
            start = self.grid_rank * self.slot_numel
            with torch.no_grad():
                self.buffer[start : start + p.owned_numel].copy_(p.owned.reshape(-1))
        return comm.all_gather_slots(self.buffer, phase, group="grid_unshard", what=what)

    @torch.no_grad()
    def reduce_grads(self, comm: Collectives, what: str) -> PendingReduce:
        """This rank's gradient of the whole stack (zeros if none), slot by slot with a
        presence flag each, reduce-scattered: each owner receives its piece's sum."""
        p = self.param
        grad = p.unsharded.grad
        if grad is not None and hasattr(grad, "to_local"):  # expert parallelism's DTensor
            grad = grad.to_local()
        p.packed_local_grad = grad is not None
        slot = self.reduce_slot_numel
        flat = torch.zeros(self.grid_size * slot, dtype=p.reduce_dtype, device=self.buffer.device)
        if grad is not None:
            grad = grad.reshape(-1)
            for k, (start, stop) in enumerate(self.pieces):
                numel = (stop - start) * self.matrix_numel
                region = flat[k * slot : (k + 1) * slot]
                region[:numel].copy_(grad[start * self.matrix_numel : stop * self.matrix_numel])
                region[numel : numel + 1].fill_(1)  # a kernel, not a host-to-device copy
            p.unsharded.grad = None
        out = flat if self.grid_size == 1 else torch.empty_like(flat[:slot])
        pending = comm.reduce_scatter_slots(
            flat, out, "reduce", self.grid_size, group="grid_reduce", what=what
        )
        if not p.is_owner:
            return PendingReduce(None, None, [pending])
        segment = Segment(0, (p,), 0, (p.owned_shape,))
        return PendingReduce(segment, out[: segment.numel], [pending])
