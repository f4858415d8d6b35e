#!/usr/bin/env python3
"""Newton–Schulz throughput per matrix shape and algorithm vs the measured bf16 matmul rate.

For each shape and method (``plain``: torch.optim.Muon's iteration; ``gram``: Gram NS with a
restart; ``plain_pK``/``gram_pK``: the same with their symmetric products in K row panels;
``_k``: by the symmetric kernel; ``plain_kp``: the kernel with X ← P·X; ``plain_kpf``,
``gram_kf``: with the normalization folded into the first products): 5 bf16 NS
iterations (Jordan coefficients) on one matrix, and batched as DMuon's optimizer batches
same-shape matrices (``ns_batch_numel`` elements per call). Reported: ms per matrix and the
*plain-equivalent* rate, plain NS FLOPs (``cost.ns_flops``, 2 per FMA) / time, as a share of a
plain ``N×N @ N×N`` bf16 matmul's rate measured in the same process — above 100 % means the
method does fewer FLOPs than plain NS. Timed as CUDA graphs of 10 calls (no host launch time
in the figures: ``gpu_timing.graph_median_milliseconds``), after warm-up, median.

    python3 scripts/bench/bench_ns.py                 # llama3-8B and the 170M flavor's shapes
    python3 scripts/bench/bench_ns.py --shapes 4096x4096,14336x4096 --methods plain,gram_p4 --json ns.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from gpu_timing import graph_median_milliseconds as timed

from dmuon_titan import newton_schulz
from dmuon_titan.options import DEFAULT_NS_BATCH_NUMEL
from dmuon_titan.plan import cost

DEFAULT_SHAPES = "4096x4096,1024x4096,14336x4096,4096x14336,1024x1024,2816x1024"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--matmul-n", type=int, default=8192, help="N of the reference matmul")
    parser.add_argument("--batch-numel", type=int, default=DEFAULT_NS_BATCH_NUMEL)
    parser.add_argument("--methods", default="plain,gram,gram_p2,gram_p4")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile",
        default=None,
        metavar="METHOD",
        help="instead of the table: profile METHOD on the first shape (batched), print kernels",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = args.matmul_n if cuda else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_tflops = 2 * n**3 / timed(partial(torch.mm, a, b), device, args.warmup, args.reps) / 1e9
    a = b = None
    coefficients = (newton_schulz.JORDAN_COEFFICIENTS,)
    if args.profile:
        _profile(args, coefficients, device)
        return
    methods = args.methods.split(",")
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.lower().split("x"))
        if not cuda:  # CPU smoke run: same code, small matrices
            shape = tuple(max(8, v // 32) for v in shape)
        flops = cost.ns_flops(shape, 5)
        one = torch.randn(shape, device=device)
        batch_numel = args.batch_numel if cuda else args.batch_numel // 32**2
        k = max(1, batch_numel // (shape[0] * shape[1]))
        batch = torch.randn((k, *shape), device=device)
        for method in methods:
            fn = _method(method, coefficients)
            one_ms = timed(partial(fn, one), device, args.warmup, args.reps)
            batch_ms = timed(partial(fn, batch), device, args.warmup, args.reps)
            rows.append(
                {
                    "shape": list(shape),
                    "method": method,
                    "gflop": flops / 1e9,
                    "one_ms": one_ms,
                    "one_tflops": flops / one_ms / 1e9,
                    "batch": k,
                    "batch_ms_per_matrix": batch_ms / k,
                    "batch_tflops": k * flops / batch_ms / 1e9,
                }
            )
        one = batch = None  # free before the next shape
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\nbf16 matmul {n}x{n}x{n}: {matmul_tflops:.0f} TFLOP/s on {name}")
    print(
        "| shape | method | plain NS GFLOP | one: ms | one: plain-eq. TFLOP/s | one / matmul "
        "| batch | batched: ms/matrix | batched: plain-eq. TFLOP/s | batched / matmul |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['method']} | {r['gflop']:.0f} "
            f"| {r['one_ms']:.3f} | {r['one_tflops']:.0f} | {r['one_tflops'] / matmul_tflops:.0%} "
            f"| {r['batch']} | {r['batch_ms_per_matrix']:.3f} | {r['batch_tflops']:.0f} "
            f"| {r['batch_tflops'] / matmul_tflops:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "matmul_tflops": matmul_tflops, "rows": rows}, f, indent=1)


def _profile(args, coefficients, device: torch.device) -> None:
    """Kernel time by kernel name (torch.profiler's table) for one batched call of
    ``args.profile`` on the first shape."""
    shape = tuple(int(v) for v in args.shapes.split(",")[0].lower().split("x"))
    k = max(1, args.batch_numel // (shape[0] * shape[1]))
    batch = torch.randn((k, *shape), device=device)
    fn = partial(_method(args.profile, coefficients), batch)
    for _ in range(args.warmup):
        fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"{args.profile} on {k}x{shape[0]}x{shape[1]}")
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90))


#: the kernel's variants (a method's suffix): the algorithms each applies to and the NS
#: arguments it adds to ``symmetric_kernel=True`` (check_ns_accuracy.py takes them from here)
KERNEL_VARIANTS = {
    "k": (("plain", "gram"), {}),
    "kp": (("plain",), {"polynomial_form": True}),
    "kpf": (("plain",), {"polynomial_form": True, "fold_normalization": True}),
    "kf": (("gram",), {"fold_normalization": True}),
}


def _method(name: str, coefficients):
    """A one-argument NS function for a method name: plain or gram, optionally suffixed _pK
    (symmetric products in K row panels) or _k (by the Triton kernel of
    dmuon_titan.symmetric; plain also _kp: the kernel and ``polynomial_form``, X ← P·X; _kpf
    (plain) and _kf (gram): the kernel with ``fold_normalization``, what ``orthogonalize``
    runs), then optionally _fp16 (the NS dtype; bf16 otherwise)."""
    functions = {
        "plain": newton_schulz.zeropower_via_newtonschulz,
        "gram": newton_schulz.gram_newton_schulz,
    }
    dtype = torch.float16 if name.endswith("_fp16") else torch.bfloat16
    algorithm, _, variant = name.removesuffix("_fp16").partition("_")
    kernel = variant in KERNEL_VARIANTS
    algorithms, extra = KERNEL_VARIANTS.get(variant, (tuple(functions), {}))
    panels = variant[1:] if variant.startswith("p") else ""
    if algorithm not in algorithms or not (kernel or variant == "" or panels.isdigit()):
        raise SystemExit(
            f"unknown method {name!r}: plain|gram, then _pK or _k (plain: or _kp, _kpf; "
            "gram: or _kf), then _fp16"
        )
    return partial(
        functions[algorithm],
        coefficients=coefficients,
        ns_steps=5,
        eps=1e-7,
        dtype=dtype,
        symmetric_panels=int(panels or 1),
        symmetric_kernel=kernel,
        **extra,
    )


if __name__ == "__main__":
    main()
