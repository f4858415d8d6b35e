#!/usr/bin/env python3
"""Experiment (to be removed): the symmetric-product kernel on the 1024-sided products of the
170M model, against variants that might run nearer the matmul rate. One H200.

Variants: the kernel of ``dmuon_titan.symmetric`` at several launch configurations; the same
without the mirror store (wrong result: only to price the epilogue); a persistent grid over
(batch, tile) with the tile loop flattened (Triton's cross-tile pipelining) and optionally
warp-specialized; 128×256 programs (two column tiles); full Triton batched matmuls at the same
tiles (the rate Triton reaches on these sizes at all); cuBLAS.

    python3 scripts/bench/exp_sym_small.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton
import triton.language as tl

from dmuon_titan import symmetric
from dmuon_titan.newton_schulz import JORDAN_COEFFICIENTS, orthogonalize


def graph_ms(fn, device, warmup, reps, calls=10):
    """GPU milliseconds per call of ``fn``: ``calls`` calls captured in one CUDA graph, the
    graph replayed ``reps`` times (median), so no host launch time is counted."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


timed = graph_ms


@triton.jit
def _tile_of(pid):
    j = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    j = tl.where((j + 1) * (j + 2) // 2 <= pid, j + 1, j)
    j = tl.where(j * (j + 1) // 2 > pid, j - 1, j)
    return pid - j * (j + 1) // 2, j


@triton.jit
def _nomirror_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal,
    HAS_ADDEND: tl.constexpr, TILE: tl.constexpr, TILE_K: tl.constexpr, K: tl.constexpr,
    MIRROR: tl.constexpr,
):  # fmt: skip
    i, j = _tile_of(tl.program_id(0))
    batch = tl.program_id(1).to(tl.int64)
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
    out = acc.to(c_ptr.dtype.element_ty)
    c_base = c_ptr + batch * c_sb
    tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out)
    if MIRROR:
        if i != j:
            tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out)


@triton.jit
def _persistent_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal, total,
    HAS_ADDEND: tl.constexpr, TILE: tl.constexpr, TILE_K: tl.constexpr, K: tl.constexpr,
    TILES: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    for t in tl.range(tl.program_id(0), total, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        batch = (t // TILES).to(tl.int64)
        i, j = _tile_of(t % TILES)
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
        out = acc.to(c_ptr.dtype.element_ty)
        c_base = c_ptr + batch * c_sb
        tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out)
        # the mirror store always (on the diagonal it rewrites the same values)
        tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out)


@triton.jit
def _wide_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr, table_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal,
    M: tl.constexpr, HAS_ADDEND: tl.constexpr, TILE: tl.constexpr, TILE_K: tl.constexpr,
    K: tl.constexpr,
):  # fmt: skip
    # one program: row tile i, column tiles j and j + 1 (j >= i); j + 1 may be past the end
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    i = tl.load(table_ptr + 2 * pid)
    j = tl.load(table_ptr + 2 * pid + 1)
    rows = i * TILE + tl.arange(0, TILE)
    cols = j * TILE + tl.arange(0, 2 * TILE)
    col_ok = cols < M
    ks = tl.arange(0, TILE_K)
    a_ptrs = a_ptr + batch * a_sb + rows[:, None] * a_sm + ks[None, :] * a_sk
    b_ptrs = b_ptr + batch * b_sb + ks[:, None] * b_sk + cols[None, :] * b_sn
    acc = tl.zeros((TILE, 2 * TILE), dtype=tl.float32)
    for _ in range(0, K // TILE_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs, mask=col_ok[None, :], other=0.0), acc)
        a_ptrs += TILE_K * a_sk
        b_ptrs += TILE_K * b_sk
    acc = acc * alpha
    if HAS_ADDEND:
        d_ptrs = d_ptr + batch * d_sb + rows[:, None] * d_sm + cols[None, :] * d_sn
        acc += beta * tl.load(d_ptrs, mask=col_ok[None, :], other=0.0).to(tl.float32)
    acc += tl.where(rows[:, None] == cols[None, :], diagonal, 0.0)
    out = acc.to(c_ptr.dtype.element_ty)
    c_base = c_ptr + batch * c_sb
    tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out, mask=col_ok[None, :])
    mirror = col_ok & (cols // TILE != i)
    tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out, mask=mirror[None, :])


@triton.jit
def _wide_exact_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal,
    HAS_ADDEND: tl.constexpr, TILE: tl.constexpr, TILE_K: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    # 128×256 programs on the grid of 256-wide column blocks J: rows tiles 0..2J+1, so
    # every program is in range; the one below the diagonal block half stores nothing there
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # programs of column block J: 2J + 2, numbered from J(J+1) on
    jj = ((tl.sqrt(4.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    jj = tl.where((jj + 1) * (jj + 2) <= pid, jj + 1, jj)
    jj = tl.where(jj * (jj + 1) > pid, jj - 1, jj)
    i = pid - jj * (jj + 1)
    rows = i * TILE + tl.arange(0, TILE)
    cols = jj * 2 * TILE + tl.arange(0, 2 * TILE)
    ks = tl.arange(0, TILE_K)
    a_ptrs = a_ptr + batch * a_sb + rows[:, None] * a_sm + ks[None, :] * a_sk
    b_ptrs = b_ptr + batch * b_sb + ks[:, None] * b_sk + cols[None, :] * b_sn
    acc = tl.zeros((TILE, 2 * TILE), dtype=tl.float32)
    for _ in range(0, K // TILE_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += TILE_K * a_sk
        b_ptrs += TILE_K * b_sk
    acc = acc * alpha
    if HAS_ADDEND:
        d_ptrs = d_ptr + batch * d_sb + rows[:, None] * d_sm + cols[None, :] * d_sn
        acc += beta * tl.load(d_ptrs).to(tl.float32)
    acc += tl.where(rows[:, None] == cols[None, :], diagonal, 0.0)
    out = acc.to(c_ptr.dtype.element_ty)
    c_base = c_ptr + batch * c_sb
    upper = (cols // TILE) >= i
    tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out, mask=upper[None, :])
    mirror = (cols // TILE) > i
    tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out, mask=mirror[None, :])


@triton.jit
def _full_kernel(
    a_ptr, b_ptr, c_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn,
    BM: tl.constexpr, BN: tl.constexpr, TILE_K: tl.constexpr, K: tl.constexpr,
    N_TILES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    i = pid // N_TILES
    j = pid % N_TILES
    rows = i * BM + tl.arange(0, BM)
    cols = j * BN + tl.arange(0, BN)
    ks = tl.arange(0, TILE_K)
    a_ptrs = a_ptr + batch * a_sb + rows[:, None] * a_sm + ks[None, :] * a_sk
    b_ptrs = b_ptr + batch * b_sb + ks[:, None] * b_sk + cols[None, :] * b_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K // TILE_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += TILE_K * a_sk
        b_ptrs += TILE_K * b_sk
    tl.store(
        c_ptr + batch * c_sb + rows[:, None] * c_sm + cols[None, :] * c_sn,
        acc.to(c_ptr.dtype.element_ty),
    )


def _prepare(a, b, addend):
    a3 = a if a.ndim == 3 else a.unsqueeze(0)
    b3 = b if b.ndim == 3 else b.unsqueeze(0)
    batch, m, k = a3.shape
    out = a3.new_empty((batch, m, m))
    add3 = out if addend is None else addend.expand(batch, m, m)
    return a3, b3, out, add3, batch, m, k


def nomirror(a, b, addend=None, *, mirror=False, tile_k=64, warps=8, stages=4):
    a3, b3, out, add3, batch, m, k = _prepare(a, b, addend)
    tiles = m // 128
    _nomirror_kernel[(tiles * (tiles + 1) // 2, batch)](
        a3, b3, out, add3, *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        0.5, 1.0, 0.0, HAS_ADDEND=addend is not None, TILE=128, TILE_K=tile_k, K=k,
        MIRROR=mirror, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def persistent(a, b, addend=None, *, flatten=False, ws=False, warps=8, stages=4, per_sm=1):
    a3, b3, out, add3, batch, m, k = _prepare(a, b, addend)
    tiles = (m // 128) * (m // 128 + 1) // 2
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count * per_sm
    grid = min(sms, tiles * batch)
    _persistent_kernel[(grid,)](
        a3, b3, out, add3, *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        0.5, 1.0, 0.0, tiles * batch, HAS_ADDEND=addend is not None, TILE=128, TILE_K=64,
        K=k, TILES=tiles, NUM_SMS=grid, FLATTEN=flatten, WS=ws,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


_TABLES: dict = {}


def _pair_table(tiles, device, order):
    key = (tiles, str(device), order)
    if key not in _TABLES:
        pairs = [(i, j) for i in range(tiles) for j in range(i, tiles, 2)]
        if order == "col":
            pairs.sort(key=lambda p: (p[1], p[0]))
        _TABLES[key] = torch.tensor(pairs, dtype=torch.int32, device=device).flatten()
    return _TABLES[key]


def wide(a, b, addend=None, *, warps=8, stages=3, order="row"):
    a3, b3, out, add3, batch, m, k = _prepare(a, b, addend)
    table = _pair_table(m // 128, a.device, order)
    _wide_kernel[(table.numel() // 2, batch)](
        a3, b3, out, add3, table, *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        0.5, 1.0, 0.0, M=m, HAS_ADDEND=addend is not None, TILE=128, TILE_K=64, K=k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def wide_exact(a, b, addend=None, *, warps=8, stages=3, tile_k=64):
    a3, b3, out, add3, batch, m, k = _prepare(a, b, addend)
    blocks = m // 256
    _wide_exact_kernel[(blocks * (blocks + 1), batch)](
        a3, b3, out, add3, *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        0.5, 1.0, 0.0, HAS_ADDEND=addend is not None, TILE=128, TILE_K=tile_k, K=k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def full(a, b, addend=None, *, bm=128, bn=128, warps=8, stages=4):
    a3, b3, out, _, batch, m, k = _prepare(a, b, None)
    _full_kernel[((m // bm) * (m // bn), batch)](
        a3, b3, out, *a3.stride(), *b3.stride(), *out.stride(),
        BM=bm, BN=bn, TILE_K=64, K=k, N_TILES=m // bn, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default="48x1024x1024,48x1024sqa,36x1024sq,36x1024x2816,8x4096sq"
    )
    parser.add_argument("--ns-configs", default="8/4,4/3,8/3,4/4")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    n = 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = 2 * n**3 / timed(partial(torch.mm, x, x), device, args.warmup, args.reps) / 1e9
    x = None
    methods = {
        "kernel 8/4 (default)": lambda a, b, d: symmetric.symmetric_mm(a, b, addend=d, alpha=0.5),
        "kernel 4/3": lambda a, b, d: symmetric.symmetric_mm(
            a, b, addend=d, alpha=0.5, num_warps=4, num_stages=3
        ),
        "kernel 8/3": lambda a, b, d: symmetric.symmetric_mm(
            a, b, addend=d, alpha=0.5, num_stages=3
        ),
        "kernel 8/2 k128": lambda a, b, d: symmetric.symmetric_mm(
            a, b, addend=d, alpha=0.5, tile_k=128, num_stages=2
        ),
        "no mirror 8/4 (wrong)": partial(nomirror, mirror=False),
        "same, mirrored 8/4": partial(nomirror, mirror=True),
        "persistent 8/4": partial(persistent),
        "persistent 8/4 flat": partial(persistent, flatten=True),
        "persistent 8/3 flat": partial(persistent, flatten=True, stages=3),
        "persistent 8/4 flat ws": partial(persistent, flatten=True, ws=True),
        "persistent 4/3 flat, 2/SM": partial(persistent, flatten=True, warps=4, stages=3, per_sm=2),
        "wide 8/3 row": partial(wide),
        "wide 8/4 col": partial(wide, stages=4, order="col"),
        "wide exact 8/3": partial(wide_exact),
        "wide exact 8/4": partial(wide_exact, stages=4),
        "triton full 128x128 8/4": partial(full),
        "triton full 128x256 8/3": partial(full, bn=256, stages=3),
    }
    rows = []
    defaults = symmetric.symmetric_mm.__kwdefaults__
    for shape in ((48, 1024, 1024), (36, 1024, 2816)):
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        for algorithm in ("plain", "auto"):
            configs = ["cublas"] if algorithm == "plain" else args.ns_configs.split(",")
            for config in configs:
                if config != "cublas":
                    warps, stages = (int(v) for v in config.split("/"))
                    defaults["num_warps"], defaults["num_stages"] = warps, stages
                call = partial(orthogonalize, x, (JORDAN_COEFFICIENTS,), 5, 1e-7,
                               algorithm=algorithm)  # fmt: skip
                ms = timed(call, device, args.warmup, args.reps)
                name = f"NS {algorithm} {config}"
                case = "x".join(map(str, shape))
                rows.append({"case": case, "method": name, "ms": ms})
                print(f"| {case} | {name} | {ms:.4f} | per matrix {ms / shape[0]:.4f} |",
                      flush=True)  # fmt: skip
        defaults["num_warps"], defaults["num_stages"] = 8, 4
    if args.skip_kernels:
        args.cases = ""
    for case in [c for c in args.cases.split(",") if c]:
        batch, _, rest = case.partition("x")
        batch = int(batch)
        addend = None
        if "sq" in rest:
            m = k = int(rest.split("sq")[0])
            s = torch.randn(batch, m, m, device=device)
            left = right = (s + s.mT).bfloat16()
            if rest.endswith("sqa"):
                addend = left
        else:
            m, _, k = rest.partition("x")
            m, k = int(m), int(k)
            left = torch.randn(batch, m, k, device=device, dtype=torch.bfloat16)
            right = left.mT
        flops = 2 * batch * m * m * k
        ref = 0.5 * torch.matmul(left, right).float()
        if addend is not None:
            ref += addend.float()
        case_methods = {"cublas full": lambda a, b, d: torch.matmul(a, b)}
        case_methods.update(methods)
        for name, fn in case_methods.items():
            call = partial(fn, left, right, addend)
            try:
                out = call()
                torch.cuda.synchronize()
            except Exception as e:  # a variant the compiler rejects: report, go on
                rows.append({"case": case, "method": name, "error": str(e)[:300]})
                print(f"| {case} | {name} | failed: {str(e)[:200]} |", flush=True)
                continue
            exact = not (name.startswith(("cublas", "triton full", "no mirror")))
            err = (
                ((out.float() - ref).abs().max() / ref.abs().max()).item()
                if exact
                else float("nan")
            )
            ms = timed(call, device, args.warmup, args.reps)
            rate = flops / ms / 1e9 / mm
            rows.append({"case": case, "method": name, "ms": ms, "rate": rate, "err": err})
            print(f"| {case} | {name} | {ms:.4f} | {rate:.0%} | {err:.1e} |", flush=True)
        left = right = addend = ref = None
    print(f"matmul {mm:.0f} TFLOP/s on {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_tflops": mm, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
