#!/usr/bin/env python3
"""The host time DMuon's hooks add to a forward, measured on CPU with a model small enough
that Python and dispatch dominate.

torchtitan's llama3 with 12 layers of width 64 (sequence 8, vocabulary 256) on CPU, once
plain (as AdamW trains it) and once with its matrices dedicated (one rank, DMuon's direct
path, one training step taken so that the step graph registry and the hooks are in their
steady state). The two models' no-grad forwards alternate, ``--blocks`` blocks of
``--per-block`` forwards each; medians per forward, and the difference. On one GPU the same
hooks run for every forward (torchtitan's validation, every training step), so this is
their host cost without a GPU's launch latencies (docs/benchmarks.md, twenty-third session).

    torchrun --standalone --nproc_per_node=1 scripts/bench/forward_host_cpu.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon_titan as dmuon
from dmuon_titan.exit import end_distributed_run


def build(dedicated: bool):
    from torchtitan.models.llama3 import Transformer, llama3_args

    from dmuon_titan.titan.selection import muon_predicate

    args = dataclasses.replace(
        llama3_args["debugmodel"], dim=64, n_layers=12, n_heads=4, n_kv_heads=4, vocab_size=256
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    if dedicated:
        dmuon.dedicate_params(model, init_device_mesh("cpu", (1,)), muon_predicate([], model))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if dedicated:
        optimizer = dmuon.Muon(model, lr=1e-3, adamw_lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--per-block", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    models = {"plain": build(False), "dedicated": build(True)}
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    for model, optimizer in models.values():  # one training step: the steady state
        model(tokens).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(args.blocks):
            for name, (model, _) in models.items():
                begin = time.perf_counter()
                for _ in range(args.per_block):
                    model(tokens)
                times[name].append((time.perf_counter() - begin) / args.per_block)
    plain, dedicated = (statistics.median(times[name]) * 1e6 for name in models)
    print(
        f"forward on CPU, medians of {args.blocks} blocks: plain {plain:.1f} us, dedicated "
        f"{dedicated:.1f} us, difference {dedicated - plain:+.1f} us"
    )
    end_distributed_run()


if __name__ == "__main__":
    main()
