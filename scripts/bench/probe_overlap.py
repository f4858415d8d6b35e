#!/usr/bin/env python3
"""Probe: where can Newton–Schulz hide behind the model's own work on one GPU?

Not DMuon's code: the momentum step, Newton–Schulz and update of the blocks' matrices are
captured as CUDA graphs (one per stage of consecutive blocks), and the variants differ only in
where those graphs are replayed:

- ``seq``: one graph of all blocks, after backward and clipping, on the compute stream (what
  ``Muon(async_step=False)`` does);
- ``next[:n1/n2/...]``: one graph per stage (default: one block each; ``next:12`` is one
  stage of 12 blocks, what ``async_step=True`` does) on a side stream, each block's next
  forward waiting for its stage's event (exact: a matrix is updated before it is next read);
- ``next_hi``: ``next`` with the side stream at high priority;
- ``bwd``: one graph per block on a side stream as soon as the block's gradients are complete
  in backward (an upper bound only: it ignores gradient clipping, which needs every gradient).

``--h2d`` copies each batch from the host with a blocking copy, as torchtitan's trainer does
(the host then waits for everything queued on the compute stream). Interleaved in blocks of
steps like bench_small_interleaved.py; prints median step times, ratios to fused AdamW, and
each variant's graphs timed alone.

    torchrun --standalone --nproc_per_node=1 scripts/bench/probe_overlap.py --algorithm auto --h2d
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dmuon_titan import newton_schulz
from dmuon_titan.toy.flavors import add_flavors

MODES = ("adamw", "seq", "next", "next:1/1/2/4/4", "next:12")  # also: next_hi, bwd


class BlockStep:
    """Momentum + NS + update (+ zeroing the gradients) of one block's matrices, captured."""

    def __init__(self, params, algorithm: str, lr: float = 2e-3) -> None:
        self.params = params
        self.buffers = [torch.zeros_like(p) for p in params]
        self.algorithm, self.lr = algorithm, lr
        self.graph = None
        self.calls = 0

    def body(self) -> None:
        by_shape: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        for shape, idx in by_shape.items():
            batch = torch.empty((len(idx), *shape), dtype=torch.bfloat16, device="cuda")
            grads = [self.params[i].grad for i in idx]
            bufs = [self.buffers[i] for i in idx]
            torch._foreach_lerp_(bufs, grads, 0.05)
            for j, (g, b) in enumerate(zip(grads, bufs, strict=True)):
                batch[j].copy_(g.lerp(b, 0.95))
            ortho = newton_schulz.orthogonalize(
                batch,
                newton_schulz.normalize_coefficients("jordan"),
                5,
                1e-7,
                torch.bfloat16,
                self.algorithm,
                overwrite_input=True,
            )
            scale = -self.lr * max(1.0, shape[0] / shape[1]) ** 0.5
            ps = [self.params[i].data for i in idx]
            torch._foreach_mul_(ps, 1 - self.lr * 0.1)
            torch._foreach_add_(ps, list(ortho.float().mul_(scale).unbind(0)))
            torch._foreach_zero_(grads)

    def run(self) -> None:
        self.calls += 1
        if self.calls == 1:
            self.body()
            return
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.graph.capture_begin(capture_error_mode="thread_local")
                self.body()
                self.graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
        self.graph.replay()


class Run:
    def __init__(self, mode: str, flavor: str, algorithm: str) -> None:
        mode, _, stages = mode.partition(":")
        from torchtitan.models.llama3 import Transformer, llama3_args

        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(llama3_args[flavor])
        model.to_empty(device="cuda")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cuda"))
        self.model, self.mode = model, mode
        blocks = list(model.layers.values())
        matrices = [[p for p in b.parameters() if p.ndim == 2] for b in blocks]
        chosen = {id(p) for ps in matrices for p in ps}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        if mode == "adamw":
            rest = list(model.parameters())
            self.steps = []
        else:
            counts = [int(c) for c in stages.split("/")] if stages else [1] * len(blocks)
            if mode == "seq":
                counts = [len(blocks)]
            assert sum(counts) == len(blocks), counts
            self.steps, self.stage_of, start = [], [], 0
            for n in counts:
                ps = [p for b in range(start, start + n) for p in matrices[b]]
                self.steps.append(BlockStep(ps, algorithm))
                self.stage_of += [len(self.steps) - 1] * n
                start += n
        self.adamw = torch.optim.AdamW(rest, lr=5e-4, betas=(0.9, 0.95), fused=True)
        self.rest = rest
        self.events = [torch.cuda.Event() for _ in range(max(len(self.steps), 1))]
        priority = -1 if mode == "next_hi" else 0
        self.side = torch.cuda.Stream(priority=priority)
        if mode in ("next", "next_hi", "bwd"):
            for i, b in enumerate(blocks):
                b.register_forward_pre_hook(self._waiter(i))
        if mode == "bwd":
            self.pending = [0] * len(blocks)
            for i, ps in enumerate(matrices):
                for p in ps:
                    p.register_post_accumulate_grad_hook(self._arrival(i))

    def _waiter(self, i: int):
        def hook(_module, _args):
            torch.cuda.current_stream().wait_event(self.events[self.stage_of[i]])

        return hook

    def _arrival(self, i: int):
        def hook(_param):
            self.pending[i] += 1
            if self.pending[i] == len(self.steps[i].params):
                self.pending[i] = 0
                self._launch(i)

        return hook

    def _launch(self, i: int) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.steps[i].run()
            self.events[i].record(self.side)

    def step(self, tokens, autocast) -> None:
        if tokens.device.type == "cpu":  # torchtitan's copy: the host waits for the stream
            tokens = tokens.to("cuda")
        with autocast:
            logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if self.mode != "bwd":
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        else:
            torch.nn.utils.clip_grad_norm_(self.rest, 1.0, foreach=True)
        if self.mode == "seq":
            for s in self.steps:
                s.run()
        elif self.mode in ("next", "next_hi"):
            for i in range(len(self.steps)):
                self._launch(i)
        self.adamw.step()
        self.adamw.zero_grad()
        if self.mode == "bwd":
            for ev in self.events:  # the graphs zero their gradients: before the next backward
                torch.cuda.current_stream().wait_event(ev)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavor", default="170M")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--h2d", action="store_true", help="batches copied from the host each step")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    add_flavors()
    modes = args.modes.split(",")
    runs = {m: Run(m, args.flavor, args.algorithm) for m in modes}
    vocab = runs[modes[0]].model.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(
            "cpu" if args.h2d else "cuda"
        )
        for _ in range(args.block)
    ]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    times = {m: [] for m in modes}
    for r in range(2 + args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for m in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for tokens in batches:
                runs[m].step(tokens, autocast)
            torch.cuda.synchronize()
            if r >= 2:
                times[m].append((time.perf_counter() - t0) / args.block)
    base = statistics.median(times["adamw"]) if "adamw" in times else None
    print(
        f"llama3 {args.flavor}, NS {args.algorithm}, {args.batch * args.seq} tokens a step, "
        f"batches {'copied from the host' if args.h2d else 'on the GPU'}"
    )
    for m in modes:
        t = statistics.median(times[m])
        ratio = f"{base / t:.3f}" if base else "-"
        alone = "-"
        if runs[m].steps:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                for s in runs[m].steps:
                    s.graph.replay()
            torch.cuda.synchronize()
            alone = f"{(time.perf_counter() - t0) / 20 * 1e3:.2f}"
        print(f"{m:16s} {t * 1e3:7.2f} ms  vs AdamW {ratio}  (its NS graphs alone: {alone} ms)")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
