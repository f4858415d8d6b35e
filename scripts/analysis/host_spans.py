#!/usr/bin/env python3
"""Host (CPU) time of a torch.profiler chrome trace's annotated spans — the optimizer step,
zero_grad, the data loader, the profiler step — and how many kernels each span launched.

A small model's training step is host-bound: the GPU idles while Python launches kernels, so
the optimizer's host time matters as much as its GPU time (``trace_summary.py`` shows the
GPU side). One line per ``user_annotation`` span, and per trace the host time of the whole
profiled step.

    python3 scripts/analysis/host_spans.py TRACE.json[.gz] [TRACE2 ...]
"""

from __future__ import annotations

import argparse
import gzip
import json


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def host_spans(events: list[dict]) -> list[tuple[str, float, int]]:
    """(name, host ms, kernels launched within it) per annotated span."""
    launches = [
        e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime"
        and "LaunchKernel" in e.get("name", "")
        or e.get("cat") == "cuda_driver"
        and "cuLaunchKernel" in e.get("name", "")
    ]
    spans = []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        count = sum(start <= t <= end for t in launches)
        spans.append((e["name"], e.get("dur", 0) / 1e3, count))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args()
    for path in args.traces:
        print(f"## {path}")
        print("| span | host ms | kernel launches |")
        print("| --- | --- | --- |")
        for name, ms, count in host_spans(load_events(path)):
            print(f"| {name} | {ms:.2f} | {count} |")


if __name__ == "__main__":
    main()
