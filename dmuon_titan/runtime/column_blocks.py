"""Newton–Schulz shared by a group of ranks that each hold column blocks of the matrices.

The math of ``dedicate_params(tp_ns="shared")`` (:mod:`dmuon_titan.runtime.shared_ns` runs
it over a tensor-parallel row): pure tensor operations plus two blocking collectives that
the caller provides through :class:`BlockCollectives`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..ops.newton_schulz import Coefficients, aol_rescale_, check_ns_preconditioner
from ..ops.ns_cost import column_block_width


class BlockCollectives(Protocol):
    """What :func:`orthogonalize_column_blocks` needs from the ranks that share one
    Newton–Schulz: their number, this rank's place, and two blocking collectives."""

    size: int
    rank: int

    def all_reduce_(self, tensor: Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` (same shape everywhere), stacked on a new dim 0 in rank
        order."""


def wide_column_block(matrix: Tensor, rank: int, size: int, out: Tensor | None = None) -> Tensor:
    """Block ``rank`` of ``size`` of ``matrix``'s wide orientation (``matrix``, or its
    transpose when tall; a batch: per matrix), zero-padded to :func:`column_block_width`
    columns: a new contiguous tensor, or written into ``out`` (zeros expected where the
    padding goes)."""
    x = matrix.mT if matrix.size(-2) > matrix.size(-1) else matrix
    width = column_block_width(matrix.shape, size)
    start, stop = min(rank * width, x.size(-1)), min((rank + 1) * width, x.size(-1))
    block = x.new_zeros((*x.shape[:-1], width)) if out is None else out
    block[..., : stop - start].copy_(x[..., start:stop])
    return block


def from_wide_column_blocks(blocks: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
    """The ``shape`` matrix (or batch) whose wide orientation's column blocks are ``blocks``
    (every rank's, in rank order; :func:`wide_column_block`'s inverse)."""
    rows, cols = int(shape[-2]), int(shape[-1])
    x = torch.cat(list(blocks), dim=-1)[..., : max(rows, cols)]
    return x.mT.contiguous() if rows > cols else x


def orthogonalize_column_blocks(
    block: Tensor,
    coefficients: Sequence[Coefficients],
    ns_steps: int,
    eps: float,
    group: BlockCollectives,
    preconditioner: str = "frobenius",
) -> Tensor:
    """:func:`zeropower_via_newtonschulz` (plain) of matrices that ``group.size`` ranks hold
    as column blocks of their wide orientation: ``block`` is this rank's (``[batch,] m ×
    w``, already in the NS dtype, used as scratch), the result this rank's block of the
    orthogonalized matrices.

    With X = [X_0 … X_{T-1}] by columns, A = X Xᵀ = Σ_k X_k X_kᵀ (every rank's partial
    product, summed over the group: m×m), each rank computes the row block k of
    B = bA + cA² (its share of the m³ term), the group gathers B, and X_k ← aX_k + B X_k
    needs nothing but X_k. So a rank does 1/T of every product, and per iteration the group
    moves one m×m all-reduce and one m×m all-gather. The Frobenius norm is the square root of
    the summed squares. The partial products (rounded to the NS dtype by their matmul, as
    torch.optim.Muon's one product is) and the squares are summed in float32 (float64 for
    float64 NS), then rounded once: in float64 torch.optim.Muon's numbers up to the order of
    summation; in bf16 one more rounding per partial product (tests: error within 1.25× of
    the whole-matrix bf16 NS's). ``preconditioner`` ``"aol"``: the first iteration's summed
    A gives the row scales of :func:`aol_rescale_` (each rank scales its block's rows),
    so AOL costs no collective beyond that iteration's."""
    check_ns_preconditioner(preconditioner)
    squeeze = block.ndim == 2
    x = block.unsqueeze(0) if squeeze else block
    dtype = x.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    aol = preconditioner == "aol"
    if not aol:
        squares = x.to(wide).square().sum(dim=(-2, -1))
        group.all_reduce_(squares)
        x.div_(squares.sqrt().to(dtype).clamp(min=eps)[:, None, None])
    m = x.size(-2)
    per = -(-m // group.size)
    start, stop = min(group.rank * per, m), min((group.rank + 1) * per, m)
    for i in range(ns_steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        gram = torch.bmm(x, x.mT).to(wide)
        group.all_reduce_(gram)
        gram = gram.to(dtype)
        if aol and i == 0:
            gram = aol_rescale_(x, gram, eps)
        rows = gram.new_zeros((gram.size(0), per, m))
        rows[:, : stop - start].copy_(gram[:, start:stop])
        rows = torch.baddbmm(rows, rows, gram, beta=b, alpha=c)
        gram_update = group.all_gather(rows).permute(1, 0, 2, 3).reshape(gram.size(0), -1, m)
        x = torch.baddbmm(x, gram_update[:, :m], x, beta=a)
    return x.squeeze(0) if squeeze else x
