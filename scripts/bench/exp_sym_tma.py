#!/usr/bin/env python3
"""Experiment: the symmetric kernel persistent and flattened, with TMA loads and stores.

At full clock a 1024-inner 128×256 block of the shipped kernel takes ≈ 4.5 µs besides its
main loop (docs/benchmarks.md, nineteenth session: the pipeline's first loads, the epilogue's
addend load, conversion and two stores, one transposed). ``exp_sym_persistent.py``'s
flattened persistent loop, with pointer loads and stores, hid little of it (≈ 0.1 ms of the
170M step). Here the same loop moves its tiles by TMA (host tensor descriptors, Triton 3.6's
``TensorDescriptor``): the loads are asynchronous copies the pipeliner can issue for the next
block during this block's epilogue; the stores, the mirror's included, go out from shared
memory asynchronously; the addend comes in by TMA too. The fifth round's TMA variants were
not persistent, not flattened, 128×128, and timed under the power cap.

Each block is one tile row i by two column tiles: two 128×128 accumulators, each product
``A[i] · B[:, j]`` read as ``(Bᵀ[j] · A[i]ᵀ)ᵀ``: the right factor of every product Newton–Schulz
asks for is Xᵀ (so Bᵀ = X) or symmetric (Bᵀ = B), so B's tiles are row blocks of a contiguous
matrix, like A's. Layout, epilogue and results are the shipped kernel's.

Written in the nineteenth session without a GPU: checked in Triton's interpreter
(``--check-cpu``) and compiled for sm_90 offline with Triton 3.6, the GPU machines' version
(``--resources``: 180–229 KB of shared memory, 214–255 registers, no spills; flattened with
an addend it needs 262 KB at four stages, so it takes three). Measured in the twentieth
session at full clock (docs/benchmarks.md): flattened 8–10 % slower than the shipped kernel
on whole NS, not flattened 0.5–1 %; not adopted. Its whole NS of the FFN batch also ended
3.7× farther from float64 NS than the shipped kernel's while every per-product check agreed:
a product Gram NS asks for that the cases here do not cover goes wrong; not investigated.

    python3 scripts/bench/exp_sym_tma.py --rounds 3 --whole-ns --cool-ms 25
    python3 scripts/bench/exp_sym_tma.py --resources     # offline, no GPU: scripts/analysis
    TRITON_INTERPRET=1 python3 scripts/bench/exp_sym_tma.py --check-cpu
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import sym_harness  # (this directory: the script's own on sys.path)
import torch
import triton
import triton.language as tl
from exp_sym_persistent import persistent_mm, sm_count

from dmuon_titan import symmetric

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # (older Triton)
    TensorDescriptor = None


@triton.jit
def _tma_kernel(
    a_desc, bt_desc, c_desc, d_desc, scale_ptr,
    rows_per_matrix, junk, tiles, per_matrix, total, launched, alpha, beta, diagonal,
    HAS_ADDEND: tl.constexpr, HAS_SCALE: tl.constexpr, TILE: tl.constexpr,
    TILE_K: tl.constexpr, K: tl.constexpr, FLATTEN: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, TILE)
    finished = tl.program_id(0) - launched
    for work in tl.range(tl.program_id(0), total, launched, flatten=FLATTEN):
        base = (work // per_matrix) * rows_per_matrix
        row, first, second, _ = symmetric.program_layout(work % per_matrix, tiles)
        acc1 = tl.zeros((TILE, TILE), dtype=tl.float32)
        acc2 = tl.zeros((TILE, TILE), dtype=tl.float32)
        for kk in range(0, K // TILE_K):
            k = kk * TILE_K
            a = a_desc.load([base + row * TILE, k])
            acc1 = tl.dot(a, bt_desc.load([base + first * TILE, k]).T, acc1)
            acc2 = tl.dot(a, bt_desc.load([base + second * TILE, k]).T, acc2)
        finished += launched
        base = (finished // per_matrix) * rows_per_matrix
        batch = finished // per_matrix
        row, first, second, _ = symmetric.program_layout(finished % per_matrix, tiles)
        acc1 = acc1 * alpha
        acc2 = acc2 * alpha
        if HAS_ADDEND:
            acc1 += beta * d_desc.load([base + row * TILE, first * TILE]).to(tl.float32)
            acc2 += beta * d_desc.load([base + row * TILE, second * TILE]).to(tl.float32)
        acc1 += tl.where((row * TILE + r)[:, None] == (first * TILE + r)[None, :], diagonal, 0.0)
        acc2 += tl.where((row * TILE + r)[:, None] == (second * TILE + r)[None, :], diagonal, 0.0)
        if HAS_SCALE:
            factor = tl.load(scale_ptr + batch)
            acc1 = acc1 * factor
            acc2 = acc2 * factor
        # No branches (the loop-flattening pass rejects them): a diagonal tile's mirror goes
        # to the junk rows after the batch; a lone leftover's second tile is its first again,
        # computed alike, and stored twice (the same bits).
        out1 = acc1.to(c_desc.dtype)
        out2 = acc2.to(c_desc.dtype)
        c_desc.store([base + row * TILE, first * TILE], out1)
        c_desc.store([base + row * TILE, second * TILE], out2)
        c_desc.store([tl.where(first != row, base + first * TILE, junk), row * TILE], out1.T)
        c_desc.store([tl.where(second != row, base + second * TILE, junk), row * TILE], out2.T)


def tma_mm(
    a, b, *, addend=None, alpha=1.0, beta=1.0, diagonal=0.0, scale=None,
    flatten=True, num_warps=8, num_stages=None,
):  # fmt: skip
    """``symmetric.symmetric_mm``'s contract for the products NS asks for (the right factor
    Xᵀ of the left one, or symmetric; an addend of the output's shape), by the TMA kernel.
    ``num_stages`` None: 4, or 3 flattened with an addend (4 would need 262 KB of shared
    memory: ``--resources``)."""
    if num_stages is None:
        num_stages = 3 if flatten and addend is not None else 4
    a3 = a if a.ndim == 3 else a.unsqueeze(0)
    b3 = b if b.ndim == 3 else b.unsqueeze(0)
    batch, m, k = a3.shape
    bt = b3.mT if b3.mT.is_contiguous() else b3  # Xᵀ's transpose, or the symmetric factor
    assert a3.is_contiguous() and bt.is_contiguous(), "contiguous operands only"
    tile, tile_k = symmetric.TILE, symmetric.TILE_K
    storage = a3.new_empty((batch * m + tile, m))  # (a tile row of junk after the batch)
    out = storage[: batch * m].view(batch, m, m)
    a_desc = TensorDescriptor(a3.view(batch * m, k), [batch * m, k], [k, 1], [tile, tile_k])
    bt_desc = TensorDescriptor(bt.view(batch * m, k), [batch * m, k], [k, 1], [tile, tile_k])
    c_desc = TensorDescriptor(storage, [batch * m + tile, m], [m, 1], [tile, tile])
    d_desc = c_desc
    if addend is not None:
        add3 = (addend if addend.ndim == 3 else addend.unsqueeze(0)).expand(batch, m, m)
        add3 = add3.contiguous()
        d_desc = TensorDescriptor(add3.view(batch * m, m), [batch * m, m], [m, 1], [tile, tile])
    scales = (
        out
        if scale is None
        else scale.to(device=out.device, dtype=torch.float32).reshape(-1).expand(batch).contiguous()
    )
    tiles = m // tile
    per_matrix = symmetric.programs(tiles)
    total = per_matrix * batch
    launched = min(sm_count(a.device.index or 0) if a.is_cuda else 3, total)
    _tma_kernel[(launched,)](
        a_desc, bt_desc, c_desc, d_desc, scales,
        m, batch * m, tiles, per_matrix, total, launched, float(alpha), float(beta),
        float(diagonal),
        HAS_ADDEND=addend is not None, HAS_SCALE=scale is not None, TILE=tile,
        TILE_K=tile_k, K=k, FLATTEN=flatten, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out if a.ndim == 3 else out.squeeze(0)


def resources() -> None:
    """Compile the kernel for sm_90 offline (no GPU) and print what it takes of an SM."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analysis"))
    from kernel_resources import compile_for_hopper
    from kernel_resources import resources as usage

    m = 1024
    load = "tensordesc<bf16[128, 64]>"
    tile = "tensordesc<bf16[128, 128]>"
    args = dict(
        a_desc=load, bt_desc=load, c_desc=tile, d_desc=tile, scale_ptr="*fp32",
        rows_per_matrix=m, junk=48 * m, tiles=m // 128, per_matrix=symmetric.programs(m // 128),
        total=48 * symmetric.programs(m // 128), launched=132, alpha=1.0, beta=1.0, diagonal=0.0,
    )  # fmt: skip
    print(f"_tma_kernel, sm_90 (Triton {triton.__version__})")
    for flatten in (False, True):
        for addend in (False, True):
            for stages in (3, 4):
                constants = dict(
                    HAS_ADDEND=addend, HAS_SCALE=False, TILE=128, TILE_K=64, K=m, FLATTEN=flatten
                )
                try:
                    compiled = compile_for_hopper(_tma_kernel, args, constants, 8, stages)
                    print(f"flatten {flatten} addend {addend} stages {stages}: {usage(compiled)}")
                except Exception as e:  # (a variant that does not compile: say why)
                    print(f"flatten {flatten} addend {addend} stages {stages}: {e!r}"[:400])


def check_cpu() -> None:
    """The kernel in Triton's interpreter (float32 stands in for bf16: IEEE dots there):
    X·Xᵀ and aI + bA + cA² with a scale, 1-5 tiles, against float64."""
    torch.manual_seed(0)
    for tiles in range(1, 6):
        m = 128 * tiles
        x = torch.randn(2, m, 64)
        sym = x @ x.mT
        got = tma_mm(x, x.mT)
        torch.testing.assert_close(got.double(), x.double() @ x.double().mT, rtol=1e-5, atol=1e-3)
        scale = torch.tensor([0.5, 2.0])
        got = tma_mm(sym, sym, addend=sym, alpha=2.0, beta=-0.5, diagonal=3.0, scale=scale)
        s64 = sym.double()
        want = (
            2.0 * s64 @ s64 - 0.5 * s64 + 3.0 * torch.eye(m, dtype=torch.float64)
        ) * scale.double()[:, None, None]
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-2)
    print("TMA kernel: equal to the float64 products in the interpreter, 1-5 tiles")


def main() -> None:
    parser = argparse.ArgumentParser()
    sym_harness.timing_arguments(parser, rounds=3, cool_ms=25.0)
    parser.add_argument("--resources", action="store_true", help="offline: compile, no GPU")
    args = parser.parse_args()
    if args.check_cpu:
        check_cpu()
        return
    if args.resources:
        resources()
        return
    variants = {
        "shipped": symmetric.symmetric_mm,
        "persistent flat 4s": functools.partial(persistent_mm, flatten=True),
        "TMA flat 4s": functools.partial(tma_mm, flatten=True),
        "TMA flat 3s": functools.partial(tma_mm, flatten=True, num_stages=3),
        "TMA persistent 4s": functools.partial(tma_mm, flatten=False),
    }
    skipped = ("1024x4096", "4096x14336")
    cases = {k: v for k, v in sym_harness.CASES.items() if not any(s in k for s in skipped)}
    sym_harness.run(args, variants, "shipped", cases)


if __name__ == "__main__":
    main()
