#!/usr/bin/env python3
"""Optimizer step on mixture-of-experts stacks, one GPU: DMuon vs ``torch.optim.Muon``.

One MoE layer's expert projections as torchtitan holds them — ``w1``/``w3`` ``[E, hidden,
dim]`` and ``w2`` ``[E, dim, hidden]`` — with the same random gradients for every variant:

- ``torch_muon``: ``torch.optim.Muon`` on every expert slice as a 2-D parameter of its own
  (what a user without DMuon writes; one Newton–Schulz per matrix, bf16);
- ``dmuon``: ``dmuon_titan.Muon`` on the 3-D stacks (one rank: the stacks stay whole on it),
  Newton–Schulz batched over experts (``ns_batch_numel``, the default);
- ``dmuon_unbatched``: the same, one expert per Newton–Schulz call (``ns_batch_numel=0``);
- ``dmuon_auto``: ``ns_algorithm="auto"`` (Gram NS where it needs fewer FLOPs).

Also Newton–Schulz alone (plain, bf16, 5 steps): one stack's experts batched vs one at a time,
in TFLOP/s of the plain-NS FLOP count. Step times are CUDA-event medians.

    python3 scripts/bench/bench_experts.py --shape deepseek_v3 --experts 32
    python3 scripts/bench/bench_experts.py --shape qwen3_30b --experts 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon_titan as dmuon
from dmuon_titan.exit import end_distributed_run
from dmuon_titan.newton_schulz import JORDAN_COEFFICIENTS, orthogonalize
from dmuon_titan.plan.cost import ns_flops

#: (dim, expert hidden): DeepSeek-V3 (7168, 2048), Qwen3-30B-A3B (2048, 768)
SHAPES = {"deepseek_v3": (7168, 2048), "qwen3_30b": (2048, 768), "tiny": (64, 32)}


class Experts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)


def timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_variant(name: str, args, grads: dict[str, torch.Tensor]) -> dict:
    torch.manual_seed(0)
    module = Experts(args.experts, *SHAPES[args.shape]).cuda()
    if name == "torch_muon":
        slices = {
            k: [nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])]
            for k, p in module.named_parameters()
        }
        del module
        params = [s for k in ("w1", "w2", "w3") for s in slices[k]]
        for k in ("w1", "w2", "w3"):
            for e, s in enumerate(slices[k]):
                s.grad = grads[k][e].clone()
        optimizer = torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    else:
        mesh = init_device_mesh("cuda", (1,))
        dmuon.dedicate_params(module, mesh, lambda n, p: True)
        kwargs = {"ns_batch_numel": 0} if name == "dmuon_unbatched" else {}
        if name == "dmuon_auto":
            kwargs["ns_algorithm"] = "auto"
        optimizer = dmuon.Muon(module, lr=0.02, weight_decay=0.1, adamw_lr=1e-3, **kwargs)
        for k, p in module.named_parameters():
            p.grad = grads[k].clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = timed(optimizer.step, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del optimizer
    torch.cuda.empty_cache()
    return {"variant": name, "step_ms": ms, "peak_gib": peak}


def ns_rates(args) -> dict:
    dim, hidden = SHAPES[args.shape]
    batch = torch.randn(args.experts, hidden, dim, device="cuda", dtype=torch.bfloat16)
    ns = (JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16

    def batched():
        orthogonalize(batch, *ns)

    def one_by_one():
        for e in range(batch.shape[0]):
            orthogonalize(batch[e], *ns)

    flop = args.experts * ns_flops((hidden, dim))
    out = {}
    for name, fn in (("batched", batched), ("one_at_a_time", one_by_one)):
        ms = timed(fn, args.warmup, args.steps)
        out[name] = {"ms": ms, "tflops": flop / ms / 1e9}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek_v3")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    dim, hidden = SHAPES[args.shape]
    torch.manual_seed(1)
    grads = {
        k: torch.randn(args.experts, *s, device="cuda") * 1e-3
        for k, s in (("w1", (hidden, dim)), ("w2", (dim, hidden)), ("w3", (hidden, dim)))
    }
    rows = [
        run_variant(v, args, grads)
        for v in ("torch_muon", "dmuon", "dmuon_unbatched", "dmuon_auto")
    ]
    base = rows[0]["step_ms"]
    print(f"## {args.shape}: 3 stacks of {args.experts} experts, [{hidden}, {dim}] matrices\n")
    print("| variant | step ms | vs torch.optim.Muon | peak GiB |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x | {r['peak_gib']:.1f} |"
        )
    rates = ns_rates(args)
    print("\n| Newton-Schulz of one stack (plain, bf16) | ms | TFLOP/s |")
    print("|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {r['ms']:.1f} | {r['tflops']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "ns": rates}, f, indent=1)
    end_distributed_run()


if __name__ == "__main__":
    main()
