#!/usr/bin/env python3
"""Simulate DMuon's owner partition for real llama3 and mixture-of-experts shapes at any
number of ranks.

No GPU, no process group: the planner is a pure function. Prints, per (model, ranks): the NS
load imbalance (max/mean), how many ranks get no matrix, how many blocks put two matrices on
one owner, the slowest rank's Newton–Schulz time at a given matmul rate, the per-rank bytes a
Z3 step moves for the dedicated matrices (bf16 broadcast, fp32 reduce), the planning time,
and the most collectives one block issues per step and phase (weights in: a broadcast per
owner column plus an all-gather per expert stack).

    python3 scripts/bench/simulate_partition.py --ranks 8 64 512 --tflops 600
    python3 scripts/bench/simulate_partition.py --ranks 3 5 7 --ns-algorithm auto --planned-for plain
    python3 scripts/bench/simulate_partition.py --ranks 8 16 32 64 128 --tp 8 --models llama3-70B

``--tp T``: tensor parallelism of degree T inside each data-parallel rank; owners are planned
over ranks x T slots (the "ranks" column counts data-parallel ranks), and the bytes count
each rank's tp shard in the data-parallel phases plus the tp gather/scatter (fp32).
``--tp-ns``: who runs a matrix's Newton–Schulz under TP (``dedicate_params(tp_ns=...)``):
its owner alone, its owner's row of T ranks together (``shared``, plain NS; the bytes then
add its bf16 column blocks out and back and, per iteration, an fp32 m×m all-reduce and a
bf16 m×m all-gather over the row), or ``auto`` (the default: shared where the slowest
row's FLOPs plus 2000 FLOPs per byte of its traffic beat the owner plan's slowest rank).
"""

from __future__ import annotations

import argparse
import time

from dmuon_titan.plan import TP_NS_MODES, ParamSpec, plan_partition
from dmuon_titan.plan.cost import NS_ALGORITHMS, orthogonalize_flops, shared_ns_moved_bytes
from dmuon_titan.plan.partition import SHARDED, stack_pieces

MODELS = {
    # name: (n_layers, dim, kv_dim, ffn_hidden): Llama 3.2 1B's shapes, torchtitan's 8B/70B/405B
    "llama3-1B": (16, 2048, 512, 8192),
    "llama3-8B": (32, 4096, 1024, 14336),
    "llama3-70B": (80, 8192, 1024, 28672),
    "llama3-405B": (126, 16384, 1024, 53248),
}
#: name: (dense layers, MoE layers, dim, experts, expert hidden, dense ffn hidden, attention
#: shapes): DeepSeek-V3 (MLA projections, 3 dense + 58 MoE layers of 256 experts and one
#: shared expert) and Qwen3-30B-A3B (48 MoE layers of 128 experts)
MOE_MODELS = {
    "deepseek-v3": (
        3,
        58,
        7168,
        256,
        2048,
        18432,
        {
            "wq_a": (1536, 7168),
            "wq_b": (24576, 1536),
            "wkv_a": (576, 7168),
            "wkv_b": (32768, 512),
            "wo": (7168, 16384),
        },
    ),
    "qwen3-30b-a3b": (
        0,
        48,
        2048,
        128,
        768,
        0,
        {"wq": (4096, 2048), "wk": (512, 2048), "wv": (512, 2048), "wo": (2048, 4096)},
    ),
}


def moe_specs(dense, moe, dim, experts, hidden, ffn, attention) -> list[ParamSpec]:
    specs = []
    for i in range(dense + moe):
        block = f"layers.{i}"
        specs += [
            ParamSpec(f"{block}.attention.{k}.weight", s, block) for k, s in attention.items()
        ]
        if i < dense:
            shapes = {
                "feed_forward.w1": (ffn, dim),
                "feed_forward.w2": (dim, ffn),
                "feed_forward.w3": (ffn, dim),
            }
        else:
            shapes = {
                "moe.experts.w1": (experts, hidden, dim),
                "moe.experts.w2": (experts, dim, hidden),
                "moe.experts.w3": (experts, hidden, dim),
                "moe.shared_experts.w1": (hidden, dim),
                "moe.shared_experts.w2": (dim, hidden),
                "moe.shared_experts.w3": (hidden, dim),
            }
        specs += [ParamSpec(f"{block}.{k}", s, block) for k, s in shapes.items()]
    return specs


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
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--tp-ns", choices=TP_NS_MODES, default="auto", help="see the doc")
    parser.add_argument("--models", nargs="+", default=None, help="only these models")
    args = parser.parse_args()
    tp = args.tp
    print(
        f"| model | ranks{' x tp' if tp > 1 else ''} | matrices | imbalance (max/mean) | idle ranks | blocks with a shared owner "
        "| slowest rank NS (ms) | perfect split NS (ms) | Z3 GiB/rank/step | plan ms "
        "| collectives per block in | NS |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    models = {name: llama_specs(*dims) for name, dims in MODELS.items()}
    models.update({name: moe_specs(*dims) for name, dims in MOE_MODELS.items()})
    for name, specs in models.items():
        if args.models and name not in args.models:
            continue
        numel = sum(s.numel for s in specs)
        matrices = sum(s.shape[0] if s.stacked else 1 for s in specs)
        for dp in args.ranks:
            n = dp * tp  # owner slots
            start = time.perf_counter()
            plan = plan_partition(
                specs,
                n,
                ns_algorithm=args.planned_for or args.ns_algorithm,
                tp_size=tp,
                tp_ns=args.tp_ns,
            )
            plan_ms = (time.perf_counter() - start) * 1e3
            loads = [0] * n
            shared_bytes = 0.0  # summed over all ranks
            for i, (spec, owner) in enumerate(zip(plan.specs, plan.owners, strict=True)):
                cost = orthogonalize_flops(spec.shape, args.ns_algorithm)
                if owner == SHARDED:
                    for k, (a, b) in enumerate(stack_pieces(spec.shape[0], n)):
                        loads[k] += cost * (b - a) // spec.shape[0]
                elif plan.is_shared(i):
                    row = owner - owner % tp
                    for k in range(row, row + tp):
                        loads[k] += orthogonalize_flops(spec.shape, "plain") // tp
                    shared_bytes += shared_ns_moved_bytes(spec.shape, tp)  # bf16 NS
                else:
                    loads[owner] += cost
            per_block: dict[str, list[int]] = {}
            for spec, owner in zip(plan.specs, plan.owners, strict=True):
                per_block.setdefault(spec.boundary, []).append(owner)
            matrix_owners = {
                b: [o for o in owners if o != SHARDED] for b, owners in per_block.items()
            }
            shared = sum(len(set(o)) < min(len(o), n) for o in matrix_owners.values() if o)
            calls = max(
                len(set(o)) + (len(owners) - len(o))
                for o, owners in zip(matrix_owners.values(), per_block.values(), strict=True)
            )
            rate = args.tflops * 1e12
            total = sum(loads)
            # bf16 bcast x2 + fp32 reduce of each rank's tp shard, then (tp) fp32 gather+scatter
            moved = (2 * 2 + 4) * numel / tp * (dp - 1) / dp / 2**30
            moved += (tp - 1) * numel / tp * (4 + 4) / n / 2**30
            moved += shared_bytes / n / 2**30
            ranks = f"{dp} x {tp}" if tp > 1 else f"{dp}"
            print(
                f"| {name} | {ranks} | {matrices} | {max(loads) / (sum(loads) / n):.3f} | {loads.count(0)} | "
                f"{shared} | {max(loads) / rate * 1e3:.1f} | {total / n / rate * 1e3:.1f} | {moved:.1f} "
                f"| {plan_ms:.0f} | {calls} | {'row' if plan.shared else 'owner'} |"
            )


if __name__ == "__main__":
    main()
