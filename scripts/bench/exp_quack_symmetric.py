#!/usr/bin/env python3
"""Experiment: quack-kernels' symmetric GEMM (CUTLASS DSL, Hopper) against DMuon's Triton
kernel and cuBLAS's full product, on the products Newton–Schulz asks for at 170M and 8B.

The symmetric kernel is 58 % of the 170M captured step, and on products with an inner size
of 1024 it runs at 420–475 TFLOP/s on the FLOPs it executes, against 725–755 for cuBLAS
(docs/benchmarks.md, sixteenth session). A CUTLASS-grade kernel (TMA, clusters, warp
specialization) over the upper tiles is the candidate. Not a dependency: this only measures.

Cases (batch x rows x inner): X·Xᵀ, and the polynomial's ``bA + cA²`` of a symmetric A (the
product with an addend). Each variant is timed as a CUDA graph of ``--calls`` calls where it captures
(``timing.graph_median_milliseconds``), the variants interleaved round by round; each result
is checked against a float32 product (relative Frobenius error) and, for quack, for symmetry.

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD \\
        python3 scripts/bench/exp_quack_symmetric.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import traceback

import torch

from dmuon_titan import symmetric
from dmuon_titan.timing import graph_median_milliseconds

CASES = {  # name: (batch, rows, inner, with addend)
    "48 X·Xᵀ 1024x1024": (48, 1024, 1024, False),
    "48 bA+cA² 1024²": (48, 1024, 1024, True),
    "36 X·Xᵀ 1024x1024": (36, 1024, 1024, False),
    "36 X·Xᵀ 1024x2816": (36, 1024, 2816, False),
    "32 X·Xᵀ 1024x4096": (32, 1024, 4096, False),
    "8 X·Xᵀ 4096x4096": (8, 4096, 4096, False),
}
B_COEF, C_COEF = -4.7750, 2.0315


def variants(quack_symmetric):
    """name -> fn(x, addend) returning the product (c·x·xᵀ + b·addend with an addend)."""

    def cublas(x, addend):
        if addend is None:
            return torch.bmm(x, x.mT)
        return torch.baddbmm(addend, x, x.mT, beta=B_COEF, alpha=C_COEF)

    def triton_kernel(x, addend):
        if addend is None:
            return symmetric.symmetric_mm(x, x.mT)
        return symmetric.symmetric_mm(x, x.mT, addend=addend, alpha=C_COEF, beta=B_COEF)

    out = {"cuBLAS full": cublas, "DMuon Triton": triton_kernel}
    if quack_symmetric is not None:

        def quack(x, addend):
            if addend is None:
                return quack_symmetric(x, x.mT)
            return quack_symmetric(x, x.mT, C=addend, alpha=C_COEF, beta=B_COEF)

        out["quack"] = quack
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    try:
        from quack.gemm_interface import gemm_symmetric as quack_symmetric
    except Exception:  # (report why, measure the rest)
        traceback.print_exc()
        quack_symmetric = None
    fns = variants(quack_symmetric)
    torch.manual_seed(0)
    inputs = {}
    for name, (batch, rows, inner, with_addend) in CASES.items():
        x = torch.randn(batch, rows, inner, device=device, dtype=torch.bfloat16) / inner**0.5
        if with_addend:  # A symmetric, as NS's Gram matrix
            x = (x @ x.mT).to(torch.bfloat16)
        inputs[name] = (x, x if with_addend else None)
    errors, times = {}, {(c, v): [] for c in CASES for v in fns}
    for case, (x, addend) in inputs.items():
        exact = (x.float() @ x.float().mT) * (C_COEF if addend is not None else 1.0)
        if addend is not None:
            exact += B_COEF * addend.float()
        for variant, fn in fns.items():
            try:
                got = fn(x, addend).float()
                rel = ((got - exact).norm() / exact.norm()).item()
                asym = (got - got.mT).abs().max().item()
                errors[(case, variant)] = f"{rel:.1e} (asym {asym:.0e})"
            except Exception as e:  # (one variant failing leaves the others)
                errors[(case, variant)] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    for r in range(args.rounds):
        for case, (x, addend) in inputs.items():
            names = list(fns)
            for variant in names[r % len(names) :] + names[: r % len(names)]:
                if errors[(case, variant)].startswith("failed"):
                    continue
                try:
                    ms = graph_median_milliseconds(
                        lambda fn=fns[variant], x=x, a=addend: fn(x, a),
                        device,
                        warmup=2,
                        reps=args.reps,
                        calls=args.calls,
                    )
                except Exception as e:
                    errors[(case, variant)] = f"failed to time: {type(e).__name__}: {str(e)[:80]}"
                    continue
                times[(case, variant)].append(ms)
    print(
        f"ms per product, median of {args.rounds} rounds (each the median of {args.reps} graph replays)"
    )
    print("| case | " + " | ".join(fns) + " | quack / Triton |")
    print("| --- " * (len(fns) + 2) + "|")
    for case in CASES:
        cells, medians = [], {}
        for variant in fns:
            t = times[(case, variant)]
            if t:
                medians[variant] = statistics.median(t)
                cells.append(f"{medians[variant]:.4f}, err {errors[(case, variant)]}")
            else:
                cells.append(errors[(case, variant)])
        ratio = (
            f"{medians['quack'] / medians['DMuon Triton']:.3f}"
            if "quack" in medians and "DMuon Triton" in medians
            else "-"
        )
        print(f"| {case} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
