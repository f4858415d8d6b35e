"""Symmetric matrix products: only the upper blocks computed, the lower ones mirrored.

Gram Newton–Schulz spends most of its FLOPs on products known to be symmetric (X·Xᵀ, and
products of commuting symmetric matrices). :func:`symmetric_matmul` is the entry point: the
Triton kernel below where it runs, else row panels of ordinary matmuls.

cuBLAS has no half-precision SYRK, and cutting the
product into row panels of ordinary matmuls (:func:`_symmetric_matmul_panels`) saves only
(panels − 1)/(2·panels) of the FLOPs, in smaller matmuls that fill the GPU worse, and then
copies the lower blocks from their transposed mirror images. The Triton kernel here computes
each upper-triangular output tile {i, j} once, two tiles of one tile row per program (a
128×256 block, which loads a quarter less per FLOP than a 128×128 one: 7–16 % faster on
products of 1024-row matrices and of 4096² ones; docs/design_notes.md#two-tiles-a-program). It
accumulates in fp32, applies ``alpha``, ``beta·addend``, ``diagonal·I`` and a per-matrix
``scale``, and stores each tile at (i, j) and its transpose at (j, i) — half the FLOPs of
the full product, no second pass over memory. A tile may be computed as its own mirror
image (C[j, i] = C[i, j]ᵀ), which is how every program gets two (:func:`program_tiles`).

:func:`supported` says whether the kernel runs (not without Triton, not off CUDA, only
bf16/fp16, sizes multiples of the tile, not under ``DMUON_FUSED=0``); where it does not, the
caller takes its cuBLAS path. The result differs from cuBLAS's only in fp32 summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused

triton = fused.triton
if triton is not None:
    import triton.language as tl

#: Output tile side (square: a tile's mirror image is a tile; a program computes two) and
#: the K step.
TILE = 128
TILE_K = 64

_HALF = (torch.bfloat16, torch.float16)


def runs_for(rows: int, inner: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel runs for a product of ``rows``×``inner`` by ``inner``×``rows``
    matrices of ``dtype`` on ``device``."""
    return (
        fused.enabled()
        and torch.device(device).type == "cuda"
        and dtype in _HALF
        and rows % TILE == 0
        and inner % TILE_K == 0
        and rows * max(rows, inner) < 2**31  # offsets within one matrix are 32-bit
    )


def supported(a: Tensor, b: Tensor) -> bool:
    """Whether :func:`symmetric_mm` runs for ``a @ b`` in production (it is not called
    otherwise): CUDA, half precision, tile-multiple sizes, Triton kernels enabled."""
    return (
        a.ndim == b.ndim
        and a.ndim in (2, 3)
        and b.dtype == a.dtype
        and b.device == a.device
        and a.shape[:-2] == b.shape[:-2]
        and a.size(-2) == b.size(-1)
        and a.size(-1) == b.size(-2)
        and runs_for(a.size(-2), a.size(-1), a.dtype, a.device)
    )


def symmetric_matmul(
    a: Tensor,
    b: Tensor,
    panels: int = 1,
    addend: Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
    diagonal: float = 0.0,
    kernel: bool = False,
    scale: Tensor | None = None,
) -> Tensor:
    """``beta·addend + alpha·(a @ b) + diagonal·I`` for a product known to be symmetric
    (XXᵀ, or two commuting symmetric matrices), computing only its upper block triangle;
    ``scale`` (float32, one value per matrix of the batch: shape ``a.shape[:-2]``) multiplies
    each result.

    ``kernel``: by :func:`symmetric_mm` (half the FLOPs, one pass, ``scale`` applied before
    the one rounding) where it runs (:func:`supported`); otherwise as follows, ``scale``
    applied to the rounded result.

    The m rows are cut into ``panels`` row panels; panel i multiplies only from its diagonal
    block rightwards (m·(m − i·h) outputs instead of m·m), and the blocks below the diagonal
    are copied from their mirror images: (panels + 1) / (2·panels) of the matmul FLOPs, at the
    price of smaller matmuls and ``panels − 1`` block copies. ``panels`` ≤ 1, or one that does
    not divide m, computes the whole product. ``addend`` must be symmetric too. 2-D or 3-D.
    """
    if kernel and supported(a, b):
        return symmetric_mm(
            a, b, addend=addend, alpha=alpha, beta=beta, diagonal=diagonal, scale=scale
        )
    out = _symmetric_matmul_panels(a, b, panels, addend, beta, alpha)
    if diagonal:
        out.diagonal(dim1=-2, dim2=-1).add_(diagonal)
    if scale is not None:  # (in float32, then rounded once more)
        out.mul_(scale[..., None, None])
    return out


def _symmetric_matmul_panels(
    a: Tensor, b: Tensor, panels: int, addend: Tensor | None, beta: float, alpha: float
) -> Tensor:
    m = a.size(-2)
    fn = torch.baddbmm if a.ndim == 3 else torch.addmm
    if panels <= 1 or m % panels or m < 2 * panels:
        if addend is None:
            return a @ b if alpha == 1.0 else torch.mul(a @ b, alpha)
        return fn(addend, a, b, beta=beta, alpha=alpha)
    out = a.new_empty((*a.shape[:-2], m, m))
    h = m // panels
    for i in range(panels):
        rows, cols = slice(i * h, (i + 1) * h), slice(i * h, m)
        target = out[..., rows, cols]
        if addend is None:
            torch.matmul(a[..., rows, :], b[..., :, cols], out=target)
            if alpha != 1.0:
                target.mul_(alpha)
        else:
            fn(
                addend[..., rows, cols],
                a[..., rows, :],
                b[..., :, cols],
                beta=beta,
                alpha=alpha,
                out=target,
            )
    for i in range(1, panels):  # row panel i, left of its diagonal block: the mirror image
        out[..., i * h : (i + 1) * h, : i * h].copy_(out[..., : i * h, i * h : (i + 1) * h].mT)
    return out


def _row_programs(tiles: int) -> int:
    """Programs that pair tiles within their own tile row (:func:`program_tiles`)."""
    return (tiles // 2) * ((tiles + 1) // 2)


def programs(tiles: int) -> int:
    """Programs per matrix of the kernel on a ``tiles``×``tiles`` grid of tiles: each one
    computes a tile row's two tiles (:func:`program_tiles`), so about half the
    tiles(tiles + 1)/2 upper tiles."""
    leftover = (tiles + 1) // 2  # tile rows of odd length hand their last tile over
    return _row_programs(tiles) + (leftover + 1) // 2


def program_tiles(pid: int, tiles: int) -> tuple[int, int, int, bool]:
    """(row, column, column, second stored) of program ``pid``: the kernel's arithmetic in
    Python, for tests and for reading it.

    Upper tile row i holds tiles i … T−1, s = T − i of them; its programs take them two by
    two, ``floor(s / 2)`` programs. Programs run row by row from the top, left to right
    (measured faster than from the bottom on 4096-row products); counted
    from the last of them, q = main − 1 − pid, the rows shorter than s hold
    F(s − 1) = ⌊(s − 1)/2⌋·⌈(s − 1)/2⌉ programs, so s follows from √q. A row of odd length
    leaves its last tile (i, T−1); those tiles, as their mirror images (T−1, i), share tile
    row T−1 and pair up in the programs after the main ones (one alone if their number is
    odd)."""
    main = _row_programs(tiles)
    if pid >= main:
        first = tiles - 1 - 4 * (pid - main)
        return tiles - 1, first, first - 2 if first >= 2 else first, first >= 2
    q = main - 1 - pid
    m = int(q**0.5)
    m = m + 1 if (m + 1) ** 2 <= q else m - 1 if m * m > q else m
    s = 2 * m + 1 if q < m * (m + 1) else 2 * m + 2
    p = s // 2 - 1 - (q - ((s - 1) // 2) * (s // 2))
    row = tiles - s
    return row, row + 2 * p, row + 2 * p + 1, True


def symmetric_mm(
    a: Tensor,
    b: Tensor,
    *,
    addend: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    diagonal: float = 0.0,
    scale: Tensor | None = None,
    tile: int = TILE,
    tile_k: int = TILE_K,
    num_warps: int = 8,
    num_stages: int = 4,
) -> Tensor:
    """``alpha·(a @ b) + beta·addend + diagonal·I`` for a product known to be symmetric
    (m×k @ k×m, or a batch of them; ``addend`` symmetric m×m, or one for the whole batch),
    by the kernel; times ``scale[i]`` for matrix i (float32, one per matrix), if given. Any
    strides: ``b`` may be ``a.mT``. Callers check :func:`supported` first; the tile (a
    program computes two: ``tile`` × 2·``tile``) and launch arguments are for benchmarks and
    tests (which run it in float32 in Triton's
    interpreter: ``float32`` inputs use IEEE fp32 dots, not TF32)."""
    a3, b3, out, add3, scales = kernel_operands(a, b, addend, scale)
    batch, m, k = a3.shape
    tiles = m // tile
    grid = (programs(tiles), batch)
    _symmetric_mm_kernel[grid](
        a3,
        b3,
        out,
        add3,
        scales,
        *a3.stride(),
        *b3.stride(),
        *out.stride(),
        *add3.stride(),
        tiles,
        float(alpha),
        float(beta),
        float(diagonal),
        HAS_ADDEND=addend is not None,
        HAS_SCALE=scale is not None,
        IEEE=a.dtype == torch.float32,
        TILE=tile,
        TILE_K=tile_k,
        K=k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out if a.ndim == 3 else out.squeeze(0)


def kernel_operands(
    a: Tensor, b: Tensor, addend: Tensor | None, scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(a, b as 3-D batches, the new output batch, the addend expanded to it, one float32
    scale per matrix, contiguous) for a kernel of :func:`symmetric_mm`'s contract; without an
    addend or a scale, the output stands in (a pointer the kernel does not read)."""
    batched = a.ndim == 3
    a3 = a if batched else a.unsqueeze(0)
    b3 = b if batched else b.unsqueeze(0)
    batch, m, _ = a3.shape
    out = a3.new_empty((batch, m, m))
    add3 = (
        out if addend is None else (addend if batched else addend.unsqueeze(0)).expand(batch, m, m)
    )
    scales = (  # the kernel reads scale_ptr + batch
        out
        if scale is None
        else scale.to(device=out.device, dtype=torch.float32).reshape(-1).expand(batch).contiguous()
    )
    return a3, b3, out, add3, scales


if triton is not None:

    @triton.jit
    def program_layout(pid, tiles):
        """(row, first column, second column, whether the second is stored) of program
        ``pid`` on a ``tiles``×``tiles`` grid of tiles: :func:`program_tiles`, in Triton (the
        kernel's)."""
        main = (tiles // 2) * ((tiles + 1) // 2)
        q = tl.maximum(main - 1 - pid, 0)  # (the leftover programs: any row, replaced below)
        m = tl.sqrt(q.to(tl.float32)).to(tl.int32)
        m = tl.where((m + 1) * (m + 1) <= q, m + 1, m)  # float rounding, either way
        m = tl.where(m * m > q, m - 1, m)
        s = tl.where(q < m * (m + 1), 2 * m + 1, 2 * m + 2)
        row = tiles - s
        first = row + 2 * (s // 2 - 1 - (q - ((s - 1) // 2) * (s // 2)))
        second = first + 1
        leftover = tiles - 1 - 4 * (pid - main)  # the odd rows' last tiles, mirrored
        extra = pid >= main
        row = tl.where(extra, tiles - 1, row)
        first = tl.where(extra, leftover, first)
        second = tl.where(extra, tl.where(leftover >= 2, leftover - 2, leftover), second)
        return row, first, second, (pid < main) | (leftover >= 2)

    @triton.jit
    def store_block(
        acc, batch, row, first, second, both,
        c_ptr, c_sb, c_sm, c_sn, d_ptr, d_sb, d_sm, d_sn, scale_ptr, alpha, beta, diagonal,
        HAS_ADDEND: tl.constexpr, HAS_SCALE: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """The epilogue of a block (``acc``: the float32 products of tile row ``row`` by tiles
        ``first`` and ``second`` of matrix ``batch``, :func:`program_layout`'s): alpha, the
        addend, the diagonal and the scale applied, stored and mirrored (the kernel's)."""
        rows = row * TILE + tl.arange(0, TILE)
        c = tl.arange(0, 2 * TILE)
        cols = tl.where(c < TILE, first * TILE + c, second * TILE + c - TILE)
        col_tile = tl.where(c < TILE, first, second)
        acc = acc * alpha
        if HAS_ADDEND:
            d_ptrs = d_ptr + batch * d_sb + rows[:, None] * d_sm + cols[None, :] * d_sn
            acc += beta * tl.load(d_ptrs).to(tl.float32)
        acc += tl.where(rows[:, None] == cols[None, :], diagonal, 0.0)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + batch)
        out = acc.to(c_ptr.dtype.element_ty)
        c_base = c_ptr + batch * c_sb
        # the second tile is stored unless it is the first again (a lone leftover); blocks,
        # not scalars, in the mask: Triton's interpreter rejects a block | scalar bool
        stored = (c < TILE) | (both.to(tl.int32) + 0 * c > 0)
        stored = (rows[:, None] >= 0) & stored[None, :]
        tl.store(c_base + rows[:, None] * c_sm + cols[None, :] * c_sn, out, mask=stored)
        # the mirror tile: element (r, c) of a tile off the diagonal is C[c, r]
        mirror = stored & (col_tile != row)[None, :]
        tl.store(c_base + rows[:, None] * c_sn + cols[None, :] * c_sm, out, mask=mirror)

    @triton.jit
    def _symmetric_mm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        d_ptr,
        scale_ptr,
        a_sb,
        a_sm,
        a_sk,
        b_sb,
        b_sk,
        b_sn,
        c_sb,
        c_sm,
        c_sn,
        d_sb,
        d_sm,
        d_sn,
        tiles,
        alpha,
        beta,
        diagonal,
        HAS_ADDEND: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        IEEE: tl.constexpr,
        TILE: tl.constexpr,
        TILE_K: tl.constexpr,
        K: tl.constexpr,  # compiled per inner size (few): a constant trip count pipelines
    ):
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        row, first, second, both = program_layout(pid, tiles)
        rows = row * TILE + tl.arange(0, TILE)
        c = tl.arange(0, 2 * TILE)
        cols = tl.where(c < TILE, first * TILE + c, second * TILE + c - TILE)
        ks = tl.arange(0, TILE_K)
        a_ptrs = a_ptr + batch * a_sb + rows[:, None] * a_sm + ks[None, :] * a_sk
        b_ptrs = b_ptr + batch * b_sb + ks[:, None] * b_sk + cols[None, :] * b_sn
        acc = tl.zeros((TILE, 2 * TILE), dtype=tl.float32)
        for _ in range(0, K // TILE_K):
            if IEEE:
                acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
            a_ptrs += TILE_K * a_sk
            b_ptrs += TILE_K * b_sk
        store_block(
            acc, batch, row, first, second, both,
            c_ptr, c_sb, c_sm, c_sn, d_ptr, d_sb, d_sm, d_sn, scale_ptr, alpha, beta, diagonal,
            HAS_ADDEND, HAS_SCALE, TILE,
        )  # fmt: skip
