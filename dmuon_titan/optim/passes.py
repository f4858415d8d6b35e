"""The Muon step's passes over matrices: momentum, Newton–Schulz and the update.

One chunk (a Newton–Schulz batch of same-shape matrices, :func:`~.step_plan.ns_chunks`) takes
one of three pass variants, chosen once per chunk by :func:`pass_for`:

- :func:`grouped_pass`: eager, several small whole matrices as foreach ops (a few launches);
- :func:`per_matrix_pass`: one momentum and one update pass per matrix, eagerly or in a
  captured step (then reading each gradient through its address slot);
- :func:`table_pass`: a captured step's one launch per run of one shape, reading the
  matrices, buffers and gradients through the step's address tables.

Expert stacks (:func:`step_stack`) and matrices whose Newton–Schulz a tensor-parallel row
shares (:func:`step_shared`) have passes of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..ops import fused, newton_schulz, update
from ..ops.newton_schulz import Coefficients
from ..runtime.owned_param import dedicated_of
from ..timing import PhaseTimer
from .layout import MatrixLayout
from .step_plan import ns_batch_size, ns_chunks, runs, shaped_as

#: Same-shape matrices of at most this many elements take their momentum and update passes
#: as foreach ops over the whole chunk (a few launches) rather than one fused kernel each: at
#: this size a kernel's launch outweighs its pass, and a one-GPU step of a small model is
#: host-bound (docs/design_notes.md#grouped-passes).
GROUPED_PASS_NUMEL = 1 << 22
#: elements per foreach group of those passes (bounds their full-precision temporaries, 256
#: MiB in float32; fewer groups, fewer launches)
GROUPED_PASS_SLICE_NUMEL = 1 << 26


class StepScalars(Protocol):
    """What a captured step's passes read of its device values
    (:class:`dmuon_titan.optim.captured.StepScalars`)."""

    decay: torch.Tensor
    grad_scale: torch.Tensor
    gradients: torch.Tensor
    buffers: torch.Tensor
    params: torch.Tensor

    def step(self, shape) -> torch.Tensor: ...

    def gradient_slot(self, param: torch.Tensor) -> torch.Tensor: ...

    def table_rows(self, params: list[torch.Tensor]) -> slice | None: ...


@dataclasses.dataclass
class MatrixStep:
    """What the passes of one Muon-group step read: the group's hyper-parameters, the
    normalized NS coefficients, the NS batching, the momentum buffers, the layout and the
    phase timer."""

    group: dict[str, Any]
    coefficients: Sequence[Coefficients]
    algorithm: str
    batch_numel: int
    unbatched_numel: int | None
    buffer: Callable[[torch.Tensor], torch.Tensor]
    layout: MatrixLayout
    timer: PhaseTimer

    def chunks(self, todo: list[torch.Tensor], captured: bool) -> list[list[torch.Tensor]]:
        """``todo``'s NS batches; the captured step's batch a matrix with its transposes (a
        tall matrix's NS runs on its transpose anyway), in runs of one shape: one batch
        instead of two, which the products fill better."""
        return ns_chunks(todo, self.batch_numel, self.unbatched_numel, merge_transposes=captured)

    def ns(self, batch: torch.Tensor, squares=None, timed: bool = True) -> torch.Tensor:
        """Newton–Schulz of ``batch`` (overwritten: its own scratch), timed as ``ns``
        unless captured (no events inside a graph)."""
        g = self.group
        if timed:
            self.timer.start("ns")
        out = newton_schulz.orthogonalize(
            batch,
            self.coefficients,
            g["ns_steps"],
            g["eps"],
            g["ns_dtype"],
            self.algorithm,
            overwrite_input=True,
            squares=squares,
            preconditioner=g["ns_preconditioner"],
        )
        if timed:
            self.timer.stop("ns")
        return out

    def write_direction(self, p, out, grad_address=None, grad_scale=None) -> None:
        self.layout.write_direction(p, self.buffer(p), self.group, out, grad_address, grad_scale)

    def update(self, p: torch.Tensor, ortho: torch.Tensor) -> None:
        """:func:`update.apply_update` of one matrix by its orthogonalized direction (to the
        part the layout says this rank updates)."""
        target, ortho = self.layout.target(p, ortho)
        g = self.group
        update.apply_update(
            target,
            ortho,
            lr=g["lr"],
            weight_decay=g["weight_decay"],
            adjust_lr_fn=g["adjust_lr_fn"],
            shape=p.shape,
        )


def step_matrices(
    ctx: MatrixStep,
    chunks: list[list[torch.Tensor]],
    streams: list | None = None,
    scalars: StepScalars | None = None,
) -> None:
    """Momentum, NS and the update of ``chunks``, each on its stream of ``streams`` (None:
    the current one; side streams are forked from the current stream and joined back)."""
    streams = streams or [None] * len(chunks)
    sides = list(dict.fromkeys(s for s in streams if s is not None))
    current = torch.cuda.current_stream(chunks[0][0].device) if sides else None
    for side in sides:  # (the inputs were written on the current stream)
        side.wait_stream(current)
    try:
        for chunk, stream in zip(chunks, streams, strict=True):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                pass_for(ctx, chunk, scalars)(ctx, chunk, scalars)
    finally:
        for side in sides:  # (what follows the step sees every chunk's update)
            current.wait_stream(side)


def pass_for(ctx: MatrixStep, chunk: list[torch.Tensor], scalars: StepScalars | None):
    """The pass variant of ``chunk``: grouped or per matrix eagerly; by table or per
    matrix in a captured step (``scalars``)."""
    if scalars is None:
        return grouped_pass if _groupable(ctx, chunk) else per_matrix_pass
    return table_pass if _table_readable(ctx, chunk, scalars) else per_matrix_pass


def _groupable(ctx: MatrixStep, chunk: list[torch.Tensor]) -> bool:
    """Several small whole matrices (the owners' masters, not shards), and not float16 NS
    (whose directions are normalized first, one by one)."""
    return (
        len(chunk) > 1
        and chunk[0].numel() <= GROUPED_PASS_NUMEL
        and ctx.group["ns_dtype"] != torch.float16
        and ctx.layout.whole_matrices
        and all(type(p.grad) is torch.Tensor and type(p.data) is torch.Tensor for p in chunk)
    )


def _table_readable(ctx: MatrixStep, chunk: list[torch.Tensor], scalars: StepScalars) -> bool:
    """Consecutive aligned rows in the step's tables, contiguous matrices (gradients and
    buffers are, or the step is not captured), one dtype per kind, and kernels for them."""
    return (
        scalars.table_rows(chunk) is not None
        and all(p.data.is_contiguous() for p in chunk)
        and len({p.grad.dtype for p in chunk}) == 1
        and len({p.dtype for p in chunk}) == 1
        and len({ctx.buffer(p).dtype for p in chunk}) == 1
        and fused.table_passes_run(
            chunk[0].device, ctx.group["ns_dtype"], chunk[0].dtype, chunk[0].grad.dtype
        )
    )


def _ns_batch(ctx: MatrixStep, chunk: list[torch.Tensor], wide: bool) -> torch.Tensor:
    """The NS-dtype buffer the chunk's directions are written into (one matrix alone for a
    chunk of one), NS's own scratch after: no full-precision direction is materialized.
    ``wide``: a tall shape stored transposed, so that NS's first product needs no
    transposing copy (docs/design_notes.md#wide-directions)."""
    rows, cols = chunk[0].shape[-2], chunk[0].shape[-1]
    layout = (min(rows, cols), max(rows, cols)) if wide else (rows, cols)
    return torch.empty(
        (*(() if len(chunk) == 1 else (len(chunk),)), *layout),
        dtype=ctx.group["ns_dtype"],
        device=chunk[0].device,
    )


def _slices(chunk: list[torch.Tensor]) -> list[range]:
    """``range``s of ``chunk`` of at most ``GROUPED_PASS_SLICE_NUMEL`` elements each."""
    per = max(1, GROUPED_PASS_SLICE_NUMEL // chunk[0].numel())
    return [range(i, min(i + per, len(chunk))) for i in range(0, len(chunk), per)]


def grouped_pass(ctx: MatrixStep, chunk: list[torch.Tensor], scalars: None = None) -> None:
    """Eager foreach passes: the same lerps in full precision, rounded once into the NS
    dtype; each slice of the orthogonalized batch brought to the masters' dtype and layout
    by one copy (not one per matrix). The foreach passes keep the tall layout (their copy
    into a strided view would be the transposing copy again)."""
    batch = _ns_batch(ctx, chunk, wide=False)
    for part in _slices(chunk):
        fused.momentum_directions_into(
            [chunk[i].grad for i in part],
            [ctx.buffer(chunk[i]) for i in part],
            [batch[i] for i in part],
            ctx.group["momentum"],
            ctx.group["nesterov"],
        )
    orthos = ctx.ns(batch)
    g = ctx.group
    for part in _slices(chunk):
        steps = orthos[part.start : part.stop].to(
            chunk[0].dtype, memory_format=torch.contiguous_format
        )
        update.apply_updates(
            [chunk[i].data for i in part],
            list(steps.unbind(0)),
            lr=g["lr"],
            weight_decay=g["weight_decay"],
            adjust_lr_fn=g["adjust_lr_fn"],
        )


def per_matrix_pass(
    ctx: MatrixStep, chunk: list[torch.Tensor], scalars: StepScalars | None = None
) -> None:
    """One momentum pass and one update per matrix; in a captured step (``scalars``) each
    gradient is read through its address slot and the lr-dependent factors come from the
    step's device scalars. A chunk may hold a matrix and its transposes: NS's batch is wide,
    the tall ones' directions written into it transposed."""
    single = len(chunk) == 1
    batch = _ns_batch(ctx, chunk, wide=True)
    for i, p in enumerate(chunk):
        slot = scale = None
        if scalars is not None:
            slot = scalars.gradient_slot(p)
            scale = scalars.grad_scale if p.grad.dtype == torch.float32 else None
        ctx.write_direction(p, shaped_as(batch if single else batch[i], p.shape), slot, scale)
    out = ctx.ns(batch, timed=scalars is None)
    orthos = [out] if single else out.unbind(0)
    for p, ortho in zip(chunk, orthos, strict=True):
        ortho = shaped_as(ortho, p.shape)  # (NS's is wide)
        if scalars is not None:
            fused.decay_and_update_(p.data, ortho, scalars.decay, scalars.step(p.shape))
        else:
            ctx.update(p, ortho)
    del orthos


def table_pass(ctx: MatrixStep, chunk: list[torch.Tensor], scalars: StepScalars) -> None:
    """A captured step's momentum and update passes, one launch per run of one shape through
    the step's tables; the momentum pass also writes partial sums of the directions' squares
    where NS folds its normalization, so NS reads no matrix for its norms
    (docs/design_notes.md#norms-from-the-momentum-pass)."""
    g = ctx.group
    batch = _ns_batch(ctx, chunk, wide=True)
    layout = tuple(batch.shape[-2:])
    squares = None
    if newton_schulz.uses_squares(
        layout,
        ctx.algorithm,
        g["ns_steps"],
        g["eps"],
        batch.dtype,
        batch.device,
        g["ns_preconditioner"],
    ):
        parts = fused.square_parts(*layout)
        squares = torch.zeros(len(chunk), parts, dtype=torch.float32, device=batch.device)
    start = 0
    for run, directions in runs(chunk, batch):
        rows = scalars.table_rows(run)
        float32 = run[0].grad.dtype == torch.float32
        fused.momentum_directions_by_table(
            scalars.gradients[rows],
            scalars.buffers[rows],
            directions,
            run[0].grad.dtype,
            ctx.buffer(run[0]).dtype,
            g["momentum"],
            g["nesterov"],
            scalars.grad_scale if float32 else None,
            None if squares is None else squares[start : start + len(run)],
        )
        start += len(run)
    out = ctx.ns(batch, squares, timed=False)
    for run, ortho in runs(chunk, out):
        fused.decay_and_update_by_table(
            scalars.params[scalars.table_rows(run)],
            run[0].dtype,
            ortho,
            scalars.decay,
            scalars.step(run[0].shape),
        )


def step_stack(ctx: MatrixStep, p: torch.Tensor) -> None:
    """Muon on each matrix of a stack (this rank's experts): the momentum step and the
    update run on the whole piece at once (elementwise, so per matrix all the same); NS
    runs on batches of at most ``batch_numel`` elements (one matrix if 0)."""
    g = ctx.group
    directions = torch.empty(p.shape, dtype=g["ns_dtype"], device=p.device)
    ctx.write_direction(p, directions)
    per_batch = ns_batch_size(p.shape[1:].numel(), ctx.batch_numel, ctx.unbatched_numel)
    for start in range(0, p.shape[0], per_batch):
        ortho = ctx.ns(directions[start : start + per_batch])
        update.apply_update(
            p[start : start + per_batch],
            ortho,
            lr=g["lr"],
            weight_decay=g["weight_decay"],
            adjust_lr_fn=g["adjust_lr_fn"],
        )


def step_shared(ctx: MatrixStep, params: list[torch.Tensor], shared) -> None:
    """Momentum step and update of the shared matrices this rank owns (``params``), their
    Newton–Schulz computed by the row together (:mod:`dmuon_titan.runtime.shared_ns`)."""
    g = ctx.group
    inputs = {}
    for p in params:
        inputs[dedicated_of(p).index] = direction = torch.empty(
            p.shape, dtype=g["ns_dtype"], device=p.device
        )
        ctx.write_direction(p, direction)
    ctx.timer.start("ns")
    orthos = shared.orthogonalize(
        inputs,
        ctx.coefficients,
        g["ns_steps"],
        g["eps"],
        g["ns_dtype"],
        g["ns_preconditioner"],
    )
    ctx.timer.stop("ns")
    del inputs
    for p in params:
        ctx.update(p, orthos.pop(dedicated_of(p).index))
