"""Fused elementwise parts of the Muon step: one pass over memory instead of two or three.

The owner's step touches every dedicated element a few times outside Newton–Schulz (momentum,
Nesterov direction, cast to the NS dtype, weight decay, update). On a GPU these passes are
bandwidth-bound, so fusing them halves that part of the step (docs/design_notes.md#fused-elementwise-passes). The Triton kernels run for contiguous CUDA tensors when
Triton imports;
everything else takes the eager path, which is the reference: the kernels follow its formulas
(``torch.lerp``'s two-sided form, the momentum buffer rounded to its dtype before use) and
differ only in rounding — fp32 contraction, and the update rounds once where ``mul_`` then
``add_`` round twice (visible only for half-precision parameters).
``DMUON_FUSED=0`` in the environment turns the kernels off.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the eager path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

_BLOCK = 2048
_TILE = 64

#: Triton's element types of the kernels' dtypes (a gradient read through its address)
_TL_DTYPES = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if triton is not None
    else {}
)


def enabled() -> bool:
    """Whether the Triton kernels may run at all (Triton importable, not disabled)."""
    return triton is not None and os.environ.get("DMUON_FUSED", "1") != "0"


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp32 math is exact enough


def _fusable(first: Tensor, *others: Tensor, contiguous_others: bool = True) -> bool:
    return enabled() and _tensors_fusable(first, *others, contiguous_others=contiguous_others)


def _tensors_fusable(first: Tensor, *others: Tensor, contiguous_others: bool = True) -> bool:
    """:func:`_fusable` without the environment (asked once for many tensors)."""
    return (
        first.is_cuda
        and first.is_contiguous()
        and first.dtype in _KERNEL_DTYPES
        and all(
            t.device == first.device
            and t.shape == first.shape
            and t.dtype in _KERNEL_DTYPES
            and (t.is_contiguous() or not contiguous_others)
            for t in others
        )
    )


def momentum_all_fusable(
    grads: list[Tensor], buffers: list[Tensor], out_dtype: torch.dtype
) -> bool:
    """Whether :func:`momentum_direction_into` runs every pair of ``grads`` and ``buffers``
    into an output of ``out_dtype`` by a kernel (and so may read each gradient through
    ``grad_address``). Asked every step for every matrix: the environment and ``out_dtype``
    are read once."""
    return (
        enabled()
        and out_dtype in _KERNEL_DTYPES
        and all(_tensors_fusable(buffer, grad) for grad, buffer in zip(grads, buffers, strict=True))
    )


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def momentum_direction_into(
    grad: Tensor,
    buffer: Tensor,
    out: Tensor,
    momentum: float,
    nesterov: bool,
    grad_address: Tensor | None = None,
    grad_scale: Tensor | None = None,
) -> None:
    """``buffer ← lerp(buffer, grad, 1 − momentum)``; ``out ← lerp(grad, buffer, momentum)``
    (Nesterov) or ``buffer``, rounded once to ``out``'s dtype. ``torch.optim.Muon``'s momentum
    step, reading grad and buffer once and writing buffer and the NS input once. ``out`` may
    be a strided 2-D view (a tall matrix's NS input laid out wide, so that NS's first product
    needs no transposing copy).

    ``grad_address``: a 0-d int64 tensor on ``grad``'s device holding the address the kernel
    reads the gradient from when it runs, not ``grad``'s own (a captured step's gradients are
    new tensors every backward; ``grad`` then gives only shape, dtype and layout). The eager
    path reads ``grad``, which must then be the gradient itself; under CUDA-graph capture it
    raises (the capture would bake in ``grad``'s address).

    ``grad_scale``: a 0-d float32 tensor on ``grad``'s device, read when the pass runs, that
    multiplies the gradient first (a gradient clip deferred to the step,
    :meth:`~dmuon_titan.runtime.state.DMuonState.defer_grad_scale`): the product is rounded
    to float32 as ``grad.mul_(scale)`` of a float32 gradient rounds it."""
    by_address = grad_address is not None
    _check_grad_scale(grad_scale, grad.dtype)
    if _launch_momentum(grad, buffer, out, momentum, nesterov, grad_address, grad_scale):
        return
    if by_address and _capturing():
        raise RuntimeError(
            "momentum_direction_into(grad_address=...) under CUDA-graph capture needs a fused "
            "kernel: Triton, CUDA, contiguous float32/bfloat16/float16 grad and buffer, and a "
            f"float32/bfloat16/float16 output (got grad {grad.dtype}, buffer {buffer.dtype}, "
            f"output {out.dtype})"
        )
    _momentum_direction_eager(grad, buffer, out, momentum, nesterov, grad_scale)


def _launch_momentum(
    grad: Tensor, buffer: Tensor, out: Tensor, momentum, nesterov, grad_address, grad_scale
) -> bool:
    """:func:`momentum_direction_into` by a kernel where one fits (a strided 2-D ``out`` by
    the tiled one, contiguous tensors by the flat one); whether it ran."""
    by_address, scaled = grad_address is not None, grad_scale is not None
    scale_arg = grad_scale if scaled else buffer  # (not read without SCALED)
    grad_arg = grad_address if by_address else grad
    grad_type = _TL_DTYPES.get(grad.dtype) if by_address else None
    # Both lerp weights come from Python, as torch.lerp receives them.
    weights = (float(1 - momentum), float(momentum))
    flags = dict(NESTEROV=nesterov, BY_ADDRESS=by_address, GRAD_TYPE=grad_type, SCALED=scaled)
    if (
        buffer.ndim == 2
        and not out.is_contiguous()
        and _fusable(buffer, grad)
        and _fusable(buffer, out, contiguous_others=False)  # (its device, shape and dtype)
    ):
        rows, cols = buffer.shape
        grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
        strides = (out.stride(0), out.stride(1))
        _momentum_kernel_2d[grid](
            *(grad_arg, buffer, out, scale_arg, rows, cols, *strides, *weights),
            TILE=_TILE,
            **flags,
        )
        return True
    if _fusable(buffer, grad, out):
        grid = (triton.cdiv(grad.numel(), _BLOCK),)
        _momentum_kernel[grid](
            *(grad_arg, buffer, out, scale_arg, grad.numel(), *weights), BLOCK=_BLOCK, **flags
        )
        return True
    return False


def _momentum_direction_eager(
    grad: Tensor, buffer: Tensor, out: Tensor, momentum: float, nesterov: bool, grad_scale
) -> None:
    """:func:`momentum_direction_into` by torch ops (no kernel for these tensors)."""
    if grad_scale is not None:
        grad = grad * grad_scale
    buffer.lerp_(grad, 1 - momentum)
    if nesterov:
        torch.lerp(grad, buffer, momentum, out=out)  # fp32 math, one rounding on store
    else:
        out.copy_(buffer)


def _check_grad_scale(grad_scale: Tensor | None, grad_dtype: torch.dtype) -> None:
    """A gradient factor multiplies float32 gradients only (rounded as their own multiply
    would round them)."""
    if grad_scale is not None and grad_dtype != torch.float32:
        raise ValueError(f"grad_scale needs a float32 gradient, got {grad_dtype}")


def decay_and_update_(
    param: Tensor, update: Tensor, decay: float | Tensor, step: float | Tensor
) -> None:
    """``param ← param · decay − step · update`` (decoupled weight decay, then the step), in
    one pass when fused; eagerly as ``mul_`` then ``add_``. ``update`` may be strided (NS
    returns tall matrices as a transposed view). ``decay`` and ``step`` may be 0-d tensors
    on ``param``'s device, read when the pass runs (a captured step's learning rate changes
    between replays); eagerly the step is then a product of its own, subtracted, where the
    Python-float path's ``add_`` may fuse it (the last bit may differ)."""
    on_device = isinstance(decay, Tensor)
    if param.ndim == 2 and _fusable(param, update, contiguous_others=False):
        rows, cols = param.shape
        grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
        _update_kernel[grid](
            param,
            update,
            rows,
            cols,
            update.stride(0),
            update.stride(1),
            decay if on_device else float(decay),
            step if on_device else float(step),
            SCALARS_ON_DEVICE=on_device,
            TILE=_TILE,
        )
        return
    param.mul_(decay)
    if on_device:  # (a 0-d tensor would not promote a bf16 update: cast it first)
        param.sub_(torch.mul(update.to(param.dtype), step))
    else:
        param.add_(update, alpha=-step)


def momentum_directions_into(
    grads: list[Tensor],
    buffers: list[Tensor],
    outs: list[Tensor],
    momentum: float,
    nesterov: bool,
) -> None:
    """:func:`momentum_direction_into` for lists of tensors as foreach ops: a few launches
    for all of them (the eager path's lerps, in full precision, rounded once by the copy
    into ``outs``). For many small matrices, whose one launch each costs more host time
    than the pass."""
    torch._foreach_lerp_(buffers, grads, 1 - momentum)
    directions = torch._foreach_lerp(grads, buffers, momentum) if nesterov else buffers
    torch._foreach_copy_(outs, directions)


def decay_and_update_many_(
    params: list[Tensor], updates: list[Tensor], decay: float, step: float
) -> None:
    """:func:`decay_and_update_` for lists of same-dtype parameters as foreach ops; the
    updates already in the parameters' dtype and layout (the caller casts its whole batch
    once, not matrix by matrix)."""
    torch._foreach_mul_(params, decay)
    torch._foreach_add_(params, updates, alpha=-step)


#: table addresses must be multiples of this (bytes): the kernels promise it to the compiler,
#: which then loads and stores 16 bytes at a time
TABLE_ALIGNMENT = 16
#: a CUDA grid's second and third dimensions, where the batched passes put their matrices
_MAX_GRID_MATRICES = 65535


def momentum_directions_by_table(
    grads: Tensor,
    buffers: Tensor,
    out: Tensor,
    grad_dtype: torch.dtype,
    buffer_dtype: torch.dtype,
    momentum: float,
    nesterov: bool,
    grad_scale: Tensor | None = None,
    squares: Tensor | None = None,
) -> None:
    """:func:`momentum_direction_into` for a batch of same-shape matrices in one launch: matrix
    ``i``'s gradient and momentum buffer (contiguous, of ``grad_dtype`` and ``buffer_dtype``)
    are at the addresses in ``grads[i]`` and ``buffers[i]`` (int64 device tables, read when
    the pass runs), its direction goes to ``out[i]``. ``out`` is a 3-D batch, contiguous or
    a transposed view of one (tall matrices written wide). Every address must be a multiple
    of :data:`TABLE_ALIGNMENT` (the caller checks). A captured step's form: the per-matrix
    launches it replaces each pay a launch and a ramp-up, and their gradient loads, through
    an address the compiler knows nothing of, were not vectorized. CUDA and Triton only
    (:func:`table_passes_run`).

    ``squares``: float32, ``[len(out), ≥ square_parts(rows, cols)]``, zeros; each program
    writes there the sum of the squares of its directions as ``out``'s dtype rounds them,
    so that Newton–Schulz's norm needs no pass of its own over ``out``
    (``newton_schulz.orthogonalize``'s ``squares``). Deterministic: a fixed number of
    partial sums per matrix, each summed in a fixed order."""
    _check_grad_scale(grad_scale, grad_dtype)
    if out.size(0) > _MAX_GRID_MATRICES:  # (the matrices are a grid dimension)
        for i in range(0, out.size(0), _MAX_GRID_MATRICES):
            part = slice(i, i + _MAX_GRID_MATRICES)
            args = (grads[part], buffers[part], out[part], grad_dtype, buffer_dtype)
            parts = None if squares is None else squares[part]
            momentum_directions_by_table(*args, momentum, nesterov, grad_scale, parts)
        return
    count, rows, cols = out.shape
    _check_squares(squares, count, rows, cols)
    types = dict(GRAD_TYPE=_TL_DTYPES[grad_dtype], BUF_TYPE=_TL_DTYPES[buffer_dtype])
    scaled, summed = grad_scale is not None, squares is not None
    common = dict(NESTEROV=nesterov, SCALED=scaled, SQUARES=summed, **types)
    squares_args = (squares, squares.stride(0)) if summed else (out, 0)
    scale_arg = grad_scale if scaled else grads  # (not read without SCALED)
    weights = (float(1 - momentum), float(momentum))
    tables = (grads, buffers, out, scale_arg, *squares_args)
    if out.stride(2) == 1 and out.stride(1) == cols:
        grid = (triton.cdiv(rows * cols, _BLOCK), count)
        _momentum_table_kernel[grid](
            *tables, rows * cols, out.stride(0), *weights, BLOCK=_BLOCK, **common
        )
        return
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE), count)
    _momentum_table_kernel_2d[grid](
        *tables,
        rows,
        cols,
        *out.stride(),
        *weights,
        TILE=_TILE,
        **common,
    )


def _check_squares(squares: Tensor | None, count: int, rows: int, cols: int) -> None:
    """``squares`` (if any) fits :func:`momentum_directions_by_table`'s partial sums."""
    if squares is not None and (
        squares.dtype != torch.float32
        or squares.size(0) != count
        or squares.size(1) < square_parts(rows, cols)
        or squares.stride(1) != 1
    ):
        raise ValueError(
            f"squares must be float32 [{count}, >= {square_parts(rows, cols)}] with "
            f"contiguous rows, got {squares.dtype} {tuple(squares.shape)}"
        )


def square_parts(rows: int, cols: int) -> int:
    """At most this many partial sums of squares per rows×cols matrix from
    :func:`momentum_directions_by_table` (one per program, of either of its kernels)."""
    return max(-(-rows * cols // _BLOCK), -(-rows // _TILE) * -(-cols // _TILE))


def decay_and_update_by_table(
    params: Tensor, param_dtype: torch.dtype, updates: Tensor, decay: Tensor, step: Tensor
) -> None:
    """:func:`decay_and_update_` for a batch of same-shape matrices in one launch: matrix
    ``i`` (contiguous, of ``param_dtype``) is at the address in ``params[i]`` (an int64
    device table, aligned as :func:`momentum_directions_by_table` requires), its update is
    ``updates[i]`` (a 3-D batch, possibly a transposed view); ``decay`` and ``step`` are 0-d
    device tensors read when the pass runs. CUDA and Triton only."""
    if updates.size(0) > _MAX_GRID_MATRICES:  # (the matrices are a grid dimension)
        for i in range(0, updates.size(0), _MAX_GRID_MATRICES):
            part = slice(i, i + _MAX_GRID_MATRICES)
            decay_and_update_by_table(params[part], param_dtype, updates[part], decay, step)
        return
    count, rows, cols = updates.shape
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE), count)
    _update_table_kernel[grid](
        params,
        updates,
        rows,
        cols,
        updates.stride(0),
        updates.stride(1),
        updates.stride(2),
        decay,
        step,
        PARAM_TYPE=_TL_DTYPES[param_dtype],
        TILE=_TILE,
    )


def table_passes_run(device: torch.device, *dtypes: torch.dtype) -> bool:
    """Whether the ``*_by_table`` passes run on ``device`` for batches and matrices of
    ``dtypes`` (Triton, CUDA, the kernels' dtypes)."""
    return (
        enabled()
        and torch.device(device).type == "cuda"
        and all(d in _KERNEL_DTYPES for d in dtypes)
    )


def divide_(matrices: Tensor, norms: Tensor) -> Tensor:
    """``matrices ← matrices / norms`` in place: one matrix (``norms`` 0-d or 1×1) or a 3-D
    batch (``norms`` of shape (B, 1, 1)), as ``Tensor.div_`` rounds it (fp32 division,
    round to nearest, one rounding to the matrices' dtype). Eager ``div_`` broadcasts the
    per-matrix norm through an unvectorized kernel, a visible share of a matrix's
    Newton–Schulz; fused, one vectorized pass."""
    batch = matrices.size(0) if matrices.ndim == 3 else 1
    # Elementwise: a transposed view (NS's tall matrices) is divided through its storage.
    storage = matrices if matrices.is_contiguous() else matrices.mT
    if (
        matrices.ndim in (2, 3)
        and norms.numel() == batch
        and norms.dtype == matrices.dtype
        and norms.device == matrices.device
        and _fusable(storage)
    ):
        per_matrix = matrices.numel() // max(batch, 1)
        grid = (triton.cdiv(per_matrix, _BLOCK), batch)
        _divide_kernel[grid](storage, norms.reshape(batch), per_matrix, BLOCK=_BLOCK)
        return matrices
    return matrices.div_(norms)


if triton is not None:

    @triton.jit
    def _divide_kernel(x_ptr, norm_ptr, per_matrix, BLOCK: tl.constexpr):
        matrix = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < per_matrix
        ptrs = x_ptr + matrix * per_matrix + offsets
        norm = tl.load(norm_ptr + matrix).to(tl.float32)
        x = tl.load(ptrs, mask=mask).to(tl.float32)
        tl.store(ptrs, tl.div_rn(x, norm).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _lerp(start, end, weight):
        # torch.lerp's form: from the nearer end, so weights 0 and 1 are exact.
        return tl.where(
            weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight)
        )

    @triton.jit
    def _tile(rows, cols, TILE: tl.constexpr):
        # This program's TILE×TILE tile of a rows×cols matrix: its rows, columns and mask.
        r = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
        return r, c, (r[:, None] < rows) & (c[None, :] < cols)

    @triton.jit
    def _momentum_step(
        grad_ptr,
        buf_ptr,
        scale_ptr,
        offsets,
        mask,
        buffer_weight,
        direction_weight,
        NESTEROV: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        # The buffer's lerp, stored; the direction (fp32) from the stored buffer.
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        if SCALED:
            # The product rounded on its own, as grad.mul_(scale) rounds it: an explicit fma
            # with +0 (a plain multiply could be contracted into the lerp's arithmetic; +0,
            # unlike −0, is no identity the compiler may fold away).
            grad = tl.fma(grad, tl.load(scale_ptr), 0.0)
        buf = tl.load(buf_ptr + offsets, mask=mask).to(tl.float32)
        buf = _lerp(buf, grad, buffer_weight)
        buf = buf.to(buf_ptr.dtype.element_ty)
        tl.store(buf_ptr + offsets, buf, mask=mask)
        buf = buf.to(tl.float32)  # the stored value, as the eager path reads it back
        if NESTEROV:
            return _lerp(grad, buf, direction_weight)
        return buf

    @triton.jit
    def _gradient(grad_ptr, BY_ADDRESS: tl.constexpr, GRAD_TYPE: tl.constexpr):
        # BY_ADDRESS: grad_ptr points at an int64 slot holding the address of the gradient
        # (of GRAD_TYPE), read now: a captured step's gradients move between replays. (One
        # return: the compiler visits what follows a return in a constexpr branch.)
        if BY_ADDRESS:
            grad_ptr = tl.load(grad_ptr).to(tl.pointer_type(GRAD_TYPE))
        return grad_ptr

    @triton.jit
    def _momentum_kernel(
        grad_ptr,
        buf_ptr,
        out_ptr,
        scale_ptr,
        n,
        buffer_weight,
        direction_weight,
        NESTEROV: tl.constexpr,
        BY_ADDRESS: tl.constexpr,
        GRAD_TYPE: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        grad_ptr = _gradient(grad_ptr, BY_ADDRESS, GRAD_TYPE)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        direction = _momentum_step(
            grad_ptr,
            buf_ptr,
            scale_ptr,
            offsets,
            mask,
            buffer_weight,
            direction_weight,
            NESTEROV,
            SCALED,
        )
        tl.store(out_ptr + offsets, direction.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _momentum_kernel_2d(
        grad_ptr,
        buf_ptr,
        out_ptr,
        scale_ptr,
        rows,
        cols,
        out_row_stride,
        out_col_stride,
        buffer_weight,
        direction_weight,
        NESTEROV: tl.constexpr,
        BY_ADDRESS: tl.constexpr,
        GRAD_TYPE: tl.constexpr,
        SCALED: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # _momentum_kernel by 2-D tiles, for an output of other strides (a transposed view).
        grad_ptr = _gradient(grad_ptr, BY_ADDRESS, GRAD_TYPE)
        r, c, mask = _tile(rows, cols, TILE)
        direction = _momentum_step(
            grad_ptr,
            buf_ptr,
            scale_ptr,
            r[:, None] * cols + c[None, :],
            mask,
            buffer_weight,
            direction_weight,
            NESTEROV,
            SCALED,
        )
        out_offsets = r[:, None] * out_row_stride + c[None, :] * out_col_stride
        tl.store(out_ptr + out_offsets, direction.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _update_kernel(
        param_ptr,
        update_ptr,
        rows,
        cols,
        update_row_stride,
        update_col_stride,
        decay,
        step,
        SCALARS_ON_DEVICE: tl.constexpr,
        TILE: tl.constexpr,
    ):
        r, c, mask = _tile(rows, cols, TILE)
        param_offsets = r[:, None] * cols + c[None, :]
        update_offsets = r[:, None] * update_row_stride + c[None, :] * update_col_stride
        if SCALARS_ON_DEVICE:  # pointers to 0-d tensors, read at run time
            decay = tl.load(decay).to(tl.float32)
            step = tl.load(step).to(tl.float32)
        param = tl.load(param_ptr + param_offsets, mask=mask).to(tl.float32)
        update = tl.load(update_ptr + update_offsets, mask=mask).to(tl.float32)
        param = param * decay - step * update
        tl.store(param_ptr + param_offsets, param.to(param_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _table_pointer(table, matrix, TYPE: tl.constexpr):
        # Matrix ``matrix``'s address from an int64 table, which the caller checked to be
        # 16-byte aligned: said so to the compiler, its loads and stores are vectorized.
        return tl.multiple_of(tl.load(table + matrix).to(tl.pointer_type(TYPE)), 16)

    @triton.jit
    def _momentum_table_kernel(
        grad_table,
        buf_table,
        out_ptr,
        scale_ptr,
        squares_ptr,
        squares_stride,
        n,
        out_matrix_stride,
        buffer_weight,
        direction_weight,
        NESTEROV: tl.constexpr,
        GRAD_TYPE: tl.constexpr,
        BUF_TYPE: tl.constexpr,
        SCALED: tl.constexpr,
        SQUARES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # _momentum_kernel for matrix program_id(1) of a batch (its tensors by table).
        matrix = tl.program_id(1)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        direction = _momentum_step(
            _table_pointer(grad_table, matrix, GRAD_TYPE),
            _table_pointer(buf_table, matrix, BUF_TYPE),
            scale_ptr,
            offsets,
            mask,
            buffer_weight,
            direction_weight,
            NESTEROV,
            SCALED,
        )
        out_ptr += matrix.to(tl.int64) * out_matrix_stride
        direction = direction.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, direction, mask=mask)
        if SQUARES:  # (masked lanes: 0)
            square = direction.to(tl.float32) * direction.to(tl.float32)
            part = squares_ptr + matrix.to(tl.int64) * squares_stride + tl.program_id(0)
            tl.store(part, tl.sum(tl.where(mask, square, 0.0), axis=0))

    @triton.jit
    def _momentum_table_kernel_2d(
        grad_table,
        buf_table,
        out_ptr,
        scale_ptr,
        squares_ptr,
        squares_stride,
        rows,
        cols,
        out_matrix_stride,
        out_row_stride,
        out_col_stride,
        buffer_weight,
        direction_weight,
        NESTEROV: tl.constexpr,
        GRAD_TYPE: tl.constexpr,
        BUF_TYPE: tl.constexpr,
        SCALED: tl.constexpr,
        SQUARES: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # _momentum_kernel_2d for matrix program_id(2) of a batch (its tensors by table).
        matrix = tl.program_id(2)
        r, c, mask = _tile(rows, cols, TILE)
        direction = _momentum_step(
            _table_pointer(grad_table, matrix, GRAD_TYPE),
            _table_pointer(buf_table, matrix, BUF_TYPE),
            scale_ptr,
            r[:, None] * cols + c[None, :],
            mask,
            buffer_weight,
            direction_weight,
            NESTEROV,
            SCALED,
        )
        out_ptr += matrix.to(tl.int64) * out_matrix_stride
        out_offsets = r[:, None] * out_row_stride + c[None, :] * out_col_stride
        direction = direction.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_offsets, direction, mask=mask)
        if SQUARES:
            square = tl.where(mask, direction.to(tl.float32) * direction.to(tl.float32), 0.0)
            program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            part = squares_ptr + matrix.to(tl.int64) * squares_stride + program
            tl.store(part, tl.sum(tl.sum(square, axis=1), axis=0))

    @triton.jit
    def _update_table_kernel(
        param_table,
        update_ptr,
        rows,
        cols,
        update_matrix_stride,
        update_row_stride,
        update_col_stride,
        decay_ptr,
        step_ptr,
        PARAM_TYPE: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # _update_kernel (scalars on the device) for matrix program_id(2) of a batch.
        matrix = tl.program_id(2)
        param_ptr = _table_pointer(param_table, matrix, PARAM_TYPE)
        update_ptr += matrix.to(tl.int64) * update_matrix_stride
        r, c, mask = _tile(rows, cols, TILE)
        param_offsets = r[:, None] * cols + c[None, :]
        update_offsets = r[:, None] * update_row_stride + c[None, :] * update_col_stride
        decay = tl.load(decay_ptr).to(tl.float32)
        step = tl.load(step_ptr).to(tl.float32)
        param = tl.load(param_ptr + param_offsets, mask=mask).to(tl.float32)
        update = tl.load(update_ptr + update_offsets, mask=mask).to(tl.float32)
        param = param * decay - step * update
        tl.store(param_ptr + param_offsets, param.to(PARAM_TYPE), mask=mask)
