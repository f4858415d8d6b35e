#!/usr/bin/env python3
"""Compare the loss curves of torchtitan runs (AdamW vs DMuon, optionally an LR sweep).

Reads each run's torchtitan log (the rank-0 console output): training loss per logged step,
validation loss per validation, and the wall-clock time of each from the log timestamps.
Writes a PNG (train and validation loss vs steps and vs wall-clock; final validation loss vs
learning rate when there is a sweep) and prints a markdown table: for every learning rate, each
optimizer's final validation loss and the first step at which the challenger's validation loss
reaches the baseline's final one (linear interpolation between validations).

A run is named ``<optimizer>_lr<lr>`` by its log's file name (``adamw_lr0.002.log``), or given
as ``label=path``.

    python3 scripts/analysis/compare_loss.py runs/*.log --baseline adamw --png loss.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import titan_logs

NAME = re.compile(r"^(?P<optimizer>[A-Za-z0-9]+)_lr(?P<lr>[0-9.eE+-]+)$")


@dataclass
class Run:
    label: str
    optimizer: str
    lr: float | None
    train: list[tuple[int, float, float]] = field(default_factory=list)  # step, seconds, loss
    valid: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def final_valid(self) -> float:
        return self.valid[-1][2] if self.valid else math.nan


def parse_log(path: Path, label: str | None = None) -> Run:
    """Parse one torchtitan log into a Run; seconds count from the first training step."""
    name = label or path.stem
    m = NAME.match(name)
    run = Run(name, m["optimizer"] if m else name, float(m["lr"]) if m else None)
    start = None
    for line in titan_logs.lines(path):
        when = titan_logs.timestamp(line)
        if when is None:
            continue
        if vm := titan_logs.VALID.search(line):
            series, step, loss = run.valid, int(vm.group(1)), float(vm.group(2))
        elif tm := titan_logs.TRAIN.search(line):
            series, step, loss = run.train, int(tm.group(1)), float(tm.group(2))
        else:
            continue
        if start is None:
            start = when
        series.append((step, when - start, loss))
    if not run.train:
        raise SystemExit(f"{path}: no training steps found (is it a torchtitan log?)")
    return run


def steps_to_reach(run: Run, target: float, axis: int = 0) -> float | None:
    """First (interpolated) step (``axis=0``) or second (``axis=1``) at which ``run``'s
    validation loss is <= ``target``."""
    prev = None
    for point in run.valid:
        x, loss = point[axis], point[2]
        if loss <= target:
            if prev is None:  # already at or below the target at the first validation
                return float(x)
            (x0, l0) = prev
            return x0 + (x - x0) * (l0 - target) / (l0 - loss)
        prev = (x, loss)
    return None


def compare(runs: list[Run], baseline: str) -> list[dict]:
    """One row per learning rate (or per challenger when runs carry no lr)."""
    base = {r.lr: r for r in runs if r.optimizer == baseline}
    if not base:
        raise SystemExit(
            f"no run of the baseline optimizer {baseline!r} among {[r.label for r in runs]}"
        )
    rows = []
    for run in runs:
        if run.optimizer == baseline:
            continue
        # Same lr if the baseline ran it, else the baseline's best run (said in the row).
        ref = base.get(run.lr) or best_of(runs, baseline) or next(iter(base.values()))
        reached = steps_to_reach(run, ref.final_valid)
        ref_steps = ref.valid[-1][0] if ref.valid else None
        rows.append(
            {
                "lr": run.lr,
                "baseline": ref.label,
                "challenger": run.label,
                "baseline_final_valid": ref.final_valid,
                "challenger_final_valid": run.final_valid,
                "baseline_steps": ref_steps,
                "challenger_steps_to_baseline_final": reached,
                "step_ratio": reached / ref_steps if reached and ref_steps else None,
                "baseline_seconds": ref.valid[-1][1] if ref.valid else None,
                "challenger_seconds": run.valid[-1][1] if run.valid else None,
            }
        )
    return rows


def best_of(runs: list[Run], optimizer: str) -> Run | None:
    mine = [r for r in runs if r.optimizer == optimizer and r.valid]
    return min(mine, key=lambda r: r.final_valid) if mine else None


def print_table(runs: list[Run], rows: list[dict], baseline: str) -> None:
    fmt = lambda v, f="{:.4f}": "-" if v is None or v != v else f.format(v)  # noqa: E731
    print(
        "| lr | baseline final val | challenger final val | challenger steps to baseline final "
        "| / baseline steps | seconds to the last validation, baseline / challenger |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {fmt(r['lr'], '{:g}')} | {r['baseline']}: {fmt(r['baseline_final_valid'])} "
            f"| {r['challenger']}: {fmt(r['challenger_final_valid'])} "
            f"| {fmt(r['challenger_steps_to_baseline_final'], '{:.0f}')} of {r['baseline_steps']} "
            f"| {fmt(r['step_ratio'], '{:.2f}')} "
            f"| {fmt(r['baseline_seconds'], '{:.0f}')} / {fmt(r['challenger_seconds'], '{:.0f}')} |"
        )
    optimizers = sorted({r.optimizer for r in runs}, key=lambda o: (o != baseline, o))
    bests = {o: best_of(runs, o) for o in optimizers}
    if all(bests.values()) and len(bests) > 1:
        ref = bests[baseline]
        for o, run in bests.items():
            if o == baseline:
                continue
            reached = steps_to_reach(run, ref.final_valid)
            secs = steps_to_reach(run, ref.final_valid, axis=1)
            ratio = f"{reached / ref.valid[-1][0]:.2f}" if reached else "not reached"
            wall = f"{secs:.0f} s of {ref.valid[-1][1]:.0f} s" if secs else "not reached"
            print(
                f"\nbest vs best: {run.label} ({run.final_valid:.4f}) reaches {ref.label}'s final "
                f"validation loss {ref.final_valid:.4f} at step "
                f"{'-' if reached is None else f'{reached:.0f}'} of {ref.valid[-1][0]} "
                f"(ratio {ratio}); wall-clock {wall}"
            )
        print(
            "\nfinal validation loss: " + ", ".join(f"{r.label} {r.final_valid:.4f}" for r in runs)
        )


def ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def plot(runs: list[Run], baseline: str, path: Path, title: str, smooth: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({r.lr for r in runs if r.lr is not None})
    sweep = len(lrs) > 1
    fig, grid = plt.subplots(2, 3, figsize=(18, 9.5))
    (train_steps, valid_steps, extra), (train_secs, valid_secs, legend_ax) = grid
    colors: dict[str, str] = {baseline: "tab:blue"}
    palette = iter(["tab:red", "tab:green", "tab:purple", "tab:orange"])
    shades = {lr: 0.35 + 0.65 * i / max(1, len(lrs) - 1) for i, lr in enumerate(lrs)}
    lowest = math.inf
    for run in runs:
        if run.optimizer not in colors:
            colors[run.optimizer] = next(palette)
        alpha = shades.get(run.lr, 1.0) if sweep else 1.0
        style = dict(color=colors[run.optimizer], alpha=alpha, label=run.label, lw=1.4)
        steps, secs, loss = zip(*run.train, strict=True)
        smoothed = ema(list(loss), smooth)
        lowest = min(lowest, *smoothed)
        train_steps.plot(steps, smoothed, **style)
        train_secs.plot(secs, smoothed, **style)
        if run.valid:
            vsteps, vsecs, vloss = zip(*run.valid, strict=True)
            lowest = min(lowest, *vloss)
            valid_steps.plot(vsteps, vloss, marker=".", **style)
            valid_secs.plot(vsecs, vloss, marker=".", **style)
    finals = [r.final_valid for r in runs if r.valid] or [lowest]
    for ax, xl, yl in (
        (train_steps, "step", f"train loss (EMA {smooth})"),
        (valid_steps, "step", "validation loss"),
        (train_secs, "wall-clock (s)", f"train loss (EMA {smooth})"),
        (valid_secs, "wall-clock (s)", "validation loss"),
    ):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        # The range where the curves separate: from the lowest point to 1.0 above the worst final.
        ax.set_ylim(lowest - 0.05, max(finals) + 1.0)
    handles, labels = valid_steps.get_legend_handles_labels()
    legend_ax.axis("off")
    legend_ax.legend(handles, labels, loc="center", fontsize=10)
    if sweep:
        for opt, color in colors.items():
            pts = sorted((r.lr, r.final_valid) for r in runs if r.optimizer == opt and r.valid)
            if pts:
                extra.plot(*zip(*pts, strict=True), marker="o", color=color, label=opt)
        extra.set_xscale("log")
        extra.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
        extra.minorticks_off()
        extra.set_xlabel("learning rate")
        extra.set_ylabel("final validation loss")
        extra.grid(alpha=0.3)
        extra.legend(fontsize=9)
    else:
        extra.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="torchtitan logs, or label=path")
    parser.add_argument("--baseline", default="adamw", help="optimizer name of the baseline runs")
    parser.add_argument("--png", help="write the plot here (needs matplotlib)")
    parser.add_argument("--title", default="DMuon vs AdamW")
    parser.add_argument("--smooth", type=float, default=0.8, help="EMA factor of train loss")
    parser.add_argument("--json", help="write the comparison rows here")
    args = parser.parse_args()
    runs = []
    for item in args.logs:
        label, _, path = item.rpartition("=")
        runs.append(parse_log(Path(path), label or None))
    runs.sort(key=lambda r: (r.optimizer != args.baseline, r.optimizer, r.lr or 0.0))
    rows = compare(runs, args.baseline)
    print_table(runs, rows, args.baseline)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.png:
        try:
            plot(runs, args.baseline, Path(args.png), args.title, args.smooth)
            print(f"\nplot: {args.png}")
        except ImportError as err:
            print(f"\nno plot ({err}); pip install matplotlib")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
