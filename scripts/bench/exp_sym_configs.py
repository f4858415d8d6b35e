#!/usr/bin/env python3
"""Experiment: the symmetric kernel's launch configuration, timed inside whole Newton–Schulz
runs of the 170M and 8B batches, configurations interleaved replay by replay.

Earlier rounds compared configurations in runs one after another, and the GPU's clock
drifted by more than their difference (docs/benchmarks.md, fourteenth session). Here each
(configuration, batch) pair is one CUDA graph of ``--calls`` NS runs of ``orthogonalize``
(``"auto"``, bf16, 5 Jordan steps), captured with the kernel's defaults patched; every round
replays all graphs once in a rotating order; medians over ``--rounds``.

    python3 scripts/bench/exp_sym_configs.py --rounds 15
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dmuon_titan import newton_schulz, symmetric

BATCHES = {  # name: (count, rows, cols)
    "170M squares 48x1024^2": (48, 1024, 1024),
    "170M FFN 36x1024x2816": (36, 1024, 2816),
    "8B squares 4x4096^2": (4, 4096, 4096),
    "8B FFN 2x4096x14336": (2, 4096, 14336),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument(
        "--configs", default="128/64/8/4,128/64/4/3,128/64/8/3,128/64/4/4,128/64/8/2,64/64/4/3"
    )
    parser.add_argument("--batches", default=",".join(BATCHES))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    configs = [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    names = args.batches.split(",")
    inputs = {n: torch.randn(BATCHES[n], device=device, dtype=torch.bfloat16) for n in names}
    coefficients = newton_schulz.normalize_coefficients("jordan")
    defaults = dict(symmetric.symmetric_mm.__kwdefaults__)
    graphs, outputs = {}, {}
    for config in configs:
        tile, tile_k, warps, stages = config
        symmetric.symmetric_mm.__kwdefaults__.update(
            tile=tile, tile_k=tile_k, num_warps=warps, num_stages=stages
        )
        for name in names:

            def run(name=name):
                return newton_schulz.orthogonalize(
                    inputs[name], coefficients, 5, 1e-7, torch.bfloat16, "auto"
                )

            for _ in range(2):  # compile, allocate
                run()
            torch.cuda.synchronize()
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                for _ in range(args.calls):
                    out = run()
            graph.replay()
            torch.cuda.synchronize()
            graphs[(config, name)] = graph
            outputs[(config, name)] = out.float().clone()
    symmetric.symmetric_mm.__kwdefaults__.update(defaults)
    keys = list(graphs)
    times = {k: [] for k in keys}
    for r in range(args.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for k in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[k].replay()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / args.calls)
    print(f"NS ('auto', bf16, 5 steps) per batch, ms, median of {args.rounds} interleaved rounds")
    print("| config (tile/tile_k/warps/stages) | " + " | ".join(names) + " | 170M sum |")
    print("| --- " * (len(names) + 2) + "|")
    base = configs[0]
    for config in configs:
        cells = []
        for name in names:
            t = statistics.median(times[(config, name)])
            b = statistics.median(times[(base, name)])
            same = torch.equal(outputs[(config, name)], outputs[(base, name)])
            cells.append(f"{t:.3f} ({t / b:.3f}{'' if same else ', other bits'})")
        small = sum(statistics.median(times[(config, n)]) for n in names if n.startswith("170M"))
        print(f"| {'/'.join(map(str, config))} | " + " | ".join(cells) + f" | {small:.3f} |")
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    print("min/max per graph:", {f"{'/'.join(map(str, c))} {n}": s for (c, n), s in spread.items()})


if __name__ == "__main__":
    main()
