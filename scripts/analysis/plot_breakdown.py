#!/usr/bin/env python3
"""Step-time breakdown PNG from torchtitan logs: AdamW vs DMuon, one pair of bars per setting.

Each DMuon bar is split into forward+backward (step time minus DMuon's logged optimizer time),
Newton–Schulz and the rest of the optimizer; torchtitan logs no optimizer time for AdamW, so its
bar is split with ``--adamw-optimizer-ms`` when given (e.g. the fused AdamW step that
``scripts/bench/bench_optimizer.py`` measured) and drawn whole otherwise. Needs matplotlib.

    python3 scripts/analysis/plot_breakdown.py --png breakdown.png --adamw-optimizer-ms 33.8 \\
        "seq 8192, full AC=8192:2:adamw.log:dmuon.log" "seq 2048, no AC=2048:2:a.log:d.log"
"""

from __future__ import annotations

import argparse
import sys

import titan_log_summary


def bars(setting: str, skip: int, adamw_optimizer_ms: float | None) -> list[tuple[str, dict]]:
    """[(label, {part: ms})] for one ``label=seq:batch:adamw_log:dmuon_log`` argument."""
    label, _, spec = setting.rpartition("=")
    seq, batch, adamw_log, dmuon_log = spec.split(":")
    tokens = int(seq) * int(batch)
    adamw = titan_log_summary.summarize(adamw_log, skip, tokens)
    dmuon = titan_log_summary.summarize(dmuon_log, skip, tokens)
    a_ms, d_ms = adamw["step_s"] * 1e3, dmuon["step_s"] * 1e3
    a_opt = adamw_optimizer_ms or 0.0
    d_opt, d_ns = dmuon["optimizer_ms"] or 0.0, dmuon["ns_ms"] or 0.0
    return [
        (f"{label}\nAdamW", {"forward+backward": a_ms - a_opt, "optimizer (other)": a_opt}),
        (
            f"{label}\nDMuon",
            {
                "forward+backward": d_ms - d_opt,
                "Newton-Schulz": d_ns,
                "optimizer (other)": d_opt - d_ns,
            },
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", help="label=seq:batch:adamw_log:dmuon_log")
    parser.add_argument("--png", required=True)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    parser.add_argument("--adamw-optimizer-ms", type=float, default=None)
    parser.add_argument("--title", default="torchtitan llama3-8B step time, AdamW vs DMuon")
    args = parser.parse_args()
    rows = [b for s in args.settings for b in bars(s, args.skip, args.adamw_optimizer_ms)]
    for label, parts in rows:
        text = ", ".join(f"{k} {v:.0f} ms" for k, v in parts.items())
        print(f"{label.replace(chr(10), ' ')}: {text}")
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit(f"no plot ({err}); pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "forward+backward": "tab:gray",
        "Newton-Schulz": "tab:red",
        "optimizer (other)": "tab:orange",
    }
    fig, ax = plt.subplots(figsize=(2.2 * len(rows) + 2, 5))
    for i, (_, parts) in enumerate(rows):
        bottom = 0.0
        for part, ms in parts.items():
            ax.bar(i, ms, bottom=bottom, color=colors[part], label=part if i < 2 else None)
            if ms > 25:
                ax.text(i, bottom + ms / 2, f"{ms:.0f}", ha="center", va="center", fontsize=8)
            bottom += ms
        ax.text(i, bottom, f"{bottom:.0f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylabel("ms per step (median)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"plot: {args.png}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
