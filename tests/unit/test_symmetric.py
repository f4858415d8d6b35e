"""The symmetric-product kernel (dmuon_titan.symmetric): its math in Triton's interpreter on
CPU, and the compiled kernel and NS with it on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dmuon_titan import fused, newton_schulz, symmetric
from dmuon_titan.plan import cost

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused.enabled()), reason="needs CUDA and Triton"
)

_INTERPRETED = r"""
import torch
from dmuon_titan import symmetric
from dmuon_titan.plan import cost
torch.manual_seed(0)
def check(got, expected):
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
for batch in ((), (3,)):
    x = torch.randn(*batch, 48, 40)
    x64 = x.double()
    check(symmetric.symmetric_mm(x, x.mT, tile=16, tile_k=8), x64 @ x64.mT)
    s = torch.randn(*batch, 48, 48)
    s = s + s.mT
    s64 = s.double()
    got = symmetric.symmetric_mm(s, s, addend=s, alpha=0.5, beta=-2.0, diagonal=3.0, tile=16, tile_k=8)
    check(got, 0.5 * s64 @ s64 - 2.0 * s64 + 3.0 * torch.eye(48, dtype=torch.float64))
    # Off the diagonal tiles, the lower triangle is the upper one's mirror image, bit for bit.
    assert torch.equal(got[..., :16, 16:], got[..., 16:, :16].mT)
# A 2-D addend for a batch (broadcast), and a row-major right operand.
s = torch.randn(2, 32, 32)
s = s + s.mT
add = torch.randn(32, 32)
add = add + add.mT
got = symmetric.symmetric_mm(s, s, addend=add, beta=0.25, tile=16, tile_k=16)
check(got, s.double() @ s.double() + 0.25 * add.double())
# A scale per matrix of the batch, after the whole epilogue.
scale = torch.tensor([0.5, -3.0])
got = symmetric.symmetric_mm(s, s, addend=add, beta=0.25, diagonal=2.0, scale=scale, tile=16, tile_k=16)
eye = torch.eye(32, dtype=torch.float64)
expected = s.double() @ s.double() + 0.25 * add.double() + 2.0 * eye
check(got, expected * scale.double()[:, None, None])
# A strided scale, and one 0-d scale for a single matrix.
strided = torch.tensor([0.5, 9.0, -3.0, 9.0])[::2]
check(symmetric.symmetric_mm(s, s, scale=strided, tile=16, tile_k=16),
      (s.double() @ s.double()) * strided.double()[:, None, None])
check(symmetric.symmetric_mm(s[0], s[0], scale=torch.tensor(-2.0), tile=16, tile_k=16),
      -2.0 * s[0].double() @ s[0].double())
# Every layout of programs: tile counts odd and even, with and without a lone leftover.
for tiles in (1, 2, 3, 4, 5, 6, 8, 9):
    x = torch.randn(2, 16 * tiles, 16)
    check(symmetric.symmetric_mm(x, x.mT, tile=16, tile_k=16), x.double() @ x.double().mT)
print("symmetric ok")
"""


@pytest.mark.skipif(symmetric.triton is None, reason="needs Triton")
def test_kernel_in_the_triton_interpreter():
    """Tile numbering, strides, epilogue (alpha, beta·addend, diagonal, scale) and the mirror
    stores, checked in float32 against float64 products (so CPU-only CI covers them)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "symmetric ok" in result.stdout


def test_programs_store_every_tile_once():
    """The kernel's program layout (:func:`symmetric.program_tiles`): each upper tile {i, j}
    stored by exactly one program, as (i, j) or as its mirror image (j, i), two per program
    but at most one lone tile per matrix."""
    for tiles in range(1, 70):
        seen: dict[tuple[int, int], int] = {}
        lone = 0
        for pid in range(symmetric.programs(tiles)):
            row, first, second, both = symmetric.program_tiles(pid, tiles)
            lone += not both
            for column in (first, second) if both else (first,):
                assert 0 <= row < tiles and 0 <= column < tiles
                key = (min(row, column), max(row, column))
                seen[key] = seen.get(key, 0) + 1
        assert seen == {(i, j): 1 for i in range(tiles) for j in range(i, tiles)}, tiles
        assert lone <= 1, tiles


def test_cpu_takes_the_fallback():
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    assert not symmetric.supported(x, x.mT)
    s = (x @ x.mT).float()
    got = symmetric.symmetric_matmul(s, s, addend=s, beta=2.0, alpha=0.5, diagonal=1.5, kernel=True)
    torch.testing.assert_close(
        got, torch.addmm(s, s, s, beta=2.0, alpha=0.5) + 1.5 * torch.eye(256)
    )


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_kernel_matches_cublas(dtype, batch):
    torch.manual_seed(0)
    x = torch.randn(*batch, 384, 640, device="cuda", dtype=dtype)
    assert symmetric.supported(x, x.mT)
    reference = x.float() @ x.float().mT
    got = symmetric.symmetric_mm(x, x.mT)
    assert got.dtype == dtype
    assert torch.equal(got[..., :128, 128:], got[..., 128:, :128].mT)  # mirror tiles
    # fp32 accumulation, one rounding to dtype: within one rounding of the fp32 product.
    torch.testing.assert_close(got.float(), reference, rtol=8e-3, atol=1e-2)
    s = reference / reference.norm()
    s = s.to(dtype)
    got = symmetric.symmetric_mm(s, s, addend=s, alpha=2.0, beta=-0.5, diagonal=0.25)
    s32 = s.float()
    expected = 2.0 * s32 @ s32 - 0.5 * s32 + 0.25 * torch.eye(384, device="cuda")
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-3)


@cuda
def test_kernel_is_not_used_when_fused_kernels_are_off(monkeypatch):
    monkeypatch.setenv("DMUON_FUSED", "0")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    assert not symmetric.supported(x, x.mT)
    assert not symmetric.runs_for(256, 256, torch.bfloat16, torch.device("cuda"))


@cuda
def test_unsupported_shapes_and_dtypes_fall_back():
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)  # 200: not a tile multiple
    assert not symmetric.supported(x, x.mT)
    x = torch.randn(256, 256, device="cuda")  # float32: TF32 dots would lose precision
    assert not symmetric.supported(x, x.mT)


@cuda
@pytest.mark.parametrize("algorithm", ["gram", "auto"])
@pytest.mark.parametrize("shape", [(512, 1536), (1536, 512), (512, 512)])
def test_ns_with_the_kernel_is_as_accurate_as_with_cublas(algorithm, shape, monkeypatch):
    """NS through the kernel (what "gram"/"auto" run on a GPU) vs float64 NS: no less
    accurate than the same algorithm on cuBLAS in bf16 (kernel off)."""
    torch.manual_seed(0)
    coefficients = (newton_schulz.JORDAN_COEFFICIENTS,)
    g = torch.randn(3, *shape, device="cuda")
    exact = newton_schulz.zeropower_via_newtonschulz(
        g.double(), coefficients, 5, 1e-7, torch.float64
    )
    assert symmetric.runs_for(min(shape), max(shape), torch.bfloat16, g.device)
    launches = []

    def counted(*args, **kwargs):
        launches.append(args[0].shape)
        return kernel(*args, **kwargs)

    kernel = symmetric.symmetric_mm
    monkeypatch.setattr(symmetric, "symmetric_mm", counted)
    with_kernel = newton_schulz.orthogonalize(g, coefficients, 5, 1e-7, torch.bfloat16, algorithm)
    # Every symmetric product ran by the kernel: plain NS has 2 per iteration, Gram NS 14
    # square ones (5 iterations, a restart after the 2nd) and 2 X·Xᵀ.
    plain = cost.ns_algorithm_for(shape, algorithm) == "plain"
    assert len(launches) == (10 if plain else 16), launches
    monkeypatch.setenv("DMUON_FUSED", "0")
    without = newton_schulz.orthogonalize(g, coefficients, 5, 1e-7, torch.bfloat16, algorithm)
    assert len(launches) == (10 if plain else 16)  # none more with the kernels off

    def error(x):
        return ((x.double() - exact).norm() / exact.norm()).item()

    assert error(with_kernel) <= 1.25 * error(without) + 1e-3, (error(with_kernel), error(without))
