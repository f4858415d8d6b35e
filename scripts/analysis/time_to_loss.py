#!/usr/bin/env python3
"""Time-to-loss over seeds: for each seed, the steps (and wall-clock) a challenger needs to
reach the baseline's final validation loss, then mean and spread over seeds.

Runs are torchtitan logs named ``<optimizer>_s<seed>.log`` (``adamw_s1.log``,
``dmuon_s1.log``). Wall-clock: the runs may have shared a GPU (side by side, for the step
counts), so time is taken as steps × the training step time of each optimizer measured
alone (``--step-seconds adamw=0.055 dmuon=0.060``, e.g. from scripts/run/small_scale.sh's
throughput runs); validation time is left out of both.

    python3 scripts/analysis/time_to_loss.py OUTDIR --baseline adamw --challenger dmuon \
        --step-seconds adamw=0.055 dmuon=0.060 [--json out.json] [--png out.png]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from compare_loss import parse_log, steps_to_reach

NAME = re.compile(r"^(?P<optimizer>[A-Za-z0-9]+)_s(?P<seed>\d+)$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--baseline", default="adamw")
    parser.add_argument("--challenger", default="dmuon")
    parser.add_argument("--step-seconds", nargs="*", default=[], metavar="OPT=SECONDS")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    seconds = {k: float(v) for k, v in (item.split("=") for item in args.step_seconds)}
    runs: dict[tuple[str, int], object] = {}
    for path in sorted(args.outdir.glob("*_s*.log")):
        m = NAME.match(path.stem)
        if m:
            runs[(m["optimizer"], int(m["seed"]))] = parse_log(path)
    seeds = sorted(s for (o, s) in runs if o == args.baseline and (args.challenger, s) in runs)
    if not seeds:
        raise SystemExit(f"no seed with both {args.baseline} and {args.challenger} runs")
    rows = []
    for seed in seeds:
        base, chal = runs[(args.baseline, seed)], runs[(args.challenger, seed)]
        target, base_steps = base.final_valid, base.valid[-1][0]
        reached = steps_to_reach(chal, target)
        row = {
            "seed": seed,
            f"{args.baseline}_final_valid": target,
            f"{args.challenger}_final_valid": chal.final_valid,
            "steps": reached,
            "step_ratio": reached / base_steps if reached else None,
        }
        if reached and args.baseline in seconds and args.challenger in seconds:
            row["time_ratio"] = (reached * seconds[args.challenger]) / (
                base_steps * seconds[args.baseline]
            )
        rows.append(row)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("| " + " | ".join("---" for _ in cols) + " |")
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    summary = {}
    for key in (
        "step_ratio",
        "time_ratio",
        f"{args.baseline}_final_valid",
        f"{args.challenger}_final_valid",
    ):
        values = [r[key] for r in rows if r.get(key) is not None]
        if len(values) == len(rows):
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            summary[key] = {
                "mean": statistics.mean(values),
                "std": spread,
                "min": min(values),
                "max": max(values),
            }
            print(
                f"{key}: mean {summary[key]['mean']:.4f}, std {spread:.4f}, "
                f"range {min(values):.4f}-{max(values):.4f} over {len(values)} seeds"
            )
        elif key in ("step_ratio",):
            print(f"{key}: not reached by every seed ({len(values)} of {len(rows)})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    if args.png:
        _plot(runs, seeds, args, args.png)


def _fmt(value) -> str:
    if value is None:
        return "–"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _plot(runs, seeds, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {args.baseline: "tab:blue", args.challenger: "tab:red"}
    for (opt, seed), run in sorted(runs.items()):
        if seed in seeds and opt in colors:
            xs, ys = [v[0] for v in run.valid], [v[2] for v in run.valid]
            ax.plot(xs, ys, color=colors[opt], alpha=0.7, label=opt if seed == seeds[0] else None)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("validation loss per seed (shuffled data)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
