#!/usr/bin/env python3
"""QK-clip's logit tracking on one GPU: milliseconds of the per-head maximum logit of one
attention call (bf16 q and k, causal) by the one-pass kernel (dmuon_titan.ops.max_logit) and by
the chunked float32 path, beside SDPA's forward on the same tensors, for llama3-8B's and the
170M model's attention shapes.

    python3 scripts/bench/bench_max_logit.py [--seq 8192] [--batch 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import median_milliseconds  # noqa: E402

from dmuon_titan.ops import max_logit  # noqa: E402
from dmuon_titan.ops import qk_clip as ops  # noqa: E402

#: name -> (heads, kv heads, head dim)
SHAPES = {"llama3-8B": (32, 8, 128), "170M": (16, 16, 64)}


def row(name: str, heads: int, kv: int, d: int, seq: int, batch: int) -> str:
    q = torch.randn(batch, seq, heads, d, device="cuda").transpose(1, 2).bfloat16()
    k = torch.randn(batch, seq, kv, d, device="cuda").transpose(1, 2).bfloat16()
    v = torch.randn_like(k)
    assert max_logit.runs_for(q, k)
    fast = median_milliseconds(lambda: ops.max_logits(q, k), "cuda", 3, 10)
    slow = median_milliseconds(lambda: ops.max_logits(q.float(), k.float()), "cuda", 1, 3)
    gqa = kv < heads
    sdpa = median_milliseconds(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
        "cuda",
        3,
        10,
    )
    assert torch.allclose(ops.max_logits(q, k), ops.max_logits(q.float(), k.float()), rtol=1e-5)
    return (
        f"| {name} | {seq} × {batch} | {fast:.2f} | {slow:.2f} | {sdpa:.2f} | {fast / sdpa:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(
        "| shape | seq × batch | kernel (ms) | chunked fp32 (ms) | SDPA forward (ms) | kernel/SDPA |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (heads, kv, d) in SHAPES.items():
        print(row(name, heads, kv, d, args.seq, args.batch))


if __name__ == "__main__":
    main()
