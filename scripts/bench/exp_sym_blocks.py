#!/usr/bin/env python3
"""Experiment: the symmetric kernel with two or four 128-blocks per program.

Up to 4c51761 the kernel (``symmetric._symmetric_mm_kernel``) computed one 128×128 upper
tile per program; on the 170M products (rows 1024, inner 1024) it ran at 420–475 TFLOP/s on
the FLOPs it executes, cuBLAS's full products at 725–755 (docs/benchmarks.md, sixteenth
session). A 128×128 tile with a K step of 64 loads 32 KB per 2.1 MFLOP (64 FLOP per byte);
wider programs load less per FLOP: 128×256 (85 FLOP/B) and 256×256 (128 FLOP/B). This
script measured the variants below against that kernel (kept here as ``previous_mm``); the
pairs won and are the shipped kernel since abb3bf6, its layout computed from the program id
(docs/benchmarks.md, eighteenth session).

The fifth round tried 128×256 programs (``exp_sym_tma.py`` at 724ad04), pairing the column
tiles j, j+1 from the diagonal on: a tenth of their FLOPs fell outside the matrix and was
masked, and they won 10 % on 32 × 1024×4096 only. Here no FLOP is wasted:

- ``pairs`` (128×256): a program is one row block i and any two column blocks j1, j2; it
  stores C[i, j] and its mirror C[j, i] for both. Since C[j, i] = C[i, j]ᵀ, a cell may be
  computed in either orientation, so the 36 unordered cells of an 8×8 tile grid fall into 18
  pairs: each row's cells pair up, and the odd rows hand their last cell to the last row
  (as its mirror image). A tile count whose last row ends up odd gets one single-cell
  program.
- ``quads`` (256×256, 16 warps): row blocks 2I, 2I+1 by column blocks 2J, 2J+1 (I ≤ J);
  the diagonal quads compute one cell twice and store it once (4 cells in 40 computed for 36
  needed at 8 tiles).

Rows and columns are gathered by pointer (two 128-runs each), so the blocks need not be
adjacent. Times are GPU-only (CUDA graphs, by ``sym_harness.py``), the
variants interleaved round by round; every result is checked against cuBLAS. ``--whole-ns``
then runs NS of the 170M batches (``"auto"``, bf16) with each variant in place of
``symmetric.symmetric_mm``.

    python3 scripts/bench/exp_sym_blocks.py --rounds 5 --whole-ns
    TRITON_INTERPRET=1 python3 scripts/bench/exp_sym_blocks.py --check-cpu   # tables + kernel
"""

from __future__ import annotations

import argparse
import functools

import sym_harness  # (this directory: the script's own on sys.path)
import torch
import triton
import triton.language as tl

from dmuon_titan import symmetric


# ---------------------------------------------------------------- tables (host, cached)
@functools.cache
def pair_entries(tiles: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """(i1, i2, j1, j2, keep) per program for 128×256 programs: one row block, two column
    blocks; ``keep`` bit 2r + c says whether cell (row r, column c) is stored."""
    cells = {i: list(range(i, tiles)) for i in range(tiles)}
    last = tiles - 1
    for i in range(last):
        if len(cells[i]) % 2:  # hand (i, last) to the last row as (last, i)
            cells[last].append(cells[i].pop())
            assert cells[last][-1] == last
            cells[last][-1] = i
    out = []
    for i in range(tiles):
        row = cells[i]
        for p in range(0, len(row), 2):
            if p + 1 < len(row):
                out.append((i, i, row[p], row[p + 1], 0b0011))
            else:
                out.append((i, i, row[p], row[p], 0b0001))
    return tuple(out)


@functools.cache
def quad_entries(tiles: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """256×256 programs: row blocks 2I, 2I+1 by column blocks 2J, 2J+1, I ≤ J; on the
    diagonal the cell (2I+1, 2I) is the mirror of (2I, 2I+1) and is not stored."""
    assert tiles % 2 == 0
    out = []
    for big_j in range(tiles // 2):
        for big_i in range(big_j + 1):
            keep = 0b1011 if big_i == big_j else 0b1111
            out.append((2 * big_i, 2 * big_i + 1, 2 * big_j, 2 * big_j + 1, keep))
    return tuple(out)


def covered(entries, tiles: int, row_blocks: int, col_blocks: int) -> dict:
    """How often each unordered cell {i, j} is stored by ``entries``."""
    count: dict = {}
    for i1, i2, j1, j2, keep in entries:
        for r, i in enumerate((i1, i2)[:row_blocks]):
            for c, j in enumerate((j1, j2)[:col_blocks]):
                if keep >> (2 * r + c) & 1:
                    key = (min(i, j), max(i, j))
                    count[key] = count.get(key, 0) + 1
    return count


_TABLES: dict = {}


def table(kind: str, tiles: int, device) -> torch.Tensor:
    key = (kind, tiles, str(device))
    if key not in _TABLES:
        entries = pair_entries(tiles) if kind == "pairs" else quad_entries(tiles)
        _TABLES[key] = torch.tensor(entries, dtype=torch.int32, device=device).flatten()
    return _TABLES[key]


# ---------------------------------------------------------------------------- the kernel
@triton.jit
def _blocks(first, second, TILE: tl.constexpr, BLOCKS: tl.constexpr):
    """Indices of one or two 128-runs (blocks ``first``, ``second``) and each one's block."""
    r = tl.arange(0, BLOCKS * TILE)
    if BLOCKS == 2:
        index = tl.where(r < TILE, first * TILE + r, second * TILE + r - TILE)
        block = tl.where(r < TILE, first, second)
        part = (r >= TILE).to(tl.int32)
    else:
        index = first * TILE + r
        block = first + 0 * r
        part = 0 * r
    return index, block, part


@triton.jit
def _block_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr, scale_ptr, table_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal,
    HAS_ADDEND: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
    TILE: tl.constexpr, TILE_K: tl.constexpr, K: tl.constexpr,
    ROW_BLOCKS: tl.constexpr, COL_BLOCKS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    entry = table_ptr + 5 * pid
    rows, row_block, row_part = _blocks(tl.load(entry), tl.load(entry + 1), TILE, ROW_BLOCKS)
    cols, col_block, col_part = _blocks(tl.load(entry + 2), tl.load(entry + 3), TILE, COL_BLOCKS)
    keep = tl.load(entry + 4)
    ks = tl.arange(0, TILE_K)
    a_ptrs = a_ptr + batch * a_sb + rows[:, None] * a_sm + ks[None, :] * a_sk
    b_ptrs = b_ptr + batch * b_sb + ks[:, None] * b_sk + cols[None, :] * b_sn
    acc = tl.zeros((ROW_BLOCKS * TILE, COL_BLOCKS * TILE), dtype=tl.float32)
    for _ in range(0, K // TILE_K):
        if IEEE:
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += TILE_K * a_sk
        b_ptrs += TILE_K * b_sk
    acc = acc * alpha
    if HAS_ADDEND:
        d_ptrs = d_ptr + batch * d_sb + rows[:, None] * d_sm + cols[None, :] * d_sn
        acc += beta * tl.load(d_ptrs).to(tl.float32)
    acc += tl.where(rows[:, None] == cols[None, :], diagonal, 0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + batch)
    out = acc.to(c_ptr.dtype.element_ty)
    stored = ((keep >> (2 * row_part[:, None] + col_part[None, :])) & 1) != 0
    c_base = c_ptr + batch * c_sb
    tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out, mask=stored)
    mirror = stored & (row_block[:, None] != col_block[None, :])
    tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out, mask=mirror)


def block_mm(
    a, b, *, addend=None, alpha=1.0, beta=1.0, diagonal=0.0, scale=None,
    kind="pairs", tile=128, tile_k=64, num_warps=8, num_stages=3,
):  # fmt: skip
    """``symmetric.symmetric_mm``'s contract by the block kernel of ``kind``."""
    a3, b3, out, add3, scales = symmetric.kernel_operands(a, b, addend, scale)
    batch, m, k = a3.shape
    entries = table(kind, m // tile, a.device)
    rb, cb = (1, 2) if kind == "pairs" else (2, 2)
    _block_kernel[(entries.numel() // 5, batch)](
        a3, b3, out, add3, scales, entries,
        *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        float(alpha), float(beta), float(diagonal),
        HAS_ADDEND=addend is not None, HAS_SCALE=scale is not None,
        IEEE=a.dtype == torch.float32, TILE=tile, TILE_K=tile_k, K=k,
        ROW_BLOCKS=rb, COL_BLOCKS=cb, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out if a.ndim == 3 else out.squeeze(0)


@triton.jit
def _previous_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr, scale_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal,
    HAS_ADDEND: tl.constexpr, HAS_SCALE: tl.constexpr, TILE: tl.constexpr,
    TILE_K: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    # symmetric._symmetric_mm_kernel of 4c51761: one upper tile per program, column by column
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    j = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    j = tl.where((j + 1) * (j + 2) // 2 <= pid, j + 1, j)
    j = tl.where(j * (j + 1) // 2 > pid, j - 1, j)
    i = pid - j * (j + 1) // 2
    rows = i * TILE + tl.arange(0, TILE)
    cols = j * TILE + tl.arange(0, TILE)
    ks = tl.arange(0, TILE_K)
    a_ptrs = a_ptr + batch * a_sb + rows[:, None] * a_sm + ks[None, :] * a_sk
    b_ptrs = b_ptr + batch * b_sb + ks[:, None] * b_sk + cols[None, :] * b_sn
    acc = tl.zeros((TILE, TILE), dtype=tl.float32)
    for _ in range(0, K // TILE_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += TILE_K * a_sk
        b_ptrs += TILE_K * b_sk
    acc = acc * alpha
    if HAS_ADDEND:
        d_ptrs = d_ptr + batch * d_sb + rows[:, None] * d_sm + cols[None, :] * d_sn
        acc += beta * tl.load(d_ptrs).to(tl.float32)
    acc += tl.where(rows[:, None] == cols[None, :], diagonal, 0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + batch)
    out = acc.to(c_ptr.dtype.element_ty)
    c_base = c_ptr + batch * c_sb
    tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out)
    if i != j:
        tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out)


def previous_mm(a, b, *, addend=None, alpha=1.0, beta=1.0, diagonal=0.0, scale=None):
    a3, b3, out, add3, scales = symmetric.kernel_operands(a, b, addend, scale)
    batch, m, k = a3.shape
    tiles = m // 128
    _previous_kernel[(tiles * (tiles + 1) // 2, batch)](
        a3, b3, out, add3, scales,
        *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        float(alpha), float(beta), float(diagonal),
        HAS_ADDEND=addend is not None, HAS_SCALE=scale is not None, TILE=128, TILE_K=64, K=k,
        num_warps=8, num_stages=4,
    )  # fmt: skip
    return out if a.ndim == 3 else out.squeeze(0)


VARIANTS = {  # name: the function in symmetric_mm's place
    "previous 128²": previous_mm,
    "shipped": symmetric.symmetric_mm,
    "table pairs 8w/4s": functools.partial(block_mm, kind="pairs", num_warps=8, num_stages=4),
}


# ------------------------------------------------------------------------------- checks
def check_cpu() -> None:
    """Tables cover every cell once; the kernel (Triton's interpreter, float32, 16-tiles)
    equals the float64 product on X·Xᵀ, with an addend, a diagonal and a scale, and on A·B
    of commuting symmetric matrices."""
    for tiles in range(1, 34):
        for kind, rb in (("pairs", 1), ("quads", 2)):
            if kind == "quads" and tiles % 2:
                continue
            entries = pair_entries(tiles) if kind == "pairs" else quad_entries(tiles)
            count = covered(entries, tiles, rb, 2)
            want = {(i, j) for i in range(tiles) for j in range(i, tiles)}
            assert set(count) == want and set(count.values()) == {1}, (kind, tiles)
            singles = sum(1 for e in entries if kind == "pairs" and e[4] == 1)
            assert kind == "quads" or singles <= 1, (tiles, singles)
    print("tables: every cell stored once for 1..33 tiles")
    torch.manual_seed(0)
    for kind, m, k in (("pairs", 128, 48), ("quads", 128, 32), ("pairs", 48, 32)):
        kw = dict(kind=kind, tile=16, tile_k=16, num_warps=1, num_stages=1)
        sym_harness.check_products(block_mm, torch.randn(3, m, k), kind, **kw)
    print("kernel: equal to the float32 products in the interpreter (pairs, quads)")


def main() -> None:
    parser = argparse.ArgumentParser()
    sym_harness.timing_arguments(parser, rounds=5, cool_ms=0.0)
    args = parser.parse_args()
    if args.check_cpu:
        check_cpu()
        return
    sym_harness.run(args, VARIANTS, "previous 128²")


if __name__ == "__main__":
    main()
