"""Per-model DMuon runtime state: the groups, the collectives, the schedule, one step's
bookkeeping.

Every collective of a step is issued in the order of the rank-consistent
:class:`~dmuon_titan.runtime.schedule.Schedule`, decided by the plan and the recorded forward
order, never by which boundaries this rank's data happened to run (see ``schedule.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Variable

from ..plan import Plan
from .collectives import Collectives
from .group import BoundaryGroup, PendingReduce, UnshardState
from .owned_param import DedicatedParam
from .schedule import (
    BackwardCursor,
    ForwardCursor,
    ScheduleError,
    merge_sequences,
    plan_order_schedule,
)

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
        reshard_after_forward: bool,
        replicate_async: bool = True,
    ) -> None:
        self.root = root
        self.plan = plan
        self.params = params
        self.groups = groups
        self.comm = comm
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.replicate_async = replicate_async
        self.shard_rank, self.replicate_rank = comm.ranks["shard"], comm.ranks["replicate"]
        self.shard_size, self.replicate_size = comm.shard_size, comm.replicate_size
        #: this rank's slot in the plan, and the number of slots (the data-parallel world)
        self.rank = self.replicate_rank * self.shard_size + self.shard_rank
        self.world_size = self.shard_size * self.replicate_size
        # Summed gradients are divided by this (FSDP2's gradient divide factor): the world size
        # averages; 1.0 sums, for losses already normalized globally (torchtitan does that).
        self.gradient_divide_factor = float(self.world_size)
        self.device = comm.device
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
        self._replicas_synced = False
        #: how many times the gradient-presence flags were read back (a host sync each);
        #: stays 0 while every owner has its own gradient for every matrix it owns
        self.presence_syncs = 0

    # ------------------------------------------------------------------ setup
    def lazy_init(self) -> None:
        """First use: check registration, resolve mixed precision, build buffers and hooks."""
        if self._initialized:
            return
        parents = {}
        for module in self.root.modules():
            for child in module.children():
                parents[child] = module
        self.adopt_registered()
        for p in self.params:
            p.check_materialized()
            policy = _nearest_mp_policy(p.module, parents)
            # FSDP2 semantics: compute in param_dtype, reduce in reduce_dtype (default: the
            # compute dtype); the owner's master and optimizer state stay in orig_dtype.
            p.param_dtype = (policy.param_dtype if policy else None) or p.orig_dtype
            p.reduce_dtype = (policy.reduce_dtype if policy else None) or p.param_dtype
        for group in self.groups:
            group.lazy_init(self.device)
            for p in group.params:
                if p.unsharded.requires_grad:
                    p.unsharded.register_post_accumulate_grad_hook(_make_grad_hook(self, group, p))
        self._initialized = True
        # Each replica's column rank ran init_weights with its own random stream: from here
        # on every copy is the global owner's.
        self.ensure_replicas_synced()

    def adopt_registered(self) -> None:
        """Track parameters that ``to_empty``/``.to()`` replaced on their modules."""
        for p in self.params:
            p.adopt_registered()

    # ------------------------------------------------------------------ forward
    def root_pre_forward(self) -> None:
        """The model's own forward starts: a new pass over the schedule."""
        if in_backward():
            return
        self.lazy_init()
        self._end_forward_pass()  # one left open by forwards of submodules alone
        self._pass = ForwardCursor(training=torch.is_grad_enabled())

    def root_post_forward(self, output):
        if in_backward() or self._pass is None:
            return output
        training = self._pass.training
        self._end_forward_pass()
        if training:  # so that backward begins here even where no boundary ran
            output = _register_pre_backward(output, self._begin_backward)
        return output

    def pre_forward(self, group: BoundaryGroup) -> None:
        self.lazy_init()
        if in_backward():  # activation-checkpoint recompute: backward's turn for the boundary
            self._begin_backward()
            self._reach_in_backward(group)
            self._ensure_current(group, "recompute")
            group.install()
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
        self._ensure_current(group, "forward")
        group.active = True
        group.install()

    def post_forward(self, group: BoundaryGroup, output):
        group.uninstall()
        group.active = False
        if in_backward():
            return output  # recompute inside backward: the backward is about to use them
        cursor = self._forward_pass()
        if cursor.training:
            output = _register_pre_backward(output, lambda: self.pre_backward(group))
        if not group.held_for_backward:
            group.reshard()  # Z3, or a forward without grad: free after use
        if self.schedule.recorded:  # a prefetch may have waited for this boundary
            self._issue_forward(cursor, cursor.consumed, prefetch=True)
        return output

    def close_scope(self, inside: frozenset[int]) -> None:
        """A module whose subtree holds the boundaries ``inside`` finished its forward: the
        entries of theirs due next were not reached here (an expert without tokens) and are
        issued now, not when this rank reaches its next boundary, for a peer that runs them
        may be waiting, and this rank may first block in collectives of its own (FSDP2's
        all-gather of the next block)."""
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
            if group.held_for_backward:
                pass  # Z2: current since this step's first training forward
            else:
                if cursor.training and not self.reshard_after_forward:
                    group.held_for_backward = True
                group.unshard(self.comm, "forward", refresh=True)
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

    def _ensure_current(self, group: BoundaryGroup, phase: str) -> None:
        """Make ``group``'s full-size weights current on this rank, waiting for what the
        schedule issued. A boundary with no entry left (run more often than scheduled) is
        served only in the first step, while the order is still being recorded."""
        if group.unshard_state is UnshardState.FREED:
            if self.schedule.recorded:
                raise ScheduleError(
                    f"DMuon: {group.name} ran again after its last scheduled use "
                    f"(phase {phase}); the forward order recorded in the first step has it "
                    f"{self.schedule.forward.count(group.index)} time(s) per forward. A "
                    "boundary must run at most as often per forward, on every rank, as in "
                    "the first step: call it a fixed number of times, or run the first step "
                    "with every boundary used"
                )
            group.unshard(self.comm, phase)
            if phase == "forward" and self._forward_pass().training:
                group.held_for_backward = not self.reshard_after_forward
        group.wait_unshard()

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
        if group.index in self._backward.reduced:
            return  # a late output gradient: the boundary's own backward is over
        self._reach_in_backward(group)
        self._ensure_current(group, "backward_unshard")
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
            self.groups[order[cursor.unshard_issued]].unshard(
                self.comm, "backward_unshard", refresh=True
            )
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
            final = (
                self._ending_backward or group.index not in self.ran_this_step or group.grads_final
            )
            if not final:
                return
            if self.requires_gradient_sync:
                self._pending_reduces.extend(group.reduce_grads(self.comm))
            if group.index in self.ran_this_step:
                # (A re-broadcast this rank only joined is freed at the end of backward:
                # waiting for it here could block on a peer that is not there yet.)
                group.reshard()
            group.held_for_backward = False
            cursor.reduced.add(group.index)
            cursor.reduce_issued += 1

    def _end_of_backward(self) -> None:
        self._ending_backward = True
        try:
            if self.reshard_after_forward:
                self._issue_backward_unshards(len(self.schedule.backward_unshard) - 1)
            self._advance_reduces()
            for group in self.groups:
                group.reshard()  # re-broadcasts this rank only joined, unused prefetches
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
            for group in self.groups:
                group.reset_step()

    def finalize_reduces(self) -> None:
        """Wait for issued reduces; global owners turn them into ``owned.grad``.

        A matrix gets ``grad`` if any rank produced a gradient for it, else keeps ``None``
        (skipped by the step, as torch.optim does). The owner knows on the host whether it
        had one itself, which settles it in ordinary training with no synchronization at
        all. Only for owned matrices the owner had no gradient for (unused on this rank) are
        the summed presence flags read back: one device-to-host copy, a host synchronization,
        after everything else has been issued.
        """
        pending, self._pending_reduces = self._pending_reduces, []
        pending = [item.complete() for item in pending]  # in issue order, as on every rank
        for item in pending:
            for handle in item.handles:
                handle.wait()
        owned = [item for item in pending if item.members is not None]
        if not owned:
            return
        grads = [
            item.bucket.reduced_grads(item.members, item.segment, self.gradient_divide_factor)
            for item in owned
        ]
        unknown = [item for item in owned if not all(p.packed_local_grad for p in item.members)]
        self.presence_syncs += bool(unknown)
        flags = iter(
            torch.cat(
                [item.segment[item.segment.numel() - len(item.members) :] for item in unknown]
            ).tolist()
            if unknown
            else ()
        )
        unknown_ids = {id(item) for item in unknown}
        for item, item_grads in zip(owned, grads, strict=True):
            read = id(item) in unknown_ids
            for p, grad in zip(item.members, item_grads, strict=True):
                flag = next(flags) if read else None
                if p.packed_local_grad or (flag is not None and flag > 0):
                    if p.owned.grad is None:
                        p.owned.grad = grad
                    else:
                        p.owned.grad.add_(grad)

    # ------------------------------------------------------------------ replicas
    def after_step(self) -> None:
        """Send the owners' updated masters to the other replicas: asynchronously (waited for
        in the next forward of each boundary, hidden behind earlier layers), or right away
        with ``replicate_async=False``."""
        if self.replicate_size == 1:
            return
        for group in self.groups:
            group.broadcast_updates(self.comm)
        if not self.replicate_async:
            self.wait_all_replicate_broadcasts()

    def wait_all_replicate_broadcasts(self) -> None:
        for group in self.groups:
            group.wait_replicate()

    def ensure_replicas_synced(self) -> None:
        if not self._replicas_synced:
            self.sync_replicas()

    def mark_replicas_synced(self) -> None:
        self._replicas_synced = True

    def sync_replicas(self) -> None:
        """Make every replica's master equal the global owner's, now (after init or a load)."""
        self._replicas_synced = True
        if self.replicate_size == 1:
            return
        for group in self.groups:
            group.broadcast_updates(self.comm)
        self.wait_all_replicate_broadcasts()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

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


def _make_grad_hook(state: DMuonState, group: BoundaryGroup, param: DedicatedParam):
    def hook(_tensor: torch.Tensor) -> None:
        state.grad_accumulated(group, param)

    return hook


def _register_pre_backward(output, callback):
    """Call ``callback()`` when the gradient of any of ``output``'s tensors arrives."""
    tensors = [
        t
        for t in torch.utils._pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]

    def hook(grad: torch.Tensor) -> None:
        callback()

    for t in tensors:
        t.register_hook(hook)
    return output
