#!/usr/bin/env python3
"""Experiment: the 170M step's two Newton–Schulz batches on two streams instead of one.

The captured step runs its NS batches one after another (48 attention matrices 1024², 36
FFN matrices 1024×2816, ``"auto"``, bf16): two chains of dependent products, each product a
launch whose last wave leaves SMs idle (960 and 720 blocks of the symmetric kernel on 132
SMs: 7.3 and 5.5 waves) until the next launch starts. The two chains do not depend on each
other; on two streams one chain's blocks may take the SMs the other's tail leaves. Timed as
CUDA graphs replayed with the GPU spun before each replay (``cool_ms``: at the training
step's clock, not the power cap's), the variants interleaved round by round; the results
are checked to equal the serial ones bit for bit.

    python3 scripts/bench/exp_ns_streams.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dmuon_titan import newton_schulz
from dmuon_titan.options import JORDAN_COEFFICIENTS
from dmuon_titan.timing import graph_median_milliseconds

BATCHES = {"attention": (48, 1024, 1024), "ffn": (36, 1024, 2816)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cool-ms", type=float, default=25.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    coefficients = newton_schulz.normalize_coefficients(JORDAN_COEFFICIENTS)
    torch.manual_seed(0)
    inputs = {
        name: torch.randn(shape, device=device, dtype=torch.bfloat16)
        for name, shape in BATCHES.items()
    }

    def ns(name: str) -> torch.Tensor:
        return newton_schulz.orthogonalize(
            inputs[name], coefficients, 5, 1e-7, torch.bfloat16, algorithm="auto"
        )

    side = torch.cuda.Stream(device)

    def serial(order=("attention", "ffn")) -> dict[str, torch.Tensor]:
        return {name: ns(name) for name in order}

    def two_streams(on_side: str = "ffn") -> dict[str, torch.Tensor]:
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = {on_side: ns(on_side)}
        for name in BATCHES:
            if name != on_side:
                out[name] = ns(name)
        current.wait_stream(side)
        return out

    variants = {
        "serial": serial,
        "serial ffn first": lambda: serial(("ffn", "attention")),
        "two streams (ffn on side)": two_streams,
        "two streams (attention on side)": lambda: two_streams("attention"),
    }
    reference = serial()
    for name, fn in variants.items():
        got = fn()
        torch.cuda.synchronize()
        same = all(torch.equal(got[k], reference[k]) for k in BATCHES)
        print(f"{name}: results {'equal' if same else 'DIFFER'} to serial")
    alone = {
        k: graph_median_milliseconds(
            lambda k=k: ns(k), device, 2, args.reps, calls=1, cool_ms=args.cool_ms
        )
        for k in BATCHES
    }
    print("alone (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.rounds):
        names = list(variants)
        names = names[round_ % len(names) :] + names[: round_ % len(names)]
        for v in names:
            times[v].append(
                graph_median_milliseconds(
                    variants[v], device, 2, args.reps, calls=1, cool_ms=args.cool_ms
                )
            )
    base = statistics.median(times["serial"])
    print(f"NS of the 170M batches, ms (median of {args.rounds} rounds; ratio to serial)")
    print("| variant | ms | ratio | rounds |")
    print("| --- | --- | --- | --- |")
    for v, ms in times.items():
        m = statistics.median(ms)
        print(f"| {v} | {m:.3f} | {m / base:.3f} | {', '.join(f'{t:.3f}' for t in ms)} |")


if __name__ == "__main__":
    main()
