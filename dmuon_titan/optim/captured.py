"""The captured step: a CUDA graph of the Muon group's step on one rank.

A small model's training step on one GPU is host-bound: the GPU waits while Python launches
kernels, and the Muon step launches over a hundred (momentum, Newton–Schulz, update per
same-shape chunk) where fused AdamW launches about ten. Captured once, the whole Muon step
is one graph launch, whatever its number of kernels.

What a replay reads and writes must stay where it was at capture: the masters and the
momentum buffers do. The gradients do not: torch allocates them anew each backward after
``zero_grad()``, and where they land depends on everything else allocated meanwhile. So the
graph does not read them where they were at capture. Each matrix's momentum pass is a fused
kernel (``fused``) that loads its gradient's address from a slot of a device table when it
runs, and before each replay the table is pointed at the current gradients (one small copy,
only when an address changed). ``zero_grad`` is torch's: gradients are dropped
(``set_to_none``), and backward hands over new ones without the read-modify-write of
accumulating into zeroed tensors (16 bytes per parameter, and the gradients no longer held
through the forward: docs/design_notes.md#gradients-dropped-not-zeroed). Only a step whose every matrix takes
that kernel is captured (CUDA, Triton, contiguous float32/bfloat16/float16 gradients and
momentum buffers, float32/bfloat16 NS: :meth:`CapturedStep.eligible`, checked every step); others
step eagerly.

Each step compares the matrices (which, their addresses and shapes), their buffers'
addresses, their gradients' dtypes and the hyper-parameters baked into the graph with the
capture's; on any difference the step is captured again (a matrix without a gradient is left out, as
torch.optim skips it, so the set changes), and when that happens more than once in
``REPLAYS_PER_CAPTURE`` steps the graph is given up for good (eager steps from then on). The
learning rate and weight decay are not baked in: they enter through device scalars refreshed
before each replay (LR schedules keep working), as does a gradient clip's factor that the clip
left owed (``clip_grad_norm_(defer_owned=True)``, what the torchtitan plugin does): each
momentum pass multiplies its float32 gradient by it as it reads it, which saves the clip's own
pass over the matrices' gradients (the gradients still owe it after the step:
``DMuonState.defer_grad_scale``). In the graph the momentum and update passes are fused
kernels, one launch per run of same-shape matrices of a chunk: they read each matrix, its
momentum buffer and its gradient through device tables of addresses (:attr:`StepScalars.params`,
``.buffers``, ``.gradients``), which they promise the compiler are 16-byte aligned (vector loads
and stores); rows that are not take one launch per matrix, and a gradient that moves off
alignment where a recorded pass promised it records the step anew. A step of two chunks (NS batches) or
more is recorded on :data:`STEP_LANES` streams, forked from the capture's and joined back,
so a replay runs them side by side. The eager step's foreach
passes over small matrices, which save host launches, move three times the bytes. The two may
round the last bit differently.

With ``async_step`` a replay runs on a side stream and ``step()`` returns before it is done.
What that buys is host time: torchtitan copies each batch to the GPU with a blocking copy,
which waits for everything queued on the compute stream, so a step queued there holds the
host until Newton–Schulz is over and only then lets it queue the next forward. On its own
stream the step overlaps the host's work on the next step. What reads or writes what the
replay touches makes its stream wait for the replay's event on the GPU (``wait``): the
model's forward (the root, and every boundary while a replay may still run:
``DMuonState.arm_step_waits``), ``state_dict()``/``load_state_dict()``
of the model and of the optimizer, DMuon's state-dict functions,
``wait_all_replicate_broadcasts``, and a ``zero_grad`` that zeroes in place (torchtitan's
checkpoint save also waits on the host, for DCP may stage on a stream of its own). The
allocator is told that the side stream uses the tensors the graph touches (``record_stream``,
once per capture), so memory freed meanwhile (``del model``) is not handed out under it; each
replay's gradients are held instead until the next ``wait``, after which the current stream
reuses their memory only behind the replay (a ``zero_grad`` right after the step drops them:
``record_stream`` on each would cost the host an allocator call per matrix, and an event per
block when it is freed). Same kernels, same inputs: the results are the
current-stream replay's, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..ops import fused, update
from ..ops.ns_cost import orthogonalize_flops
from .passes import MatrixStep, step_matrices
from .step_plan import StepPaths, chunk_lanes

logger = logging.getLogger(__name__)

#: A captured step runs its chunks on this many streams (:meth:`CapturedStep.lane_streams`):
#: each chunk's momentum, NS and update is a chain of dependent launches, and the chunks do
#: not depend on each other, so on two streams one chain's kernels take the SMs another's
#: last wave leaves idle. Same kernels, same results. Memory: the graph's private pool holds
#: about the sum of the lanes' peaks instead of the largest chunk's, plus the side stream's
#: cuBLAS workspace (docs/design_notes.md#step-lanes). Read when the step is captured.
STEP_LANES = 2

#: captures allowed before the rate rule below applies
MAX_RECAPTURES = 3
#: beyond those, at least this many replays per capture, or the graph is given up: the
#: occasional move (after a validation pass, say) is recaptured, addresses that move every
#: few steps make capture a loss
REPLAYS_PER_CAPTURE = 20


class StepScalars:
    """Device values the captured step reads when it runs: the lr-dependent factors (the
    decay ``1 − lr·wd`` and, per matrix shape, the step ``adjusted_lr``) and the factor on
    float32 gradients (a clip's, deferred to the step; else 1), refreshed by kernel launches
    (``fill_``, ``copy_``), and the table of the gradients' addresses (:meth:`point_at`)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.decay = torch.ones((), device=device, dtype=dtype)
        #: multiplies each float32 gradient as the momentum pass reads it
        self.grad_scale = torch.ones((), device=device, dtype=torch.float32)
        self._grad_scale_is_one = True
        self.steps: dict[tuple[int, ...], torch.Tensor] = {}
        #: one int64 slot per stepped matrix (in the order :meth:`point_at` got them): the
        #: address of its gradient, which the momentum kernel loads when it runs
        self.gradients = torch.zeros(0, dtype=torch.int64, device=device)
        self._rows: dict[int, int] = {}  # id(matrix) → its row of the tables
        self._addresses: list[int] = []  # what the table holds
        #: the matrices' and their momentum buffers' addresses, in the rows of
        #: :attr:`gradients` (fixed while a graph holds: they are part of its key)
        self.params = torch.zeros(0, dtype=torch.int64, device=device)
        self.buffers = torch.zeros(0, dtype=torch.int64, device=device)
        # Per row, whether its matrix and buffer are 16-byte aligned, and the rows a batched
        # pass reads (it promises the compiler aligned addresses, fused.TABLE_ALIGNMENT):
        # their gradients must stay aligned for the recorded graph to be replayed.
        self._aligned: list[bool] = []
        self._promised: set[int] = set()

    def step(self, shape) -> torch.Tensor:
        key = tuple(shape)
        if key not in self.steps:
            self.steps[key] = torch.zeros((), device=self.device, dtype=self.dtype)
        return self.steps[key]

    def refresh(self, group: dict[str, Any], grad_scale: torch.Tensor | None = None) -> None:
        """Set the scalars for the next run: ``group``'s lr and weight decay, and
        ``grad_scale`` (0-d; None: 1) as the gradients' factor."""
        self.decay.fill_(1 - group["lr"] * group["weight_decay"])
        for shape, value in self.steps.items():
            value.fill_(update.adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))
        if grad_scale is not None:
            self.grad_scale.copy_(grad_scale)
        elif not self._grad_scale_is_one:
            self.grad_scale.fill_(1.0)
        self._grad_scale_is_one = grad_scale is None

    def gradient_slot(self, param: torch.Tensor) -> torch.Tensor:
        """The 0-d int64 slot holding ``param``'s gradient address (its row of
        :attr:`gradients`)."""
        return self.gradients[self._rows[id(param)]]

    def table_rows(self, params: list[torch.Tensor]) -> slice | None:
        """The rows of the tables (:attr:`gradients`, :attr:`params`, :attr:`buffers`) that
        hold ``params``, when they are consecutive ones and the addresses in them (the
        current gradients' too) are aligned, so that a batched pass may read them; else
        None. Rows handed out are promised aligned (:meth:`promises_hold`)."""
        start = self._rows[id(params[0])]
        rows = range(start, start + len(params))
        if not all(self._rows[id(p)] == row for p, row in zip(params, rows, strict=True)):
            return None
        alignment = fused.TABLE_ALIGNMENT
        if not all(self._aligned[r] and self._addresses[r] % alignment == 0 for r in rows):
            return None
        self._promised.update(rows)
        return slice(rows.start, rows.stop)

    def promises_hold(self, addresses: list[int]) -> bool:
        """Whether ``addresses`` (the gradients', by row) are aligned in every row a
        recorded batched pass reads (:meth:`table_rows`)."""
        return all(addresses[r] % fused.TABLE_ALIGNMENT == 0 for r in self._promised)

    def point_at(
        self,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        addresses: list[int],
        fresh_table: bool = False,
    ) -> None:
        """Make the table hold ``addresses``, ``params``' gradient addresses (slot i:
        ``params[i]``), by one copy issued on the current stream, and only if one changed;
        ``fresh_table``: a table of its own, for a new capture (a held graph reads its own
        table), with the tables of the matrices' and their momentum ``buffers``' addresses
        (in ``params``' order) too. The caller orders it: after the last replay that read the
        table (``Muon``'s step pre-hook waits for it), before the next (a side-stream replay
        waits for the current stream)."""
        if fresh_table or self.gradients.numel() != len(params):
            self.gradients = torch.zeros(len(params), dtype=torch.int64, device=self.device)
            self._rows = {id(p): i for i, p in enumerate(params)}
            self._addresses = []
            fixed = [[p.data_ptr() for p in params], [b.data_ptr() for b in buffers]]
            alignment = fused.TABLE_ALIGNMENT
            self._aligned = [
                p % alignment == 0 and b % alignment == 0 for p, b in zip(*fixed, strict=True)
            ]
            self._promised = set()
            # (outside any capture: run() points the tables before it records)
            self.params, self.buffers = (
                torch.tensor(a, dtype=torch.int64, device=self.device) for a in fixed
            )
        if addresses == self._addresses:
            return
        # Pinned, so that the copy is asynchronous (from pageable memory it would first
        # wait for the stream); the host allocator keeps the block until the copy is done.
        pinned = self.device.type == "cuda"
        host = torch.tensor(addresses, dtype=torch.int64, pin_memory=pinned)
        self.gradients.copy_(host, non_blocking=pinned)
        self._addresses = addresses


def _current_raw_stream(device: torch.device) -> int | None:
    """The current CUDA stream's handle on ``device``, cheaply (no ``torch.cuda.Stream``
    made); None where torch does not offer it."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return (
        get(device.index if device.index is not None else torch.cuda.current_device())
        if get
        else None
    )


class MuonStepGraph:
    """Capture and replay of one Muon group's step (see the module doc)."""

    def __init__(self, async_step: bool = False) -> None:
        #: replay on :attr:`stream` and return at once (see the module doc)
        self.async_step = async_step
        #: the side stream replays run on, and the event of the last replay; None until the
        #: first asynchronous replay
        self.stream: torch.cuda.Stream | None = None
        self.done: torch.cuda.Event | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None
        self.scalars: StepScalars | None = None
        #: the first step runs the same kernels eagerly (JIT compiles, library handles)
        self.warmed = False
        self.captures = 0
        self.replays = 0
        self.disabled = False
        #: the matrices the held graph steps
        self.params: list[torch.Tensor] = []
        #: the gradients the last asynchronous replay reads, until the next :meth:`wait`
        self._held: list[torch.Tensor] = []
        self._held_stream: torch.cuda.Stream | None = None
        #: (replays, raw stream) of the last wait: that stream follows that many replays
        self._waited: tuple[int, int | None] | None = None

    @staticmethod
    def key_of(group: dict[str, Any], entries) -> tuple:
        """A graph's key: what it bakes in of ``group``, then per matrix (its id, its and
        its momentum buffer's addresses, its shape, its gradient's dtype), ``entries``."""
        baked = tuple(
            str(group[k])
            for k in ("momentum", "nesterov", "ns_steps", "eps", "ns_dtype", "ns_preconditioner")
        ) + (str(group["ns_coefficients"]), str(group["adjust_lr_fn"]))
        return baked + tuple(entries)

    @staticmethod
    def _key(group: dict[str, Any], params: list[torch.Tensor], buffers) -> tuple:
        return MuonStepGraph.key_of(
            group,
            (
                (id(p), p.data_ptr(), b.data_ptr(), tuple(p.shape), p.grad.dtype)
                for p, b in zip(params, buffers, strict=True)
            ),
        )

    def run(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        body: Callable[[StepScalars], None],
        grad_scale: torch.Tensor | None = None,
        key: tuple | None = None,
        addresses: list[int] | None = None,
    ) -> bool:
        """Run the step by the graph (capturing it first if needed); ``False``: it was
        not (the caller steps eagerly). ``body(scalars)`` issues the step's kernels, each
        matrix's gradient read through ``scalars.gradient_slot`` and multiplied by
        ``scalars.grad_scale``, which holds ``grad_scale`` (0-d float32; None: 1). ``key``
        and ``addresses`` (the gradients'): computed by the caller already (see
        :meth:`key_of`), or None."""
        if self.disabled:
            return False
        if key is None:
            key = self._key(group, params, buffers)
        if addresses is None:
            addresses = [p.grad.data_ptr() for p in params]
        recording = (
            not self.warmed
            or self.graph is None
            or key != self.key
            # (a gradient the graph reads as aligned is not: recorded anew, the batched pass
            # that read it reads it no more; torch's allocator hands out aligned blocks, a
            # view into one may not be)
            or not self.scalars.promises_hold(addresses)
        )
        if recording and not self._prepare_recording(params):
            return False
        self.scalars.refresh(group, grad_scale)
        self.scalars.point_at(params, buffers, addresses, fresh_table=recording)
        if not self.warmed:
            body(self.scalars)
            self.warmed = True
            return True
        if recording:
            self.graph, self.key, self.params = self._capture(body), key, list(params)
            if self.asynchronous:
                self._share_with_side_stream(params, buffers)
            self.captures += 1
        self._replay(params)
        self.replays += 1
        return True

    def _prepare_recording(self, params: list[torch.Tensor]) -> bool:
        """Before recording the step anew: the scalars the recorded kernels read (a shape
        change records anew), the held graph dropped once no replay of it may run; False
        (and the graph given up for good) when the tensors moved too often."""
        if self.scalars is None:
            self.scalars = StepScalars(params[0].device, params[0].dtype)
        for p in params:
            self.scalars.step(p.shape)
        if self.warmed:
            if (
                self.captures > MAX_RECAPTURES
                and self.replays < REPLAYS_PER_CAPTURE * self.captures
            ):
                self._drain()
                self.disabled, self.graph, self.params = True, None, []
                logger.warning(
                    f"DMuon: the Muon step's tensors moved {self.captures} times in "
                    f"{self.replays} steps; stepping without a CUDA graph from here on"
                )
                return False
            self._drain()  # (the graph replaced may still run, reading the old table)
        # (its tables are replaced now: never replay it, even if capture fails)
        self.graph, self.key, self.params = None, None, []
        return True

    @property
    def asynchronous(self) -> bool:
        """Whether replays run on :attr:`stream` (``async_step``, on a GPU)."""
        return self.async_step and self.scalars is not None and self.scalars.device.type == "cuda"

    def _side_stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.scalars.device)
            self.done = torch.cuda.Event()
        return self.stream

    def _replay(self, params: list[torch.Tensor]) -> None:
        if not self.asynchronous:
            self.graph.replay()
            return
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # gradients, scalars
        # (a zero_grad right after the step drops them: held until the next wait())
        self._held = [p.grad for p in params]
        self._held_stream = torch.cuda.current_stream(stream.device)
        with torch.cuda.stream(stream):
            self.graph.replay()
        self.done.record(stream)

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Where work that must follow the last step's updates runs (Muon's update hooks):
        once replays run asynchronously, on their side stream behind the last replay and
        everything queued on the current stream, with the replay's event recorded again
        after it, so the waits that cover the replay (the next forward's) cover it too;
        before that, on the current stream, in order."""
        if self.done is None:
            yield
            return
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            yield
        self.done.record(stream)
        self._waited = None  # (a stream that waited for the replay has not for this)

    def _drain(self) -> None:
        """Wait on the host for the side stream: before a graph it runs is destroyed, or the
        table it reads is replaced."""
        if self.stream is not None:
            self.stream.synchronize()
            self._held = []

    def in_flight(self) -> bool:
        """Whether an asynchronous replay may still be running on the GPU (its event not yet
        reached: one query, no wait; while the current stream is being captured, where a
        query is not allowed, it may)."""
        if self.done is None:
            return False
        if torch.cuda.is_current_stream_capturing():
            return True
        return not self.done.query()

    def wait(self) -> None:
        """Make the current stream wait (on the GPU) for the last replay; nothing without
        asynchronous replays, or while the current stream is being captured (a wait on an
        outside event would void it), or where the current stream already waited for that
        replay (the forward asks at its root and at every block: one wait is enough)."""
        if self.done is None:
            return
        raw = _current_raw_stream(self.stream.device)
        if raw is not None and self._waited == (self.replays, raw):
            return  # (this stream's work from here on follows that replay already)
        if torch.cuda.is_current_stream_capturing():
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_event(self.done)
        self._waited = (self.replays, raw)
        if current == self._held_stream:
            # The gradients' stream: their memory freed from here on is reused behind
            # the replay (the caching allocator hands a block out again on its stream).
            self._held = []

    def _share_with_side_stream(self, params: list[torch.Tensor], buffers) -> None:
        """Tell the caching allocator that the side stream uses what the graph reads and
        writes: memory freed on the compute stream (``del model``) is then not handed out
        again before the side stream's work queued at that time is done."""
        stream = self._side_stream()
        tensors = [p.data for p in params] + list(buffers) + [self.scalars.gradients]
        tensors += [self.scalars.params, self.scalars.buffers]
        tensors += [self.scalars.decay, self.scalars.grad_scale, *self.scalars.steps.values()]
        for tensor in tensors:
            tensor.record_stream(stream)

    def _capture(self, body: Callable[[StepScalars], None]) -> torch.cuda.CUDAGraph:
        """Record ``body`` on a side stream (as ``torch.cuda.graph`` does, without its
        synchronize and cache flush: a host wait, and allocator churn, each capture)."""
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")  # (other threads: theirs)
            try:
                body(self.scalars)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return graph


class CapturedStep:
    """The Muon group's captured step on one rank: whether it may run (:meth:`eligible`),
    the short checks of the usual step (:meth:`steady_paths`), the chunks' order and lanes,
    and the graph itself (:attr:`graph`, a :class:`MuonStepGraph`)."""

    def __init__(self, dmuon, cuda_graph: bool, async_step: bool) -> None:
        #: the model's DMuon state (the step is captured on its direct path only)
        self.dmuon = dmuon
        #: ``Muon(cuda_graph=...)``: whether the step may be captured at all
        self.cuda_graph = cuda_graph
        self.graph = MuonStepGraph(async_step=async_step)
        #: the side streams of the lanes (:meth:`lane_streams`), made on first use
        self._side_lanes: list[torch.cuda.Stream] | None = None
        #: the last captured step's matrices in chunk order, while a step of the same
        #: matrices may reuse them (:meth:`steady_paths`); None: not known
        self.steady: list[torch.Tensor] | None = None
        #: (the matrices' ids, those matrices in chunk order): :meth:`in_chunk_order`'s last
        self._chunk_order: tuple[tuple[int, ...], list[torch.Tensor]] | None = None

    @property
    def may_capture(self) -> bool:
        """Whether the step may still run as a captured graph (``cuda_graph``, not given up)."""
        return self.cuda_graph and not self.graph.disabled

    # What the model's runtime asks of an attached step (``runtime/step_waits.py``):
    def wait(self) -> None:
        """The current stream waits (on the GPU) for the last asynchronous replay."""
        self.graph.wait()

    def in_flight(self) -> bool:
        """Whether that replay may still be running."""
        return self.graph.in_flight()

    def steady_paths(self, ctx: MatrixStep, state: dict) -> StepPaths | None:
        """The paths of the usual step: every matrix this rank steps has a gradient, the held
        graph's key is unchanged and :meth:`eligible` holds as it did when the graph was
        recorded; else None (the full checks decide). The same facts as those checks, in one
        pass over the matrices: a step's host time is the loop's time in a host-bound one-GPU
        loop (docs/design_notes.md#host-time-of-the-usual-step)."""
        todo, graph, group = self.steady, self.graph, ctx.group
        if (
            todo is None
            or graph.graph is None
            or not (self.cuda_graph and not graph.disabled and fused.enabled())
            or group["ns_dtype"] == torch.float16
            or fused._capturing()
        ):
            return None
        plain, dtype = torch.Tensor, todo[0].dtype
        buffers, addresses, entries = [], [], []
        for p in todo:
            grad, buffer = p.grad, state[p].get("momentum_buffer")
            if (
                grad is None
                or type(grad) is not plain
                or grad.dtype != dtype
                or buffer is None
                or not grad.is_contiguous()
            ):
                return None
            buffers.append(buffer)
            addresses.append(grad.data_ptr())
            entries.append((id(p), p.data_ptr(), buffer.data_ptr(), tuple(p.shape), grad.dtype))
        key = graph.key_of(group, entries)
        if key != graph.key:  # (recorded anew: after the full checks)
            return None
        return StepPaths(todo, captured=True, buffers=buffers, key=key, addresses=addresses)

    def decide(self, ctx: MatrixStep, paths: StepPaths, stepped: int) -> None:
        """Whether ``paths.matrices`` run captured (then in chunk order, with their buffers);
        the usual step when they are all ``stepped`` matrices of this rank."""
        self.steady = None
        paths.captured = self.eligible(ctx, paths.matrices)
        if paths.captured:  # (in chunk order: each chunk's rows of the step's tables consecutive)
            paths.matrices = self.in_chunk_order(ctx, paths.matrices)
            paths.buffers = [ctx.buffer(p) for p in paths.matrices]
            if len(paths.matrices) == stepped:
                self.steady = paths.matrices

    def eligible(self, ctx: MatrixStep, todo: list[torch.Tensor]) -> bool:
        """Whether the matrices' step may run as a CUDA graph: the direct path on a GPU,
        every matrix a plain tensor of one dtype, not float16 NS, and every momentum pass a
        kernel that reads its gradient through an address slot (Triton, contiguous
        gradients and momentum buffers, an NS dtype of the kernels')."""
        group = ctx.group
        if not (
            self.cuda_graph
            and bool(todo)
            and self.dmuon is not None
            and self.dmuon.direct
            and todo[0].device.type == "cuda"
            and group["ns_dtype"] != torch.float16
            and not torch.cuda.is_current_stream_capturing()
        ):
            return False
        # (asked every step of every matrix: one pass, each attribute read once)
        dtype, plain = todo[0].dtype, torch.Tensor
        grads = [p.grad for p in todo]
        if not all(
            p.dtype == dtype and type(g) is plain and type(p.data) is plain
            for p, g in zip(todo, grads, strict=True)
        ):
            return False
        buffers = [ctx.buffer(p) for p in todo]
        return fused.momentum_all_fusable(grads, buffers, group["ns_dtype"])

    def in_chunk_order(self, ctx: MatrixStep, todo: list[torch.Tensor]) -> list[torch.Tensor]:
        """``todo`` in the order of the captured step's chunks, kept from the last step while
        the matrices are the same ones (the chunking costs the host some 30 times the
        lookup). A stale order (a matrix's shape changed in place) costs speed only: the
        recording step chunks anew, and a chunk whose rows are then not consecutive takes
        the per-matrix passes (``StepScalars.table_rows``)."""
        ids = tuple(map(id, todo))
        if self._chunk_order is None or self._chunk_order[0] != ids:
            order = [p for chunk in ctx.chunks(todo, True) for p in chunk]
            self._chunk_order = (ids, order)
        return self._chunk_order[1]

    def run(self, ctx: MatrixStep, paths: StepPaths, grad_scale: torch.Tensor | None) -> bool:
        """Run ``paths.matrices``' step by the graph; ``False``: it was not (step eagerly)."""

        def body(scalars: StepScalars) -> None:
            chunks = ctx.chunks(paths.matrices, True)
            step_matrices(ctx, chunks, self.lane_streams(ctx, chunks), scalars)

        return self.graph.run(
            ctx.group,
            paths.matrices,
            paths.buffers,
            body,
            grad_scale,
            paths.key,
            paths.addresses,
        )

    def lane_streams(
        self, ctx: MatrixStep, chunks: list[list[torch.Tensor]]
    ) -> list[torch.cuda.Stream | None]:
        """The stream each chunk runs on (None: the current one), by :func:`chunk_lanes` over
        :data:`STEP_LANES` lanes of their NS FLOPs; one chunk, off a GPU, or not being
        captured: all on the current stream (the eager first step gains nothing from lanes,
        and what a side stream allocates outside a graph stays cached for that stream
        alone). A side stream that is the current stream (torch hands out streams from a
        pool, round robin, and each capture takes one) is no lane either."""
        device = chunks[0][0].device if chunks else None
        if len(chunks) < 2 or STEP_LANES < 2 or device.type != "cuda":
            return [None] * len(chunks)
        if (
            self._side_lanes is None
            or len(self._side_lanes) != STEP_LANES - 1
            or self._side_lanes[0].device != device
        ):  # (usually made by the eager first step, before any capture; safe during one too)
            self._side_lanes = [torch.cuda.Stream(device) for _ in range(STEP_LANES - 1)]
        if not torch.cuda.is_current_stream_capturing() or any(
            side == torch.cuda.current_stream(device) for side in self._side_lanes
        ):
            return [None] * len(chunks)
        steps = ctx.group["ns_steps"]
        costs = [
            len(chunk) * orthogonalize_flops(chunk[0].shape, ctx.algorithm, steps)
            for chunk in chunks
        ]
        lanes = [None, *self._side_lanes]
        return [lanes[lane] for lane in chunk_lanes(costs, STEP_LANES)]
