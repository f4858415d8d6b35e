#!/usr/bin/env python3
"""Accuracy of the Newton–Schulz variants against the same iteration in float64.

For each shape, singular-value spectrum and method: ‖NS_method(G) − NS_float64(G)‖_F /
‖NS_float64(G)‖_F, where NS_float64 is torch.optim.Muon's iteration (5 Jordan steps) run in
float64. torch.optim.Muon itself is the ``plain`` bf16 row: a variant is as trustworthy as
plain bf16 when its error is of the same size. Spectra: ``gauss`` (i.i.d. normal entries),
``powerlaw1``/``powerlaw2`` (σ_i = i^-1, i^-2), ``lowrank16`` (16 singular values of 1,
the rest 1e-3: the shape of a few-token gradient).

    python3 scripts/bench/check_ns_accuracy.py                       # small shapes (CPU is fine)
    python3 scripts/bench/check_ns_accuracy.py --shapes 4096x14336,4096x4096 --json acc.json  # GPU
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_ns import KERNEL_VARIANTS  # (this directory: the script's own on sys.path)

from dmuon_titan import newton_schulz
from dmuon_titan.plan import cost

SPECTRA = ("gauss", "powerlaw1", "powerlaw2", "lowrank16")
#: name -> (algorithm, dtype, Gram restarts, symmetric panels, or a variant of the Triton
#: kernel: bench_ns.KERNEL_VARIANTS — "k", "kp" X ← P·X, "kpf"/"kf" the normalization folded)
METHODS = {
    "plain_bf16": ("plain", torch.bfloat16, (), 1),
    "plain_fp16": ("plain", torch.float16, (), 1),
    "plain_k_bf16": ("plain", torch.bfloat16, (), "k"),
    "plain_kp_bf16": ("plain", torch.bfloat16, (), "kp"),
    "plain_kpf_bf16": ("plain", torch.bfloat16, (), "kpf"),
    "gram_bf16": ("gram", torch.bfloat16, cost.DEFAULT_GRAM_RESTARTS, 1),
    "gram_k_bf16": ("gram", torch.bfloat16, cost.DEFAULT_GRAM_RESTARTS, "k"),
    "gram_kf_bf16": ("gram", torch.bfloat16, cost.DEFAULT_GRAM_RESTARTS, "kf"),
    "gram_p4_bf16": ("gram", torch.bfloat16, cost.DEFAULT_GRAM_RESTARTS, 4),
    "gram_fp16": ("gram", torch.float16, cost.DEFAULT_GRAM_RESTARTS, 1),
    "gram_norestart_bf16": ("gram", torch.bfloat16, (), 1),
}


def make_matrix(shape, spectrum: str, device, seed: int = 0) -> torch.Tensor:
    """A float64 matrix of ``shape`` with the named singular-value spectrum."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows, cols = shape
    if spectrum == "gauss":
        return torch.randn(shape, generator=g, device=device, dtype=torch.float64)
    k = min(shape)
    left, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, device=device, dtype=torch.float64))
    right, _ = torch.linalg.qr(
        torch.randn(cols, k, generator=g, device=device, dtype=torch.float64)
    )
    i = torch.arange(1, k + 1, device=device, dtype=torch.float64)
    if spectrum == "powerlaw1":
        s = 1 / i
    elif spectrum == "powerlaw2":
        s = 1 / i**2
    elif spectrum == "lowrank16":
        s = torch.where(i <= 16, 1.0, 1e-3)
    else:
        raise SystemExit(f"unknown spectrum {spectrum!r}; known: {SPECTRA}")
    return (left * s) @ right.T


def run(method: str, g: torch.Tensor, coefficients) -> torch.Tensor:
    algorithm, dtype, restarts, panels = METHODS[method]
    kernel = panels in KERNEL_VARIANTS
    extra = {"symmetric_kernel": kernel, **(KERNEL_VARIANTS[panels][1] if kernel else {})}
    if algorithm == "plain":
        return newton_schulz.zeropower_via_newtonschulz(g, coefficients, 5, 1e-7, dtype, **extra)
    return newton_schulz.gram_newton_schulz(
        g, coefficients, 5, 1e-7, dtype, restarts, 1 if kernel else panels, **extra
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="128x448,448x128,192x192")
    parser.add_argument("--spectra", default=",".join(SPECTRA))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every matrix by this (float16 needs its input normalized before the "
        "cast; try 1e-7, a clipped 8B model's gradient entries)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    coefficients = (newton_schulz.JORDAN_COEFFICIENTS,)
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {list(METHODS)}")
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.lower().split("x"))
        for spectrum in args.spectra.split(","):
            g = make_matrix(shape, spectrum, device) * args.scale
            reference = newton_schulz.zeropower_via_newtonschulz(
                g, coefficients, 5, 1e-7, torch.float64
            )
            errors = {}
            for m in methods:
                out = run(m, g, coefficients).double()
                errors[m] = ((out - reference).norm() / reference.norm()).item()
            rows.append({"shape": list(shape), "spectrum": spectrum, "errors": errors})
    print(
        f"\nrelative error vs float64 NS on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}"
    )
    print("| shape | spectrum | " + " | ".join(methods) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in methods) + " |")
    for r in rows:
        cells = " | ".join(f"{r['errors'][m]:.2e}" for m in methods)
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {r['spectrum']} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
