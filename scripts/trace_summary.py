#!/usr/bin/env python3
"""Where the GPU time of DMuon's optimizer step goes, from a torch.profiler chrome trace.

The step is the window from the first momentum kernel to the end of the last update kernel
(the fused Triton kernels of ``dmuon_titan.fused``; run with ``DMUON_FUSED=1``, the default).
For that window it prints: its span, the time some kernel ran (on any stream), the idle time
on the step's stream (gaps between its kernels: host launch latency, or waits), and kernel
time by kind — the symmetric-product kernel, cuBLAS/CUTLASS matmuls, the fused elementwise
kernels, everything else. Comparing two traces (e.g. torchtitan's and bench_optimizer's)
tells slower kernels (clocks, data) apart from a starved stream (host overhead).

    python3 scripts/trace_summary.py TRACE.json [TRACE2.json ...]   # .json or .json.gz

Traces: torchtitan ``--profiling.enable_profiling`` (``profile_traces/iteration_N/``),
``scripts/bench_optimizer.py --profile DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("momentum", ("_momentum_kernel",)),
    ("update", ("_update_kernel",)),
    ("divide", ("_divide_kernel",)),
    ("symmetric", ("_symmetric_mm_kernel",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma")),
    ("nccl", ("nccl",)),
)


def kind_of(name: str) -> str:
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def load_kernels(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted(
        (e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(path: str) -> dict:
    kernels = load_kernels(path)
    moments = [k for k in kernels if "_momentum_kernel" in k["name"]]
    updates = [k for k in kernels if "_update_kernel" in k["name"]]
    if not moments or not updates:
        raise SystemExit(f"{path}: no DMuon momentum/update kernels (DMUON_FUSED=0, or no step)")
    begin = moments[0]["ts"]
    end = max(k["ts"] + k["dur"] for k in updates)
    inside = [k for k in kernels if k["ts"] >= begin and k["ts"] + k["dur"] <= end]
    stream = moments[0].get("args", {}).get("stream")
    on_stream = [k for k in inside if k.get("args", {}).get("stream") == stream]
    gaps = [
        b["ts"] - (a["ts"] + a["dur"])
        for a, b in zip(on_stream, on_stream[1:], strict=False)
        if b["ts"] > a["ts"] + a["dur"]
    ]
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for k in inside:
        by_kind[kind_of(k["name"])] += k["dur"]
        count[kind_of(k["name"])] += 1
    return {
        "trace": path,
        "span_ms": (end - begin) / 1e3,
        "busy_ms": union_us([(k["ts"], k["ts"] + k["dur"]) for k in inside]) / 1e3,
        "stream_idle_ms": sum(gaps) / 1e3,
        "gaps_over_50us": sum(1 for g in gaps if g > 50),
        "kernels": len(inside),
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items())},
        "count": dict(count),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    rows = [summarize(p) for p in args.traces]
    kinds = sorted({k for r in rows for k in r["by_kind_ms"]})
    print(
        "| trace | span (ms) | busy (ms) | idle on step stream (ms) | gaps > 50 µs | "
        + " | ".join(f"{k} (ms)" for k in kinds)
        + " |"
    )
    print("| --- " * (5 + len(kinds)) + "|")
    for r in rows:
        print(
            f"| {r['trace']} | {r['span_ms']:.1f} | {r['busy_ms']:.1f} | "
            f"{r['stream_idle_ms']:.1f} | {r['gaps_over_50us']} | "
            + " | ".join(f"{r['by_kind_ms'].get(k, 0.0):.1f}" for k in kinds)
            + " |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
