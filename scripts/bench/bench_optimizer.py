#!/usr/bin/env python3
"""Optimizer benchmark on an FSDP2 stack of llama3-shaped matrices, all variants in one run.

Each variant gets a fresh model of the same shapes (32 blocks × 7 matrices for "8B"), the
same inputs, and a few timed steps after warm-up: forward+backward of ``--tokens`` tokens
(the same compute for every variant; the differences are each variant's communication and
bookkeeping), and the optimizer step, timed with CUDA events (median). Variants:

- ``adamw``: every matrix on FSDP2, fused ``torch.optim.AdamW``;
- ``dmuon_z3`` / ``dmuon_z2``: DMuon (dedicated owners, bf16 Newton–Schulz, batched per
  shape); ``dmuon_z2_unbatched``: one Newton–Schulz call per matrix; ``dmuon_z3_auto``:
  ``ns_algorithm="auto"`` (Gram NS where it needs fewer FLOPs), ``dmuon_z3_auto_fp16``: the
  same in float16; suffixes ``_bigone`` / ``_bigbatched``: matrices of 4096² elements or more
  one per NS call / batched like the others (whatever the algorithm's default); ``_gather``:
  each block's weights by one all-gather and its gradients by one reduce-scatter
  (``collectives="gather"``) instead of a broadcast from and a reduce to each owner;
  the NS schedule by ``_aol``, ``_pe``/``_pe1`` and ``_s<N>`` (:func:`ns_schedule`), e.g.
  ``dmuon_z3_auto_aol_pe1_s4``;
- ``naive``: every matrix on FSDP2, all-gather + Newton–Schulz on every rank;
- ``torch_muon`` (one rank only): no FSDP2, ``torch.optim.Muon`` on the matrices and fused
  ``torch.optim.AdamW`` on the rest: the reference DMuon's one-rank step is held to;
- suffix ``_unhooked`` (one rank): DMuon with every forward hook below the root removed, which
  do nothing there without an asynchronous step: what the boundary hooks cost;
- ``ns_floor``: only Newton–Schulz (bf16, 5 steps) of this rank's share of the matrices under
  DMuon's partition, no communication, no momentum: the plain-NS floor;
- peers: ``muon_fsdp2`` (PyPI ``muon-fsdp2`` 0.3.0: gather to one rank per matrix, NS, scatter)
  and ``distmuon`` (torchtitan 0.3.0's ``DistMuon``, all-to-all to owners, loaded from
  ``.peers/torchtitan030`` by ``scripts/bench/peers/distmuon_peer.py``); a peer that is not installed
  is reported as skipped.

On one rank only ``naive`` and the peers (DTensor parameters) are wrapped in FSDP2: torchtitan
applies no FSDP2 on one GPU, and ``torch_muon`` has none, so neither do ``adamw`` and DMuon
(``--one-rank-fsdp`` wraps them anyway, as one-rank tables before 2026-12-03 did).

Gradients have rank ≤ ``--tokens``; Newton–Schulz runs faster on low-rank inputs (its matmuls'
speed depends on the data), so use at least as many tokens as the model width for NS times
that hold in training. Forward and backward use TF32 matmuls (a benchmark of the optimizer, not
of fp32 matmuls); Newton–Schulz runs in its own dtype either way.

``--max-norm``: the gradients are clipped by their global norm before each step, inside the
step's time, as training clips them: DMuon's variants by ``dmuon_titan.clip_grad_norm_``
with ``defer_owned=True`` (the torchtitan plugin's clip: on one rank the captured step
applies the factor to the owned gradients), the others by torch's ``clip_grad_norm_``;
suffix ``_clipnow`` (DMuon): ``defer_owned=False``, the owned gradients multiplied by the clip.

``host forward`` is the host's time to issue the forward (no synchronization inside): each
timed step starts from an idle GPU (the last step was read back), so while the host has not
got ahead of the GPU, host time is GPU idle time. ``--settle-ms`` idles before each forward,
so that the GPU's clocks recover from the step before.

Peak memory is the variant's own: allocated memory above what was left allocated when it
started (``leftover_gib`` in the JSON). Every column is its slowest rank's median, column by column (the step waits for the slowest
rank at the next collective); the columns of one row may come from different ranks.

    torchrun --standalone --nproc_per_node=2 scripts/bench/bench_optimizer.py --model 8B
    torchrun --standalone --nproc_per_node=2 scripts/bench/bench_optimizer.py --model tiny   # CPU smoke

Prints one markdown table with ratios to AdamW; ``--json PATH`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_timing import median_milliseconds
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_titan as dmuon
from dmuon_titan import newton_schulz
from dmuon_titan.exit import end_distributed_run
from dmuon_titan.naive import NaiveMuon
from dmuon_titan.options import DEFAULT_NS_BATCH_NUMEL
from dmuon_titan.timing import PhaseTimer

SHAPES = {  # n_layers, dim, kv_dim, ffn_hidden
    "8B": (32, 4096, 1024, 14336),
    "1B": (16, 2048, 512, 8192),
    "170M": (12, 1024, 1024, 2816),  # the repository's llama3 170M flavor
    "tiny": (4, 256, 64, 768),
}


class Block(nn.Module):
    def __init__(self, dim: int, kv: int, ffn: int) -> None:
        super().__init__()
        self.wq, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wk, self.wv = nn.Linear(dim, kv, bias=False), nn.Linear(dim, kv, bias=False)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every matrix takes part (wk/wv through a zero-weighted term, so they get gradients).
        side = (self.wk(x).sum(-1, keepdim=True) + self.wv(x).sum(-1, keepdim=True)) * 0.0
        h = x + self.wo(self.wq(x)) + side
        return h + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stack(nn.Module):
    def __init__(self, n_layers: int, dim: int, kv: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(dim, kv, ffn) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TorchMuonAndAdamW:
    """``torch.optim.Muon`` on the matrices and fused ``torch.optim.AdamW`` on the rest, as one
    optimizer (the one-rank reference of ``torch_muon``)."""

    def __init__(self, model, device) -> None:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        self.optimizers = [torch.optim.Muon(matrices, lr=1e-3)]
        if others:
            self.optimizers.append(torch.optim.AdamW(others, lr=1e-4, fused=device.type == "cuda"))

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


#: variants that run on DTensor parameters, so on FSDP2 even on one rank
NEEDS_FSDP = ("naive", "muon_fsdp2", "distmuon")


def build(
    variant: str,
    shape,
    mesh,
    device,
    ns_batch_numel: int = DEFAULT_NS_BATCH_NUMEL,
    one_rank_fsdp: bool = False,
):
    with torch.device("meta"):
        model = Stack(*shape)
    algorithm = "auto" if "_auto" in variant else "plain"
    if variant.startswith("dmuon"):
        dmuon.dedicate_params(
            model,
            mesh,
            lambda n, p: p.ndim == 2,
            reshard_after_forward=variant.startswith("dmuon_z3"),
            ns_algorithm=algorithm,
            collectives="gather" if "_gather" in variant else "broadcast",
        )
    # One rank: torchtitan applies no FSDP2 there (on one rank it cost AdamW 5.6 ms of
    # forward+backward at 170M, copying every matrix in and out; H200, 2026-12-03), and
    # torch.optim.Muon takes plain tensors, so AdamW and DMuon run on plain modules too
    # unless --one-rank-fsdp (the layout of measurements made before 2026-12-03).
    sharded = dist.get_world_size() > 1 or variant in NEEDS_FSDP or one_rank_fsdp
    if variant == "torch_muon":
        sharded = False
    if sharded:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if device.type == "cpu":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel():
                local.normal_(0.0, 0.02)
    if variant == "adamw":
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, fused=device.type == "cuda", foreach=device.type != "cuda"
        )
    elif variant == "torch_muon":
        if dist.get_world_size() != 1:
            raise RuntimeError("torch_muon runs on one rank (torch.optim.Muon has no FSDP2)")
        optimizer = TorchMuonAndAdamW(model, device)
    elif variant == "naive":
        optimizer = NaiveMuon(model, lambda n, p: p.ndim == 2, lr=1e-3, adamw_lr=1e-4)
    elif variant == "muon_fsdp2":
        from muon_fsdp2 import Muon as MuonFsdp2

        optimizer = MuonFsdp2([dict(params=list(model.parameters()), lr=1e-3, use_muon=True)])
    elif variant == "distmuon":
        from peers.distmuon_peer import build_distmuon

        optimizer = build_distmuon(model, mesh, lr=1e-3)
    else:
        # "..._unbatched": one Newton–Schulz per matrix (the before of batched NS).
        batch = 0 if variant.endswith("_unbatched") else ns_batch_numel
        optimizer = dmuon.Muon(
            model,
            lr=1e-3,
            adamw_lr=1e-4,
            ns_batch_numel=batch,
            ns_algorithm=algorithm,
            ns_dtype=torch.float16 if variant.endswith("_fp16") else torch.bfloat16,
            **ns_schedule(variant),
        )
        if variant.endswith("_bigone"):  # matrices of 4096² elements or more one at a time
            optimizer.ns_unbatched_numel = 4096 * 4096
        elif variant.endswith("_bigbatched"):  # everything batched by ns_batch_numel
            optimizer.ns_unbatched_numel = None
    return model, optimizer


def ns_schedule(variant: str) -> dict:
    """The NS schedule a DMuon variant's suffixes name: ``_aol`` (AOL preconditioning),
    ``_pe`` (Polar Express's coefficients) or ``_pe1`` (the same without its first
    polynomial, for AOL's nearer start), ``_s<N>`` (N steps; default 5)."""
    steps = re.search(r"_s(\d+)(?:_|$)", variant)
    coefficients = newton_schulz.JORDAN_COEFFICIENTS
    if re.search(r"_pe1(?:_|$)", variant):
        coefficients = newton_schulz.NS_COEFFICIENT_SETS["polar_express"][1:]
    elif re.search(r"_pe(?:_|$)", variant):
        coefficients = "polar_express"
    return {
        "ns_coefficients": coefficients,
        "ns_steps": int(steps.group(1)) if steps else 5,
        "ns_preconditioner": "aol" if "_aol" in variant else "frobenius",
    }


def run_ns_floor(shape, device, warmup, steps) -> dict:
    from dmuon_titan.newton_schulz import JORDAN_COEFFICIENTS, zeropower_via_newtonschulz
    from dmuon_titan.plan import ParamSpec, plan_partition

    with torch.device("meta"):
        model = Stack(*shape)
    specs = [ParamSpec(n, tuple(p.shape), n.rsplit(".", 2)[0]) for n, p in model.named_parameters()]
    plan = plan_partition(specs, dist.get_world_size())
    mine = [s.shape for s, o in zip(plan.specs, plan.owners, strict=True) if o == dist.get_rank()]
    mats = [torch.randn(s, device=device) for s in mine]

    def all_ns() -> None:
        for m in mats:
            zeropower_via_newtonschulz(m, (JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16)

    (slowest,) = slowest_rank(median_milliseconds(all_ns, device, warmup, steps))
    return {
        "variant": "ns_floor",
        "fwd_bwd_ms": 0.0,
        "host_forward_ms": 0.0,
        "step_ms": slowest,
        "ns_ms": slowest,
        "peak_gib": float("nan"),
    }


def _remove_boundary_hooks(model: nn.Module) -> None:
    """``_unhooked``: every forward hook below the root dropped (one rank, no FSDP2, no
    asynchronous step: DMuon's boundary hooks do nothing there), to time what they cost."""
    if dist.get_world_size() != 1:
        raise RuntimeError("_unhooked variants run on one rank (the hooks move the weights)")
    for module in model.modules():
        if module is not model:
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()


def clip(model: nn.Module, variant: str, max_norm: float) -> None:
    """Clip the gradients as training does: DMuon's variants as the torchtitan plugin does,
    the others by torch's clip."""
    if variant.startswith("dmuon"):
        defer = not variant.endswith("_clipnow")
        dmuon.clip_grad_norm_(model, max_norm, foreach=True, defer_owned=defer)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)


def run_variant(
    variant,
    shape,
    mesh,
    device,
    tokens,
    warmup,
    steps,
    profile=None,
    one_rank_fsdp=False,
    settle_ms=0.0,
    max_norm=None,
) -> dict:
    if variant == "ns_floor":
        return run_ns_floor(shape, device, warmup, steps)
    gc.collect()  # earlier variants' modules hold reference cycles (hooks): free them first
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    leftover = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    try:
        model, optimizer = build(variant, shape, mesh, device, one_rank_fsdp=one_rank_fsdp)
    except (ImportError, OSError) as err:  # a peer not installed here (same on every rank)
        if dist.get_rank() == 0:
            print(f"skipped {variant}: {err}")
        return None
    if variant.endswith("_unhooked"):
        _remove_boundary_hooks(model)
    x = torch.randn(tokens, shape[1], device=device, generator=None)
    fwd_bwd, step, ns, host_forward = [], [], [], []
    timer = PhaseTimer(device)
    for i in range(warmup + steps + bool(profile)):
        profiler = None
        if i == warmup + steps:  # one more step, untimed, into a trace
            profiler = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            profiler.__enter__()
        if settle_ms:
            time.sleep(settle_ms / 1000)  # the GPU idle: clocks back up after the last step
        timer.reset()
        timer.start("fwd_bwd")
        began = time.perf_counter()
        y = model(x)
        host_forward.append((time.perf_counter() - began) * 1000)
        y.float().square().mean().backward()
        timer.stop("fwd_bwd")
        timer.start("step")
        if max_norm is not None:
            clip(model, variant, max_norm)
        optimizer.step()
        timer.stop("step")
        optimizer.zero_grad()
        if profiler is not None:
            profiler.__exit__(None, None, None)
            os.makedirs(profile, exist_ok=True)
            profiler.export_chrome_trace(f"{profile}/{variant}_rank{dist.get_rank()}.json")
        if warmup <= i < warmup + steps:
            ms = timer.milliseconds()
            fwd_bwd.append(ms["fwd_bwd"])
            step.append(ms["step"])
            if hasattr(optimizer, "step_timings"):
                ns.append(optimizer.step_timings().get("ns", 0.0))
    peak = (
        (torch.cuda.max_memory_allocated() - leftover) / 2**30
        if device.type == "cuda"
        else float("nan")
    )
    del model, optimizer
    fwd_bwd_ms, host_forward_ms, step_ms, ns_ms, peak, leftover_gib = slowest_rank(
        statistics.median(fwd_bwd),
        statistics.median(host_forward),
        statistics.median(step),
        statistics.median(ns) if ns else -1.0,
        peak,
        leftover / 2**30,
    )
    return {
        "variant": variant,
        "fwd_bwd_ms": fwd_bwd_ms,
        "host_forward_ms": host_forward_ms,
        "step_ms": step_ms,
        "ns_ms": ns_ms if ns else None,
        "peak_gib": peak,
        "leftover_gib": leftover_gib,
    }


def slowest_rank(*values: float) -> list[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=_current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _current_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="8B")
    parser.add_argument(
        "--variants",
        default="adamw,dmuon_z3,dmuon_z2,dmuon_z3_auto,dmuon_z3_auto_fp16,naive,ns_floor,"
        "muon_fsdp2,distmuon",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="blocks in the stack (default: the model's)"
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile",
        default=None,
        help="folder: a torch.profiler trace of one more step of each variant, after the "
        "timed ones (chrome trace JSON: open in Perfetto or chrome://tracing)",
    )
    parser.add_argument(
        "--one-rank-fsdp",
        action="store_true",
        help="on one rank, wrap AdamW's and DMuon's blocks in FSDP2 anyway (the layout of "
        "one-rank tables before 2026-12-03; torchtitan applies no FSDP2 on one GPU)",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        help="idle time before each forward (after the last step was read back), so that "
        "the GPU's clocks recover from the step before",
    )
    parser.add_argument(
        "--max-norm",
        type=float,
        default=None,
        help="clip the gradients by their global norm before each step, inside the step's "
        "time (DMuon's variants as the torchtitan plugin clips)",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    # Global, but only fp32 matmuls use it: forward/backward here (NS runs in bf16/fp16).
    torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = _current_device()
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))  # DistMuon
    shape = SHAPES[args.model]
    if args.layers is not None:
        shape = (args.layers, *shape[1:])
    rows = [
        run_variant(
            v,
            shape,
            mesh,
            device,
            args.tokens,
            args.warmup,
            args.steps,
            args.profile,
            args.one_rank_fsdp,
            args.settle_ms,
            args.max_norm,
        )
        for v in args.variants.split(",")
    ]
    rows = [r for r in rows if r is not None]
    if dist.get_rank() == 0:
        base = next((r for r in rows if r["variant"] == "adamw"), rows[0])
        print(
            f"\nllama3-{args.model} matrix stack ({shape[0]} blocks), {world} x {torch.cuda.get_device_name() if cuda else 'CPU'}, "
            f"{args.tokens} tokens, median of {args.steps} steps after {args.warmup} warm-up"
            + ("" if args.max_norm is None else f", clipped at {args.max_norm} in the step")
        )
        print(
            "| variant | fwd+bwd (ms) | host forward (ms) | optimizer step (ms) | of which NS (ms) | step / AdamW step | total / AdamW total | peak (GiB) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            total = r["fwd_bwd_ms"] + r["step_ms"]
            base_total = base["fwd_bwd_ms"] + base["step_ms"]
            ns = "-" if r["ns_ms"] is None else f"{r['ns_ms']:.1f}"
            print(
                f"| {r['variant']} | {r['fwd_bwd_ms']:.1f} | {r['host_forward_ms']:.2f} | "
                f"{r['step_ms']:.1f} | {ns} | "
                f"{r['step_ms'] / base['step_ms']:.2f} | {total / base_total:.2f} | {r['peak_gib']:.1f} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "world": world, "rows": rows}, f, indent=1)
    end_distributed_run()


if __name__ == "__main__":
    main()
