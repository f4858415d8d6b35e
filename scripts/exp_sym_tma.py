#!/usr/bin/env python3
"""Experiment: the symmetric-product kernel with TMA loads/stores (and a persistent variant)
against the pointer kernel of ``dmuon_titan.symmetric`` and cuBLAS. Hopper only.

    python3 scripts/exp_sym_tma.py --cases 1x4096x14336,8x4096sq --configs 8/4,8/3
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dmuon_titan import symmetric
from dmuon_titan.timing import median_milliseconds as timed


@triton.jit
def _tile_of(pid):
    j = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    j = tl.where((j + 1) * (j + 2) // 2 <= pid, j + 1, j)
    j = tl.where(j * (j + 1) // 2 > pid, j - 1, j)
    i = pid - j * (j + 1) // 2
    return i, j


@triton.jit
def _one_tile(
    a_desc,
    s_desc,
    c_desc,
    d_desc,
    b,
    i,
    j,
    alpha,
    beta,
    diagonal,
    M: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    A_T: tl.constexpr,
    S_T: tl.constexpr,
    TILE: tl.constexpr,
    TILE_K: tl.constexpr,
    K: tl.constexpr,
):
    acc = tl.zeros((TILE, TILE), dtype=tl.float32)
    for k in range(0, K, TILE_K):
        if A_T:
            a = a_desc.load([b * K + k, i * TILE]).T
        else:
            a = a_desc.load([b * M + i * TILE, k])
        if S_T:
            s = s_desc.load([b * K + k, j * TILE])
        else:
            s = s_desc.load([b * M + j * TILE, k]).T
        acc = tl.dot(a, s, acc)
    acc = acc * alpha
    if HAS_ADDEND:
        acc += beta * d_desc.load([b * M + i * TILE, j * TILE]).to(tl.float32)
    rows = i * TILE + tl.arange(0, TILE)
    cols = j * TILE + tl.arange(0, TILE)
    acc += tl.where(rows[:, None] == cols[None, :], diagonal, 0.0)
    out = acc.to(c_desc.dtype)
    c_desc.store([b * M + i * TILE, j * TILE], out)
    if i != j:
        c_desc.store([b * M + j * TILE, i * TILE], out.T)


@triton.jit
def _tma_kernel(
    a_desc,
    s_desc,
    c_desc,
    d_desc,
    alpha,
    beta,
    diagonal,
    M: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    A_T: tl.constexpr,
    S_T: tl.constexpr,
    TILE: tl.constexpr,
    TILE_K: tl.constexpr,
    K: tl.constexpr,
):
    i, j = _tile_of(tl.program_id(0))
    b = tl.program_id(1)
    _one_tile(
        a_desc, s_desc, c_desc, d_desc, b, i, j, alpha, beta, diagonal,
        M, HAS_ADDEND, A_T, S_T, TILE, TILE_K, K,
    )  # fmt: skip


@triton.jit
def _tma_persistent_kernel(
    a_desc,
    s_desc,
    c_desc,
    d_desc,
    alpha,
    beta,
    diagonal,
    total,
    M: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    A_T: tl.constexpr,
    S_T: tl.constexpr,
    TILE: tl.constexpr,
    TILE_K: tl.constexpr,
    K: tl.constexpr,
    TILES: tl.constexpr,  # upper tiles per matrix
    NUM_SMS: tl.constexpr,
):
    for t in range(tl.program_id(0), total, NUM_SMS):
        b = t // TILES
        i, j = _tile_of(t % TILES)
        _one_tile(
            a_desc, s_desc, c_desc, d_desc, b, i, j, alpha, beta, diagonal,
            M, HAS_ADDEND, A_T, S_T, TILE, TILE_K, K,
        )  # fmt: skip


def _storage_2d(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(2-D row-major view of t's storage stacking the batch, whether t is a transposed view)."""
    t3 = t if t.ndim == 3 else t.unsqueeze(0)
    if t3.stride(-1) == 1 and t3.stride(0) == t3.size(1) * t3.stride(1):
        return t3.reshape(-1, t3.size(2)) if t3.stride(1) == t3.size(2) else None, False
    tt = t3.mT
    if (
        tt.stride(-1) == 1
        and tt.stride(1) == tt.size(2)
        and tt.stride(0) == tt.size(1) * tt.size(2)
    ):
        return tt.reshape(-1, tt.size(2)), True
    return None


def symmetric_mm_tma(
    a, b, *, addend=None, alpha=1.0, beta=1.0, diagonal=0.0, s_is_b=None,
    tile=128, tile_k=64, num_warps=8, num_stages=4, persistent=False,
):  # fmt: skip
    """C = A·Sᵀ with S = a when b is a.mT, else S = b (b symmetric)."""
    m, k = a.shape[-2:]
    batch = a.shape[0] if a.ndim == 3 else 1
    if s_is_b is None:
        s_is_b = not (b.data_ptr() == a.data_ptr() and b.stride(-1) == a.stride(-2))
    a2, a_t = _storage_2d(a)
    if s_is_b:
        s2, s_t = _storage_2d(b)
    else:
        s2, s_t = a2, a_t
    out = a.new_empty((batch, m, m))
    c2 = out.view(-1, m)
    a_desc = TensorDescriptor.from_tensor(a2, [tile_k, tile] if a_t else [tile, tile_k])
    s_desc = TensorDescriptor.from_tensor(s2, [tile_k, tile] if s_t else [tile, tile_k])
    c_desc = TensorDescriptor.from_tensor(c2, [tile, tile])
    d_desc = c_desc
    if addend is not None:
        d2, d_t = _storage_2d(addend.expand(batch, m, m).contiguous())
        d_desc = TensorDescriptor.from_tensor(d2, [tile, tile])
    tiles = (m // tile) * (m // tile + 1) // 2
    meta = dict(
        M=m, HAS_ADDEND=addend is not None, A_T=a_t, S_T=s_t, TILE=tile, TILE_K=tile_k, K=k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if persistent:
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 3
        _tma_persistent_kernel[(min(sms, tiles * batch),)](
            a_desc, s_desc, c_desc, d_desc, float(alpha), float(beta), float(diagonal),
            tiles * batch, TILES=tiles, NUM_SMS=sms, **meta,
        )  # fmt: skip
    else:
        _tma_kernel[(tiles, batch)](
            a_desc, s_desc, c_desc, d_desc, float(alpha), float(beta), float(diagonal), **meta
        )
    return out if a.ndim == 3 else out.squeeze(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default="1x4096x14336,8x4096x14336,1x14336tx4096,1x4096sq,8x4096sq,32x1024x4096"
    )
    parser.add_argument("--configs", default="8/4,8/3,4/4,4/5")
    parser.add_argument("--wide-configs", default="8/3/row,8/4/row,8/3/col,8/4/col")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    n = 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = 2 * n**3 / timed(partial(torch.mm, x, x), device, args.warmup, args.reps) / 1e9
    x = None
    rows = []
    for case in args.cases.split(","):
        batch, _, rest = case.partition("x")
        batch = int(batch)
        if rest.endswith("sq"):
            m = k = int(rest[:-2])
            s = torch.randn(batch, m, m, device=device)
            left = (s + s.mT).bfloat16()
            right = left
        elif "t" in rest:  # a tall matrix's transposed view, as NS sees it
            kk, _, mm_ = rest.partition("tx")
            m, k = int(mm_), int(kk)
            left = torch.randn(batch, k, m, device=device, dtype=torch.bfloat16).mT
            right = left.mT
        else:
            m, _, k = rest.partition("x")
            m, k = int(m), int(k)
            left = torch.randn(batch, m, k, device=device, dtype=torch.bfloat16)
            right = left.mT
        flops = 2 * batch * m * m * k
        ref = torch.matmul(left, right)
        methods = {
            "cublas": partial(torch.matmul, left, right),
            "pointer 8/4": partial(symmetric.symmetric_mm, left, right),
        }
        for cfg in args.wide_configs.split(","):
            w, st, order = cfg.split("/")
            methods[f"wide {cfg}"] = partial(
                symmetric_mm_wide, left, right, num_warps=int(w), num_stages=int(st), order=order
            )
        for cfg in [c for c in args.configs.split(",") if c]:
            w, st = (int(v) for v in cfg.split("/"))
            for pers in (False, True):
                methods[f"tma{'_pers' if pers else ''} {cfg}"] = partial(
                    symmetric_mm_tma, left, right, num_warps=w, num_stages=st, persistent=pers
                )
        for name, fn in methods.items():
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:
                rows.append({"case": case, "method": name, "error": str(e)[:300]})
                print(case, name, "FAILED", str(e)[:300], flush=True)
                continue
            err = ((out.float() - ref.float()).abs().max() / ref.abs().max()).item()
            ms = timed(fn, device, args.warmup, args.reps)
            rows.append(
                {"case": case, "method": name, "ms": ms, "rate": flops / ms / 1e9 / mm, "err": err}
            )
            print(
                f"| {case} | {name} | {ms:.3f} | {flops / ms / 1e9 / mm:.0%} | {err:.1e} |",
                flush=True,
            )
    print(f"matmul {mm:.0f} TFLOP/s")
    if args.json:
        json.dump({"matmul_tflops": mm, "rows": rows}, open(args.json, "w"), indent=1)


@triton.jit
def _wide_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr, table_ptr,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, c_sb, c_sm, c_sn, d_sb, d_sm, d_sn,
    alpha, beta, diagonal,
    M: tl.constexpr, HAS_ADDEND: tl.constexpr, TILE: tl.constexpr, TILE_K: tl.constexpr,
    K: tl.constexpr,
):  # fmt: skip
    # One program: row tile i, column tiles j and j + 1 (j >= i); j + 1 may be past the end.
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


_TABLES = {}


def _pair_table(tiles, device, order):
    key = (tiles, str(device), order)
    if key not in _TABLES:
        pairs = [(i, j) for i in range(tiles) for j in range(i, tiles, 2)]
        if order == "col":
            pairs.sort(key=lambda p: (p[1], p[0]))
        _TABLES[key] = torch.tensor(pairs, dtype=torch.int32, device=device).flatten()
    return _TABLES[key]


def symmetric_mm_wide(
    a, b, *, addend=None, alpha=1.0, beta=1.0, diagonal=0.0, tile=128, tile_k=64,
    num_warps=8, num_stages=3, order="row",
):  # fmt: skip
    batched = a.ndim == 3
    a3 = a if batched else a.unsqueeze(0)
    b3 = b if batched else b.unsqueeze(0)
    batch, m, k = a3.shape
    out = a3.new_empty((batch, m, m))
    add3 = (
        out if addend is None else (addend if batched else addend.unsqueeze(0)).expand(batch, m, m)
    )
    table = _pair_table(m // tile, a.device, order)
    _wide_kernel[(table.numel() // 2, batch)](
        a3, b3, out, add3, table, *a3.stride(), *b3.stride(), *out.stride(), *add3.stride(),
        float(alpha), float(beta), float(diagonal),
        M=m, HAS_ADDEND=addend is not None, TILE=tile, TILE_K=tile_k, K=k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out if batched else out.squeeze(0)


if __name__ == "__main__":
    main()
