#!/usr/bin/env python3
"""Host time per phase of torchtitan's training step, without a profiler.

A small model's step on one GPU is host-bound: the step takes as long as Python takes to
launch it, and whatever an optimizer adds on the host adds to the step. The profiler's own
overhead distorts exactly that, so this wraps torchtitan's ``Trainer`` with wall-clock
timers (no synchronization added) and prints, per phase, the median host milliseconds a
step over the steps after ``--warmup`` (validation steps and the one after them left out):

- ``zero_grad``, ``fetch`` (the next batch from the loader), ``forward`` (the model's call,
  every forward hook included), ``backward`` (loss and ``loss.backward()``), ``clip``,
  ``optimizer``, ``lr``; ``other`` is the rest of ``train_step`` (the batch's host-to-device
  copies, which wait for the compute stream, and the logging);
- ``step``: ``train_step`` whole; ``wall``: from one ``train_step``'s start to the next's
  (the loop's checkpoint call and garbage collection included).

Usage (torchtitan's own arguments after the script's)::

    torchrun --standalone --nproc_per_node=1 scripts/bench/titan_host_phases.py \
        [--warmup 20] [--json OUT.json] --job.config_file configs/llm170m_dmuon.toml \
        --training.steps 150 --validation.no-enable
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

PHASES = ("zero_grad", "fetch", "forward", "backward", "clip", "optimizer", "lr", "other")


class PhaseClock:
    """Per-step host milliseconds of each phase; ``steps[i]`` holds step ``i + 1``'s."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.step_starts: list[float] = []
        self.skipped: set[int] = set()

    def add(self, phase: str, seconds: float) -> None:
        if self.current is not None:
            self.current[phase] = self.current.get(phase, 0.0) + 1e3 * seconds

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)

        return wrapper

    def summary(self, warmup: int) -> tuple[int, dict[str, float]]:
        """(steps counted, median ms per phase) over the steps after ``warmup`` but those
        :attr:`skipped`."""
        rows = defaultdict(list)
        for index, phases in enumerate(self.steps):
            step = index + 1
            if step <= warmup or step in self.skipped:
                continue
            for phase in (*PHASES, "step"):
                rows[phase].append(phases.get(phase, 0.0))
            if index + 1 < len(self.step_starts):
                rows["wall"].append(1e3 * (self.step_starts[index + 1] - self.step_starts[index]))
        medians = {phase: statistics.median(values) for phase, values in rows.items() if values}
        return len(rows["step"]), medians


def install(clock: PhaseClock) -> None:
    """Wrap torchtitan's trainer, optimizer and scheduler containers with ``clock``."""
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.train as titan_train
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer

    Trainer = titan_train.Trainer
    OptimizersContainer.zero_grad = clock.timed("zero_grad", OptimizersContainer.zero_grad)
    OptimizersContainer.step = clock.timed("optimizer", OptimizersContainer.step)
    LRSchedulersContainer.step = clock.timed("lr", LRSchedulersContainer.step)

    stock_generator = Trainer.batch_generator

    def batch_generator(self, data_iterable):
        inner = stock_generator(self, data_iterable)
        while True:
            start = time.perf_counter()
            try:
                batch = next(inner)
            finally:
                clock.add("fetch", time.perf_counter() - start)
            yield batch

    Trainer.batch_generator = batch_generator

    stock_forward_backward = Trainer.forward_backward_step

    def forward_backward_step(self, **kwargs):
        # (the model's forward hooks below time ``forward``; the rest of this is backward's)
        forward_before = clock.current.get("forward", 0.0) if clock.current else 0.0
        start = time.perf_counter()
        try:
            return stock_forward_backward(self, **kwargs)
        finally:
            forward = clock.current.get("forward", 0.0) - forward_before if clock.current else 0.0
            clock.add("backward", time.perf_counter() - start - forward / 1e3)

    Trainer.forward_backward_step = forward_backward_step

    stock_train_step = Trainer.train_step

    def train_step(self, data_iterator):
        if not getattr(self, "_phase_hooks", False):
            self._phase_hooks = True
            # (the plugin may replace clip_grad_norm_ after import: wrap what is there now)
            dist_utils.clip_grad_norm_ = clock.timed("clip", dist_utils.clip_grad_norm_)
            marks = {}

            def before(_module, _args):
                marks["start"] = time.perf_counter()

            def after(_module, _args, _output):
                clock.add("forward", time.perf_counter() - marks.pop("start"))

            for part in self.model_parts:
                part.register_forward_pre_hook(before, prepend=True)
                part.register_forward_hook(after, always_call=True)
        validates = self.job_config.validation.enable and (
            self.step % self.job_config.validation.freq == 0
        )
        if validates:  # this step and the one after it
            clock.skipped.update({self.step, self.step + 1})
        clock.current = {}
        start = time.perf_counter()
        clock.step_starts.append(start)
        try:
            return stock_train_step(self, data_iterator)
        finally:
            phases = clock.current
            phases["step"] = 1e3 * (time.perf_counter() - start)
            phases["other"] = phases["step"] - sum(phases.get(p, 0.0) for p in PHASES)
            clock.steps.append(phases)
            clock.current = None

    Trainer.train_step = train_step


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default=None)
    args, rest = parser.parse_known_args()
    # (before torchtitan is imported: its parser binds sys.argv[1:] as a default at import)
    sys.argv[1:] = rest
    clock = PhaseClock()
    install(clock)
    import torchtitan.train as titan_train

    titan_train.main(titan_train.Trainer)
    if os.environ.get("RANK", "0") != "0":
        return
    counted, summary = clock.summary(args.warmup)
    print(f"host ms per step, medians over {counted} steps after step {args.warmup}:")
    print(" ".join(f"{phase}={summary.get(phase, 0.0):.2f}" for phase in (*PHASES, "step", "wall")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "steps": clock.steps}, f)


if __name__ == "__main__":
    main()
