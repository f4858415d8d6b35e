#!/usr/bin/env python3
"""Small-model training and forward-only throughput, AdamW vs DMuon, interleaved in one process.

A small model's step on one GPU is host-bound, and on a shared machine the host's speed
drifts by more than the difference between the optimizers (docs/benchmarks.md, "torchtitan,
small models on one GPU"): runs one after another cannot resolve a few percent. Here every
variant gets a model of the same flavor (torchtitan's llama3, same initial weights) and the
same batches,
and the variants take turns in blocks of ``--block`` steps (synchronized only at block ends,
as torchtitan synchronizes at its logging steps), the order rotating each round, so drift
hits all of them alike. Each round also times ``--block`` forward-only passes per variant
(torchtitan's validation). Medians over the rounds, and ratios to AdamW, in one table.

Variants: ``adamw`` (fused AdamW on everything), ``dmuon`` (DMuon's one-rank direct path:
Muon on the default matrices, fused AdamW on the rest, the captured step on its own stream),
``dmuon_sync`` (the same, ``async_step=False``: replayed on the compute stream), ``dmuon_eager``
(the same, ``cuda_graph=False``), ``dmuon_auto`` (``dmuon`` with ``ns_algorithm="auto"``: Gram NS
and the symmetric kernel where they are faster; same math, other rounding), ``dmuon_auto_clipnow``
(``dmuon_auto`` with the clip's multiply of the owned gradients done by the clip,
``defer_owned=False``, instead of inside the captured step), ``dmuon_auto_sync``
(``dmuon_auto`` replayed on the compute stream),
``dmuon_auto_nowait`` (``dmuon_auto`` whose forward does not wait for the step in flight: its
weights race the step, so only its timing means anything, a bound on what overlapping the
step with the forward could gain), ``dmuon_auto_full`` (``dmuon_auto`` with the host work of the
library before commit 0f527c4, 2026-12-04: the full checks every step, every block's wait
asked of the GPU),
``adamw_mw`` (``adamw`` whose weights are set to ``dmuon_auto``'s before each of its blocks: the
same kernels as AdamW's on a Muon-trained model's values, which tells what the weights alone do
to the forward and backward), ``torch_muon`` (``torch.optim.Muon`` on the same matrices + fused
AdamW). Every step clips by the global norm 1.0 (torchtitan's default): DMuon's variants by
``dmuon_titan.clip_grad_norm_(defer_owned=True)``, as the torchtitan plugin does. bf16 autocast on CUDA, as torchtitan's single-device training. ``--h2d`` keeps
the batches on the host and copies each to the GPU as torchtitan does (a blocking copy: the
host waits for the compute stream), otherwise they stay on the GPU. ``--titan-order`` also runs each
step in the order of torchtitan's ``train_step``, with its extra host work: ``zero_grad``
first, the token count and then inputs and labels each copied from the host, and an LR
scheduler stepped after the optimizer (so that a gap seen in torchtitan but not here can be
told apart from one of the loop's order). ``--lag`` tells whether the step's GPU work is
hidden behind the host's (a step left on the GPU when the next step's blocking copies begin is
waited for there).

    torchrun --standalone --nproc_per_node=1 scripts/bench/bench_small_interleaved.py --flavor 170M
    torchrun --standalone --nproc_per_node=1 scripts/bench/bench_small_interleaved.py \\
        --flavor debugmodel --batch 2 --seq 64 --rounds 2 --block 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import gzip
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_optimizer import clip  # (this directory: the script's own on sys.path)
from gpu_timing import gpu_busy_milliseconds, interval_union
from torch.distributed.device_mesh import init_device_mesh

import dmuon_titan as dmuon
from dmuon_titan.exit import end_distributed_run
from dmuon_titan.toy.flavors import add_flavors

VARIANTS = (
    "adamw",
    "dmuon",
    "dmuon_sync",
    "dmuon_eager",
    "dmuon_auto",
    "dmuon_auto_clipnow",
    "dmuon_auto_sync",
    "dmuon_auto_nowait",
    "dmuon_auto_full",
    "adamw_mw",
    "torch_muon",
)

#: prefix of the profiler ranges that mark a training step's phases (``--phases``)
PHASE = "phase:"
PHASES = ("forward", "backward", "clip", "step")


def phase_gpu_milliseconds(trace_path: str) -> dict[str, tuple[float, float]]:
    """Per phase of a profiled block (``PHASE`` ranges of a chrome trace): (the GPU time of
    the work its host range launched, summed over kernels, copies and fills; the union of
    their intervals), in ms. A GPU event belongs to the phase in which its runtime call
    (``cudaLaunchKernel``, ``cudaGraphLaunch``, ...) was made, matched by correlation id:
    the step's replay on a side stream counts as the step's even while the next forward
    runs."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"].removeprefix(PHASE))
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE)
    )
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        at = launched.get(e.get("args", {}).get("correlation"))
        i = bisect.bisect_right(ranges, (at, float("inf"), "")) - 1 if at is not None else -1
        name = ranges[i][2] if i >= 0 and at <= ranges[i][1] else "other"
        spans.setdefault(name, []).append((e["ts"], e["ts"] + e["dur"]))
    return {
        name: (sum(e - b for b, e in intervals) / 1e3, interval_union(intervals) / 1e3)
        for name, intervals in spans.items()
    }


def build(
    variant: str,
    flavor: str,
    device: torch.device,
    lr: float,
    adamw_lr: float,
    ns_batch_numel: int | None = None,
):
    from torchtitan.models.llama3 import Transformer, llama3_args

    from dmuon_titan.titan.selection import muon_predicate

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(llama3_args[flavor])
    predicate = muon_predicate([], model)
    if variant.startswith("dmuon"):
        mesh = init_device_mesh(device.type, (1,))
        algorithm = "auto" if variant.startswith("dmuon_auto") else "plain"
        dmuon.dedicate_params(model, mesh, predicate, ns_algorithm=algorithm)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    fused = {"fused": True} if device.type == "cuda" else {}
    if variant.startswith("dmuon"):
        optimizer = dmuon.Muon(
            model,
            lr=lr,
            adamw_lr=adamw_lr,
            adamw_fused=device.type == "cuda",
            cuda_graph=variant != "dmuon_eager",
            async_step=not variant.endswith("_sync"),
            **({} if ns_batch_numel is None else {"ns_batch_numel": ns_batch_numel}),
        )
        if variant.endswith("_nowait"):  # (a bound on timing only: the forward races the step)
            optimizer._dmuon.wait_for_step = lambda: None
        if variant.endswith("_full"):  # every step's full checks, every wait asked of the GPU
            optimizer._steady_matrices = lambda group: None
            optimizer._still_followed = lambda: False
            graph, wait = optimizer.step_graph, optimizer.step_graph.wait
            graph.wait = lambda: (setattr(graph, "_waited", None), wait())[1]
        return model, [optimizer]
    if variant in ("adamw", "adamw_mw"):
        return model, [
            torch.optim.AdamW(model.parameters(), lr=adamw_lr, betas=(0.9, 0.95), **fused)
        ]
    matrices = [p for n, p in model.named_parameters() if predicate(n, p)]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return model, [
        torch.optim.Muon(matrices, lr=lr, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=adamw_lr, betas=(0.9, 0.95), **fused),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="170M")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=10, help="steps per turn")
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--h2d", action="store_true", help="copy each batch from the host")
    parser.add_argument(
        "--titan-order",
        action="store_true",
        help="each training step in torchtitan's order and with its extra host work (implies "
        "--h2d): zero_grad first, the token count and then inputs and labels each copied from "
        "the host (blocking), the loss summed over tokens and divided by that count, and an LR "
        "scheduler stepped after the optimizer (LambdaLR, linear warm-up over 200 steps)",
    )
    parser.add_argument(
        "--ns-batch-numel", type=int, default=None, help="DMuon's ns_batch_numel (its default)"
    )
    parser.add_argument(
        "--gpu-busy",
        type=int,
        default=0,
        help="then this many rounds of one profiled training block per variant: the GPU's busy "
        "time per step (the step's GPU work, what a GPU-bound loop takes), median",
    )
    parser.add_argument(
        "--phases",
        type=int,
        default=0,
        help="then this many rounds of one block per variant timed by phase on the host (no "
        "synchronization added) and one profiled block per variant: the GPU time of the work "
        "each phase launched (forward, backward, clip, step), medians per step",
    )
    parser.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="then this many blocks per variant with cProfile on around the clip and the step "
        "(with zero_grad): the host's time in them by function, per step",
    )
    parser.add_argument(
        "--wait-cost",
        action="store_true",
        help="then the host's time per call of each DMuon variant's wait_for_step (the forward "
        "calls it once per block and once at the root)",
    )
    parser.add_argument(
        "--lag",
        type=int,
        default=0,
        help="then this many rounds of one block per variant with an event recorded on the "
        "compute stream at each phase's start, before the model's forward (after the batch's "
        "copies) and at the step's end (CUDA only): how far the "
        "GPU runs behind the host there (the event's GPU time less its host time, both from "
        "the block's start, after a synchronization), medians per step; a lag at the step's "
        "start is what the next blocking copy waits for",
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="with --phases: keep each variant's last profiled block there "
        "(VARIANT.json.gz, torch.profiler's chrome trace)",
    )
    args = parser.parse_args()
    if "adamw_mw" in args.variants.split(",") and "dmuon_auto" not in args.variants.split(","):
        parser.error("adamw_mw takes dmuon_auto's weights: add dmuon_auto to --variants")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    add_flavors()
    args.h2d = args.h2d or args.titan_order
    variants = args.variants.split(",")
    runs = {v: build(v, args.flavor, device, 2e-3, 5e-4, args.ns_batch_numel) for v in variants}
    # --titan-order: torchtitan's warm-up, whose factor changes every step (made only then: a
    # LambdaLR sets its first factor on the optimizers as it is made)
    schedulers = {
        v: [
            torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 200))
            for opt in run[1]
        ]
        if args.titan_order
        else []
        for v, run in runs.items()
    }
    vocab = runs[variants[0]][0].vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator).to(
            "cpu" if args.h2d else device
        )
        for _ in range(args.block)
    ]
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def prepare(variant: str) -> None:
        """Before a block of ``variant``'s (untimed): adamw_mw takes dmuon_auto's weights."""
        if variant != "adamw_mw":
            return
        source = dict(runs["dmuon_auto"][0].named_parameters())
        with torch.no_grad():
            for name, p in runs["adamw_mw"][0].named_parameters():
                p.copy_(source[name])
        sync()

    def train_block(
        model,
        optimizers,
        phases: dict[str, list[float]] | None = None,
        marked: bool = False,
        profiler: cProfile.Profile | None = None,
        lags: list[tuple[str, torch.cuda.Event, float]] | None = None,
    ) -> None:
        """``--block`` training steps; ``phases``: each step's host seconds per phase
        appended (no synchronization added); ``marked``: each phase a profiler range;
        ``profiler``: enabled during the clip and the step; ``lags``: (phase, an event
        recorded on the current stream, the host's clock) appended at each phase's start,
        before the model's forward ("model") and at each step's end ("end")."""
        variant = next(v for v, run in runs.items() if run[0] is model)

        @contextlib.contextmanager
        def phase(name: str):
            profiled = profiler is not None and name in ("clip", "step")
            if lags is not None:
                mark(name)
            if profiled:
                profiler.enable()
            begin = time.perf_counter()
            with (
                torch.profiler.record_function(PHASE + name) if marked else contextlib.nullcontext()
            ):
                yield
            if phases is not None:
                phases.setdefault(name, []).append(time.perf_counter() - begin)
            if profiled:
                profiler.disable()

        def mark(name: str) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            lags.append((name, event, time.perf_counter()))

        for tokens in batches:
            with phase("forward"):
                if args.titan_order:  # (torchtitan's train_step; its copies block the host)
                    for opt in optimizers:
                        opt.zero_grad()
                    count = (tokens[:, 1:] >= 0).sum().to(device)
                    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
                else:
                    tokens = tokens.to(device)  # (--h2d: torchtitan's blocking copy)
                    inputs, labels = tokens[:, :-1], tokens[:, 1:]
                if lags is not None:  # (after the copies, which waited for the GPU)
                    mark("model")
                with autocast:
                    logits = model(inputs)
            with phase("backward"):
                if args.titan_order:
                    loss = (
                        F.cross_entropy(
                            logits.float().flatten(0, 1), labels.flatten(), reduction="sum"
                        )
                        / count.float()
                    )
                else:
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
                loss.backward()
            with phase("clip"):
                clip(model, variant, 1.0)
            with phase("step"):
                for opt in optimizers:
                    opt.step()
                    if not args.titan_order:
                        opt.zero_grad()
                for scheduler in schedulers[variant]:  # (--titan-order)
                    scheduler.step()
            if lags is not None:
                mark("end")

    @torch.no_grad()
    def forward_block(model, _optimizers) -> None:
        for tokens in batches:
            tokens = tokens.to(device)
            with autocast:
                model(tokens[:, :-1])

    times: dict[str, dict[str, list[float]]] = {v: {"train": [], "forward": []} for v in variants}
    for round_ in range(args.warmup_rounds + args.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for kind, block in (("train", train_block), ("forward", forward_block)):
            for v in order:
                prepare(v)
                sync()
                start = time.perf_counter()
                block(*runs[v])
                sync()
                if round_ >= args.warmup_rounds:
                    times[v][kind].append((time.perf_counter() - start) / args.block)
    busy: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.gpu_busy):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for v in order:
            prepare(v)
            ms = gpu_busy_milliseconds(lambda v=v: train_block(*runs[v]), device)
            busy[v].append(ms / 1e3 / args.block)
    host: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    gpu: dict[str, dict[str, list[tuple[float, float]]]] = {v: {} for v in variants}
    for round_ in range(args.phases):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for v in order:
            prepare(v)
            sync()
            train_block(*runs[v], phases=host[v])
            sync()
            prepare(v)
            activity = torch.profiler.ProfilerActivity
            with torch.profiler.profile(
                activities=[activity.CPU] + [activity.CUDA] * (device.type == "cuda")
            ) as profile:
                train_block(*runs[v], marked=True)
                sync()
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "trace.json")
                profile.export_chrome_trace(path)
                for name, (total, union) in phase_gpu_milliseconds(path).items():
                    gpu[v].setdefault(name, []).append((total / args.block, union / args.block))
                if args.trace_dir and round_ == args.phases - 1:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    target = os.path.join(args.trace_dir, f"{v}.json.gz")
                    with open(path, "rb") as src, gzip.open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
    lag: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    for round_ in range(args.lag if device.type == "cuda" else 0):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for v in order:
            prepare(v)
            sync()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            marks = [("block", start, time.perf_counter())]
            train_block(*runs[v], lags=marks)
            sync()
            for name, event, host_time in marks[1:]:
                behind = start.elapsed_time(event) / 1e3 - (host_time - marks[0][2])
                lag[v].setdefault(name, []).append(behind)
    profiles = {}
    for v in variants if args.host_profile else ():
        profiles[v] = cProfile.Profile()
        for _ in range(args.host_profile):
            prepare(v)
            sync()
            train_block(*runs[v], profiler=profiles[v])
            sync()
    tokens = args.batch * args.seq
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"llama3 {args.flavor}, 1 x {name}, {tokens} tokens a step, {args.rounds} rounds of "
        f"{args.block} steps per variant, batches {'copied from the host' if args.h2d else 'on the GPU'}{', torchtitan order' if args.titan_order else ''} "
        "(medians; ratio: AdamW's step time / the variant's)"
    )
    print(
        "| variant | train step (ms) | train tok/s | vs AdamW | forward (ms) | forward tok/s | vs AdamW |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = (
        {kind: statistics.median(times["adamw"][kind]) for kind in ("train", "forward")}
        if "adamw" in times
        else None
    )
    for v in variants:
        row = [v]
        for kind in ("train", "forward"):
            t = statistics.median(times[v][kind])
            ratio = f"{base[kind] / t:.3f}" if base else "-"
            row += [f"{t * 1e3:.1f}", f"{tokens / t:,.0f}", ratio]
        print("| " + " | ".join(row) + " |")
    if args.gpu_busy:
        print(
            f"GPU busy time per training step (union of its GPU activity, {args.gpu_busy} "
            "profiled blocks per variant, medians; ratio: AdamW's / the variant's):"
        )
        print("| variant | GPU busy per step (ms) | vs AdamW | blocks (ms per step) |")
        print("| --- | --- | --- | --- |")
        for v in variants:
            t = statistics.median(busy[v])
            ratio = f"{statistics.median(busy['adamw']) / t:.3f}" if "adamw" in busy else "-"
            each = ", ".join(f"{b * 1e3:.2f}" for b in busy[v])
            print(f"| {v} | {t * 1e3:.2f} | {ratio} | {each} |")
    if args.phases:
        print(
            f"Per phase of a training step ({args.phases} rounds, medians per step, ms): host "
            "time (no synchronization added; what the host spends issuing it) and GPU time of "
            "the work it launched (summed / union of its intervals):"
        )
        print(
            "| variant | "
            + " | ".join(f"{p} host" for p in PHASES)
            + " | host total | "
            + " | ".join(f"{p} GPU" for p in PHASES)
            + " | other GPU |"
        )
        print("| --- " * (2 * len(PHASES) + 3) + "|")
        for v in variants:
            hosts = [statistics.median(host[v].get(p, [0.0])) * 1e3 for p in PHASES]
            cells = [f"{h:.2f}" for h in hosts] + [f"{sum(hosts):.2f}"]
            for p in PHASES + ("other",):
                pairs = gpu[v].get(p)
                if pairs:
                    total = statistics.median(t for t, _ in pairs)
                    union = statistics.median(b for _, b in pairs)
                    cells.append(f"{total:.2f} / {union:.2f}")
                else:
                    cells.append("-")
            print(f"| {v} | " + " | ".join(cells) + " |")
    if any(lag.values()):
        print(
            f"How far the GPU runs behind the host (ms; {args.lag} rounds of one block per "
            "variant, medians over its steps): at each phase's start (forward: the step's), "
            "after the batch's blocking copies (model), and at the step's end (what the next "
            "step's copies wait for):"
        )
        names = ["forward", "model", *PHASES[1:], "end"]
        print("| variant | " + " | ".join(f"at {n}" for n in names) + " |")
        print("| --- " * (len(names) + 1) + "|")
        for v in variants:
            cells = [f"{statistics.median(lag[v][n]) * 1e3:.2f}" for n in names]
            print(f"| {v} | " + " | ".join(cells) + " |")
    for v, profile in profiles.items():
        steps = args.host_profile * args.block
        stats = pstats.Stats(profile)
        total = stats.total_tt / steps * 1e3
        print(
            f"{v}: host time in clip + step under cProfile, {total:.2f} ms per step; top functions:"
        )
        print("| function | calls per step | own ms per step | cumulative ms per step |")
        print("| --- | --- | --- | --- |")
        by_own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
        ours = [kv for kv in stats.stats.items() if "dmuon_titan" in kv[0][0]]
        by_cumulative = sorted(ours, key=lambda kv: -kv[1][3])[:20]
        for title, rows in (("own time", by_own), ("DMuon's, by cumulative time", by_cumulative)):
            print(f"| ({title}) | | | |")
            for (file, line, func), (_, calls, own, cumulative, _) in rows:
                where = f"{os.path.basename(file)}:{line}:{func}" if line else func
                print(
                    f"| {where} | {calls / steps:.1f} | {own / steps * 1e3:.3f} | "
                    f"{cumulative / steps * 1e3:.3f} |"
                )
    for v in ("dmuon", "dmuon_sync", "dmuon_auto", "dmuon_auto_clipnow", "dmuon_auto_sync"):
        if v in runs:
            record = runs[v][1][0].step_graph
            print(
                f"({v}'s graph: {record.captures} capture(s), {record.replays} replays, "
                f"given up: {record.disabled})"
            )
    for v in variants if args.wait_cost and device.type == "cuda" else ():
        if v.startswith("dmuon"):
            state, calls = runs[v][1][0]._dmuon, 2000
            sync()
            begin = time.perf_counter()
            for _ in range(calls):
                state.wait_for_step()
            print(
                f"({v}: wait_for_step {(time.perf_counter() - begin) / calls * 1e6:.1f} us a call)"
            )
    end_distributed_run()


if __name__ == "__main__":
    main()
