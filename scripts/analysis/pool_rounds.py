#!/usr/bin/env python3
"""Pool paired torchtitan throughput rounds: per-round ratios to AdamW and what they can say.

Reads the summaries that ``scripts/run/small_scale.sh OUT throughput`` writes (the tables of
``titan_log_summary.py``: one row per run, named ``throughput_<variant>_<round>.log``). In each
file a round pairs every variant's run with the baseline's run of the same round number
(``--baseline``, AdamW's by default; ``adamw_w`` for the runs with a data-loader worker); a
round without the baseline's run, or a variant without its run, is left out. Prints one row per round, then
per variant the median and mean ratio, how many rounds reach ``--threshold``, a seeded
bootstrap interval of the median, and a one-sided sign test of "a round reaches the threshold
more often than not" (the chance of that many or more under a coin flip).

    python3 scripts/analysis/pool_rounds.py OUT1/throughput.md OUT2/throughput.md
    python3 scripts/analysis/pool_rounds.py OUT/throughput.md --baseline adamw_w
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
from pathlib import Path

RUN = re.compile(r"throughput_([a-z0-9_]+?)_(\d+)\.log$")


def read_runs(path: Path) -> dict[tuple[str, int], float]:
    """(variant, round) → training tok/s of the runs listed in one summary table."""
    runs: dict[tuple[str, int], float] = {}
    header: list[str] | None = None
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if "tok/s/device" in cells:
                header = cells
            continue
        if len(cells) != len(header) or set(cells[0]) <= {"-", " "}:
            continue
        match = RUN.search(cells[0])
        if match is None:
            continue
        key = (match.group(1), int(match.group(2)))
        if key in runs:
            raise SystemExit(f"{path}: run {cells[0]} listed twice")
        runs[key] = float(cells[header.index("tok/s/device")].replace(",", ""))
    return runs


def paired_rounds(paths: list[Path], baseline: str = "adamw") -> list[dict]:
    """One record per (file, round): the baseline's tok/s (``"base"``) and every other
    variant's ratio to it (by the variant's name)."""
    rounds = []
    for path in paths:
        runs = read_runs(path)
        for number in sorted({r for v, r in runs if v == baseline}):
            base = runs[(baseline, number)]
            ratios = {v: t / base for (v, r), t in runs.items() if r == number and v != baseline}
            if ratios:
                rounds.append({"file": str(path), "round": number, "base": base, **ratios})
    return rounds


def bootstrap_median(values: list[float], resamples: int, seed: int) -> tuple[float, float]:
    """2.5 and 97.5 percentiles of the median over ``resamples`` resamples with replacement."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def sign_test(reached: int, n: int) -> float:
    """P(at least ``reached`` of ``n`` fair coin flips come up heads)."""
    return sum(math.comb(n, k) for k in range(reached, n + 1)) / 2**n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="+", type=Path)
    parser.add_argument(
        "--baseline", default="adamw", help="the variant the others are paired with"
    )
    parser.add_argument("--threshold", type=float, default=0.90)
    parser.add_argument("--resamples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rounds = paired_rounds(args.summaries, args.baseline)
    variants = sorted({k for r in rounds for k in r} - {"file", "round", "base"})
    print(f"| summary | round | {args.baseline} tok/s | " + " | ".join(variants) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in variants) + " |")
    for r in rounds:
        cells = [f"{r[v]:.3f}" if v in r else "-" for v in variants]
        print(f"| {r['file']} | {r['round']} | {r['base']:,.0f} | " + " | ".join(cells) + " |")
    print()
    print(
        f"| variant | rounds | median | mean | rounds ≥ {args.threshold:.2f} | 95 % bootstrap "
        "interval of the median | sign test p | range |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for v in variants:
        values = [r[v] for r in rounds if v in r]
        low, high = bootstrap_median(values, args.resamples, args.seed)
        reached = sum(x >= args.threshold for x in values)
        print(
            f"| {v} | {len(values)} | {statistics.median(values):.3f} | "
            f"{statistics.mean(values):.3f} | {reached} | {low:.3f}–{high:.3f} | "
            f"{sign_test(reached, len(values)):.2f} | {min(values):.3f}–{max(values):.3f} |"
        )


if __name__ == "__main__":
    main()
