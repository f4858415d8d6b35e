#!/usr/bin/env python3
"""Where the GPU time of DMuon's optimizer step goes, from a torch.profiler chrome trace.

The step is the window from the first momentum kernel to the end of the last update kernel
(the fused Triton kernels of ``dmuon_titan.fused``; run with ``DMUON_FUSED=1``, the default);
``--whole``: every kernel of the trace (a whole training step, any optimizer).
For that window it prints: its span, the time some kernel ran (on any stream), the idle time
on the step's stream (gaps between its kernels: host launch latency, or waits), and kernel
time by kind — the symmetric-product kernel, cuBLAS/CUTLASS matmuls, the fused elementwise
kernels, runtime memcpys/memsets, everything else. Comparing two traces (e.g. torchtitan's and bench_optimizer's)
tells slower kernels (clocks, data) apart from a starved stream (host overhead).
``--per-step``: for a trace of several steps, medians per step by kind of kernel and launch
grid (the symmetric kernel's and the matmuls' grids tell the NS batches apart).

    python3 scripts/analysis/trace_summary.py TRACE.json [TRACE2.json ...]   # .json or .json.gz
    python3 scripts/analysis/trace_summary.py --per-step dmuon_auto.json.gz

Traces: torchtitan ``--profiling.enable_profiling`` (``profile_traces/iteration_N/``),
``scripts/bench/bench_optimizer.py --profile DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("momentum", ("_momentum_kernel", "_momentum_table_kernel")),
    ("update", ("_update_kernel", "_update_table_kernel")),
    ("divide", ("_divide_kernel",)),
    ("symmetric", ("_symmetric_mm_kernel",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma")),
    ("nccl", ("nccl",)),
    ("flash_attention", ("flash", "fmha", "attention")),
    ("copy_cast", ("copy", "cast", "Cat", "cat_", "CatArrayBatched")),
)


def kind_of(name: str, category: str = "kernel") -> str:
    if category != "kernel":
        return category.removeprefix("gpu_")
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


#: GPU activity in a torch.profiler trace: kernels, and copies/fills the runtime issues itself
#: (``cudaMemcpyAsync`` device to device runs as a "gpu_memcpy", not as a kernel).
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_kernels(path: str, events: list[dict] | None = None) -> list[dict]:
    """Everything that ran on the GPU (kernels, memcpys, memsets), by start time."""
    events = load_events(path) if events is None else events
    return sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])


def largest_gaps(path: str, count: int, whole: bool) -> list[dict]:
    """The ``count`` longest idle intervals of the step's stream, each with the kernels around
    it and the host work that overlapped it (the longest CUDA runtime calls and CPU ops), to
    tell a host synchronization or allocation from a slow launch."""
    events = load_events(path)
    summary = summarize(path, whole, events)
    kernels = [k for k in load_kernels(path, events) if k["ts"] >= summary["_begin"]]
    stream = [k for k in kernels if k.get("args", {}).get("stream") == summary["_stream"]]
    stream = [k for k in stream if k["ts"] + k["dur"] <= summary["_end"]]
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cpu_op", "cuda_driver")]
    gaps = []
    for a, b in zip(stream, stream[1:], strict=False):
        start, stop = a["ts"] + a["dur"], b["ts"]
        if stop - start <= 0:
            continue
        overlapping = sorted(
            (e for e in host if e["ts"] < stop and e["ts"] + e["dur"] > start),
            key=lambda e: -e["dur"],
        )
        gaps.append(
            {
                "at_ms": (start - summary["_begin"]) / 1e3,
                "us": stop - start,
                "before": a["name"][:60],
                "after": b["name"][:60],
                "host": [f"{e['name'][:40]} {e['dur']:.0f}us" for e in overlapping[:4]],
            }
        )
    return sorted(gaps, key=lambda g: -g["us"])[:count]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(path: str, whole: bool = False, events: list[dict] | None = None) -> dict:
    kernels = load_kernels(path, events)
    if whole:  # every kernel of the trace; "the step's stream" is the busiest one
        if not kernels:
            raise SystemExit(f"{path}: no GPU kernels")
        begin = kernels[0]["ts"]
        end = max(k["ts"] + k["dur"] for k in kernels)
        busy_by_stream: dict = defaultdict(float)
        for k in kernels:
            busy_by_stream[k.get("args", {}).get("stream")] += k["dur"]
        stream = max(busy_by_stream, key=busy_by_stream.get)
    else:
        # (per matrix: _momentum_kernel[_2d], _update_kernel; by table: _momentum_table_kernel[_2d],
        # _update_table_kernel)
        moments = [k for k in kernels if k["name"].startswith("_momentum_")]
        updates = [k for k in kernels if k["name"].startswith("_update_")]
        if not moments or not updates:
            raise SystemExit(
                f"{path}: no DMuon momentum/update kernels (DMUON_FUSED=0, or no step)"
            )
        begin = moments[0]["ts"]
        end = max(k["ts"] + k["dur"] for k in updates)
        stream = moments[0].get("args", {}).get("stream")
    inside = [k for k in kernels if k["ts"] >= begin and k["ts"] + k["dur"] <= end]
    on_stream = [k for k in inside if k.get("args", {}).get("stream") == stream]
    gaps = [
        b["ts"] - (a["ts"] + a["dur"])
        for a, b in zip(on_stream, on_stream[1:], strict=False)
        if b["ts"] > a["ts"] + a["dur"]
    ]
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for k in inside:
        kind = kind_of(k["name"], k["cat"])
        by_kind[kind] += k["dur"]
        count[kind] += 1
    return {
        "trace": path,
        "span_ms": (end - begin) / 1e3,
        "busy_ms": union_us([(k["ts"], k["ts"] + k["dur"]) for k in inside]) / 1e3,
        "stream_idle_ms": sum(gaps) / 1e3,
        "gaps_over_50us": sum(1 for g in gaps if g > 50),
        "kernels": len(inside),
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items())},
        "count": dict(count),
        "_begin": begin,
        "_end": end,
        "_stream": stream,
    }


#: idle time on the step's stream that separates two steps of a multi-step trace
STEP_GAP_US = 1000.0


def per_step(path: str) -> dict:
    """Medians over the optimizer steps of a trace of several (the step's stream split where
    it idles over :data:`STEP_GAP_US`): span, busy time, and per kind of kernel its time and
    launches, the symmetric kernel and the matmuls split by launch grid (one NS batch each,
    as a rule)."""
    events = load_events(path)
    first = summarize(path, False, events)
    stream = [
        k
        for k in load_kernels(path, events)
        if k.get("args", {}).get("stream") == first["_stream"] and k.get("cat") == "kernel"
    ]
    steps: list[list[dict]] = []
    for k in stream:
        if not steps or k["ts"] - (steps[-1][-1]["ts"] + steps[-1][-1]["dur"]) > STEP_GAP_US:
            steps.append([])
        steps[-1].append(k)
    parts: dict[str, list[tuple[float, int]]] = defaultdict(list)
    spans, busy = [], []
    for step in steps:
        times: dict[str, float] = defaultdict(float)
        launches: dict[str, int] = defaultdict(int)
        for k in step:
            kind = kind_of(k["name"], k["cat"])
            if kind in ("symmetric", "matmul"):
                kind += f" grid {k.get('args', {}).get('grid')}"
            times[kind] += k["dur"]
            launches[kind] += 1
        for kind in times:
            parts[kind].append((times[kind] / 1e3, launches[kind]))
        spans.append((step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]) / 1e3)
        busy.append(union_us([(k["ts"], k["ts"] + k["dur"]) for k in step]) / 1e3)
    return {
        "trace": path,
        "steps": len(steps),
        "span_ms": statistics.median(spans),
        "busy_ms": statistics.median(busy),
        "parts": {
            kind: (statistics.median(t for t, _ in v), statistics.median(n for _, n in v))
            for kind, v in sorted(parts.items(), key=lambda kv: -sum(t for t, _ in kv[1]))
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--whole",
        action="store_true",
        help="the whole trace instead of the optimizer step (e.g. forward+backward; works for "
        "any training step, AdamW's too)",
    )
    parser.add_argument(
        "--gaps", type=int, default=0, help="also list this many longest idle intervals"
    )
    parser.add_argument(
        "--per-step",
        action="store_true",
        help="medians per optimizer step of a trace of several (bench_small_interleaved.py "
        "--trace-dir), by kind of kernel and launch grid",
    )
    args = parser.parse_args()
    if args.per_step:
        for path in args.traces:
            r = per_step(path)
            print(
                f"{path}: {r['steps']} steps, medians per step: span {r['span_ms']:.3f} ms, "
                f"busy {r['busy_ms']:.3f} ms"
            )
            print("| kernels | ms per step | launches per step |")
            print("| --- | --- | --- |")
            for kind, (ms, n) in r["parts"].items():
                print(f"| {kind} | {ms:.3f} | {n:g} |")
        return
    rows = [summarize(p, args.whole) for p in args.traces]
    for r in rows:
        for key in ("_begin", "_end", "_stream"):
            r.pop(key)
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
    for path in args.traces if args.gaps else ():
        print(f"\n{path}: the {args.gaps} longest idle intervals of the step's stream")
        print("| at (ms) | idle (µs) | kernel before | kernel after | host work overlapping |")
        print("| --- | --- | --- | --- | --- |")
        for g in largest_gaps(path, args.gaps, args.whole):
            print(
                f"| {g['at_ms']:.1f} | {g['us']:.0f} | {g['before']} | {g['after']} | "
                f"{'; '.join(g['host'])} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
