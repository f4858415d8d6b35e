"""Per-head maximum attention logit in one pass over the keys, as a Triton kernel.

Each program takes a block of one head's queries and walks the key blocks it may see
(causal: those up to its last row's diagonal), forming ``q · kᵀ`` with fp32 accumulation —
the logits a flash-attention kernel forms from the same half-precision q and k. It keeps an
elementwise running maximum of the tile (no row reduction per block); only the blocks that
cross the diagonal or the sequence's end are masked; rows past the queries' end, the
row reduction and the (positive) scale come once at the end, and the block's maximum is
folded into the head's slot of the output with an atomic max. Nothing of size (queries,
keys) reaches memory: the chunked matmul of :func:`dmuon_titan.ops.qk_clip.max_logits`
writes and rereads every logit, which costs more than the products themselves at long
sequences. The result differs from it only in fp32 summation order (rounding is monotonic,
so scaling the maximum equals the maximum of the scaled logits).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import fused

triton = fused.triton
if triton is not None:
    import triton.language as tl

_HALF = (torch.bfloat16, torch.float16)
#: head dimension -> (query rows per program, keys per block, warps, pipeline stages)
TILES = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3)}
TILES.update({128: (128, 64, 8, 3), 256: (64, 32, 8, 2)})


def runs_for(q: Tensor, k: Tensor) -> bool:
    """Whether :func:`max_logits` runs for these query and key tensors: Triton enabled,
    CUDA, half precision, a power-of-two head dimension from 16 to 256."""
    d = q.shape[-1]
    return (
        fused.enabled()
        and q.device.type == "cuda"
        and q.dtype in _HALF
        and k.dtype == q.dtype
        and d in TILES
    )


def max_logits(
    q: Tensor, k: Tensor, *, causal: bool, scale: float, out: Tensor | None = None, tiles=None
) -> Tensor:
    """Per query head, the largest ``q_i · k_j · scale`` over the batch and every unmasked
    pair, float32 (the layout and mask of :func:`dmuon_titan.ops.qk_clip.max_logits`;
    ``scale`` > 0). ``out``: a contiguous float32 (heads,) tensor to fold the maxima into
    (its values count as seen already); None: a new one. ``tiles``: a :data:`TILES` entry."""
    if not scale > 0:
        raise ValueError(f"max_logits: scale = {scale!r}, the kernel needs a positive one")
    b, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    if out is None:
        out = torch.full((heads,), -math.inf, dtype=torch.float32, device=q.device)
    block_m, block_n, warps, stages = tiles or TILES[d]
    _max_logit_kernel[(triton.cdiv(n_q, block_m), b * heads)](
        *(q, k, out, *q.stride(), *k.stride()),
        *(n_q, n_k, heads, heads // kv_heads, float(scale), n_k - n_q),
        CAUSAL=causal,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _max_logit_kernel(
        q_ptr, k_ptr, out_ptr,
        q_sb, q_sh, q_sm, q_sd, k_sb, k_sh, k_sn, k_sd,
        n_q, n_k, heads, group, scale, offset,
        CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        batch, head = bh // heads, bh % heads
        first = pid_m * BLOCK_M
        rows = first + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        q_base = q_ptr + batch.to(tl.int64) * q_sb + head.to(tl.int64) * q_sh
        q = tl.load(
            q_base + rows[:, None] * q_sm + dims[None, :] * q_sd,
            mask=rows[:, None] < n_q,
            other=0.0,
        )
        k_base = k_ptr + batch.to(tl.int64) * k_sb + (head // group).to(tl.int64) * k_sh
        k_tile = k_base + tl.arange(0, BLOCK_N)[None, :] * k_sn + dims[:, None] * k_sd
        acc = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
        end = n_k
        # blocks every row of the program sees whole: before the sequence's end and (causal)
        # at or below its first row's diagonal
        whole = n_k
        if CAUSAL:
            end = tl.maximum(tl.minimum(n_k, first + BLOCK_M + offset), 0)
            whole = tl.maximum(tl.minimum(n_k, first + offset + 1), 0)
        whole = (whole // BLOCK_N) * BLOCK_N
        for start in range(0, whole, BLOCK_N):
            k = tl.load(k_tile + start * k_sn)
            acc = tl.maximum(acc, tl.dot(q, k))
        for start in range(whole, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_tile + start * k_sn, mask=cols[None, :] < n_k, other=0.0)
            seen = cols[None, :] < n_k
            if CAUSAL:
                seen = seen & (cols[None, :] <= rows[:, None] + offset)
            acc = tl.maximum(acc, tl.where(seen, tl.dot(q, k), float("-inf")))
        best = tl.where(rows < n_q, tl.max(acc, axis=1), float("-inf"))
        tl.atomic_max(out_ptr + head, tl.max(best, axis=0) * scale)
