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
        python3 scripts/bench/exp_quack_symmetric.py --rounds 5 --whole-ns
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


def quack_symmetric_mm(quack_symmetric, fallback):
    """A stand-in for ``symmetric.symmetric_mm`` that runs quack's kernel (the diagonal added
    afterwards) and leaves a call with a per-matrix ``scale`` (NS's folded normalization) to
    ``fallback``, the Triton kernel."""

    def mm(a, b, *, addend=None, alpha=1.0, beta=1.0, diagonal=0.0, scale=None, **launch):
        if scale is not None:
            return fallback(
                a, b, addend=addend, alpha=alpha, beta=beta, diagonal=diagonal, scale=scale
            )
        batched = a.ndim == 3
        a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
        c3 = None
        if addend is not None:
            c3 = addend if addend.ndim == 3 else addend.unsqueeze(0).expand(a3.size(0), -1, -1)
        out = quack_symmetric(a3, b3, C=c3, alpha=float(alpha), beta=float(beta))
        if diagonal:
            out.diagonal(dim1=-2, dim2=-1).add_(diagonal)
        return out if batched else out.squeeze(0)

    return mm


def whole_ns(quack_symmetric, rounds: int, reps: int) -> None:
    """Newton–Schulz of the two 170M batches (``"auto"``, bf16, 5 Jordan steps) with the
    Triton kernel and with quack's, interleaved; each result against float64 NS."""
    from dmuon_titan import newton_schulz

    device = torch.device("cuda")
    coefficients = newton_schulz.normalize_coefficients("jordan")
    batches = {
        "48 x 1024x1024": torch.randn(48, 1024, 1024, device=device),
        "36 x 1024x2816": torch.randn(36, 1024, 2816, device=device),
    }
    triton_mm = symmetric.symmetric_mm
    quack_mm = quack_symmetric_mm(quack_symmetric, triton_mm)
    times = {}
    for name, x in batches.items():
        exact = newton_schulz.orthogonalize(x.double(), coefficients, 5, 1e-7, torch.float64)
        bf16 = x.to(torch.bfloat16)
        for label, mm in (("Triton", triton_mm), ("quack", quack_mm)):
            symmetric.symmetric_mm = mm
            try:
                got = newton_schulz.orthogonalize(
                    bf16, coefficients, 5, 1e-7, torch.bfloat16, "auto"
                )
                err = ((got.double() - exact).norm() / exact.norm()).item()
                times[(name, label)] = (err, [])
            except Exception as e:
                times[(name, label)] = (f"failed: {type(e).__name__}: {str(e)[:80]}", None)
            finally:
                symmetric.symmetric_mm = triton_mm
    keys = list(times)
    for r in range(rounds):
        for name, label in keys[r % len(keys) :] + keys[: r % len(keys)]:
            samples = times[(name, label)][1]
            if samples is None:
                continue
            symmetric.symmetric_mm = quack_mm if label == "quack" else triton_mm
            try:
                bf16 = batches[name].to(torch.bfloat16)
                samples.append(
                    graph_median_milliseconds(
                        lambda bf16=bf16: newton_schulz.orthogonalize(
                            bf16, coefficients, 5, 1e-7, torch.bfloat16, "auto"
                        ),
                        device,
                        warmup=2,
                        reps=reps,
                        calls=2,
                    )
                )
            finally:
                symmetric.symmetric_mm = triton_mm
    print(
        f"whole NS ('auto', bf16), ms, median of {rounds} rounds; relative error against float64 NS"
    )
    print("| batch | Triton kernel | quack |")
    print("| --- | --- | --- |")
    for name in batches:
        cells = []
        for label in ("Triton", "quack"):
            err, samples = times[(name, label)]
            if samples:
                cells.append(f"{statistics.median(samples):.3f} (err {err:.2e})")
            else:
                cells.append(str(err))
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument(
        "--whole-ns", action="store_true", help="then whole NS of the 170M batches, both kernels"
    )
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
    if args.whole_ns and quack_symmetric is not None:
        whole_ns(quack_symmetric, args.rounds, args.reps)


if __name__ == "__main__":
    main()
