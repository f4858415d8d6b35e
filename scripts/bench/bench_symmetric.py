#!/usr/bin/env python3
"""Symmetric products (the bulk of Gram NS): Triton upper-tile kernel vs cuBLAS vs row panels.

For each case (``BxMxK``: a batch of B products of an M×K matrix with an M×K matrix's
transpose, X·Xᵀ; ``sq`` suffix: the product of two symmetric M×M matrices, K = M) it times the
full cuBLAS product, ``symmetric.symmetric_matmul`` in 4 row panels, and the kernel of
``dmuon_titan.symmetric`` for each launch configuration in ``--configs``, and checks the
kernel's result against cuBLAS. Times are GPU times of CUDA graphs of 10 calls (no host
launch time: ``timing.graph_median_milliseconds``). Rates are *full-product-equivalent*
(2·M²·K FLOPs per product / time) as a share of an N×N bf16 matmul measured in the same
process: the kernel does half of those FLOPs, so 100 % of the matmul rate here means it runs
at half the matmul rate.

    python3 scripts/bench/bench_symmetric.py
    python3 scripts/bench/bench_symmetric.py --cases 16x4096x14336,8x4096sq --configs 128/64/8/3
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from gpu_timing import graph_median_milliseconds as timed

from dmuon_titan import symmetric

DEFAULT_CASES = "1x4096x14336,8x4096x14336,1x4096sq,8x4096sq,32x1024x4096,32x1024sq"
DEFAULT_CONFIGS = "128/64/8/4,128/64/8/3,128/128/8/3,64/64/4/4"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help="tile/tile_k/num_warps/num_stages, ..."
    )
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or symmetric.triton is None:
        raise SystemExit("needs CUDA and Triton")
    device = torch.device("cuda")
    n = args.matmul_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_tflops = 2 * n**3 / timed(partial(torch.mm, a, a), device, args.warmup, args.reps) / 1e9
    a = None
    rows = []
    for case in args.cases.split(","):
        batch, _, rest = case.partition("x")
        square = rest.endswith("sq")
        m, _, k = rest.removesuffix("sq").partition("x")
        batch, m = int(batch), int(m)
        k = m if square else int(k)
        if square:
            s = torch.randn(batch, m, m, device=device)
            left = right = (s + s.mT).bfloat16()  # a symmetric matrix times itself
        else:
            left = torch.randn(batch, m, k, device=device, dtype=torch.bfloat16)
            right = left.mT
        flops = 2 * batch * m * m * k
        reference = torch.matmul(left, right)
        methods = {
            "cublas": partial(torch.matmul, left, right),
            "panels4": partial(symmetric.symmetric_matmul, left, right, 4),
        }
        for config in args.configs.split(","):
            tile, tile_k, warps, stages = (int(v) for v in config.split("/"))
            methods[f"kernel {config}"] = partial(
                symmetric.symmetric_mm,
                left,
                right,
                tile=tile,
                tile_k=tile_k,
                num_warps=warps,
                num_stages=stages,
            )
        for name, fn in methods.items():
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as error:  # a configuration the compiler rejects: report, go on
                rows.append({"case": case, "method": name, "error": str(error)[:200]})
                continue
            error = ((out.float() - reference.float()).abs().max() / reference.abs().max()).item()
            ms = timed(fn, device, args.warmup, args.reps)
            rows.append(
                {
                    "case": case,
                    "method": name,
                    "ms": ms,
                    "tflops_equivalent": flops / ms / 1e9,
                    "max_error_vs_cublas": error,
                }
            )
        left = right = reference = None
    print(
        f"\nbf16 matmul {n}x{n}x{n}: {matmul_tflops:.0f} TFLOP/s on {torch.cuda.get_device_name()}"
    )
    print("| case | method | ms | full-equivalent TFLOP/s | / matmul | max rel. diff vs cuBLAS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['method']} | failed: {r['error']} | | | |")
            continue
        print(
            f"| {r['case']} | {r['method']} | {r['ms']:.3f} | {r['tflops_equivalent']:.0f} "
            f"| {r['tflops_equivalent'] / matmul_tflops:.0%} | {r['max_error_vs_cublas']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "matmul_tflops": matmul_tflops,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
