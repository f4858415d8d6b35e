"""Per-head maximum attention logit in one pass over the keys, as a Triton kernel.

Each program takes a block of one head's queries, walks the key blocks it may see (causal:
those up to its last row's diagonal), forms ``q · kᵀ`` with fp32 accumulation — the logits a
flash-attention kernel forms from the same half-precision q and k — and keeps the running
maximum of the unmasked ones. Nothing of size (queries, keys) reaches memory: the chunked
matmul of :func:`dmuon_titan.ops.qk_clip.max_logits` writes and rereads every logit, which
costs more than the products themselves at long sequences. The result differs from it only
in fp32 summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused

triton = fused.triton
if triton is not None:
    import triton.language as tl

_HALF = (torch.bfloat16, torch.float16)
#: query rows per program
BLOCK_M = 128


def runs_for(q: Tensor, k: Tensor) -> bool:
    """Whether :func:`max_logits` runs for these query and key tensors: Triton enabled,
    CUDA, half precision, a power-of-two head dimension from 16 to 256."""
    d = q.shape[-1]
    return (
        fused.enabled()
        and q.device.type == "cuda"
        and q.dtype in _HALF
        and k.dtype == q.dtype
        and 16 <= d <= 256
        and d & (d - 1) == 0
    )


def max_logits(q: Tensor, k: Tensor, *, causal: bool, scale: float) -> Tensor:
    """Per query head, the largest ``q_i · k_j · scale`` over the batch and every unmasked
    pair, float32 (the layout and mask of :func:`dmuon_titan.ops.qk_clip.max_logits`)."""
    b, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    blocks = triton.cdiv(n_q, BLOCK_M)
    out = torch.empty((b * heads, blocks), dtype=torch.float32, device=q.device)
    block_n = 64 if d > 64 else 128
    _max_logit_kernel[(blocks, b * heads)](
        *(q, k, out, *q.stride(), *k.stride()),
        *(n_q, n_k, heads, heads // kv_heads, float(scale), n_k - n_q, blocks),
        CAUSAL=causal,
        D=d,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        num_warps=8 if d > 64 else 4,
        num_stages=3,
    )
    return out.view(b, heads, blocks).amax(dim=(0, 2))


if triton is not None:

    @triton.jit
    def _max_logit_kernel(
        q_ptr, k_ptr, out_ptr,
        q_sb, q_sh, q_sm, q_sd, k_sb, k_sh, k_sn, k_sd,
        n_q, n_k, heads, group, scale, offset, blocks,
        CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        batch, head = bh // heads, bh % heads
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        q_base = q_ptr + batch.to(tl.int64) * q_sb + head.to(tl.int64) * q_sh
        q = tl.load(
            q_base + rows[:, None] * q_sm + dims[None, :] * q_sd,
            mask=rows[:, None] < n_q,
            other=0.0,
        )
        k_base = k_ptr + batch.to(tl.int64) * k_sb + (head // group).to(tl.int64) * k_sh
        best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        end = n_k
        if CAUSAL:  # the block's last row sees keys up to its diagonal
            end = tl.maximum(tl.minimum(n_k, (pid_m + 1) * BLOCK_M + offset), 0)
        for start in range(0, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k = tl.load(
                k_base + cols[None, :] * k_sn + dims[:, None] * k_sd,
                mask=cols[None, :] < n_k,
                other=0.0,
            )
            logits = tl.dot(q, k) * scale
            seen = (rows[:, None] < n_q) & (cols[None, :] < n_k)
            if CAUSAL:
                seen = seen & (cols[None, :] <= rows[:, None] + offset)
            best = tl.maximum(best, tl.max(tl.where(seen, logits, float("-inf")), axis=1))
        tl.store(out_ptr + bh * blocks + pid_m, tl.max(best, axis=0))
