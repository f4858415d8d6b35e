"""MuonClip's math (QK-clip, Kimi K2): per-head maximum attention logits and the rescale of
the query and key weights. Pure functions over tensors (no process group).

A head h whose largest logit S_h = max q_i·k_j·scale over a step's batch exceeds τ gets
γ_h = τ / S_h; its query rows are multiplied by γ_h^α and the rows of the key head it reads
by γ^(1−α). Under grouped-query attention one key head serves several query heads, so it
takes the smallest γ of its group: every head's logit then scales by at most γ_h, and its
maximum on that batch is at most τ after the clip.
"""

from __future__ import annotations

import math

import torch

from . import max_logit

#: query rows per chunk of the logit maximum: bounds its memory at
#: batch x heads x QUERY_CHUNK x keys elements
QUERY_CHUNK = 256


@torch.no_grad()
def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    query_chunk: int = QUERY_CHUNK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per query head, the largest attention logit ``q_i · k_j · scale`` over the batch and
    every unmasked (query, key) pair, in float32 (float64 inputs stay float64).

    ``q``: (batch, heads, queries, head_dim); ``k``: (batch, kv_heads, keys, head_dim), each
    key head serving ``heads / kv_heads`` consecutive query heads (as ``enable_gqa`` and
    ``repeat_interleave`` do). ``causal``: query i sees keys j ≤ i + keys − queries (the
    bottom-right alignment of a cache; equal lengths: j ≤ i). ``scale`` defaults to
    1/√head_dim. Exact: on CUDA in half precision, the one-pass kernel of
    :mod:`dmuon_titan.ops.max_logit` (fp32 accumulation, as flash attention); elsewhere
    chunked over the queries in float32 (float64 stays float64), so no (queries, keys) matrix
    of every head is held at once, and causal chunks read only the keys they see.

    ``out``: a (heads,) tensor of that dtype (float32 for half inputs) to fold the maxima
    into in place and return (its values count as seen already: a running maximum over a
    step's forwards); None: a new one."""
    b, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} key heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if scale > 0 and max_logit.runs_for(q, k):
        return max_logit.max_logits(q, k, causal=causal, scale=scale, out=out)
    dtype = logit_dtype(q.dtype)
    qg = q.to(dtype).reshape(b, kv_heads, heads // kv_heads, n_q, d)
    kt = k.to(dtype).transpose(-1, -2).unsqueeze(2)  # (b, kv_heads, 1, d, keys)
    best = torch.full((heads,), -math.inf, dtype=dtype, device=q.device)
    offset = n_k - n_q
    for start in range(0, n_q, max(1, query_chunk)):
        stop = min(n_q, start + max(1, query_chunk))
        seen = max(0, min(n_k, stop + offset)) if causal else n_k  # keys the chunk may see
        if seen == 0:
            continue
        logits = (qg[:, :, :, start:stop] @ kt[..., :seen]) * scale  # (b, kv, rep, chunk, seen)
        if causal:
            rows = torch.arange(start, stop, device=q.device).unsqueeze(1) + offset
            hidden = torch.arange(seen, device=q.device).unsqueeze(0) > rows
            logits = logits.masked_fill(hidden, -math.inf)
        chunk_max = logits.amax(dim=(0, 3, 4)).reshape(heads)
        best = torch.maximum(best, chunk_max)
    if out is None:
        return best
    return torch.maximum(out, best, out=out)


def logit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`max_logits` returns for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_scales(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """γ_h = min(1, τ / S_h) per head; heads with no logit seen (−inf) or none above τ keep
    1."""
    gamma = torch.ones_like(maxima)
    over = maxima > threshold
    return torch.where(over, threshold / torch.where(over, maxima, gamma), gamma)


def query_key_scales(
    gamma: torch.Tensor, n_kv_heads: int, alpha: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per query head γ_h^α, per key head (min over its group of γ)^(1−α))."""
    heads = gamma.numel()
    group_min = gamma.reshape(n_kv_heads, heads // n_kv_heads).amin(dim=1)
    return gamma.pow(alpha), group_min.pow(1.0 - alpha)


@torch.no_grad()
def scale_head_rows_(weight: torch.Tensor, per_head: torch.Tensor) -> None:
    """Multiply ``weight``'s rows, ``heads`` equal blocks of them (a projection's output
    features by head), by ``per_head`` in place, with no host synchronization; blocks with
    factor 1 keep their values exactly (x · 1 = x)."""
    heads = per_head.numel()
    rows = weight.view(heads, weight.shape[0] // heads, *weight.shape[1:])
    rows.mul_(per_head.to(weight.dtype).view(heads, *([1] * (rows.dim() - 1))))


@torch.no_grad()
def scale_heads_rows_(rows: list[torch.Tensor], per_head: list[torch.Tensor]) -> None:
    """Multiply each of ``rows`` — a weight's rows as (heads, rows per head, in) blocks, or a
    slice of them — by its ``per_head`` factors (heads,) in place, in one foreach call (the
    clip's host time would otherwise grow with the layers); factor 1 keeps values exactly."""
    if rows:
        torch._foreach_mul_(
            rows, [f.to(r.dtype).view(-1, 1, 1) for r, f in zip(rows, per_head, strict=True)]
        )


def context_parallel_max_logits(
    q_local: torch.Tensor,
    k_all: torch.Tensor,
    *,
    rank: int,
    world: int,
    load_balanced: bool,
    causal: bool = True,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`max_logits` of one context-parallel rank's query rows against every key:
    ``q_local`` (batch, heads, seq / world, d) this rank's rows, ``k_all`` (batch, kv_heads,
    seq, d) every rank's keys concatenated in rank order. ``load_balanced``: torch's
    head-tail layout (rank r holds sequence chunks r and 2·world−1−r of 2·world), else rank r
    holds the r-th contiguous slice. Causal rows see the keys up to their place in the
    sequence; the maximum over the ranks is the whole sequence's."""
    if not causal:
        return max_logits(q_local, k_all, causal=False, scale=scale, out=out)
    if not load_balanced:
        seen = (rank + 1) * q_local.shape[2]
        return max_logits(q_local, k_all[:, :, :seen], causal=True, scale=scale, out=out)
    chunk = q_local.shape[2] // 2
    held = [(j, 2 * world - 1 - j) for j in range(world)]  # (chunks of each rank, in order)
    place = {c: (j * 2 + i) * chunk for j, pair in enumerate(held) for i, c in enumerate(pair)}
    natural = torch.cat([k_all[:, :, place[c] : place[c] + chunk] for c in range(2 * world)], 2)
    for i, c in enumerate(held[rank]):
        rows = q_local[:, :, i * chunk : (i + 1) * chunk]
        out = max_logits(rows, natural[:, :, : (c + 1) * chunk], causal=True, scale=scale, out=out)
    return out
