#!/usr/bin/env python3
"""Where a torchtitan run's host time goes per training step, from cProfile files.

torchtitan's 170M loop on one GPU is host-bound on the lent machines, and there DMuon loses
more wall-clock to AdamW than its extra GPU work (docs/benchmarks.md, twenty-second session).
A host wait shows in cProfile as time inside the call that blocks: a blocking host-to-device
copy in ``Tensor.to``, an event or stream synchronize, ``Tensor.item``. This prints, per run,
the host milliseconds per training step of the loop's parts (cumulative: a part includes what
it calls), and with two or more runs, the functions whose own time per step (``tottime``)
differs most between the first run and each other: what the second optimizer's host does
more of, waits included. cProfile slows every Python call, so absolute times run high and a
host-bound loop becomes more so; compare runs profiled alike.

    HOST_PROFILE=101-300 scripts/run/small_scale.sh OUT throughput   # OUT/NAME.prof per run
    python3 scripts/analysis/host_profile.py OUT/throughput_adamw_w_1.prof \\
        OUT/throughput_dmuon_auto_w_1.prof
"""

from __future__ import annotations

import argparse
import os
import pstats

#: (label, file suffix, function name): the loop's parts; the first matching entry of the
#: profile with the largest cumulative time is taken (one function may have several entries)
PARTS = (
    ("train_step", "torchtitan/train.py", "train_step"),
    ("zero_grad", "torchtitan/components/optimizer.py", "zero_grad"),
    ("data (next)", "torchtitan/components/dataloader.py", "__next__"),
    ("forward_backward_step", "torchtitan/train.py", "forward_backward_step"),
    ("backward (autograd)", "~", "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("clip", "dmuon_titan/titan/clip.py", "clip_grad_norm_"),
    ("clip (stock)", "torchtitan/distributed/utils.py", "clip_grad_norm_"),
    ("optimizers.step", "torchtitan/components/optimizer.py", "step"),
    ("lr_schedulers.step", "torchtitan/components/lr_scheduler.py", "step"),
    ("metrics log", "torchtitan/components/metrics.py", "log"),
    ("Tensor.to", "~", "<method 'to' of 'torch._C.TensorBase' objects>"),
    ("Tensor.item", "~", "<method 'item' of 'torch._C.TensorBase' objects>"),
    ("validate", "torchtitan/components/validate.py", "validate"),
)


def _entries(stats: pstats.Stats, suffix: str, name: str) -> list[tuple]:
    """(cumulative seconds, calls, own seconds) of every profile entry matching."""
    out = []
    for (path, _line, func), (_cc, calls, own, cumulative, _callers) in stats.stats.items():
        if func == name and (suffix == "~" and path == "~" or path.endswith(suffix)):
            out.append((cumulative, calls, own))
    return out


def summarize(path: str) -> tuple[int, dict[str, float | None], dict[tuple, float]]:
    """(training steps, milliseconds per step of each part, own seconds per step of every
    function keyed by (file, function))."""
    stats = pstats.Stats(path)
    # One LR-scheduler step per training step, whatever the gradient accumulation. (train_step's
    # own count is not used: cProfile switched on inside a call counts that call's frames
    # unreliably, e.g. 57 of 200 steps in the twenty-third session's first profiles.)
    steps = max(
        (c for _, c, _ in _entries(stats, "torchtitan/components/lr_scheduler.py", "step")),
        default=0,
    )
    per_step = max(steps, 1)
    parts: dict[str, float | None] = {}
    for label, suffix, name in PARTS:
        found = _entries(stats, suffix, name)
        parts[label] = max(c for c, _, _ in found) * 1e3 / per_step if found else None
    own: dict[tuple, float] = {}
    for (file, _line, func), (_cc, _calls, tottime, _cum, _callers) in stats.stats.items():
        key = (file if file == "~" else os.path.join(*file.split(os.sep)[-2:]), func)
        own[key] = own.get(key, 0.0) + tottime / per_step
    return steps, parts, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", help="cProfile output files (-o), one per run")
    parser.add_argument("--top", type=int, default=15, help="functions listed per comparison")
    args = parser.parse_args()
    runs = {p: summarize(p) for p in args.profiles}
    names = [os.path.basename(p).removesuffix(".prof") for p in args.profiles]
    print("Host milliseconds per training step (cumulative; cProfile on):")
    print("| part | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    print("| steps | " + " | ".join(str(runs[p][0]) for p in args.profiles) + " |")
    for label, _, _ in PARTS:
        cells = [runs[p][1][label] for p in args.profiles]
        if all(c is None for c in cells):
            continue
        print(f"| {label} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    base_name, (_, _, base) = names[0], runs[args.profiles[0]]
    for name, path in zip(names[1:], args.profiles[1:], strict=True):
        other = runs[path][2]
        keys = set(base) | set(other)
        diffs = sorted(keys, key=lambda k: -abs(other.get(k, 0.0) - base.get(k, 0.0)))
        print(f"\nOwn host time per step, {name} against {base_name} (ms; largest differences):")
        print(f"| function | {base_name} | {name} | difference |")
        print("| --- | --- | --- | --- |")
        for key in diffs[: args.top]:
            a, b = base.get(key, 0.0) * 1e3, other.get(key, 0.0) * 1e3
            print(f"| `{key[0]}:{key[1]}` | {a:.3f} | {b:.3f} | {b - a:+.3f} |")


if __name__ == "__main__":
    main()
