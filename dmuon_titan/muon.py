"""The optimizer: owner-only Muon for dedicated matrices, AdamW for everything else.

Two parameter groups, identical in structure on every rank (so LR schedulers and state dicts
line up): ``param_groups[0]`` holds every dedicated parameter (the master weight on its owner,
an empty placeholder elsewhere) and is stepped only where owned; ``param_groups[1]`` holds all
other trainable parameters (FSDP2 DTensors, usually) and runs ``torch.optim.AdamW``'s math.
Without tensor parallelism ``step()`` issues no collective, so calling it on any subset of
ranks cannot hang. With it, ``step()`` exchanges tp shards within each owner's row (and,
``tp_ns="shared"``, runs the row's Newton–Schulz together): every rank must step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from . import fused, newton_schulz, update
from .options import DEFAULT_NS_BATCH_NUMEL, MuonOptions
from .plan.cost import orthogonalize_flops
from .runtime.owned_param import dedicated_of, is_dedicated
from .runtime.state import STATE_ATTR, DMuonState, scale_gradients_
from .step_graph import MuonStepGraph, StepScalars
from .timing import PhaseTimer

#: Plain NS (cuBLAS, ``ns_algorithm="plain"``) of a matrix this large already runs near the
#: matmul rate alone and measured slower batched, so such matrices go one at a time; with the
#: symmetric kernel ("gram"/"auto") both measured the same and those stay batched (docs/benchmarks.md, "Measurements behind code choices").
PLAIN_NS_UNBATCHED_NUMEL = 4096 * 4096

#: Same-shape matrices of at most this many elements take their momentum and update passes
#: as foreach ops over the whole chunk (a few launches) rather than one fused kernel each: at
#: this size a kernel's launch (Triton's launcher: ~50 µs of host time) outweighs its pass,
#: and a one-GPU step of a small model is host-bound (docs/benchmarks.md, "Small scale").
GROUPED_PASS_NUMEL = 1 << 22
#: elements per foreach group of those passes (bounds their full-precision temporaries, 256
#: MiB in float32; fewer groups, fewer launches)
GROUPED_PASS_SLICE_NUMEL = 1 << 26

#: A captured step runs its chunks on this many streams (``chunk_lanes``): each chunk's
#: momentum, NS and update is a chain of dependent launches, and the chunks do not depend on
#: each other, so on two streams one chain's kernels take the SMs another's last wave leaves
#: idle. Same kernels, same results. Memory: the graph's private pool holds about the sum of
#: the lanes' peaks (each lane reuses only blocks it freed itself) instead of the largest
#: chunk's, plus the side stream's cuBLAS workspace (docs/benchmarks.md, twentieth session).
#: Read when the step is captured: a change takes effect at the next capture.
STEP_LANES = 2


class Muon(torch.optim.Optimizer):
    """DMuon: ``torch.optim.Muon`` semantics on dedicated matrices, AdamW on the rest.

    Args:
        model: the model passed to :func:`dmuon_titan.dedicate_params` (a model without
            dedicated parameters gets AdamW on everything).
        lr: Muon learning rate (scaled per matrix by ``adjust_lr_fn``).
        momentum, nesterov, eps, weight_decay, adjust_lr_fn: as ``torch.optim.Muon``.
        ns_coefficients: one (a, b, c) triple, a per-iteration list of triples (iteration i
            uses entry ``min(i, len-1)``), or a name from ``newton_schulz.NS_COEFFICIENT_SETS``.
        ns_steps: Newton–Schulz iterations.
        ns_dtype: dtype the NS iterations run in (``torch.optim.Muon`` uses bfloat16).
        adamw_lr: AdamW learning rate; defaults to ``lr`` only with
            ``adjust_lr_fn="match_rms_adamw"`` (where the two are meant to be equal).
        adamw_betas, adamw_eps, adamw_weight_decay: AdamW hyper-parameters.
        adamw_foreach, adamw_fused: AdamW implementation switches (as ``torch.optim.AdamW``).
        ns_batch_numel: same-shape matrices are orthogonalized together, as one batched
            Newton–Schulz, in chunks of at most this many elements (small matrices are far
            from the matmul rate one at a time); 0 runs one matrix at a time.
        ns_algorithm: ``None`` (default): the one the owners were planned for
            (``dedicate_params(ns_algorithm=...)``, ``"plain"`` without dedicated matrices);
            ``"plain"`` (``torch.optim.Muon``'s iteration), ``"gram"`` (the same
            polynomial on the Gram matrix, :func:`dmuon_titan.newton_schulz.gram_newton_schulz`: fewer
            FLOPs for wide matrices, equal in exact arithmetic) or ``"auto"`` (per shape, the
            one with fewer FLOPs). ``"gram"``/``"auto"`` run their symmetric products by the
            Triton kernel of :mod:`dmuon_titan.symmetric` on CUDA (bf16/fp16); ``"plain"``
            is always torch.optim.Muon's operations. See ``newton_schulz.orthogonalize``.
        cuda_graph: on one rank on a GPU (DMuon's direct path: a single-device model), run
            the matrices' step as one captured CUDA graph after a first eager step
            (:mod:`dmuon_titan.step_graph`): a small model's step is host-bound and the
            Muon step launches far more kernels than fused AdamW. The step's timings then
            report no separate ``ns`` phase. Needs the fused momentum kernel (Triton;
            float32, bfloat16 or float16 gradients, momentum buffers and ``ns_dtype``):
            otherwise the step is eager. ``False``: always eager.
        async_step: with the captured step, replay it on a side stream and return at once
            (:mod:`dmuon_titan.step_graph`): the host goes on to the next step while the GPU
            runs Newton–Schulz (a blocking batch copy, as torchtitan's, waits for the compute
            stream alone). The model's next forward, ``zero_grad(set_to_none=False)``,
            ``state_dict()`` (the model's and this optimizer's), DMuon's state-dict functions
            and ``wait_all_replicate_broadcasts`` wait for it on the GPU.
            Anything else that reads the matrices between ``step()`` and the next forward
            (an EMA of the weights, a norm logged) must call
            ``wait_all_replicate_broadcasts(model)`` first, hence off by default (the
            torchtitan plugin, whose loop is known, turns it on). Same results.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: newton_schulz.Coefficients
        | Sequence[newton_schulz.Coefficients]
        | str = newton_schulz.JORDAN_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        weight_decay: float = 0.1,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.1,
        *,
        adamw_foreach: bool | None = None,
        adamw_fused: bool | None = None,
        ns_batch_numel: int = DEFAULT_NS_BATCH_NUMEL,
        ns_algorithm: str | None = None,
        cuda_graph: bool = True,
        async_step: bool = False,
    ) -> None:
        options = MuonOptions(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            ns_steps=ns_steps,
            eps=eps,
            weight_decay=weight_decay,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            adamw_foreach=adamw_foreach,
            adamw_fused=adamw_fused,
            ns_batch_numel=ns_batch_numel,
            ns_algorithm=ns_algorithm,
            cuda_graph=cuda_graph,
            async_step=async_step,
        )
        self._dmuon: DMuonState | None = getattr(model, STATE_ATTR, None)
        planned = self._dmuon.plan.ns_algorithm if self._dmuon is not None else "plain"
        if options.ns_algorithm is None:
            options = dataclasses.replace(options, ns_algorithm=planned)
        elif options.ns_algorithm != planned and self._dmuon is not None:
            warnings.warn(
                f"Muon(ns_algorithm={options.ns_algorithm!r}) on a model whose owners were "
                f"balanced for ns_algorithm={planned!r}: results are unaffected, but pass "
                f"ns_algorithm={options.ns_algorithm!r} to dedicate_params (or leave it out "
                "here) to balance the NS work of the algorithm that runs",
                stacklevel=2,
            )
        #: the validated hyper-parameters; the param groups hold the ones schedulers change
        self.options = options
        #: Not a param-group entry (it stays out of optimizer state dicts): same math per
        #: matrix, though batched and single matmuls round differently in bf16, so results are
        #: not bitwise identical across batch sizes (nor, hence, across owner counts).
        self.ns_batch_numel = options.ns_batch_numel
        #: Not a param-group entry either, for the same reason (and old checkpoints lack it).
        self.ns_algorithm = options.ns_algorithm
        #: Matrices of at least this many elements go through NS one at a time (None: all
        #: batched by ``ns_batch_numel``); see PLAIN_NS_UNBATCHED_NUMEL.
        self.ns_unbatched_numel = (
            PLAIN_NS_UNBATCHED_NUMEL if options.ns_algorithm == "plain" else None
        )
        muon_params, other_params = self._split_params(model)
        #: names for messages (a parameter of the AdamW group still on the meta device)
        self._names = {id(p): name for name, p in model.named_parameters()}
        super().__init__(_param_groups(options, muon_params, other_params), {})
        device = self._dmuon.device if self._dmuon else next(model.parameters()).device
        #: Per-step phase times ("optimizer", "ns", "adamw"); read with :meth:`step_timings`.
        self.timer = PhaseTimer(device)
        #: the captured step of the matrices (one rank on a GPU; see ``cuda_graph``)
        self.step_graph = MuonStepGraph(async_step=options.async_step)
        #: ids of the matrices this rank steps, as :meth:`follow_model` last found them
        self._stepped: set[int] | None = None
        #: the side streams of a captured step's lanes (``_lane_streams``), made on first use
        self._side_lanes: list[torch.cuda.Stream] | None = None
        #: (module slots, attribute, parameter) per dedicated matrix, as follow_model last
        #: left the Muon group (None: not yet)
        self._followed: list[tuple[dict, str, torch.Tensor]] | None = None
        #: the last captured step's matrices in chunk order, while a step of the same
        #: matrices may reuse them (see ``_steady_matrices``); None: not known
        self._steady: list[torch.Tensor] | None = None
        #: (the matrices' ids, those matrices in chunk order): ``_in_chunk_order``'s last
        self._chunk_order: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        if self._dmuon is not None:  # (its forward, backward and state dicts wait for it)
            self._dmuon.step_graphs.add(self.step_graph)
            self._dmuon.optimizers.add(self)  # (a clip may leave its factor to this step)
        self.register_step_pre_hook(Muon._before_step)
        self.register_step_post_hook(Muon._after_step)

    def _split_params(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(Muon group, AdamW group): every dedicated matrix, then every other trainable one."""
        dedicated = [p.owned for p in self._dmuon.params] if self._dmuon else []
        others = [p for p in model.parameters() if p.requires_grad and not is_dedicated(p)]
        return dedicated, others

    def follow_model(self) -> None:
        """Hold the dedicated parameters the model holds now.

        ``to_empty`` (a meta model) replaces every plain parameter object; FSDP2's keep theirs.
        A ``Muon`` built before ``to_empty`` would otherwise step the discarded meta tensors:
        the dedicated slots are followed (their state moves along), and an AdamW parameter
        left on the meta device is an error naming it.
        """
        if self._dmuon is not None and not self._still_followed():
            held = self.param_groups[0]["params"]
            stepped = set()
            for i, p in enumerate(self._dmuon.params):
                owned = p.owned
                if held[i] is not owned:
                    if held[i] in self.state:
                        self.state[owned] = self.state.pop(held[i])
                    held[i] = owned
                if p.is_owner:
                    stepped.add(id(owned))
            self._stepped = stepped
            self._followed = [
                (p.module._parameters, p.attr, held[i]) for i, p in enumerate(self._dmuon.params)
            ]
            self._steady = None
        for p in self.param_groups[1]["params"]:
            if p.is_meta:
                name = self._names.get(id(p), f"of shape {tuple(p.shape)}")
                raise RuntimeError(
                    f"Muon: parameter {name!r} (AdamW group) is still on the meta device: "
                    "build the optimizer after model.to_empty(...) (FSDP2 parameters survive "
                    "to_empty, parameters of modules without fully_shard do not)"
                )

    def _still_followed(self) -> bool:
        """Whether every dedicated slot still holds the parameter :meth:`follow_model` last
        put in the Muon group (then there is nothing to follow: the usual step, checked at
        a fraction of the host time of following)."""
        followed = self._followed
        if followed is None:
            return False
        held = self.param_groups[0]["params"]
        return len(held) == len(followed) and all(
            slots.get(attr) is param and current is param
            for (slots, attr, param), current in zip(followed, held, strict=True)
        )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.timer.reset()
        self.timer.start("optimizer")
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self.timer.start("adamw")
                self._adamw_step(group)
                self.timer.stop("adamw")
        side = self.step_graph.stream
        if side is not None:  # (the captured step may still run there)
            side.wait_stream(torch.cuda.current_stream())
        self.timer.stop("optimizer", stream=side)
        return loss

    @property
    def may_capture_step(self) -> bool:
        """Whether this optimizer may still run its matrices' step as a captured graph
        (``cuda_graph``, not given up)."""
        return self.options.cuda_graph and not self.step_graph.disabled

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; gradients zeroed in place
        (``set_to_none=False``) first wait, on the GPU, for a captured step still in flight on
        its own stream (``async_step``), which reads them."""
        if not set_to_none:
            self.step_graph.wait()
        if self._dmuon is not None:  # (a clip's factor left to a step that did not come)
            self._dmuon.drop_deferred_grad_scale()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self.step_graph.wait()  # (the tensors are read after this returns)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step_graph.wait()
        super().load_state_dict(state_dict)

    @staticmethod
    def _before_step(optimizer: Muon, _args, _kwargs) -> None:
        """A step pre-hook: current parameters, and the owners' gradients arrived; a step
        still in flight done first (it reads the scalars and buffers this one writes)."""
        optimizer.step_graph.wait()
        optimizer.follow_model()
        if optimizer._dmuon is not None:
            optimizer._dmuon.finalize_reduces()

    @staticmethod
    def _after_step(optimizer: Muon, _args, _kwargs) -> None:
        """A step post-hook: with replicas, the updated matrices go back to them (async)."""
        if optimizer._dmuon is not None:
            optimizer._dmuon.after_step()

    def step_timings(self) -> dict[str, float]:
        """Milliseconds of the last ``step()`` per phase: ``optimizer`` (all of it), ``ns``
        (Newton–Schulz only) and ``adamw``. Synchronizes once on CUDA: call it when logging."""
        return self.timer.milliseconds()

    def _stepped_ids(self) -> set[int]:
        """ids of the Muon-group parameters this rank updates: the matrices it owns (as
        :meth:`follow_model`, which ``step()`` and :meth:`materialize_state` call first,
        last found them)."""
        if self._dmuon is None:
            return set()
        if self._stepped is None:
            self.follow_model()
        return self._stepped

    def _scatter(self, param: torch.Tensor, ortho: torch.Tensor):
        """(the tensor to update, its part of ``ortho``): the whole matrix for an owner."""
        return param, ortho

    def _muon_step(self, group: dict[str, Any]) -> None:
        coefficients = newton_schulz.normalize_coefficients(group["ns_coefficients"])
        steady = self._steady_matrices(group)
        if steady is not None:  # (the held graph's matrices again, as the checks below find)
            todo, buffers, key, addresses = steady
            stacks, mine, shared, captured = [], [], None, True
        else:
            stepped = self._stepped_ids()
            todo = [p for p in group["params"] if p.grad is not None and id(p) in stepped]
            stacks = [p for p in todo if p.ndim == 3]
            todo = [p for p in todo if p.ndim == 2]
            shared = self._dmuon.shared_ns if self._dmuon is not None else None
            mine = []
            if shared is not None:  # (every rank: the row's NS is collective)
                mine = [p for p in todo if dedicated_of(p).shared_ns]
                todo = [p for p in todo if not dedicated_of(p).shared_ns]
            captured = self._graph_eligible(group, todo)
            key = addresses = None
            self._steady = None
            if captured:  # (in chunk order: each chunk's rows of the step's tables consecutive)
                todo = self._in_chunk_order(todo)
                buffers = [self._momentum_buffer(p) for p in todo]  # (made by the check above)
                if len(todo) == len(stepped):  # (every matrix stepped: the usual step)
                    self._steady = todo
        # A clip's factor the gradients still owe (DMuonState.defer_grad_scale): the captured
        # step multiplies each gradient by it as its momentum pass reads it (and the factor
        # stays owed); every other path first multiplies the gradients, as the clip would have.
        deferred = self._dmuon.take_grad_scale() if self._dmuon is not None else None
        factor, in_graph = None, []
        if deferred is not None:
            factor, due = deferred
            todo_ids = {id(p) for p in todo}
            if captured and todo_ids <= {id(p) for p in due}:  # (the graph scales all or none)
                in_graph, due = todo, [p for p in due if id(p) not in todo_ids]
            scale_gradients_(due, factor)
        for p in stacks:
            self._step_stack(p, group, coefficients)
        if shared is not None:
            self._step_shared(group, mine, coefficients, shared)
        if captured:

            def body(scalars: StepScalars) -> None:
                self._step_matrices(group, todo, coefficients, scalars)

            grad_scale = factor if in_graph else None
            if self.step_graph.run(group, todo, buffers, body, grad_scale, key, addresses):
                if in_graph and not self._dmuon.defer_grad_scale(factor, in_graph):
                    scale_gradients_(in_graph, factor)  # (not multiplied: settled now)
                return
            scale_gradients_(in_graph, factor)  # (no graph after all)
        self._step_matrices(group, todo, coefficients)

    def _steady_matrices(self, group: dict[str, Any]):
        """(matrices in chunk order, their momentum buffers, the step graph's key, the
        gradients' addresses) when this step is the usual one: every matrix this rank steps
        has a gradient, the held graph's key is unchanged and :meth:`_graph_eligible` holds
        as it did when the graph was recorded; else None (the full checks decide). The
        same facts as those checks, in one pass over the matrices: a step's host time is
        the loop's time in a host-bound one-GPU loop (docs/benchmarks.md, twenty-third
        session)."""
        todo, graph = self._steady, self.step_graph
        if (
            todo is None
            or graph.graph is None
            or not (self.options.cuda_graph and not graph.disabled and fused.enabled())
            or group["ns_dtype"] == torch.float16
            or fused._capturing()
        ):
            return None
        state, plain, dtype = self.state, torch.Tensor, todo[0].dtype
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
        return todo, buffers, key, addresses

    def _graph_eligible(self, group: dict[str, Any], todo: list[torch.Tensor]) -> bool:
        """Whether the matrices' step may run as a CUDA graph (see ``cuda_graph``): the
        direct path on a GPU, every matrix a plain tensor of one dtype, not float16 NS, and
        every momentum pass a kernel that reads its gradient through an address slot
        (:mod:`dmuon_titan.step_graph`): Triton, contiguous gradients and momentum buffers
        and an NS dtype of the kernels' (float32/bfloat16/float16; not float64)."""
        if not (
            self.options.cuda_graph
            and bool(todo)
            and self._dmuon is not None
            and self._dmuon.direct
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
        buffers = [self._momentum_buffer(p) for p in todo]
        return fused.momentum_all_fusable(grads, buffers, group["ns_dtype"])

    def _step_matrices(
        self,
        group: dict[str, Any],
        todo: list[torch.Tensor],
        coefficients,
        scalars: StepScalars | None = None,
    ) -> None:
        """Momentum, NS and the update of the 2-D matrices ``todo``, chunk by chunk. With
        ``scalars`` (a captured step) the matrices take the fused passes (a fused pass moves a
        third of the foreach passes' bytes), one launch per run of one shape in a chunk where
        the step's tables allow (``_table_passes``), else one per matrix (in a graph a launch
        costs the host nothing, but the GPU a ramp-up each), and the lr-dependent factors
        come from those device scalars. Being captured, the step runs its chunks side by
        side on ``STEP_LANES`` streams (``_lane_streams``), forked from the capture's stream
        and joined back into it."""
        captured = scalars is not None
        chunks = self._chunks(todo, captured)
        streams = self._lane_streams(chunks, group) if captured else [None] * len(chunks)
        sides = list(dict.fromkeys(s for s in streams if s is not None))
        current = torch.cuda.current_stream(todo[0].device) if sides else None
        for side in sides:  # (the inputs were written on the current stream)
            side.wait_stream(current)
        try:
            for chunk, stream in zip(chunks, streams, strict=True):
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self._step_chunk(chunk, group, coefficients, scalars)
        finally:
            for side in sides:  # (what follows the step sees every chunk's update)
                current.wait_stream(side)

    def _lane_streams(
        self, chunks: list[list[torch.Tensor]], group: dict[str, Any]
    ) -> list[torch.cuda.Stream | None]:
        """The stream each chunk of a captured step runs on (None: the current one), by
        :func:`chunk_lanes` over ``STEP_LANES`` lanes of their NS FLOPs; one chunk, off a
        GPU, or not being captured: all on the current stream. (The first step, which runs
        the captured step's kernels eagerly, gains nothing from lanes, and what a side
        stream allocates outside a graph stays cached for that stream alone, out of reach
        of the forward's and backward's allocations.) A side stream that is the current
        stream (torch hands out streams from a pool of 32, round robin, and each capture
        takes one) is no lane: all on the current stream then too."""
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
        costs = [
            len(chunk) * orthogonalize_flops(chunk[0].shape, self.ns_algorithm, group["ns_steps"])
            for chunk in chunks
        ]
        lanes = [None, *self._side_lanes]
        return [lanes[lane] for lane in chunk_lanes(costs, STEP_LANES)]

    def _step_chunk(
        self,
        chunk: list[torch.Tensor],
        group: dict[str, Any],
        coefficients,
        scalars: StepScalars | None,
    ) -> None:
        """Momentum, NS and the update of one chunk (see :meth:`_step_matrices`), on the
        current stream: everything it allocates is allocated and freed there."""
        captured = scalars is not None
        grouped = not captured and self._grouped(chunk, group)
        by_table = captured and self._table_passes(chunk, group, scalars)
        out = self._orthogonalize(chunk, group, coefficients, grouped, scalars, by_table)
        if grouped:
            self._grouped_update(chunk, out, group)
        elif by_table:
            for run, batch in _runs(chunk, out):
                fused.decay_and_update_by_table(
                    scalars.params[scalars.table_rows(run)],
                    run[0].dtype,
                    batch,
                    scalars.decay,
                    scalars.step(run[0].shape),
                )
        else:
            orthos = [out] if len(chunk) == 1 else out.unbind(0)
            for p, ortho in zip(chunk, orthos, strict=True):
                ortho = _shaped_as(ortho, p.shape)  # (NS's is wide)
                if captured:
                    step = scalars.step(p.shape)
                    fused.decay_and_update_(p.data, ortho, scalars.decay, step)
                else:
                    self._update_matrix(p, ortho, group)
            del orthos

    def _in_chunk_order(self, todo: list[torch.Tensor]) -> list[torch.Tensor]:
        """``todo`` in the order of the captured step's chunks, kept from the last step while
        the matrices are the same ones (the chunking costs the host some 30 times the lookup:
        docs/benchmarks.md, fifteenth session). A stale order (a matrix's shape changed in
        place) costs speed only: the recording step chunks anew, and a chunk whose rows are
        then not consecutive takes the per-matrix passes (``StepScalars.table_rows``)."""
        ids = tuple(map(id, todo))
        if self._chunk_order is None or self._chunk_order[0] != ids:
            self._chunk_order = (ids, [p for chunk in self._chunks(todo, True) for p in chunk])
        return self._chunk_order[1]

    def _chunks(self, todo: list[torch.Tensor], captured: bool) -> list[list[torch.Tensor]]:
        """``todo``'s NS batches (:func:`ns_chunks`); the captured step's batch a matrix with
        its transposes (a tall matrix's NS runs on its transpose anyway), in runs of one
        shape: one batch instead of two, which the products fill better."""
        return ns_chunks(
            todo, self.ns_batch_numel, self.ns_unbatched_numel, merge_transposes=captured
        )

    def _table_passes(
        self, chunk: list[torch.Tensor], group: dict[str, Any], scalars: StepScalars
    ) -> bool:
        """Whether the captured step's momentum and update passes of ``chunk`` run as one
        launch per run of one shape (``fused.*_by_table``), reading the matrices, buffers
        and gradients through the step's tables: consecutive aligned rows there, contiguous
        matrices (gradients and buffers are, or the step is not captured), and one dtype
        per kind."""
        return (
            scalars.table_rows(chunk) is not None
            and all(p.data.is_contiguous() for p in chunk)
            and len({p.grad.dtype for p in chunk}) == 1
            and len({p.dtype for p in chunk}) == 1
            and len({self._momentum_buffer(p).dtype for p in chunk}) == 1
            and fused.table_passes_run(
                chunk[0].device, group["ns_dtype"], chunk[0].dtype, chunk[0].grad.dtype
            )
        )

    def _step_shared(
        self, group: dict[str, Any], params: list[torch.Tensor], coefficients, shared
    ) -> None:
        """Momentum step and update of the shared matrices this rank owns (``params``), their
        Newton–Schulz computed by the row together (``runtime/shared_ns.py``)."""
        dtype = group["ns_dtype"]
        inputs = {}
        for p in params:
            inputs[dedicated_of(p).index] = direction = torch.empty(
                p.shape, dtype=dtype, device=p.device
            )
            self._write_direction(p, group, direction)
        self.timer.start("ns")
        orthos = shared.orthogonalize(inputs, coefficients, group["ns_steps"], group["eps"], dtype)
        self.timer.stop("ns")
        del inputs
        for p in params:
            self._update_matrix(p, orthos.pop(dedicated_of(p).index), group)

    def _update_matrix(self, p: torch.Tensor, ortho: torch.Tensor, group: dict[str, Any]) -> None:
        """:func:`update.apply_update` of one matrix by its orthogonalized direction (to the
        part ``_scatter`` says this rank updates)."""
        target, ortho = self._scatter(p, ortho)
        update.apply_update(
            target,
            ortho,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            adjust_lr_fn=group["adjust_lr_fn"],
            shape=p.shape,
        )

    def _step_stack(self, p: torch.Tensor, group: dict[str, Any], coefficients) -> None:
        """Muon on each matrix of a stack (this rank's experts): the momentum step and the
        update run on the whole piece at once (elementwise, so per matrix all the same); NS
        runs on batches of at most ``ns_batch_numel`` elements (one matrix if 0)."""
        directions = torch.empty(p.shape, dtype=group["ns_dtype"], device=p.device)
        self._write_direction(p, group, directions)
        per_batch = ns_batch_size(p.shape[1:].numel(), self.ns_batch_numel, self.ns_unbatched_numel)
        args = (coefficients, group["ns_steps"], group["eps"], group["ns_dtype"], self.ns_algorithm)
        for start in range(0, p.shape[0], per_batch):
            batch = directions[start : start + per_batch]
            self.timer.start("ns")
            ortho = newton_schulz.orthogonalize(batch, *args, overwrite_input=True)
            self.timer.stop("ns")
            update.apply_update(
                p[start : start + per_batch],
                ortho,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"],
            )

    def _orthogonalize(
        self,
        chunk: list[torch.Tensor],
        group: dict[str, Any],
        coefficients,
        grouped: bool,
        scalars: StepScalars | None = None,
        by_table: bool = False,
    ) -> torch.Tensor:
        """Momentum step + NS of one chunk of same-shape matrices: the orthogonalized batch
        (``[len(chunk), *shape]``; one matrix alone for a chunk of one). The directions are
        written straight into one NS-dtype buffer, which NS then uses as its own scratch: no
        full-precision direction is ever materialized. ``scalars``: a captured step's (the
        gradients read through their slots; no timing events); ``by_table``: its momentum
        passes one launch per run of one shape (``_table_passes``)."""
        args = (coefficients, group["ns_steps"], group["eps"], group["ns_dtype"], self.ns_algorithm)
        shape = chunk[0].shape  # the whole matrix's (also for a DTensor)
        single = len(chunk) == 1
        # A tall matrix's NS runs on its transpose: matrix by matrix, its direction is
        # written transposed (a wide buffer seen tall), so that NS's first product needs no
        # transposing copy (docs/benchmarks.md, ninth session). The foreach passes keep the
        # tall layout (their copy into a strided view would be that copy again).
        # A chunk may hold a matrix and its transposes (``_chunks``); NS's batch is then wide,
        # the tall ones' directions written into it transposed, and NS returns it wide.
        rows, cols = shape[-2], shape[-1]
        layout = (rows, cols) if grouped else (min(rows, cols), max(rows, cols))
        batch = torch.empty(
            (*(() if single else (len(chunk),)), *layout),
            dtype=group["ns_dtype"],
            device=chunk[0].device,
        )
        squares = None
        if grouped:
            self._grouped_directions(chunk, group, batch.unsqueeze(0) if single else batch)
        elif by_table:
            # Partial sums of the directions' squares, from the pass that writes them, where
            # NS folds its normalization: NS then reads no matrix for its norms
            # (docs/benchmarks.md, eighteenth session).
            if newton_schulz.uses_squares(
                layout,
                self.ns_algorithm,
                group["ns_steps"],
                group["eps"],
                batch.dtype,
                batch.device,
            ):
                parts = fused.square_parts(*layout)
                squares = torch.zeros(len(chunk), parts, dtype=torch.float32, device=batch.device)
            start = 0
            for run, directions in _runs(chunk, batch):
                rows_of_run = scalars.table_rows(run)
                float32 = run[0].grad.dtype == torch.float32
                fused.momentum_directions_by_table(
                    scalars.gradients[rows_of_run],
                    scalars.buffers[rows_of_run],
                    directions,
                    run[0].grad.dtype,
                    self._momentum_buffer(run[0]).dtype,
                    group["momentum"],
                    group["nesterov"],
                    scalars.grad_scale if float32 else None,
                    None if squares is None else squares[start : start + len(run)],
                )
                start += len(run)
        else:
            for i, p in enumerate(chunk):
                slot = scale = None
                if scalars is not None:
                    slot = scalars.gradient_slot(p)
                    scale = scalars.grad_scale if p.grad.dtype == torch.float32 else None
                out = _shaped_as(batch if single else batch[i], p.shape)
                self._write_direction(p, group, out, slot, scale)
        timed = scalars is None  # (no events inside a captured graph)
        if timed:
            self.timer.start("ns")
        orthos = newton_schulz.orthogonalize(batch, *args, overwrite_input=True, squares=squares)
        if timed:
            self.timer.stop("ns")
        return orthos

    def _grouped(self, chunk: list[torch.Tensor], group: dict[str, Any]) -> bool:
        """Whether ``chunk``'s momentum and update passes run as foreach ops: several small
        whole matrices (the owner's masters, not shards), and not float16 NS (whose
        directions are normalized first, one by one)."""
        return (
            len(chunk) > 1
            and chunk[0].numel() <= GROUPED_PASS_NUMEL
            and group["ns_dtype"] != torch.float16
            and type(self)._scatter is Muon._scatter
            and all(type(p.grad) is torch.Tensor and type(p.data) is torch.Tensor for p in chunk)
        )

    def _slices(self, chunk: list[torch.Tensor]):
        """``range``s of ``chunk`` of at most ``GROUPED_PASS_SLICE_NUMEL`` elements each."""
        per = max(1, GROUPED_PASS_SLICE_NUMEL // chunk[0].numel())
        return [range(i, min(i + per, len(chunk))) for i in range(0, len(chunk), per)]

    def _grouped_directions(
        self, chunk: list[torch.Tensor], group: dict[str, Any], batch: torch.Tensor
    ) -> None:
        """:meth:`_write_direction` for every matrix of ``chunk`` into ``batch[i]``, as foreach
        ops: the same lerps in full precision, rounded once into the NS dtype."""
        for part in self._slices(chunk):
            fused.momentum_directions_into(
                [chunk[i].grad for i in part],
                [self._momentum_buffer(chunk[i]) for i in part],
                [batch[i] for i in part],
                group["momentum"],
                group["nesterov"],
            )

    def _grouped_update(
        self, chunk: list[torch.Tensor], orthos: torch.Tensor, group: dict[str, Any]
    ) -> None:
        """:func:`update.apply_update` for every matrix of ``chunk`` as foreach ops; each
        slice of the orthogonalized batch ``orthos`` is brought to the masters' dtype and
        layout by one copy (not one per matrix)."""
        for part in self._slices(chunk):
            params = [chunk[i].data for i in part]
            steps = orthos[part.start : part.stop].to(
                chunk[0].dtype, memory_format=torch.contiguous_format
            )
            update.apply_updates(
                params,
                list(steps.unbind(0)),
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"],
            )

    def _write_direction(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        out: torch.Tensor,
        grad_address: torch.Tensor | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """Momentum step for ``p``; its whole direction, cast, into ``out`` (one fused pass on
        a GPU; eagerly, the cast happens in lerp's store, rounding once as a copy would). For
        a float16 ``out`` the direction is normalized first, in full precision.
        ``grad_address``, ``grad_scale``: see :func:`fused.momentum_direction_into`."""
        if out.dtype == torch.float16 and p.grad.dtype != torch.float16:
            # float16's range: normalize in full precision first.
            newton_schulz.normalize_into(self._direction(p, group), out, group["eps"])
            return
        fused.momentum_direction_into(
            p.grad,
            self._momentum_buffer(p),
            out,
            group["momentum"],
            group["nesterov"],
            grad_address,
            grad_scale,
        )

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _direction(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return update.momentum_direction(
            p.grad, self._momentum_buffer(p), group["momentum"], group["nesterov"]
        )

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._adamw_state(p, group)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=group["foreach"],
            fused=group["fused"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _adamw_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """``torch.optim.AdamW``'s state for ``p``, created as AdamW creates it."""
        state = self.state[p]
        if not state:
            fused = bool(group["fused"])
            state["step"] = (
                torch.zeros((), dtype=torch.float32, device=p.device)
                if fused
                else torch.tensor(0.0, dtype=torch.float32)
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def materialize_state(self) -> None:
        """Create every state entry a first ``step()`` would create, without stepping.

        Zero momentum and zero Adam moments at step 0 behave exactly like absent state, so
        this changes no future update; it gives checkpoint loading tensors to load into.
        Collective-free, like ``step()``.
        """
        self.follow_model()
        stepped = self._stepped_ids()
        for group in self.param_groups:
            for p in group["params"]:
                if not group["use_muon"]:
                    self._adamw_state(p, group)
                elif id(p) in stepped and "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )


def _param_groups(options: MuonOptions, muon_params: list, other_params: list) -> list[dict]:
    """``[Muon group, AdamW group]``: the hyper-parameters torch's LR schedulers and state
    dicts see (keys as ``torch.optim.Muon``'s and ``torch.optim.AdamW``'s)."""
    o = options
    muon_group = {
        "params": muon_params,
        "use_muon": True,
        "lr": o.lr,
        "momentum": o.momentum,
        "nesterov": o.nesterov,
        "ns_coefficients": o.ns_coefficients,
        "ns_steps": o.ns_steps,
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        "adjust_lr_fn": o.adjust_lr_fn,
        "ns_dtype": o.ns_dtype,
    }
    adamw_group = {
        "params": other_params,
        "use_muon": False,
        "lr": o.adamw_lr,
        "betas": o.adamw_betas,
        "eps": o.adamw_eps,
        "weight_decay": o.adamw_weight_decay,
        "amsgrad": False,
        "maximize": False,
        "foreach": o.adamw_foreach,
        "fused": o.adamw_fused,
        "capturable": False,
        "differentiable": False,
        "decoupled_weight_decay": True,
    }
    return [muon_group, adamw_group]


def ns_chunks(
    params: Sequence[torch.Tensor],
    max_numel: int,
    unbatched_numel: int | None = None,
    merge_transposes: bool = False,
) -> list[list[torch.Tensor]]:
    """Split ``params`` into batches of same (full) shape and dtype, each of at most
    ``max_numel`` elements (at least one matrix); ``max_numel == 0``: one matrix per batch,
    and so for matrices of ``unbatched_numel`` elements or more. Order: shapes by first
    appearance, params in their order within a shape. ``merge_transposes``: 2-D matrices of
    transposed shapes batch together, each shape's matrices consecutive (the one that
    appears first, first); the order is then a fixed point (chunking the chunks' concatenation
    gives them back)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        shape = tuple(p.shape)
        kind = tuple(sorted(shape)) if merge_transposes and len(shape) == 2 else shape
        by_kind.setdefault((kind, p.dtype), []).append(p)
    if merge_transposes:  # (a stable sort by each shape's first appearance)
        for kind, same in by_kind.items():
            first = {}
            for p in same:
                first.setdefault(tuple(p.shape), len(first))
            by_kind[kind] = sorted(same, key=lambda p: first[tuple(p.shape)])
    chunks = []
    for (shape, _), same in by_kind.items():
        per_chunk = ns_batch_size(
            max(1, int(torch.Size(shape).numel())), max_numel, unbatched_numel
        )
        chunks.extend(same[i : i + per_chunk] for i in range(0, len(same), per_chunk))
    return chunks


def chunk_lanes(costs: Sequence[float], lanes: int) -> list[int]:
    """The lane (0 … ``lanes`` - 1) of each chunk of the given costs, taken in order: each
    to the lane with the least cost so far (the lowest such lane). Each lane runs its
    chunks in their order; lanes run side by side."""
    loads = [0.0] * max(1, lanes)
    placed = []
    for cost in costs:
        lane = min(range(len(loads)), key=loads.__getitem__)
        loads[lane] += cost
        placed.append(lane)
    return placed


def ns_batch_size(matrix_numel: int, max_numel: int, unbatched_numel: int | None) -> int:
    """How many same-shape matrices of ``matrix_numel`` elements one batched Newton–Schulz
    takes: as many as fit in ``max_numel`` elements (at least one; one if 0), one for
    matrices of ``unbatched_numel`` elements or more."""
    if unbatched_numel is not None and matrix_numel >= unbatched_numel:
        return 1
    return max(1, max_numel // matrix_numel) if max_numel else 1


def _runs(chunk: list[torch.Tensor], batch: torch.Tensor):
    """(the matrices, their part of ``batch`` seen in their shape) for each run of one shape
    in ``chunk``: ``batch`` is NS's (a 3-D batch, or one 2-D matrix), wide, so a tall run's
    part is a transposed view."""
    batch = batch if batch.ndim == 3 else batch[None]
    start = 0
    while start < len(chunk):
        stop = start + 1
        while stop < len(chunk) and chunk[stop].shape == chunk[start].shape:
            stop += 1
        yield chunk[start:stop], _shaped_as(batch[start:stop], chunk[start].shape)
        start = stop


def _shaped_as(view: torch.Tensor, shape) -> torch.Tensor:
    """``view`` (a matrix or a batch of them, NS's wide layout) seen as matrices of
    ``shape``: itself, or its transpose for a tall ``shape``."""
    return view if tuple(view.shape[-2:]) == tuple(shape[-2:]) else view.mT
