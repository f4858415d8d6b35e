#!/usr/bin/env python3
"""Simulate DMuon's owner partition for real llama3 shapes at any number of ranks.

No GPU, no process group: the planner is a pure function. Prints, per (model, ranks): the NS
load imbalance (max/mean), how many ranks get no matrix, how many blocks put two matrices on
one owner, the slowest rank's Newton–Schulz time at a given matmul rate, and the per-rank bytes
a Z3 step moves for the dedicated matrices (bf16 broadcast, fp32 reduce).

    python3 scripts/bench/simulate_partition.py --ranks 8 64 512 --tflops 600
    python3 scripts/bench/simulate_partition.py --ranks 3 5 7 --ns-algorithm auto --planned-for plain
"""

from __future__ import annotations

import argparse

from dmuon_titan.plan import ParamSpec, plan_partition
from dmuon_titan.plan.cost import NS_ALGORITHMS, orthogonalize_flops

MODELS = {
    # name: (n_layers, dim, kv_dim, ffn_hidden): Llama 3.2 1B's shapes, torchtitan's 8B/70B
    "llama3-1B": (16, 2048, 512, 8192),
    "llama3-8B": (32, 4096, 1024, 14336),
    "llama3-70B": (80, 8192, 1024, 28672),
}


def llama_specs(n_layers: int, dim: int, kv: int, ffn: int) -> list[ParamSpec]:
    shapes = {
        "attention.wq": (dim, dim),
        "attention.wk": (kv, dim),
        "attention.wv": (kv, dim),
        "attention.wo": (dim, dim),
        "feed_forward.w1": (ffn, dim),
        "feed_forward.w2": (dim, ffn),
        "feed_forward.w3": (ffn, dim),
    }
    return [
        ParamSpec(f"layers.{i}.{name}.weight", shape, f"layers.{i}")
        for i in range(n_layers)
        for name, shape in shapes.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 512])
    parser.add_argument("--tflops", type=float, default=600.0, help="achieved NS matmul rate")
    parser.add_argument(
        "--ns-algorithm", choices=NS_ALGORITHMS, default="plain", help="the NS that runs"
    )
    parser.add_argument(
        "--planned-for",
        choices=NS_ALGORITHMS,
        default=None,
        help="balance owners for this algorithm's FLOPs (default: --ns-algorithm's), "
        "loads are reported in --ns-algorithm's",
    )
    args = parser.parse_args()
    print(
        "| model | ranks | matrices | imbalance (max/mean) | idle ranks | blocks with a shared owner "
        "| slowest rank NS (ms) | perfect split NS (ms) | Z3 GiB/rank/step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, dims in MODELS.items():
        specs = llama_specs(*dims)
        numel = sum(s.numel for s in specs)
        for n in args.ranks:
            plan = plan_partition(specs, n, ns_algorithm=args.planned_for or args.ns_algorithm)
            loads = [0] * n
            for spec, owner in zip(plan.specs, plan.owners, strict=True):
                loads[owner] += orthogonalize_flops(spec.shape, args.ns_algorithm)
            per_block: dict[str, list[int]] = {}
            for spec, owner in zip(plan.specs, plan.owners, strict=True):
                per_block.setdefault(spec.boundary, []).append(owner)
            shared = sum(len(set(o)) < min(len(o), n) for o in per_block.values())
            rate = args.tflops * 1e12
            total = sum(loads)
            moved = (2 * 2 + 4) * numel * (n - 1) / n / 2**30  # bf16 bcast x2 + fp32 reduce
            print(
                f"| {name} | {n} | {len(specs)} | {max(loads) / (sum(loads) / n):.3f} | {loads.count(0)} | "
                f"{shared} | {max(loads) / rate * 1e3:.1f} | {total / n / rate * 1e3:.1f} | {moved:.1f} |"
            )


if __name__ == "__main__":
    main()
