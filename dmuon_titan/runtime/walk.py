"""One model's walk over the rank-consistent schedule on this rank: forward passes, the
backward, and the reduces they issue.

Every collective of a step is issued in the order of the
:class:`~dmuon_titan.runtime.schedule.Schedule`, decided by the plan and the forward order
recorded on all ranks, never by which boundaries this rank's data happened to run (see
``schedule.py``). The walk decides *when*; each
:class:`~dmuon_titan.runtime.group.BoundaryGroup` does *what* its lifecycle needs. The root
state (``state.py``) calls in here from its hooks, off DMuon's direct path.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable

from .bucket import PendingReduce
from .group import BoundaryGroup, TrainingState, UnshardState
from .modules import register_pre_backward
from .owned_param import DedicatedParam
from .schedule import (
    BackwardCursor,
    ForwardCursor,
    ScheduleError,
    merge_sequences,
    plan_order_schedule,
)


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class ScheduleWalk:
    """The schedule of one model and where this rank is in it (``state``: the root state,
    whose pipelining, resharding and gradient-sync settings the walk follows)."""

    def __init__(self, state) -> None:
        self.state = state
        self.groups: list[BoundaryGroup] = state.groups
        #: the order every rank issues the step's collectives in: plan order for the first
        #: step, the forward order recorded on all ranks after it
        self.schedule = plan_order_schedule(len(self.groups))
        self._recording: list[int] | None = []  # this rank's first training forward
        self._local_sequence: list[int] | None = None
        self.cursor: ForwardCursor | None = None
        self._backward: BackwardCursor | None = None
        self._ending_backward = False
        #: boundaries a training forward ran on this rank since the last backward
        self.ran_this_step: set[int] = set()
        #: reduces issued and not yet finalized (``DMuonState.finalize_reduces``)
        self.pending: list[PendingReduce] = []

    @property
    def in_backward_pass(self) -> bool:
        """Whether a backward of this model is under way on this rank."""
        return self._backward is not None

    # ------------------------------------------------------------------ forward
    def begin_pass(self) -> None:
        """The model's own forward starts: a new pass over the schedule."""
        self.end_pass()  # one left open by forwards of submodules alone
        self.cursor = ForwardCursor(training=torch.is_grad_enabled())

    def end_root_pass(self, output):
        """The model's own forward ended: its pass closed; in training, the backward begins
        at ``output`` even where no boundary ran."""
        if self.cursor is None:
            return output
        training = self.cursor.training
        self.end_pass()
        if training:
            output = register_pre_backward(output, self.begin_backward)
        return output

    def pre_forward(self, group: BoundaryGroup) -> None:
        """Before ``group``'s forward (or its activation-checkpoint recompute in backward)."""
        if in_backward():  # activation-checkpoint recompute: backward's turn for the boundary
            self.begin_backward()
            self.reach_in_backward(group)
            self.ensure_scheduled(group, "recompute")
            group.recompute()
            return
        cursor = self.forward_pass()
        if cursor.training:
            self.ran_this_step.add(group.index)
            if self._recording is not None:
                self._recording.append(group.index)
        entry = self.schedule.next_entry(group.index, cursor.consumed)
        if entry is not None:
            self.issue_forward(cursor, entry)
            cursor.consumed = entry + 1
            if self.schedule.recorded:
                self.issue_forward(cursor, cursor.consumed, prefetch=True)
        self.ensure_scheduled(group, "forward")
        group.pre_forward()

    def post_forward(self, group: BoundaryGroup, output):
        """After ``group``'s forward: its weights out (Z2 keeps them for backward), its
        backward hooked onto ``output``."""
        if in_backward():
            group.end_recompute()  # the backward is about to use the weights
            return output
        group.post_forward(free=not group.held_for_backward)
        cursor = self.forward_pass()
        if cursor.training:
            output = register_pre_backward(output, lambda: self.pre_backward(group))
        if self.schedule.recorded:  # a prefetch may have waited for this boundary
            self.issue_forward(cursor, cursor.consumed, prefetch=True)
        return output

    def close_scope(self, inside: frozenset[int]) -> None:
        """A module whose subtree holds the boundaries ``inside`` finished its forward: the
        entries of theirs due next were not reached here (an expert without tokens) and are
        issued now, not when this rank reaches its next boundary, for a peer that runs them
        may be waiting, and this rank may first block in collectives of its own (FSDP2's
        all-gather of the next block)."""
        cursor = self.cursor
        if cursor is None or in_backward():
            return
        entries, end = self.schedule.forward, cursor.consumed
        while end < len(entries) and entries[end] in inside:
            end += 1
        if end > cursor.consumed:
            self.issue_forward(cursor, end - 1)
            cursor.consumed = end

    def forward_pass(self) -> ForwardCursor:
        if self.cursor is None:  # a forward of submodules, without the root's hooks
            self.cursor = ForwardCursor(training=torch.is_grad_enabled())
        return self.cursor

    def issue_forward(self, cursor: ForwardCursor, upto: int, prefetch: bool = False) -> None:
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
                if cursor.training and not self.state.reshard_after_forward:
                    group.held_for_backward = True
                group.unshard("forward", refresh=True)
            cursor.issued += 1

    def end_pass(self) -> None:
        """Issue what this rank did not reach (other ranks did), free what it does not keep."""
        cursor = self.cursor
        if cursor is None:
            return
        self.cursor = None
        self.issue_forward(cursor, len(self.schedule.forward) - 1)
        if cursor.training and self._recording is not None:
            self._local_sequence, self._recording = self._recording, None
        for group in self.groups:
            if not (group.held_for_backward or group.active):
                group.reshard()

    def ensure_scheduled(self, group: BoundaryGroup, phase: str) -> None:
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
        if phase == "forward" and self.forward_pass().training:
            group.held_for_backward = not self.state.reshard_after_forward

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        if self._backward is not None:
            return
        self.end_pass()
        Variable._execution_engine.queue_callback(self.end_of_backward)
        self._backward = BackwardCursor()
        if self.state.reshard_after_forward:
            self.issue_backward_unshards(-1)  # the leading ones that did not run here

    def pre_backward(self, group: BoundaryGroup) -> None:
        self.begin_backward()
        if group.training_state is TrainingState.POST_BACKWARD:
            return  # a late output gradient: the boundary's own backward is over
        self.reach_in_backward(group)
        self.ensure_scheduled(group, "backward_unshard")
        group.pre_backward()
        self.advance_reduces()

    def reach_in_backward(self, group: BoundaryGroup) -> None:
        """Z3: issue the re-broadcasts up to ``group``'s (and prefetch the next one)."""
        if not self.state.reshard_after_forward:
            return
        position = self.schedule.backward_unshard.index(group.index)
        self.issue_backward_unshards(position)
        if self.schedule.recorded:
            self.issue_backward_unshards(position + 1)

    def issue_backward_unshards(self, upto: int) -> None:
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
        self.begin_backward()
        group.grads_ready.add(param.index)
        self.advance_reduces()

    def advance_reduces(self) -> None:
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
            self.pending.extend(
                group.post_backward(
                    sync=self.state.requires_gradient_sync and not self.state.pipelined,
                    free=ran and not self.state.pipelined,
                )
            )
            cursor.reduce_issued += 1

    def end_of_backward(self) -> None:
        self._ending_backward = True
        try:
            if self.state.reshard_after_forward:
                self.issue_backward_unshards(len(self.schedule.backward_unshard) - 1)
            self.advance_reduces()
            for group in self.groups:
                # frees re-broadcasts this rank only joined, prefetches; pipelined: keeps all
                group.end_backward(keep=self.state.pipelined)
            self.state.finalize_reduces()
            if not self.schedule.recorded:
                # Every rank's first backward ends here: one gather of the recorded orders.
                sequences = self.state.comm.all_gather_objects(self._local_sequence or [])
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
        if self._backward is not None:
            raise RuntimeError("reduce_step_gradients inside a backward")
        for index in self.schedule.reduce:
            group = self.groups[index]
            if self.state.requires_gradient_sync:
                self.pending.extend(group.reduce_grads())
            group.end_backward()
        self.state.finalize_reduces()
