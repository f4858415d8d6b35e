#!/usr/bin/env python3
"""Accuracy of the Newton–Schulz variants against the same iteration in float64.

For each shape, singular-value spectrum and method: ‖NS_method(G) − NS_float64(G)‖_F /
‖NS_float64(G)‖_F, where NS_float64 is torch.optim.Muon's iteration (5 Jordan steps) run in
float64. torch.optim.Muon itself is the ``plain`` bf16 row: a variant is as trustworthy as
plain bf16 when its error is of the same size. Spectra: ``gauss`` (i.i.d. normal entries),
``powerlaw1``/``powerlaw2`` (σ_i = i^-1, i^-2), ``lowrank16`` (16 singular values of 1,
the rest 1e-3: the shape of a few-token gradient).

``--reference polar``: against the exact polar factor U·Vᵀ (float64 SVD) instead, the error
that matters to Muon, which the schedules (``--schedules``: preconditioner:coefficients:steps,
coefficients a name of ``NS_COEFFICIENT_SETS`` or ``polar_express1``, Polar Express without its
first polynomial) trade against their step counts.

    python3 scripts/bench/check_ns_accuracy.py                       # small shapes (CPU is fine)
    python3 scripts/bench/check_ns_accuracy.py --shapes 4096x14336,4096x4096 --json acc.json  # GPU
    python3 scripts/bench/check_ns_accuracy.py --reference polar --methods plain_bf16,gram_kf_bf16 \
        --schedules frobenius:jordan:5,frobenius:polar_express:5,aol:polar_express1:4
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


def schedule(text: str) -> tuple[str, tuple, int]:
    """(preconditioner, coefficients, steps) of ``--schedules``' ``pre:coefficients:steps``."""
    preconditioner, name, steps = text.split(":")
    newton_schulz.check_ns_preconditioner(preconditioner)
    if name == "polar_express1":
        return preconditioner, newton_schulz.NS_COEFFICIENT_SETS["polar_express"][1:], int(steps)
    return preconditioner, newton_schulz.normalize_coefficients(name), int(steps)


def run(method: str, g: torch.Tensor, coefficients, steps=5, preconditioner="frobenius"):
    algorithm, dtype, restarts, panels = METHODS[method]
    kernel = panels in KERNEL_VARIANTS
    extra = {"symmetric_kernel": kernel, **(KERNEL_VARIANTS[panels][1] if kernel else {})}
    extra["preconditioner"] = preconditioner
    if algorithm == "plain":
        return newton_schulz.zeropower_via_newtonschulz(
            g, coefficients, steps, 1e-7, dtype, **extra
        )
    return newton_schulz.gram_newton_schulz(
        g, coefficients, steps, 1e-7, dtype, restarts, 1 if kernel else panels, **extra
    )


def polar_factor(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return u @ vh


def matrices(args, device):
    """(label, float64 matrix) pairs: ``--fixtures``' matrices (captured from training by
    ``capture_momentum.py``; label: step/name), else each shape × spectrum."""
    if args.fixtures:
        for path in args.fixtures.split(","):
            for name, matrix in torch.load(path).items():
                yield name, matrix.to(device, torch.float64) * args.scale
        return
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.lower().split("x"))
        for spectrum in args.spectra.split(","):
            yield spectrum, make_matrix(shape, spectrum, device) * args.scale


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
    parser.add_argument("--reference", choices=("ns64", "polar"), default="ns64")
    parser.add_argument(
        "--fixtures", default=None, help="files of capture_momentum.py, instead of --shapes"
    )
    parser.add_argument("--schedules", default="frobenius:jordan:5")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    schedules = {text: schedule(text) for text in args.schedules.split(",")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    coefficients = (newton_schulz.JORDAN_COEFFICIENTS,)
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {list(METHODS)}")
    rows = []
    for label, g in matrices(args, device):
        if args.reference == "polar":
            reference = polar_factor(g)
        else:
            reference = newton_schulz.zeropower_via_newtonschulz(
                g, coefficients, 5, 1e-7, torch.float64
            )
        errors = {}
        for m in methods:
            for name, (pre, coeffs, steps) in schedules.items():
                column = m if len(schedules) == 1 else f"{m} {name}"
                out = run(m, g, coeffs, steps, pre).double()
                errors[column] = ((out - reference).norm() / reference.norm()).item()
        rows.append({"shape": list(g.shape), "spectrum": label, "errors": errors})
    against = "the polar factor (float64 SVD)" if args.reference == "polar" else "float64 NS"
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\nrelative error vs {against} on {where}")
    columns = list(rows[0]["errors"])
    print("| shape | spectrum | " + " | ".join(columns) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for r in rows:
        cells = " | ".join(f"{r['errors'][m]:.2e}" for m in columns)
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {r['spectrum']} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
