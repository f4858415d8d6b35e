"""A CUDA graph of the Muon group's step on one rank.

A small model's training step on one GPU is host-bound: the GPU waits while Python launches
kernels, and the Muon step launches over a hundred (momentum, Newton–Schulz, update per
same-shape chunk) where fused AdamW launches about ten. Captured once, the whole Muon step
is one graph launch, whatever its number of kernels.

What a replay reads and writes must stay where it was at capture: the masters, their
gradients, the momentum buffers. Torch allocates gradients anew each backward after
``zero_grad()``, and where they land depends on everything else allocated meanwhile (a
validation pass, a second model): so while a graph is held, ``Muon.zero_grad`` zeroes the
captured matrices' gradients in place instead of dropping them (one foreach pass), and
backward accumulates into the same tensors. A matrix that then gets no gradient (unused in
that step, or frozen) must still be skipped as torch.optim skips a ``None`` gradient: a
post-accumulate-grad hook on each captured matrix records which ones got one, and the step
drops the others' zeroed gradients first (the matrices then differ from the capture's:
captured again, or eager). Each step compares those addresses and the
hyper-parameters baked into the graph with the capture's; on any difference the step is
captured again, and when that happens more than once in ``REPLAYS_PER_CAPTURE`` steps the
graph is given up for good (eager steps from then on). The learning rate and weight decay
are not baked in: they enter through device scalars refreshed before each replay (LR
schedules keep working). In the graph each matrix's momentum and update run as fused
passes of their own (``fused``): the launches cost the host nothing there, and the eager
step's foreach passes over small matrices, which save launches, move three times the
bytes. The two may round the last bit differently.

With ``async_step`` a replay runs on a side stream and ``step()`` returns before it is done.
What that buys is host time: torchtitan copies each batch to the GPU with a blocking copy,
which waits for everything queued on the compute stream, so a step queued there holds the
host until Newton–Schulz is over and only then lets it queue the next forward. On its own
stream the step overlaps the host's work on the next step. What reads or writes what the
replay touches makes its stream wait for the replay's event on the GPU (``wait``): the
model's next forward (every boundary, and the root), ``state_dict()``/``load_state_dict()``
of the model and of the optimizer, DMuon's state-dict functions and
``wait_all_replicate_broadcasts`` (torchtitan's checkpoint save also waits on the host, for
DCP may stage on a stream of its own). ``zero_grad`` zeroes the held gradients on the side
stream, after the replay that reads them, and a hook on each held matrix makes the first
gradient accumulated after that wait for it (a ``zero_grad`` between forward and backward).
The allocator is told that the side stream uses the tensors the graph touches
(``record_stream``), so memory freed meanwhile is not handed out under it. Same kernels, same
inputs: the results are the current-stream replay's, bit for bit.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import update

logger = logging.getLogger(__name__)

#: captures allowed before the rate rule below applies
MAX_RECAPTURES = 3
#: beyond those, at least this many replays per capture, or the graph is given up: the
#: occasional move (after a validation pass, say) is recaptured, addresses that move every
#: few steps make capture a loss
REPLAYS_PER_CAPTURE = 20


class StepScalars:
    """Device scalars the captured step reads for the lr-dependent factors: the decay
    ``1 − lr·wd`` and, per matrix shape, the step ``adjusted_lr``. Refreshed by kernel
    launches (``fill_``), never by host-to-device copies that could race with the GPU."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.decay = torch.ones((), device=device, dtype=dtype)
        self.steps: dict[tuple[int, ...], torch.Tensor] = {}

    def step(self, shape) -> torch.Tensor:
        key = tuple(shape)
        if key not in self.steps:
            self.steps[key] = torch.zeros((), device=self.device, dtype=self.dtype)
        return self.steps[key]

    def refresh(self, group: dict[str, Any]) -> None:
        self.decay.fill_(1 - group["lr"] * group["weight_decay"])
        for shape, value in self.steps.items():
            value.fill_(update.adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))


class MuonStepGraph:
    """Capture and replay of one Muon group's step (see the module doc)."""

    def __init__(self, async_step: bool = False) -> None:
        #: replay on :attr:`stream` and return at once (see the module doc)
        self.async_step = async_step
        #: the side stream replays run on, and the event of the last replay (or of the
        #: gradient zeroing queued after it); None until the first asynchronous replay
        self.stream: torch.cuda.Stream | None = None
        self.done: torch.cuda.Event | None = None
        #: a ``zero_grad`` queued a zeroing of the held gradients on :attr:`stream` that the
        #: next accumulation into them has not waited for yet
        self.zero_pending = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None
        self.scalars: StepScalars | None = None
        #: the first step runs the same kernels eagerly (JIT compiles, library handles)
        self.warmed = False
        self.captures = 0
        self.replays = 0
        self.disabled = False
        #: the matrices the held graph steps (their gradients must stay where they are)
        self.params: list[torch.Tensor] = []
        #: per matrix of ``params``: a gradient accumulated since ``expect_gradients``
        self.arrived: list[bool] = []
        self._hooks: list = []

    @staticmethod
    def _key(group: dict[str, Any], params: list[torch.Tensor], buffers) -> tuple:
        baked = tuple(
            str(group[k]) for k in ("momentum", "nesterov", "ns_steps", "eps", "ns_dtype")
        ) + (str(group["ns_coefficients"]), str(group["adjust_lr_fn"]))
        return baked + tuple(
            (p.data_ptr(), p.grad.data_ptr(), b.data_ptr(), tuple(p.shape), p.grad.dtype)
            for p, b in zip(params, buffers, strict=True)
        )

    def run(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        body: Callable[[StepScalars], None],
    ) -> bool:
        """Run the step by the graph (capturing it first if needed); ``False``: it was
        not (the caller steps eagerly). ``body(scalars)`` issues the step's kernels."""
        if self.disabled:
            return False
        key = self._key(group, params, buffers)
        recording = not self.warmed or self.graph is None or key != self.key
        if recording:  # the scalars the recorded kernels read (a shape change records anew)
            if self.scalars is None:
                self.scalars = StepScalars(params[0].device, params[0].dtype)
            for p in params:
                self.scalars.step(p.shape)
        self.scalars.refresh(group)
        if not self.warmed:
            body(self.scalars)
            self.warmed = True
            return True
        if recording:
            if (
                self.captures > MAX_RECAPTURES
                and self.replays < REPLAYS_PER_CAPTURE * self.captures
            ):
                self._drain()
                self.disabled, self.graph = True, None
                self._watch([])
                logger.warning(
                    f"DMuon: the Muon step's tensors moved {self.captures} times in "
                    f"{self.replays} steps; stepping without a CUDA graph from here on"
                )
                return False
            self._drain()  # (the graph replaced may still run)
            self.graph, self.key = self._capture(body), key
            self._watch(params)
            if self.asynchronous:
                self._share_with_side_stream(params, buffers)
            self.captures += 1
        self._replay()
        self.replays += 1
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

    def _replay(self) -> None:
        if not self.asynchronous:
            self.graph.replay()
            return
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # gradients, scalars
        with torch.cuda.stream(stream):
            self.graph.replay()
        self.done.record(stream)

    def _drain(self) -> None:
        """Wait on the host for the side stream: before a graph it runs is destroyed."""
        if self.stream is not None:
            self.stream.synchronize()

    def wait(self) -> None:
        """Make the current stream wait (on the GPU) for the last replay and what was queued
        after it on the side stream; nothing without asynchronous replays, or while the
        current stream is being captured (a wait on an outside event would void it)."""
        if self.done is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.stream.device).wait_event(self.done)

    def zero_held(self, grads: list[torch.Tensor]) -> None:
        """Zero ``grads`` (the held gradients) in place: on the side stream after the last
        replay, which reads them, when replays are asynchronous (:attr:`done` then covers the
        zeroing too, and the next gradient accumulated into them waits for it); else on the
        current stream."""
        if self.done is None:
            torch._foreach_zero_(grads)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # their reads
        with torch.cuda.stream(self.stream):
            torch._foreach_zero_(grads)
        self.done.record(self.stream)
        self.zero_pending = True

    def _share_with_side_stream(self, params: list[torch.Tensor], buffers) -> None:
        """Tell the caching allocator that the side stream uses what the graph reads and
        writes: memory freed on the compute stream (``del model``, ``p.grad = None``) is then
        not handed out again before the side stream's work queued at that time is done."""
        stream = self._side_stream()
        tensors = [p.data for p in params] + [p.grad for p in params] + list(buffers)
        tensors += [self.scalars.decay, *self.scalars.steps.values()]
        for tensor in tensors:
            tensor.record_stream(stream)

    def _watch(self, params: list[torch.Tensor]) -> None:
        """Hold ``params``'s gradients (see the module doc) and watch which get one; with
        asynchronous replays, a gradient about to be accumulated into a held one that a
        ``zero_grad`` still zeroes on the side stream first waits for it. (The hooks hold
        this object weakly: an optimizer dropped takes its graph along.)"""
        for handle in self._hooks:
            handle.remove()
        self.params, self.arrived = list(params), [True] * len(params)
        owner = weakref.ref(self)

        def arrived(index: int):
            def hook(_param) -> None:
                graph = owner()
                if graph is not None:
                    graph.arrived[index] = True

            return hook

        def before_accumulation(_grad) -> None:
            graph = owner()
            if graph is not None and graph.zero_pending:
                graph.zero_pending = False  # (one wait orders this backward's stream)
                graph.wait()

        trained = [(i, p) for i, p in enumerate(params) if p.requires_grad]  # (else: no hook)
        self._hooks = [p.register_post_accumulate_grad_hook(arrived(i)) for i, p in trained] + [
            p.register_hook(before_accumulation) for _, p in trained
        ]

    def expect_gradients(self, fresh: bool) -> None:
        """``zero_grad`` zeroed the held gradients: with ``fresh`` (``set_to_none=True``)
        only those a backward accumulates into from here on count as gradients."""
        self.arrived = [not fresh] * len(self.params)

    def drop_missing_gradients(self) -> None:
        """Before the step: held matrices that got no gradient since ``zero_grad`` lose their
        zeroed one (``None``: skipped, as torch.optim does)."""
        for p, arrived in zip(self.params, self.arrived, strict=True):
            if not arrived:
                p.grad = None

    def _capture(self, body: Callable[[StepScalars], None]) -> torch.cuda.CUDAGraph:
        """Record ``body`` on a side stream (as ``torch.cuda.graph`` does, without its
        synchronize and cache flush, which would move the next gradients elsewhere)."""
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
