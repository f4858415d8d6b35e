"""The timing harness of the symmetric-kernel experiments (``exp_sym_*.py``).

Each variant is a function of ``symmetric.symmetric_mm``'s contract. ``per_product`` times
each on the products Newton–Schulz runs at 170M and 8B scale, ``whole_ns`` times NS of the
two 170M batches (``"auto"``, bf16, 5 Jordan steps) with each in ``symmetric_mm``'s place.
Times are GPU-only (CUDA graphs, ``timing.graph_median_milliseconds``); the variants take
turns round by round, and every result is checked (against cuBLAS, or float64 NS).
``cool_ms`` spaces the timed replays out so that they run at the training step's clock
rather than under the power cap (docs/benchmarks.md, nineteenth session).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from dmuon_titan import newton_schulz, symmetric
from dmuon_titan.timing import graph_median_milliseconds

CASES = {  # name: (batch, rows, inner, kind of product)
    "48 X·Xᵀ 1024x1024": (48, 1024, 1024, "gram"),
    "48 aI+bA+cA² 1024²": (48, 1024, 1024, "poly"),
    "36 A·B 1024²": (36, 1024, 1024, "sym"),
    "36 X·Xᵀ 1024x2816": (36, 1024, 2816, "gram"),
    "32 X·Xᵀ 1024x4096": (32, 1024, 4096, "gram"),
    "8 A² 4096²": (8, 4096, 4096, "sym"),
    "2 X·Xᵀ 4096x14336": (2, 4096, 14336, "gram"),
}

NS_BATCHES = {  # name: shape of the 170M NS batch
    "48 x 1024x1024": (48, 1024, 1024),
    "36 x 1024x2816": (36, 1024, 2816),
}


def product(mm, kind, x, y):
    if kind == "gram":
        return mm(x, x.mT)
    if kind == "poly":
        return mm(x, x, addend=x, alpha=2.0315, beta=-4.7750, diagonal=3.4445)
    return mm(x, y)


def reference(kind, x, y):
    if kind == "gram":
        return torch.bmm(x, x.mT)
    if kind == "poly":
        out = torch.baddbmm(x, x, x, beta=-4.7750, alpha=2.0315)
        out.diagonal(dim1=-2, dim2=-1).add_(3.4445)
        return out
    return torch.bmm(x, y)


def _table(title, rows, names, base, times, status) -> None:
    print(title)
    print("| case | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for case in rows:
        reference_times = times.get((case, base))
        base_ms = statistics.median(reference_times) if reference_times else float("nan")
        cells = []
        for v in names:
            t = times.get((case, v))
            if not t:
                cells.append(status.get((case, v), "-"))
                continue
            ms = statistics.median(t)
            cells.append(f"{ms:.4f} ({ms / base_ms:.3f}, {status[(case, v)]})")
        print(f"| {case} | " + " | ".join(cells) + " |")


def per_product(
    variants: dict[str, Callable],
    base: str,
    rounds: int,
    reps: int,
    calls: int,
    cool_ms: float = 0.0,
    cases: dict | None = None,
    device: str = "cuda",
) -> None:
    """ms per product of each of ``variants`` (and cuBLAS's full product), medians of
    ``rounds`` rounds; ratios to ``base``."""
    cases = CASES if cases is None else cases
    device = torch.device(device)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32  # (the interpreter)
    torch.manual_seed(0)
    inputs = {}
    for name, (batch, rows, inner, kind) in cases.items():
        x = torch.randn(batch, rows, inner, device=device, dtype=half) / inner**0.5
        y = None
        if kind != "gram":  # symmetric, commuting: A and A² (as Gram NS's P and Q)
            x = (x @ x.mT).to(half)
            y = (x @ x).to(half)
        inputs[name] = (x, y)
    names = ["cuBLAS", *variants]
    status, times = {}, {(c, v): [] for c in cases for v in names}
    for case, (x, y) in inputs.items():
        kind = cases[case][3]
        want = reference(kind, x, y).float()
        for v in names:
            if v == "cuBLAS":
                status[(case, v)] = "ok"
                continue
            try:
                got = product(variants[v], kind, x, y).float()
                rel = ((got - want).norm() / want.norm()).item()
                status[(case, v)] = f"err {rel:.1e}"
            except Exception as e:  # (one variant failing leaves the others)
                status[(case, v)] = f"failed: {type(e).__name__}: {str(e)[:100]}"
    for r in range(rounds):
        for case, (x, y) in inputs.items():
            kind = cases[case][3]
            for v in names[r % len(names) :] + names[: r % len(names)]:
                if status[(case, v)].startswith("failed"):
                    continue
                fn = (
                    (lambda x=x, y=y, kind=kind: reference(kind, x, y))
                    if v == "cuBLAS"
                    else (lambda x=x, y=y, kind=kind, v=v: product(variants[v], kind, x, y))
                )
                times[(case, v)].append(
                    graph_median_milliseconds(
                        fn, device, warmup=2, reps=reps, calls=calls, cool_ms=cool_ms
                    )
                )
    title = f"ms per product, median of {rounds} rounds; ratio to {base}"
    _table(title, list(cases), names, base, times, status)


def whole_ns(
    variants: dict[str, Callable],
    base: str,
    rounds: int,
    reps: int,
    cool_ms: float = 0.0,
    batches: dict | None = None,
    device: str = "cuda",
) -> None:
    """NS of the 170M batches with each of ``variants`` in ``symmetric.symmetric_mm``'s place,
    interleaved; errors against float64 NS."""
    device = torch.device(device)
    coefficients = newton_schulz.normalize_coefficients("jordan")
    torch.manual_seed(1)
    shapes = NS_BATCHES if batches is None else batches
    inputs = {name: torch.randn(*shape, device=device) for name, shape in shapes.items()}
    shipped = symmetric.symmetric_mm

    def ns(x):
        return newton_schulz.orthogonalize(x, coefficients, 5, 1e-7, torch.bfloat16, "auto")

    status, times = {}, {}
    for name, x in inputs.items():
        exact = newton_schulz.orthogonalize(x.double(), coefficients, 5, 1e-7, torch.float64)
        for v in variants:
            symmetric.symmetric_mm = variants[v]
            try:
                got = ns(x.to(torch.bfloat16)).double()
                status[(name, v)] = f"err {((got - exact).norm() / exact.norm()).item():.2e}"
                times[(name, v)] = []
            except Exception as e:
                status[(name, v)] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            finally:
                symmetric.symmetric_mm = shipped
    keys = list(times)
    for r in range(rounds):
        for name, v in keys[r % len(keys) :] + keys[: r % len(keys)]:
            symmetric.symmetric_mm = variants[v]
            try:
                bf16 = inputs[name].to(torch.bfloat16)
                times[(name, v)].append(
                    graph_median_milliseconds(
                        lambda bf16=bf16: ns(bf16), device, 2, reps, calls=2, cool_ms=cool_ms
                    )
                )
            finally:
                symmetric.symmetric_mm = shipped
    title = f"whole NS ('auto', bf16), ms, median of {rounds} rounds; error against float64 NS"
    _table(title, list(inputs), list(variants), base, times, status)


def check_products(mm: Callable, x: torch.Tensor, label, **kwargs) -> None:
    """In Triton's interpreter (float32): ``mm`` (``symmetric_mm``'s contract, with
    ``kwargs``) gives X·Xᵀ of the batch ``x`` and (2A² − 0.5A + 3I)·s for A = X·Xᵀ and a
    random scale s per matrix, as the float32 products do; ``label`` names a failure."""
    scale = torch.rand(x.shape[0]) + 0.5
    sym = x @ x.mT
    got = mm(x, x.mT, **kwargs)
    assert torch.allclose(got, sym, atol=1e-4), label
    got = mm(sym, sym, addend=sym, alpha=2.0, beta=-0.5, diagonal=3.0, scale=scale, **kwargs)
    eye = torch.eye(x.shape[1])
    want = (2.0 * sym @ sym - 0.5 * sym + 3.0 * eye) * scale[:, None, None]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-2), label


def timing_arguments(parser: argparse.ArgumentParser, rounds: int, cool_ms: float) -> None:
    """The experiments' common options: rounds, replays, calls per graph, ``--whole-ns``,
    ``--cool-ms``, ``--check-cpu``."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--whole-ns", action="store_true")
    parser.add_argument("--cool-ms", type=float, default=cool_ms, help="spin before each replay")
    parser.add_argument("--check-cpu", action="store_true", help="the kernel, interpreter")


def run(args: argparse.Namespace, variants: dict[str, Callable], base: str, cases=None) -> None:
    """Per product, then (``--whole-ns``) whole NS, as ``args`` say."""
    per_product(variants, base, args.rounds, args.reps, args.calls, args.cool_ms, cases)
    if args.whole_ns:
        whole_ns(variants, base, args.rounds, args.reps, args.cool_ms)
