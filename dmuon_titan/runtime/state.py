"""The root state of one model on this rank: lazy init, the hooks' entry points, the reduces.

Every collective of a step is issued in the order of the rank-consistent schedule, walked by
:class:`~dmuon_titan.runtime.walk.ScheduleWalk`; each
:class:`~dmuon_titan.runtime.group.BoundaryGroup` does *what* its lifecycle needs. The hooks
that call in here are registered by :meth:`DMuonState.install_hooks` (helpers in ``hooks.py``);
the clip's owed factor (``grad_scale.py``), the copies of the masters (``replicas.py``) and
the optimizer steps in flight (``step_waits.py``) are parts of their own.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..options import DedicateOptions
from ..plan import Plan
from . import hooks
from .bucket import finalize
from .collectives import Collectives
from .grad_scale import OwedGradScale
from .group import BoundaryGroup
from .owned_param import DedicatedParam
from .replicas import ReplicaSync
from .shared_ns import SharedNewtonSchulz
from .step_waits import StepWaits
from .tensor_parallel import TensorParallelExchange
from .walk import ScheduleWalk, in_backward

STATE_ATTR = "_dmuon_state"


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
        self.root, self.plan, self.params, self.groups = root, plan, params, groups
        for p in params:
            p.state_ref = weakref.ref(self)
        self.comm, self.mesh, self.options = comm, comm.mesh, options
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
        #: the walk over the step's schedule (forward passes, backward, reduces)
        self.walk = ScheduleWalk(self)
        self._initialized, self.direct = False, False  # (direct: decided at lazy init)
        #: the post-forward hooks that close scopes (register_scope_hooks)
        self.scope_handles: list = []
        #: the optimizer steps that may run on their own streams, and the waits for them
        self.waits = StepWaits()
        self.replicas = ReplicaSync(self)
        #: a gradient clip's factor the owned gradients still owe (:meth:`defer_grad_scale`)
        self.grad_scale = OwedGradScale()
        #: how many times the gradient-presence flags were read back (a host sync each);
        #: stays 0 while every owner has its own gradient for every matrix it owns
        self.presence_syncs = 0

    def attach_step(self, step) -> None:
        """The captured step of an optimizer that steps the owned matrices
        (``dmuon_titan.Muon``'s; see ``step_waits.py`` for what is asked of it): the forward,
        backward and state dicts wait for it, and a clip may leave its factor to it."""
        self.waits.steps.add(step)

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
        if self._initialized and not self.pipelined and self.walk.in_backward_pass:
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
        self.walk.begin_pass()

    def root_post_forward(self, output):
        if in_backward() or self.direct:
            return output
        return self.walk.end_root_pass(output)

    def pre_forward(self, group: BoundaryGroup) -> None:
        self.lazy_init()
        if self.direct:
            self.wait_for_step()
            return
        self.walk.pre_forward(group)

    def post_forward(self, group: BoundaryGroup, output):
        return output if self.direct else self.walk.post_forward(group, output)

    def close_scope(self, inside: frozenset[int]) -> None:
        if not self.direct:
            self.walk.close_scope(inside)

    # ------------------------------------------------------------------ backward
    def pre_backward(self, group: BoundaryGroup) -> None:
        self.walk.pre_backward(group)

    def grad_accumulated(self, group: BoundaryGroup, param: DedicatedParam) -> None:
        self.walk.grad_accumulated(group, param)

    def reduce_step_gradients(self) -> None:
        """Pipelining, after the step's last backward on this stage: every boundary's
        accumulated gradients to their owners (in schedule order; the same on every rank
        whatever ran here), the full-size weights dropped, the owners' ``grad`` set."""
        if self.pipelined and not self.direct and self._initialized:
            self.walk.reduce_step_gradients()

    def finalize_reduces(self) -> None:
        """Wait for the issued reduces; owners get ``owned.grad`` (see
        :func:`~dmuon_titan.runtime.bucket.finalize`). Direct (one rank): the gradients are
        in place already."""
        if self.direct:
            return
        pending, self.walk.pending = self.walk.pending, []
        if pending:
            self.presence_syncs += finalize(pending, self.gradient_divide_factor, self.tp_exchange)

    # ------------------------------------------------------------------ clipping
    def defer_grad_scale(self, factor: torch.Tensor, masters: list[torch.Tensor]) -> bool:
        """Record ``factor`` (0-d, on the gradients' device) as owed on the gradients of the
        owned ``masters``, without multiplying them (a factor still owed is settled first),
        where that is allowed: on one rank (the direct path), with one DMuon optimizer
        attached whose step may be captured (whose momentum pass then applies
        it: one pass over the gradients less), and float32 gradients. Returns whether it was
        recorded (if not, the caller multiplies). See ``grad_scale.py``."""
        self.grad_scale.settle()
        steps = list(self.waits.steps)
        if not (self.direct and len(steps) == 1 and getattr(steps[0], "may_capture", False)):
            return False
        return self.grad_scale.owe(factor, masters)

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
