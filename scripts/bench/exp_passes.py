#!/usr/bin/env python3
"""Experiment (to be removed): the captured step's momentum and update passes on the 170M
matrices, at their launch configuration and others, timed as CUDA graphs (no host time), with
the bytes they move as a bandwidth; and NS of the two 170M batches at two symmetric-kernel
configurations, alternating.

    python3 scripts/bench/exp_passes.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from exp_sym_small import graph_ms  # noqa: E402

from dmuon_titan import fused, symmetric  # noqa: E402
from dmuon_titan.newton_schulz import JORDAN_COEFFICIENTS, orthogonalize  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    shapes = [(1024, 1024)] * 48 + [(2816, 1024)] * 24 + [(1024, 2816)] * 12
    grads = [torch.randn(s, device=device) for s in shapes]
    bufs = [torch.randn(s, device=device) for s in shapes]
    params = [torch.randn(s, device=device) for s in shapes]
    squares = torch.empty(48, 1024, 1024, device=device, dtype=torch.bfloat16)
    ffn = torch.empty(36, 1024, 2816, device=device, dtype=torch.bfloat16)
    outs = [squares[i] for i in range(48)] + [ffn[i].mT for i in range(24)]
    outs += [ffn[24 + i] for i in range(12)]
    numel = sum(g.numel() for g in grads)
    decay = torch.tensor(0.999, device=device)
    step = torch.tensor(1e-3, device=device)

    def momentum(block=2048, tile=64, warps=4, warps2d=4):
        for g, b, o in zip(grads, bufs, outs, strict=True):
            if o.is_contiguous():
                fused._momentum_kernel[(triton.cdiv(g.numel(), block),)](
                    g, b, o, g.numel(), 0.05, 0.95, NESTEROV=True, BY_ADDRESS=False,
                    GRAD_TYPE=None, BLOCK=block, num_warps=warps,
                )  # fmt: skip
            else:
                rows, cols = b.shape
                fused._momentum_kernel_2d[(triton.cdiv(rows, tile), triton.cdiv(cols, tile))](
                    g, b, o, rows, cols, o.stride(0), o.stride(1), 0.05, 0.95, NESTEROV=True,
                    BY_ADDRESS=False, GRAD_TYPE=None, TILE=tile, num_warps=warps2d,
                )  # fmt: skip

    def update(tile=64, warps=4):
        for p, o in zip(params, outs, strict=True):
            rows, cols = p.shape
            fused._update_kernel[(triton.cdiv(rows, tile), triton.cdiv(cols, tile))](
                p, o, rows, cols, o.stride(0), o.stride(1), decay, step,
                SCALARS_ON_DEVICE=True, TILE=tile, num_warps=warps,
            )  # fmt: skip

    def production():
        for g, b, o in zip(grads, bufs, outs, strict=True):
            fused.momentum_direction_into(g, b, o, 0.95, True)
        for p, o in zip(params, outs, strict=True):
            fused.decay_and_update_(p, o, decay, step)

    big = torch.empty(numel * 3, device=device)
    copy_bytes = big.numel() * 4 * 2 // 2
    half = big.numel() // 2
    ms = graph_ms(lambda: big[:half].copy_(big[half : 2 * half]), device, 3, 20, calls=5)
    print(f"copy: {ms:.3f} ms, {copy_bytes / ms / 1e9:.2f} TB/s (read + write)")
    momentum_bytes, update_bytes = numel * 14, numel * 10
    variants = [
        ("production (both passes, fused.py)", production, momentum_bytes + update_bytes),
        ("momentum 2048 w4, 2d 64 w4", momentum, momentum_bytes),
        ("momentum 4096 w4", partial(momentum, block=4096), momentum_bytes),
        ("momentum 4096 w8", partial(momentum, block=4096, warps=8), momentum_bytes),
        ("momentum 8192 w8", partial(momentum, block=8192, warps=8), momentum_bytes),
        ("momentum 1024 w4", partial(momentum, block=1024), momentum_bytes),
        ("momentum 2d 64 w8", partial(momentum, warps2d=8), momentum_bytes),
        ("momentum 2d 128 w8", partial(momentum, tile=128, warps2d=8), momentum_bytes),
        ("momentum 2d 32 w4", partial(momentum, tile=32), momentum_bytes),
        ("update 64 w4", update, update_bytes),
        ("update 64 w8", partial(update, warps=8), update_bytes),
        ("update 128 w8", partial(update, tile=128, warps=8), update_bytes),
        ("update 128 w4", partial(update, tile=128, warps=4), update_bytes),
        ("update 32 w4", partial(update, tile=32), update_bytes),
        ("update 32 w2", partial(update, tile=32, warps=2), update_bytes),
    ]
    for _ in range(2):
        for name, fn, nbytes in variants:
            ms = graph_ms(fn, device, 3, 20, calls=3)
            print(f"| {name} | {ms:.3f} ms | {nbytes / ms / 1e9:.2f} TB/s |", flush=True)
    grads = bufs = params = outs = squares = ffn = big = None

    defaults = symmetric.symmetric_mm.__kwdefaults__
    inputs = [torch.randn(48, 1024, 1024, device=device, dtype=torch.bfloat16)]
    inputs.append(torch.randn(36, 1024, 2816, device=device, dtype=torch.bfloat16))
    for _ in range(3):
        for config in ("8/4", "4/3", "8/3"):
            defaults["num_warps"], defaults["num_stages"] = (int(v) for v in config.split("/"))
            total = 0.0
            for x in inputs:
                call = partial(orthogonalize, x, (JORDAN_COEFFICIENTS,), 5, 1e-7, algorithm="auto")
                total += graph_ms(call, device, 3, 10, calls=3)
            print(f"| NS auto, both 170M batches | {config} | {total:.3f} ms |", flush=True)


if __name__ == "__main__":
    main()
