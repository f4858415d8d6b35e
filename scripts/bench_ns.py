#!/usr/bin/env python3
"""Newton–Schulz throughput per matrix shape vs the measured bf16 matmul rate, one run.

For each shape: 5 bf16 NS iterations (Jordan coefficients) on one matrix, and batched as DMuon's
optimizer batches same-shape matrices (``ns_batch_numel`` elements per call); achieved TFLOP/s
(``ns.ns_flops``: 2 FLOPs per FMA) and its share of a plain ``N×N @ N×N`` bf16 matmul's rate
measured in the same process. CUDA events, warm-up, median.

    python3 scripts/bench_ns.py                 # llama3-8B and the 170M flavor's shapes
    python3 scripts/bench_ns.py --shapes 4096x4096,14336x4096 --json ns.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from dmuon_titan import ns
from dmuon_titan.muon import DEFAULT_NS_BATCH_NUMEL
from dmuon_titan.timing import median_milliseconds as timed

DEFAULT_SHAPES = "4096x4096,1024x4096,14336x4096,4096x14336,1024x1024,2816x1024"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--matmul-n", type=int, default=8192, help="N of the reference matmul")
    parser.add_argument("--batch-numel", type=int, default=DEFAULT_NS_BATCH_NUMEL)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = args.matmul_n if cuda else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_tflops = 2 * n**3 / timed(partial(torch.mm, a, b), device, args.warmup, args.reps) / 1e9
    a = b = None
    coefficients = (ns.JORDAN_COEFFICIENTS,)
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.lower().split("x"))
        if not cuda:  # CPU smoke run: same code, small matrices
            shape = tuple(max(8, v // 32) for v in shape)
        flops = ns.ns_flops(shape, 5)
        one = torch.randn(shape, device=device)
        batch_numel = args.batch_numel if cuda else args.batch_numel // 32**2
        k = max(1, batch_numel // (shape[0] * shape[1]))
        batch = torch.randn((k, *shape), device=device)
        run_one = partial(ns.zeropower_via_newtonschulz, one, coefficients, 5, 1e-7)
        run_batch = partial(ns.zeropower_via_newtonschulz, batch, coefficients, 5, 1e-7)
        one_ms = timed(run_one, device, args.warmup, args.reps)
        batch_ms = timed(run_batch, device, args.warmup, args.reps)
        rows.append(
            {
                "shape": list(shape),
                "gflop": flops / 1e9,
                "one_ms": one_ms,
                "one_tflops": flops / one_ms / 1e9,
                "batch": k,
                "batch_ms_per_matrix": batch_ms / k,
                "batch_tflops": k * flops / batch_ms / 1e9,
            }
        )
        one = batch = run_one = run_batch = None  # free before the next shape
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\nbf16 matmul {n}x{n}x{n}: {matmul_tflops:.0f} TFLOP/s on {name}")
    print(
        "| shape | NS GFLOP | one: ms | one: TFLOP/s | one / matmul | batch | batched: ms/matrix "
        "| batched: TFLOP/s | batched / matmul |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['gflop']:.0f} | {r['one_ms']:.3f} "
            f"| {r['one_tflops']:.0f} | {r['one_tflops'] / matmul_tflops:.0%} | {r['batch']} "
            f"| {r['batch_ms_per_matrix']:.3f} | {r['batch_tflops']:.0f} "
            f"| {r['batch_tflops'] / matmul_tflops:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "matmul_tflops": matmul_tflops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
