#!/usr/bin/env python3
"""What a Triton kernel variant costs an SM, without a GPU: compiled offline for Hopper.

Triton compiles for a target it is not running on (``triton.compile`` with a
``GPUTarget``), and its wheel carries ``ptxas`` and ``cuobjdump``. So shared memory, the
software pipeline's buffers, the kinds of loads (``cp.async`` or TMA), the MMA instructions,
registers and spills can be read on a CPU machine before a variant takes device time (a
256×256 block that spills, or a pipeline that does not fit, shows here; the eighteenth
session found the 256×256 spill on a GPU). The arguments are specialized as Triton's
launcher does it on real tensors: pointers and integers divisible by 16 get
``tt.divisibility``, integers equal to 1 become constants (without that, loads are not
provably contiguous and nothing is pipelined).

By default it reports the shipped symmetric kernel (``symmetric._symmetric_mm_kernel``) on
the 170M products and a 4096² one; ``compile_for_hopper`` and ``resources`` serve other
variants (``exp_*.py`` kernels).

    python3 scripts/analysis/kernel_resources.py
    python3 scripts/analysis/kernel_resources.py --stages 3 --warps 8

The Triton here need not be the GPU machines' (Triton 3.6 there): layouts and buffers may
differ between versions; timings are the GPU's to tell (docs/benchmarks.md, nineteenth
session).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dmuon_titan import symmetric


def compile_for_hopper(
    kernel, args: dict, constants: dict, num_warps: int = 8, num_stages: int = 4, **options
):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90. ``args``: every runtime
    argument by name, each a pointer type string (``"*bf16"``), a float, or an int (its
    value decides the specialization); ``constants``: the ``tl.constexpr`` ones."""
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        key = (index,)
        if name in constants:
            signature[name], constexprs[key] = "constexpr", constants[name]
            continue
        value = args[name]
        if isinstance(value, str):
            signature[name], attrs[key] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constexprs[key] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[key] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **options}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def resources(compiled) -> dict:
    """Shared memory (bytes), shared buffers (shapes), ``cp.async`` and TMA copies, wgmma
    instructions, registers per thread and local-memory bytes (spills) of a compiled kernel."""
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    usage = {"REG": None, "LOCAL": None}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            dump = subprocess.run(
                [tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True
            ).stdout
        for key in usage:
            found = re.search(rf"\b{key}:(\d+)", dump)
            usage[key] = int(found.group(1)) if found else None
    return {
        "shared": compiled.metadata.shared,
        "buffers": sorted(set(re.findall(r"memdesc<([0-9x]+)x(?:bf16|f16|f32)", ttgir))),
        "cp_async": ptx.count("cp.async.cg"),
        "tma": ptx.count("cp.async.bulk"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "registers": usage["REG"],
        "spill_bytes": usage["LOCAL"],
    }


def symmetric_case(rows: int, inner: int, product: str) -> tuple[dict, dict]:
    """(args, constants) of the shipped kernel on a contiguous batch: ``"gram"`` X·Xᵀ,
    ``"poly"`` aI + bA + cA² (addend, row-major right factor)."""
    matrix, square = rows * inner, rows * rows
    args = dict(
        a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", d_ptr="*bf16", scale_ptr="*fp32",
        a_sb=matrix, a_sm=inner, a_sk=1, b_sb=matrix, b_sk=1, b_sn=inner,
        c_sb=square, c_sm=rows, c_sn=1, d_sb=square, d_sm=rows, d_sn=1,
        tiles=rows // symmetric.TILE, alpha=1.0, beta=1.0, diagonal=0.0,
    )  # fmt: skip
    if product == "poly":
        args.update(b_sk=rows, b_sn=1)
    constants = dict(
        HAS_ADDEND=product == "poly", HAS_SCALE=False, IEEE=False,
        TILE=symmetric.TILE, TILE_K=symmetric.TILE_K, K=inner,
    )  # fmt: skip
    return args, constants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    cases = {
        "X·Xᵀ 1024×1024": (1024, 1024, "gram"),
        "aI + bA + cA², 1024²": (1024, 1024, "poly"),
        "X·Xᵀ 1024×2816": (1024, 2816, "gram"),
        "aI + bA + cA², 4096²": (4096, 4096, "poly"),
    }
    print(
        f"symmetric._symmetric_mm_kernel, sm_90, {args.warps} warps, {args.stages} stages "
        f"(Triton {triton.__version__})"
    )
    print("| product | shared (KB) | buffers | cp.async | TMA | wgmma | registers | spills (B) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (rows, inner, product) in cases.items():
        kernel_args, constants = symmetric_case(rows, inner, product)
        compiled = compile_for_hopper(
            symmetric._symmetric_mm_kernel, kernel_args, constants, args.warps, args.stages
        )
        r = resources(compiled)
        print(
            f"| {name} | {r['shared'] / 1024:.0f} | {', '.join(r['buffers'])} | {r['cp_async']} "
            f"| {r['tma']} | {r['wgmma']} | {r['registers']} | {r['spill_bytes']} |"
        )


if __name__ == "__main__":
    main()
