#!/usr/bin/env python3
"""bf16 matmul rate in a burst and sustained: back-to-back N×N products for a while.

A short timing (what ``scripts/bench/bench_ns.py`` measures, and the rate T_floor is defined by)
runs at boost clocks; a GPU kept busy for seconds, as by a training step, settles at the
clocks its power cap allows. This prints the rate per window of ``--window`` seconds, the
first window's (burst) and the median of the last half (sustained), so the two can be put
side by side. Sample clocks and power alongside, e.g.
``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 250``.

    python3 scripts/bench/bench_sustained_matmul.py --seconds 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=0.5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    flops = 2 * args.n**3
    torch.matmul(a, b, out=out)  # cuBLAS heuristics, workspace
    torch.cuda.synchronize()
    # Matmuls per window, from a short calibration, so a window is one timed batch.
    start = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    per_window = max(1, round(args.window / ((time.perf_counter() - start) / 10)))
    windows = []
    begin = time.perf_counter()
    while time.perf_counter() - begin < args.seconds:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        for _ in range(per_window):
            torch.matmul(a, b, out=out)
        last.record()
        last.synchronize()
        ms = first.elapsed_time(last)
        windows.append({"t": time.perf_counter() - begin, "tflops": per_window * flops / ms / 1e9})
    rates = [w["tflops"] for w in windows]
    burst, sustained = rates[0], statistics.median(rates[len(rates) // 2 :])
    print(f"{torch.cuda.get_device_name()}: {args.n}^3 bf16 matmul, {len(rates)} windows")
    print("| window start (s) | TFLOP/s |")
    print("| --- | --- |")
    for w in windows[:: max(1, len(windows) // 20)]:
        print(f"| {w['t']:.1f} | {w['tflops']:.0f} |")
    print(
        f"burst (first window) {burst:.0f} TFLOP/s; sustained (median of the last half) "
        f"{sustained:.0f} TFLOP/s = {sustained / burst:.2f} x burst"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "windows": windows, "burst": burst, "sustained": sustained}, f)


if __name__ == "__main__":
    main()
