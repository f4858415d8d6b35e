#!/usr/bin/env python3
"""Summarize torchtitan training logs: median step time, tok/s per device, peak memory and,
for DMuon runs, optimizer and Newton-Schulz milliseconds. Prints one table (markdown) with the
first log as the baseline of the ratio column.

    python3 scripts/analysis/titan_log_summary.py --seq-len 8192 --batch 2 adamw.log dmuon.log
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from titan_logs import DMUON, PLAIN, PLAN, STEP, lines

VAL_TPS = re.compile(r"validate step:\s*(\d+).*?tps:\s*([\d,]+)")


def summarize(path: str, skip: int, tokens_per_step: int) -> dict:
    tps, mem, opt, ns, loss, ns_gflop, plain = [], [], [], [], {}, None, None
    val_tps = []
    for line in lines(path):
        if "validate" in line:
            if (m := VAL_TPS.search(line)) and int(m.group(1)) > skip:
                val_tps.append(float(m.group(2).replace(",", "")))
            continue
        if (m := PLAN.search(line)) and ns_gflop is None:
            ns_gflop = [float(v) for v in m.group(1).split(",")]
            if p := PLAIN.search(line):
                plain = float(p.group(1))
        if m := STEP.search(line):
            step = int(m.group(1))
            loss[step] = float(m.group(2))
            mem.append(float(m.group(3)))
            if step > skip:
                tps.append(float(m.group(4).replace(",", "")))
        elif (m := DMUON.search(line)) and int(m.group(1)) > skip:
            opt.append(float(m.group(2)))
            ns.append(float(m.group(3)))
    if not tps:
        raise SystemExit(f"{path}: no training steps after step {skip} found")
    med_tps = statistics.median(tps)
    return {
        "log": path,
        "steps": max(loss),
        "step_s": tokens_per_step / med_tps,
        "tps": med_tps,
        "peak_gib": max(mem),
        "optimizer_ms": statistics.median(opt) if opt else None,
        "ns_ms": statistics.median(ns) if ns else None,
        "final_loss": loss[max(loss)],
        "val_tps": statistics.median(val_tps) if val_tps else None,
        "ns_gflop_per_rank": ns_gflop,
        "plain_ns_gflop": plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True, help="local batch size")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    parser.add_argument(
        "--floor-gflop",
        type=float,
        default=None,
        help="plain-NS GFLOP of all dedicated matrices, for logs that do not state it "
        "(llama3-8B: 665891.7)",
    )
    parser.add_argument(
        "--floor-tflops",
        type=float,
        default=None,
        help="bf16 matmul TFLOP/s: also print (T - T_first) / T_floor for DMuon runs, with "
        "T_floor = NS FLOPs of all dedicated matrices / (ranks x this rate)",
    )
    args = parser.parse_args()
    rows = [summarize(p, args.skip, args.seq_len * args.batch) for p in args.logs]
    base = rows[0]["step_s"]
    print(
        "| run | steps | step time (s) | tok/s/device | peak mem (GiB) | optimizer (ms) | NS (ms) "
        "| step time / first | validation tok/s (median) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        val = "-" if r["val_tps"] is None else f"{r['val_tps']:,.0f}"
        print(
            f"| {r['log']} | {r['steps']} | {r['step_s']:.3f} | {r['tps']:,.0f} | {r['peak_gib']:.1f} "
            f"| {fmt(r['optimizer_ms'])} | {fmt(r['ns_ms'])} | {r['step_s'] / base:.3f} "
            f"| {val} |"
        )
    if args.floor_tflops:
        for r in rows[1:]:
            if r["ns_gflop_per_rank"]:
                loads = r["ns_gflop_per_rank"]
                # Plain NS FLOPs of all matrices: given, logged (by the converter since
                # 2026-12-01), or, in older logs whose plans were weighed by plain FLOPs, the
                # sum of the per-rank loads.
                total = args.floor_gflop or r["plain_ns_gflop"] or sum(loads)
                floor_s = total / len(loads) / (args.floor_tflops * 1e3)
                print(
                    f"\n{r['log']}: T_floor = {floor_s * 1e3:.0f} ms (plain NS {total:,.0f} GFLOP "
                    f"over {len(loads)} ranks at {args.floor_tflops:.0f} TFLOP/s); "
                    f"(T - T_first) / T_floor = {(r['step_s'] - base) / floor_s:.2f}"
                )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
