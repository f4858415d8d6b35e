"""The optimizer: owner-only Muon for dedicated matrices, AdamW for everything else.

Two parameter groups, identical in structure on every rank (so LR schedulers and state dicts
line up): ``param_groups[0]`` holds every dedicated parameter (the master weight on its owner,
an empty placeholder elsewhere) and is stepped only where owned; ``param_groups[1]`` holds all
other trainable parameters (FSDP2 DTensors, usually) and runs ``torch.optim.AdamW``'s math.
Without tensor parallelism ``step()`` issues no collective, so calling it on any subset of
ranks cannot hang. With it, ``step()`` exchanges tp shards within each owner's row (and,
``tp_ns="shared"``, runs the row's Newton–Schulz together): every rank must step.

The class orchestrates; the step's parts live beside it: the paths and NS batches
(:mod:`.step_plan`), the pass variants (:mod:`.passes`), the captured step
(:mod:`.captured`), the AdamW group (:mod:`.adamw`), where the matrices live
(:mod:`.layout`) and following the model's parameters (:mod:`.follow`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..ops import newton_schulz
from ..options import DEFAULT_NS_BATCH_NUMEL, MuonOptions
from ..runtime.grad_scale import scale_gradients_
from ..runtime.owned_param import dedicated_of
from ..runtime.state import DMuonState
from ..timing import PhaseTimer
from . import passes
from .adamw import adamw_state, adamw_step
from .captured import CapturedStep
from .follow import DedicatedFollower, check_not_meta
from .layout import MatrixLayout, OwnedLayout
from .step_plan import PLAIN_NS_UNBATCHED_NUMEL, StepPaths, split_paths


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
        ns_preconditioner: how NS scales its input first: ``"frobenius"`` (by the Frobenius
            norm, as ``torch.optim.Muon``) or ``"aol"`` (each row by the inverse square root
            of X·Xᵀ's absolute row sum, fused with the first iteration's X·Xᵀ:
            :func:`dmuon_titan.newton_schulz.aol_precondition_`; a nearer start, which takes
            fewer ``ns_steps``, and a polar factor of the rescaled matrix). A param-group
            entry, as ``ns_steps``.
        layout: where the Muon matrices live (:mod:`dmuon_titan.optim.layout`); default
            DMuon's owners. The naive baseline passes its gathered layout.
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
        ns_preconditioner: str = "frobenius",
        layout: MatrixLayout | None = None,
    ) -> None:
        arguments = dict(locals())
        options = MuonOptions(
            **{f.name: arguments[f.name] for f in dataclasses.fields(MuonOptions)}
        )
        self.layout = layout if layout is not None else OwnedLayout(model)
        self._dmuon: DMuonState | None = self.layout.dmuon
        #: the validated hyper-parameters; the param groups hold the ones schedulers change
        self.options = options = _resolve_ns_algorithm(options, self._dmuon)
        #: Not param-group entries (they stay out of optimizer state dicts): same math per
        #: matrix, though batched and single matmuls round differently in bf16.
        self.ns_batch_numel, self.ns_algorithm = options.ns_batch_numel, options.ns_algorithm
        #: matrices of at least this many elements go through NS one at a time (None: all
        #: batched by ``ns_batch_numel``); see ``PLAIN_NS_UNBATCHED_NUMEL``
        plain = options.ns_algorithm == "plain"
        self.ns_unbatched_numel = PLAIN_NS_UNBATCHED_NUMEL if plain else None
        muon_params, other_params = self.layout.split(model)
        #: names for messages (a parameter of the AdamW group still on the meta device)
        self._names = {id(p): name for name, p in model.named_parameters()}
        super().__init__(_param_groups(options, muon_params, other_params), {})
        device = self._dmuon.device if self._dmuon else next(model.parameters()).device
        #: per-step phase times ("optimizer", "ns", "adamw"); read with :meth:`step_timings`
        self.timer = PhaseTimer(device)
        self._follower = DedicatedFollower(self._dmuon)
        #: the captured step of the matrices (one rank on a GPU; see ``cuda_graph``)
        self.captured = CapturedStep(self._dmuon, options.cuda_graph, options.async_step)
        self.step_graph = self.captured.graph
        if self._dmuon is not None:  # (its forward, backward and state dicts wait for it)
            self._dmuon.attach_step(self.captured)
        #: callables run after each step's updates, before replicas receive the matrices
        self._update_hooks: list = []
        self.register_step_pre_hook(Muon._before_step)
        self.register_step_post_hook(Muon._after_step)

    def register_update_hook(self, hook) -> None:
        """Run ``hook()`` after each ``step()``'s updates and before the updated matrices go
        to replicas or to the next forward's broadcasts: where a change to the owners'
        masters (QK-clip's rescale) must happen. Its GPU work is queued behind the step: on
        the asynchronous step's side stream once replays run there (a tensor it reads from
        the compute stream and then drops needs ``record_stream``), else on the current
        stream."""
        self._update_hooks.append(hook)

    def follow_model(self) -> None:
        """Hold the dedicated parameters the model holds now (see :mod:`.follow`): after
        ``to_empty`` the Muon group steps the new tensors; an AdamW parameter left on the
        meta device is an error naming it."""
        if self._follower.follow(self.param_groups[0]["params"], self.state):
            self.captured.steady = None
        check_not_meta(self.param_groups[1]["params"], self._names)

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
                adamw_step(group, self.state)
                self.timer.stop("adamw")
        side = self.step_graph.stream
        if side is not None:  # (the captured step may still run there)
            side.wait_stream(torch.cuda.current_stream())
        self.timer.stop("optimizer", stream=side)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        ctx = self._matrix_step(group)
        paths = self.captured.steady_paths(ctx, self.state)
        if paths is None:
            stepped = self._stepped_ids()
            shared = self._dmuon.shared_ns if self._dmuon is not None else None
            paths = split_paths(group["params"], stepped, shared, _is_shared)
            self.captured.decide(ctx, paths, len(stepped))
        factor, in_graph = self._settle_grad_scale(paths)
        for p in paths.stacks:
            passes.step_stack(ctx, p)
        if paths.shared_ns is not None:  # (every rank: the row's NS is collective)
            passes.step_shared(ctx, paths.shared, paths.shared_ns)
        if paths.captured:
            if self.captured.run(ctx, paths, factor if in_graph else None):
                if in_graph and not self._dmuon.defer_grad_scale(factor, in_graph):
                    scale_gradients_(in_graph, factor)  # (not multiplied: settled now)
                return
            scale_gradients_(in_graph, factor)  # (no graph after all)
        if paths.matrices:
            passes.step_matrices(ctx, ctx.chunks(paths.matrices, False))

    def _settle_grad_scale(self, paths: StepPaths):
        """(factor, the captured matrices that take it in their momentum pass) of a clip's
        factor the gradients still owe (``DMuonState.defer_grad_scale``): the captured step
        multiplies each gradient as it reads it (the graph scales all or none); every other
        gradient is multiplied now, as the clip would have."""
        deferred = self._dmuon.take_grad_scale() if self._dmuon is not None else None
        if deferred is None:
            return None, []
        factor, due = deferred
        in_graph, todo_ids = [], {id(p) for p in paths.matrices}
        if paths.captured and todo_ids <= {id(p) for p in due}:
            in_graph, due = paths.matrices, [p for p in due if id(p) not in todo_ids]
        scale_gradients_(due, factor)
        return factor, in_graph

    def _matrix_step(self, group: dict[str, Any]) -> passes.MatrixStep:
        return passes.MatrixStep(
            group,
            newton_schulz.normalize_coefficients(group["ns_coefficients"]),
            self.ns_algorithm,
            self.ns_batch_numel,
            self.ns_unbatched_numel,
            self._momentum_buffer,
            self.layout,
            self.timer,
        )

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _stepped_ids(self) -> set[int]:
        """ids of the Muon-group parameters this rank updates (by the layout: the matrices it
        owns, as :meth:`follow_model` last found them)."""
        if self._dmuon is not None and self._follower.owned is None:
            self.follow_model()
        return self.layout.stepped(self.param_groups[0]["params"], self._follower.owned or set())

    # ------------------------------------------------------------------ around the step
    @property
    def may_capture_step(self) -> bool:
        """Whether this optimizer may still run its matrices' step as a captured graph
        (``cuda_graph``, not given up)."""
        return self.captured.may_capture

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # (a state dict saved before the entry existed)
            if group.get("use_muon"):
                group.setdefault("ns_preconditioner", "frobenius")

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
        """A step post-hook: the update hooks, then, with replicas, the updated matrices go
        back to them (async)."""
        if optimizer._update_hooks:
            with optimizer.step_graph.following():  # (an async step's stream: still overlapped)
                for hook in optimizer._update_hooks:
                    hook()
        if optimizer._dmuon is not None:
            optimizer._dmuon.after_step()

    def step_timings(self) -> dict[str, float]:
        """Milliseconds of the last ``step()`` per phase: ``optimizer`` (all of it), ``ns``
        (Newton–Schulz only) and ``adamw``. Synchronizes once on CUDA: call it when logging."""
        return self.timer.milliseconds()

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
                    adamw_state(self.state[p], p, group)
                elif id(p) in stepped:
                    self._momentum_buffer(p)


def _is_shared(p: torch.Tensor) -> bool:
    return dedicated_of(p).shared_ns


def _resolve_ns_algorithm(options: MuonOptions, dmuon: DMuonState | None) -> MuonOptions:
    """``options`` with ``ns_algorithm`` the one the owners were planned for when unset; a
    warning when another is asked (results are unaffected, the balance is)."""
    planned = dmuon.plan.ns_algorithm if dmuon is not None else "plain"
    if options.ns_algorithm is None:
        return dataclasses.replace(options, ns_algorithm=planned)
    if options.ns_algorithm != planned and dmuon is not None:
        warnings.warn(
            f"Muon(ns_algorithm={options.ns_algorithm!r}) on a model whose owners were "
            f"balanced for ns_algorithm={planned!r}: results are unaffected, but pass "
            f"ns_algorithm={options.ns_algorithm!r} to dedicate_params (or leave it out "
            "here) to balance the NS work of the algorithm that runs",
            stacklevel=3,
        )
    return options


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
        "ns_preconditioner": o.ns_preconditioner,
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
