"""Newton–Schulz shared by a tensor-parallel row: ``dedicate_params(tp_ns="shared")``.

With whole-matrix owners a model with fewer matrices than owner slots leaves slots idle
and the largest matrix sets the step (llama3-70B has 560 matrices for dp 128 × tp 8 =
1,024 slots). A shared matrix is still owned by one slot (r, s, t) — master, gradient,
momentum and update stay there, so clipping, state dicts and checkpoints see nothing new —
but its Newton–Schulz is computed by the T ranks of the owner's row (r, s, ·), the tp group
that already gathers its gradient shards:

1. each owner cuts the NS input of each shared matrix it owns into T column blocks of its
   wide orientation and sends rank k block k (one all-to-all over the row for all of them);
2. the row runs :func:`~dmuon_titan.runtime.column_blocks.orthogonalize_column_blocks` on every
   same-shape batch of the row's shared matrices, in plan order (one m×m all-reduce and one
   all-gather per iteration and batch);
3. the blocks of the result go back to their owners (one more all-to-all), who update.

Every rank of a row takes part for every shared matrix of the row, with zeros for a matrix
whose owner has no gradient (it then ignores the result): what is issued is the plan's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops.newton_schulz import Coefficients
from ..ops.ns_cost import column_block_width
from .collectives import Collectives
from .column_blocks import (
    from_wide_column_blocks,
    orthogonalize_column_blocks,
    wide_column_block,
)
from .owned_param import DedicatedParam

PHASE = "tp_ns"

#: a shared batch holds at most this many elements of m×m (Gram) or m×w (block) per matrix
#: (at least one matrix): its scratch — the float32 Gram, its NS-dtype copy, the gathered
#: update — stays near the owner path's chunks (``DEFAULT_NS_BATCH_NUMEL``). A constant,
#: not an option: every rank of a row must cut the same batches.
SHARED_BATCH_NUMEL = 1 << 27


class _RowCollectives:
    """:class:`~dmuon_titan.runtime.column_blocks.BlockCollectives` over the tp group."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm
        self.size, self.rank = comm.mesh.tp_size, comm.mesh.tp_rank

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        self.comm.group_all_reduce(tensor, PHASE)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.comm.group_all_gather(tensor, PHASE)


def block_numel(p: DedicatedParam, tp_size: int) -> int:
    """Elements of one rank's column block of ``p``."""
    return min(p.shape) * column_block_width(p.shape, tp_size)


class SharedNewtonSchulz:
    """The shared matrices of this rank's row and their Newton–Schulz (see the module doc)."""

    def __init__(self, params: list[DedicatedParam], comm: Collectives) -> None:
        self.comm = comm
        self.tp_size, self.tp_rank = comm.mesh.tp_size, comm.mesh.tp_rank
        #: the row's shared matrices, in parameter (plan) order
        self.row = [p for p in params if p.shared_ns and p.in_owner_row]
        #: by owner tp coordinate
        self.by_owner = [[p for p in self.row if p.owner_tp_rank == t] for t in range(self.tp_size)]
        #: same-shape batches (first appearance order, cut at ``SHARED_BATCH_NUMEL``): each
        #: one orthogonalization
        by_shape: dict[tuple[int, ...], list[DedicatedParam]] = {}
        for p in self.row:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        self.batches: list[list[DedicatedParam]] = []
        for shape, members in by_shape.items():
            m = min(shape)
            per = max(1, SHARED_BATCH_NUMEL // max(m * m, block_numel(members[0], self.tp_size)))
            self.batches += [members[i : i + per] for i in range(0, len(members), per)]
        #: each row matrix's (m, w): one rank's column block of its wide orientation
        self.block_shape = {
            p.index: (min(p.shape), column_block_width(p.shape, self.tp_size)) for p in self.row
        }
        #: the matrices this rank owns, and where each one's block sits in a rank's part
        self.mine = self.by_owner[self.tp_rank]
        self.starts, start = {}, 0
        for p in self.mine:
            self.starts[p.index] = start
            start += block_numel(p, self.tp_size)
        #: elements this rank sends each rank (its matrices' blocks), and each owner sends it
        self.per_dest = start
        self.splits = [sum(block_numel(p, self.tp_size) for p in part) for part in self.by_owner]
        self.group = _RowCollectives(comm)

    @torch.no_grad()
    def orthogonalize(
        self,
        inputs: dict[int, torch.Tensor],
        coefficients: Sequence[Coefficients],
        ns_steps: int,
        eps: float,
        dtype: torch.dtype,
        preconditioner: str = "frobenius",
    ) -> dict[int, torch.Tensor]:
        """NS of the row's shared matrices. ``inputs``: parameter index -> the whole NS input
        (``dtype``) of each shared matrix this rank owns and has a gradient for (consumed:
        each is dropped once cut into blocks); returns the whole orthogonalized matrix for
        each of them. Every rank of the row must call it."""
        if not self.row:
            return {}
        device, size, per_dest = self.comm.device, self.tp_size, self.per_dest
        present: set[int] = set()

        def part_of(buffer: torch.Tensor, k: int, p: DedicatedParam) -> torch.Tensor:
            """``p``'s block in rank ``k``'s part of a buffer laid out by ``self.mine``."""
            start = k * per_dest + self.starts[p.index]
            return buffer[start : start + block_numel(p, size)].view(self.block_shape[p.index])

        send = torch.zeros(per_dest * size, dtype=dtype, device=device)
        for p in self.mine:  # into destination k's part: each of its matrices' block k
            matrix = inputs.pop(p.index, None)
            if matrix is not None:
                for k in range(size):
                    wide_column_block(matrix, k, size, out=part_of(send, k, p))
                present.add(p.index)
            del matrix
        recv = torch.empty(sum(self.splits), dtype=dtype, device=device)
        self.comm.all_to_all(recv, send, self.splits, [per_dest] * size, PHASE).wait()
        del send
        blocks: dict[int, torch.Tensor] = {}
        offset = 0
        for part in self.by_owner:
            for p in part:
                n = block_numel(p, size)
                blocks[p.index] = recv[offset : offset + n].view(self.block_shape[p.index])
                offset += n
        results: dict[int, torch.Tensor] = {}
        for members in self.batches:
            batch = torch.stack([blocks[p.index] for p in members])
            out = orthogonalize_column_blocks(
                batch, coefficients, ns_steps, eps, self.group, preconditioner
            )
            results.update(zip((p.index for p in members), out.unbind(0), strict=True))
        del recv, blocks
        back = torch.cat([results[p.index].reshape(-1) for part in self.by_owner for p in part])
        returned = torch.empty(per_dest * size, dtype=dtype, device=device)
        self.comm.all_to_all(returned, back, [per_dest] * size, self.splits, PHASE).wait()
        return {
            p.index: from_wide_column_blocks(
                [part_of(returned, k, p) for k in range(size)], p.shape
            )
            for p in self.mine
            if p.index in present
        }
