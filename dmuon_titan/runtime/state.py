"""The root state of one model on this rank: lazy init, the step's schedule, the end of backward.

Every collective of a step is issued in the order of the rank-consistent
:class:`~dmuon_titan.runtime.schedule.Schedule`, decided by the plan and the forward order
recorded on all ranks, never by which boundaries this rank's data happened to run (see
``schedule.py``). The root walks the schedule and decides *when*; each
:class:`~dmuon_titan.runtime.group.BoundaryGroup` does *what* its lifecycle needs. The hooks
that call in here are registered by :meth:`DMuonState.install_hooks` (helpers in ``hooks.py``);
the clip's owed factor (``grad_scale.py``), the copies of the masters (``replicas.py``) and
the optimizer steps in flight (``step_waits.py``) are parts of their own.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.autograd import Variable

from ..options import DedicateOptions
from ..plan import Plan
from . import hooks
from .bucket import PendingReduce, finalize
from .collectives import Collectives
from .grad_scale import OwedGradScale
from .group import BoundaryGroup, TrainingState, UnshardState
from .owned_param import DedicatedParam
from .replicas import ReplicaSync
from .schedule import (
    BackwardCursor,
    ForwardCursor,
    ScheduleError,
    merge_sequences,
    plan_order_schedule,
)
from .shared_ns import SharedNewtonSchulz
from .step_waits import StepWaits
from .tensor_parallel import TensorParallelExchange

STATE_ATTR = "_dmuon_state"


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def get_state(model: nn.Module) -> DMuonState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("model has no dedicated parameters: call dmuon.dedicate_params first")
    return state


class DMuonState:
    """Everything DMuon knows about one model on this rank."""

    def __init__(
        self,
        root: nn.Module,
        plan: Plan,
        params: list[DedicatedParam],
        groups: list[BoundaryGroup],
        comm: Collectives,
        options: DedicateOptions,
    ) -> None:
        self.root = root
        self.plan = plan
        self.params = params
        for p in params:
            p.state_ref = weakref.ref(self)
        self.groups = groups
        self.comm = comm
        self.mesh = comm.mesh
        self.options = options
        self.reshard_after_forward = options.reshard_after_forward
        self.requires_gradient_sync = True
        #: pipeline parallelism (:meth:`enable_pipelining`): the step's microbatches run their
        #: forwards and backwards interleaved; weights stay from the first forward to
        #: :meth:`reduce_step_gradients`, gradients accumulate locally until then
        self.pipelined = False
        # Summed gradients are divided by this (FSDP2's gradient divide factor): the world size
        # averages; 1.0 sums, for losses already normalized globally (torchtitan does that).
        # (The data-parallel world: tensor-parallel ranks hold shards of one batch's gradient.)
        self.gradient_divide_factor = float(self.mesh.shard_size * self.mesh.replicate_size)
        #: tensor parallelism: the owners' exchange of tp shards with their rows
        self.tp_exchange = TensorParallelExchange(params, comm) if self.mesh.tp_size > 1 else None
        #: ``tp_ns="shared"``: the Newton–Schulz this rank's row shares (None: none shared)
        self.shared_ns = (
            SharedNewtonSchulz(params, comm) if any(p.shared_ns for p in params) else None
        )
        #: the order every rank issues the step's collectives in: plan order for the first
        #: step, the forward order recorded on all ranks after it
        self.schedule = plan_order_schedule(len(groups))
        self._recording: list[int] | None = []  # this rank's first training forward
        self._local_sequence: list[int] | None = None
        self._pass: ForwardCursor | None = None
        self._backward: BackwardCursor | None = None
        self._ending_backward = False
        #: boundaries a training forward ran on this rank since the last backward
        self.ran_this_step: set[int] = set()
        self._pending_reduces: list[PendingReduce] = []
        self._initialized = False
        self.direct = False  # decided at lazy init
        #: the post-forward hooks that close scopes (register_scope_hooks)
        self.scope_handles: list = []
        #: the optimizer steps that may run on their own streams, and the waits for them
        self.waits = StepWaits()
        self.replicas = ReplicaSync(self)
        #: a gradient clip's factor the owned gradients still owe (:meth:`defer_grad_scale`)
        self.grad_scale = OwedGradScale()
        #: the DMuon optimizers (``dmuon_titan.Muon``) that step the owned matrices
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        #: how many times the gradient-presence flags were read back (a host sync each);
        #: stays 0 while every owner has its own gradient for every matrix it owns
        self.presence_syncs = 0

    def attach_optimizer(self, optimizer) -> None:
        """An optimizer that steps the owned matrices (``dmuon_titan.Muon``): its captured
        step is waited for by the forward, backward and state dicts; a clip may leave its
        factor to its step."""
        self.waits.steps.add(optimizer.step_graph)
        self.optimizers.add(optimizer)

    @property
    def step_graphs(self):
        """The attached optimizers' captured steps (:attr:`StepWaits.steps`)."""
        return self.waits.steps

    @property
    def step_waits_armed(self) -> bool:
        return self.waits.armed

    # ------------------------------------------------------------------ hooks
    def install_hooks(self, modules: dict[str, nn.Module], boundary_paths: list[str]) -> None:
        """Every hook of this model (see ``hooks.py``): the boundaries', the scopes' and the
        root's."""
        for group in self.groups:
            self.hook_boundary(group)
        self.scope_handles = hooks.register_scope_hooks(modules, boundary_paths, self.close_scope)
        hooks.register_forward_pair(
            self.root, self.root_pre_forward, self.root_post_forward, first=True
        )
        hooks.register_state_dict_waits(self.root, self.wait_for_step)

    def hook_boundary(self, group: BoundaryGroup, module: nn.Module | None = None) -> None:
        """Hook ``group`` onto ``module`` (default: its boundary module), replacing earlier
        hooks: a wrapper such as ``torch.compile``'s may take them, so that they run outside
        the compiled region. After lazy init on one rank: the step wait alone, while armed."""
        for handle in group.hook_handles:
            handle.remove()
        group.hook_module = group.module if module is None else module
        if self.direct:
            group.hook_handles = self._step_wait_hooks(group) if self.waits.armed else []
            return
        group.hook_handles = hooks.register_forward_pair(
            group.hook_module,
            lambda: self.pre_forward(group),
            lambda output: self.post_forward(group, output),
        )

    def _step_wait_hooks(self, group: BoundaryGroup) -> list:
        return [hooks.register_first_pre_hook(group.hook_module, lambda: self.pre_forward(group))]

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    def enable_pipelining(self) -> None:
        """Serve a pipeline stage: several microbatches per step, their forwards and
        backwards interleaved by the schedule (1F1B: the forward of one between the
        backwards of others). The full-size weights are brought in by the step's first
        training forward and kept until :meth:`reduce_step_gradients`, every backward only
        accumulates, and the step's gradients are reduced once, there: what FSDP2 does under
        torch's pipeline schedules (no reshard after forward or backward, one
        reduce-scatter per step). ``reshard_after_forward`` does not apply."""
        if self._initialized and not self.pipelined and self._backward is not None:
            raise RuntimeError("enable_pipelining inside a backward")
        self.pipelined = True
        self.reshard_after_forward = False

    # ------------------------------------------------------------------ setup
    def lazy_init(self) -> None:
        """First use: check registration, resolve mixed precision, build buffers and hooks."""
        if self._initialized:
            return
        parents = {}
        for module in self.root.modules():
            for child in module.children():
                parents[child] = module
        for p in self.params:
            p.check_materialized()
            p.resolve_dtypes(_nearest_mp_policy(p.module, parents))
        #: one rank computing in the masters' own dtype: nothing to move, cast or reduce, so
        #: the modules keep the masters and autograd accumulates into them (no buffers, no
        #: hooks at work) — DMuon is then torch.optim.Muon's bookkeeping and no more
        self.direct = (
            self.mesh.world_size == 1
            and self.gradient_divide_factor == 1
            and all(p.param_dtype == p.orig_dtype == p.reduce_dtype for p in self.params)
        )
        if self.direct:
            # Nothing to bring in or out: the boundaries' hooks would only ask, every forward,
            # whether a step is in flight, and a module with hooks takes nn.Module's slower
            # call path. They come back as waits only while a step may be in flight, on a
            # block's torch.compile wrapper if it has one (torch.compile does not guard on
            # hooks: one added inside a compiled region later would never run).
            wrappers = hooks.compile_wrappers(self.root)
            for group in self.groups:
                if group.hook_module is group.module and group.module in wrappers:
                    group.hook_module = wrappers[group.module]
            self.disarm_step_waits()
            for handle in self.scope_handles:
                handle.remove()
            self.scope_handles = []
        else:
            for group in self.groups:
                group.lazy_init()
                hooks.register_grad_hooks(
                    group.params, lambda p, group=group: self.grad_accumulated(group, p)
                )
            self.replicas.make_tp_copies()
        self._initialized = True
        # Each replica's column rank ran init_weights with its own random stream: from here
        # on every copy is the global owner's.
        self.ensure_replicas_synced()

    # ------------------------------------------------------------------ forward
    def root_pre_forward(self) -> None:
        """The model's own forward starts: a new pass over the schedule."""
        if in_backward():
            return
        self.lazy_init()
        if self.direct:
            self.wait_for_step()
            if self.step_waits_armed and not self.step_in_flight():
                self.disarm_step_waits()
            # (an owed clip factor: settled before any new gradient accumulates, after the
            # step in flight that reads the gradients)
            self.apply_deferred_grad_scale()
            return
        self._end_forward_pass()  # one left open by forwards of submodules alone
        self._pass = ForwardCursor(training=torch.is_grad_enabled())

    def root_post_forward(self, output):
        if in_backward() or self._pass is None or self.direct:
            return output
        training = self._pass.training
        self._end_forward_pass()
        if training:  # so that backward begins here even where no boundary ran
            output = hooks.register_pre_backward(output, self._begin_backward)
        return output

    def pre_forward(self, group: BoundaryGroup) -> None:
        self.lazy_init()
        if self.direct:
            self.wait_for_step()
            return
        if in_backward():  # activation-checkpoint recompute: backward's turn for the boundary
            self._begin_backward()
            self._reach_in_backward(group)
            self._ensure_scheduled(group, "recompute")
            group.recompute()
            return
        cursor = self._forward_pass()
        if cursor.training:
            self.ran_this_step.add(group.index)
            if self._recording is not None:
                self._recording.append(group.index)
        entry = self.schedule.next_entry(group.index, cursor.consumed)
        if entry is not None:
            self._issue_forward(cursor, entry)
            cursor.consumed = entry + 1
            if self.schedule.recorded:
                self._issue_forward(cursor, cursor.consumed, prefetch=True)
        self._ensure_scheduled(group, "forward")
        group.pre_forward()

    def post_forward(self, group: BoundaryGroup, output):
        if self.direct:
            return output
        if in_backward():
            group.end_recompute()  # the backward is about to use the weights
            return output
        group.post_forward(free=not group.held_for_backward)  # Z2 keeps them for backward
        cursor = self._forward_pass()
        if cursor.training:
            output = hooks.register_pre_backward(output, lambda: self.pre_backward(group))
        if self.schedule.recorded:  # a prefetch may have waited for this boundary
            self._issue_forward(cursor, cursor.consumed, prefetch=True)
        return output

    def close_scope(self, inside: frozenset[int]) -> None:
        """A module whose subtree holds the boundaries ``inside`` finished its forward: the
        entries of theirs due next were not reached here (an expert without tokens) and are
        issued now, not when this rank reaches its next boundary, for a peer that runs them
        may be waiting, and this rank may first block in collectives of its own (FSDP2's
        all-gather of the next block)."""
        if self.direct:
            return
        cursor = self._pass
        if cursor is None or in_backward():
            return
        entries, end = self.schedule.forward, cursor.consumed
        while end < len(entries) and entries[end] in inside:
            end += 1
        if end > cursor.consumed:
            self._issue_forward(cursor, end - 1)
            cursor.consumed = end

    def _forward_pass(self) -> ForwardCursor:
        if self._pass is None:  # a forward of submodules, without the root's hooks
            self._pass = ForwardCursor(training=torch.is_grad_enabled())
        return self._pass

    def _issue_forward(self, cursor: ForwardCursor, upto: int, prefetch: bool = False) -> None:
        """Issue the forward entries up to ``upto`` (inclusive) not issued yet, in order. An
        entry whose boundary is running now waits for its post-forward when prefetched."""
        entries = self.schedule.forward
        while cursor.issued <= upto and cursor.issued < len(entries):
            group = self.groups[entries[cursor.issued]]
            if group.active:
                if prefetch:
                    return
                raise ScheduleError(
                    f"DMuon: {group.name} is due again while its own forward is still running "
                    "(a nested or recursive call); DMuon cannot serve it: make it a hook "
                    "boundary of its own that is not called from inside itself"
                )
            if not group.held_for_backward:  # (Z2: current since this step's first forward)
                if cursor.training and not self.reshard_after_forward:
                    group.held_for_backward = True
                group.unshard("forward", refresh=True)
            cursor.issued += 1

    def _end_forward_pass(self) -> None:
        """Issue what this rank did not reach (other ranks did), free what it does not keep."""
        cursor = self._pass
        if cursor is None:
            return
        self._pass = None
        self._issue_forward(cursor, len(self.schedule.forward) - 1)
        if cursor.training and self._recording is not None:
            self._local_sequence, self._recording = self._recording, None
        for group in self.groups:
            if not (group.held_for_backward or group.active):
                group.reshard()

    def _ensure_scheduled(self, group: BoundaryGroup, phase: str) -> None:
        """``group``'s full-size weights must have been scheduled (issued) by now. A boundary
        with no entry left (run more often than scheduled) is served only in the first step,
        while the order is still being recorded."""
        if group.unshard_state is not UnshardState.FREED:
            return
        if self.schedule.recorded:
            raise ScheduleError(
                f"DMuon: {group.name} ran again after its last scheduled use (phase {phase}); "
                "the forward order recorded in the first step has it "
                f"{self.schedule.forward.count(group.index)} time(s) per forward. A boundary "
                "must run at most as often per forward, on every rank, as in the first step: "
                "call it a fixed number of times per forward"
            )
        group.unshard(phase)
        if phase == "forward" and self._forward_pass().training:
            group.held_for_backward = not self.reshard_after_forward

    # ------------------------------------------------------------------ backward
    def _begin_backward(self) -> None:
        if self._backward is not None:
            return
        self._end_forward_pass()
        Variable._execution_engine.queue_callback(self._end_of_backward)
        self._backward = BackwardCursor()
        if self.reshard_after_forward:
            self._issue_backward_unshards(-1)  # the leading ones that did not run here

    def pre_backward(self, group: BoundaryGroup) -> None:
        self._begin_backward()
        if group.training_state is TrainingState.POST_BACKWARD:
            return  # a late output gradient: the boundary's own backward is over
        self._reach_in_backward(group)
        self._ensure_scheduled(group, "backward_unshard")
        group.pre_backward()
        self._advance_reduces()

    def _reach_in_backward(self, group: BoundaryGroup) -> None:
        """Z3: issue the re-broadcasts up to ``group``'s (and prefetch the next one)."""
        if not self.reshard_after_forward:
            return
        position = self.schedule.backward_unshard.index(group.index)
        self._issue_backward_unshards(position)
        if self.schedule.recorded:
            self._issue_backward_unshards(position + 1)

    def _issue_backward_unshards(self, upto: int) -> None:
        """Issue the re-broadcasts up to ``upto`` (inclusive), and right after them those of
        boundaries that did not run here: this rank will never reach them, and a peer that
        needs one must not wait for this rank to get further (it may be held up by the
        peer's own collectives, FSDP2's for instance)."""
        cursor, order = self._backward, self.schedule.backward_unshard
        while cursor.unshard_issued < len(order) and (
            cursor.unshard_issued <= upto or order[cursor.unshard_issued] not in self.ran_this_step
        ):
            self.groups[order[cursor.unshard_issued]].unshard("backward_unshard", refresh=True)
            cursor.unshard_issued += 1

    def grad_accumulated(self, group: BoundaryGroup, param: DedicatedParam) -> None:
        self._begin_backward()
        group.grads_ready.add(param.index)
        self._advance_reduces()

    def _advance_reduces(self) -> None:
        """Issue the reduces, in schedule order, of every boundary whose gradients are final
        on this rank: all arrived, or it did not run here (it contributes zeros), or the
        backward is over."""
        cursor, order = self._backward, self.schedule.reduce
        while cursor.reduce_issued < len(order):
            group = self.groups[order[cursor.reduce_issued]]
            ran = group.index in self.ran_this_step
            if not (self._ending_backward or not ran or group.grads_final):
                return
            # A re-broadcast this rank only joined is freed at the end of backward: waiting
            # for it here could block on a peer that is not there yet.
            self._pending_reduces.extend(
                group.post_backward(
                    sync=self.requires_gradient_sync and not self.pipelined,
                    free=ran and not self.pipelined,
                )
            )
            cursor.reduce_issued += 1

    def _end_of_backward(self) -> None:
        self._ending_backward = True
        try:
            if self.reshard_after_forward:
                self._issue_backward_unshards(len(self.schedule.backward_unshard) - 1)
            self._advance_reduces()
            for group in self.groups:
                # frees re-broadcasts this rank only joined, prefetches; pipelined: keeps all
                group.end_backward(keep=self.pipelined)
            self.finalize_reduces()
            if not self.schedule.recorded:
                # Every rank's first backward ends here: one gather of the recorded orders.
                sequences = self.comm.all_gather_objects(self._local_sequence or [])
                self.schedule = merge_sequences(sequences, len(self.groups))
                self._local_sequence = self._recording = None
        finally:
            self._ending_backward = False
            self._backward = None
            self.ran_this_step.clear()

    def reduce_step_gradients(self) -> None:
        """Pipelining, after the step's last backward on this stage: every boundary's
        accumulated gradients to their owners (in schedule order; the same on every rank
        whatever ran here), the full-size weights dropped, the owners' ``grad`` set."""
        if not self.pipelined or self.direct or not self._initialized:
            return
        if self._backward is not None:
            raise RuntimeError("reduce_step_gradients inside a backward")
        for index in self.schedule.reduce:
            group = self.groups[index]
            if self.requires_gradient_sync:
                self._pending_reduces.extend(group.reduce_grads())
            group.end_backward()
        self.finalize_reduces()

    def finalize_reduces(self) -> None:
        """Wait for the issued reduces; owners get ``owned.grad`` (see
        :func:`~dmuon_titan.runtime.bucket.finalize`). Direct (one rank): the gradients are
        in place already."""
        if self.direct:
            return
        pending, self._pending_reduces = self._pending_reduces, []
        if pending:
            self.presence_syncs += finalize(pending, self.gradient_divide_factor, self.tp_exchange)

    # ------------------------------------------------------------------ clipping
    def defer_grad_scale(self, factor: torch.Tensor, masters: list[torch.Tensor]) -> bool:
        """Record ``factor`` (0-d, on the gradients' device) as owed on the gradients of the
        owned ``masters``, without multiplying them (a factor still owed is settled first),
        where that is allowed: on one rank (the direct path), with one DMuon optimizer
        stepping the matrices that may capture its step (whose momentum pass then applies
        it: one pass over the gradients less), and float32 gradients. Returns whether it was
        recorded (if not, the caller multiplies). See ``grad_scale.py``."""
        self.grad_scale.settle()
        if not (self.direct and len(self.optimizers) == 1):
            return False
        (optimizer,) = self.optimizers
        return optimizer.may_capture_step and self.grad_scale.owe(factor, masters)

    def take_grad_scale(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """:meth:`OwedGradScale.take`."""
        return self.grad_scale.take()

    def apply_deferred_grad_scale(self) -> None:
        """Settle an owed factor: multiply the gradients that owe it, now."""
        self.grad_scale.settle()

    def drop_deferred_grad_scale(self) -> None:
        """Forget an owed factor (its gradients are being zeroed or dropped)."""
        self.grad_scale.drop()

    # ------------------------------------------------------------------ replicas
    def after_step(self) -> None:
        """Send the owners' updated masters to the other replicas: asynchronously (waited for
        in the next forward of each boundary, hidden behind earlier layers), or right away
        with ``replicate_async=False``. With tensor parallelism their shards go to the
        owners' rows first (waited for here). On the direct path: the boundaries' waits
        armed, if the step is in flight."""
        if self.direct:
            self.arm_step_waits()
        else:
            self.replicas.send_updates()

    def wait_all_replicate_broadcasts(self) -> None:
        self.wait_for_step()
        for group in self.groups:
            group.wait_replicate()

    def wait_for_step(self) -> None:
        """The current stream waits (on the GPU) for an optimizer step still in flight on its
        own stream (``Muon(async_step=True)``); nothing otherwise."""
        self.waits.wait()

    def step_in_flight(self) -> bool:
        """Whether an optimizer step may still be running on its own stream (a stand-in
        without ``in_flight`` counts as one)."""
        return self.waits.in_flight()

    def arm_step_waits(self) -> None:
        """Direct path: every boundary's module waits for the step in flight before its
        forward (a module run outside the model's forward, or on another stream, reads the
        matrices the step writes), until a forward of the model finds no step in flight
        (:meth:`disarm_step_waits`). So a forward after the step, while it runs, asks at
        every boundary, as before; later ones, validation's say, take nn.Module's plain call
        path. Nothing while no step is in flight."""
        self.waits.arm(self.groups, self._step_wait_hooks)

    def disarm_step_waits(self) -> None:
        """No step in flight any more: the boundaries' waits removed (and the step graphs
        held for them let go)."""
        self.waits.disarm(self.groups)

    def ensure_replicas_synced(self) -> None:
        if not self.replicas.synced:
            self.sync_replicas()

    def mark_replicas_synced(self) -> None:
        self.replicas.synced = True

    def sync_replicas(self) -> None:
        """:meth:`ReplicaSync.sync`: every copy equal to the global owner's master, now."""
        self.replicas.sync(self._initialized)

    # ------------------------------------------------------------------ queries
    def owned_params(self) -> list[DedicatedParam]:
        return [p for p in self.params if p.is_owner]


def _nearest_mp_policy(module: nn.Module, parents: dict[nn.Module, nn.Module]):
    """FSDP2's MixedPrecisionPolicy of the lowest ``fully_shard`` module at or above ``module``."""
    from torch.distributed.fsdp import FSDPModule

    current: nn.Module | None = module
    while current is not None:
        if isinstance(current, FSDPModule):
            return current._get_fsdp_state()._mp_policy
        current = parents.get(current)
    return None
