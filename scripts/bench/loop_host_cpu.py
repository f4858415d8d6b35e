#!/usr/bin/env python3
"""The host time DMuon adds to parts of torchtitan's loop on one rank, measured on CPU with a
model small enough that Python and dispatch dominate.

torchtitan's llama3 with 12 layers of width 64 (sequence 8, vocabulary 256; the 170M
flavor's 111 parameters) on CPU, once plain (as AdamW trains it) and once with its matrices
dedicated (one rank, DMuon's direct path, one training step taken so that the step graph
registry and the hooks are in their steady state). Parts:

- ``forward``: a no-grad forward, as torchtitan's validation runs it (the root's hooks run
  in every forward; since the twenty-fourth session the boundaries' waits only while a step
  may be in flight, never on CPU);
- ``armed``: a training forward (grad enabled, no backward) while a step is in flight, as
  torchtitan's forward right after an asynchronous step runs: the root and every block wait
  for it (a stand-in step that never ends, whose wait does nothing; never the case on CPU
  otherwise);
- ``clip``: torchtitan's ``clip_grad_norm_`` over the model's parameters, as its trainer
  calls it (DMuon's replaces it: the global norm, the owned gradients' factor left to the
  step, which is dropped here as the step would take it).

The plain and dedicated runs of a part alternate, ``--blocks`` blocks of ``--per-block``
calls each; medians per call, and the difference: host cost without a GPU's launch latencies
(docs/benchmarks.md, twenty-third and twenty-fourth sessions).

    torchrun --standalone --nproc_per_node=1 scripts/bench/loop_host_cpu.py [--parts forward,armed,clip]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torchtitan.distributed.utils as dist_utils
from torch.distributed.device_mesh import init_device_mesh

import dmuon_titan as dmuon
from dmuon_titan.exit import end_distributed_run
from dmuon_titan.runtime.state import STATE_ATTR
from dmuon_titan.titan.clip import install_clip


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
    parser.add_argument("--parts", default="forward,clip")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    install_clip()  # as the DMuon converter does; plain models keep torchtitan's own clip
    models = {"plain": build(False), "dedicated": build(True)}
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    for model, optimizer in models.values():  # one training step: the steady state
        model(tokens).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        model(tokens).float().sum().backward()  # gradients for the clip

    def forward(model: torch.nn.Module) -> None:
        with torch.no_grad():
            model(tokens)

    def armed(model: torch.nn.Module) -> None:
        model(tokens)

    def clip(model: torch.nn.Module) -> None:
        dist_utils.clip_grad_norm_(list(model.parameters()), 1e-3, 2.0, foreach=True)
        state = getattr(model, STATE_ATTR, None)
        if state is not None:
            state.drop_deferred_grad_scale()  # (the step applies it)

    class StepInFlight:
        """Stands in for an asynchronous step that is still running (no ``in_flight``)."""

        def wait(self) -> None:
            pass

    in_flight = StepInFlight()
    state = getattr(models["dedicated"][0], STATE_ATTR)
    for part in args.parts.split(","):
        call = {"forward": forward, "armed": armed, "clip": clip}[part]
        if part == "armed":
            state.step_graphs.add(in_flight)
            state.arm_step_waits()
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.blocks):
            for name, (model, _) in models.items():
                begin = time.perf_counter()
                for _ in range(args.per_block):
                    call(model)
                times[name].append((time.perf_counter() - begin) / args.per_block)
        plain, dedicated = (statistics.median(times[name]) * 1e6 for name in models)
        print(
            f"{part} on CPU, medians of {args.blocks} blocks: plain {plain:.1f} us, dedicated "
            f"{dedicated:.1f} us, difference {dedicated - plain:+.1f} us"
        )
        if part == "armed":
            state.step_graphs.refs = [r for r in state.step_graphs.refs if r() is not in_flight]
            state.disarm_step_waits()
    end_distributed_run()


if __name__ == "__main__":
    main()
