#!/usr/bin/env python3
"""Experiment: what the captured step's lanes cost in GPU memory, one setting per process.

torchtitan logs the peak of the caching allocator's reserved memory; at 170M it logged 9.7
GiB for DMuon ``auto`` against AdamW's 8.0 in the twentieth session, where the tenth logged
8.1. Two suspects: the lanes' first (eager) step, whose side-stream allocations stay cached
for that stream alone (since ``b8471da`` that step runs on one stream), and the capture
itself, where two chunks' Newton–Schulz buffers are alive at once instead of one. Each
process trains ``bench_small_interleaved.py``'s model for ``--steps`` steps (bf16 autocast,
clip 1.0, batches on the GPU) with ``muon.STEP_LANES`` = ``--lanes``, then
prints one line: the peaks of reserved and allocated memory and the GPU time of the last
steps. Run the settings one after another:

    for a in "adamw" "dmuon_auto --lanes 1" "dmuon_auto --lanes 2"; do
        torchrun --standalone --nproc_per_node=1 scripts/bench/exp_step_memory.py --variant $a
    done
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_optimizer import clip  # (this directory: the script's own on sys.path)
from bench_small_interleaved import build

from dmuon_titan import muon
from dmuon_titan.exit import end_distributed_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="dmuon_auto", help="bench_small_interleaved's")
    parser.add_argument("--flavor", default="170M")
    parser.add_argument("--lanes", type=int, default=muon.STEP_LANES)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    muon.STEP_LANES = args.lanes
    model, optimizers = build(args.variant, args.flavor, device, 2e-3, 5e-4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (args.batch, args.seq + 1), generator=generator).to(
        device
    )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    timed = max(1, args.steps // 3)
    start = end = None
    for step in range(args.steps):
        if device.type == "cuda" and step == args.steps - timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        clip(model, args.variant, 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    ms = float("nan")
    if device.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / timed
    gib = 2**30
    reserved = torch.cuda.max_memory_reserved() / gib if device.type == "cuda" else float("nan")
    allocated = torch.cuda.max_memory_allocated() / gib if device.type == "cuda" else float("nan")
    print(f"| {args.variant} | {args.lanes} | {reserved:.2f} | {allocated:.2f} | {ms:.2f} |")
    end_distributed_run()


if __name__ == "__main__":
    main()
