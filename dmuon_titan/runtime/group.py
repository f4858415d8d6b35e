"""One hook boundary: its dedicated parameters grouped by owner column into buckets, with
coalesced collectives and the boundary's own lifecycle.

Stage 1 (the shard ranks) moves by one of two ``collectives``, chosen per boundary by
:func:`dmuon_titan.plan.choose_boundary_collectives`:

- ``"broadcast"``: each bucket has its own flat buffer, broadcast from its column (forward,
  and again before backward under Z3) and reduced to it (backward), bucket after bucket;
- ``"gather"``: one buffer of one equal slot per shard rank, each bucket at its column's slot
  (padded to the largest bucket); one all-gather fills it, one reduce-scatter returns each
  column its bucket's gradient sum, every rank sending at once.

With replicas each bucket's segments go on to their global owners (stage 2), and after the
step the owners broadcast their updated weights back to the replicas. Expert stacks (3-D)
are not in buckets: each moves by an all-gather and a reduce-scatter of its own over the
whole grid (``stack.py``). When each of this is
issued is the root state's decision (``state.py``: the rank-consistent schedule); what it does
to the boundary is here.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from .bucket import OwnerBucket, PendingReduce, common_dtypes
from .bucket_reduce import reduce_bucket, reduce_gathered
from .collectives import Collectives, Pending
from .owned_param import DedicatedParam
from .stack import ExpertStack


class UnshardState(enum.Enum):
    FREED = "freed"  # no full-size storage (column ranks still hold their masters)
    PENDING = "pending"  # broadcast issued, not waited for
    READY = "ready"  # full-size params hold current weights


class TrainingState(enum.Enum):
    """Where the boundary is in this rank's step (as FSDP2's parameter groups)."""

    IDLE = "idle"
    FORWARD = "forward"  # between its forward pre- and post-hook: its buffers are in use
    PRE_BACKWARD = "pre_backward"  # its backward began (an output's gradient arrived)
    POST_BACKWARD = "post_backward"  # its reduce was issued: its backward is over here


class BoundaryGroup:
    """The dedicated parameters whose hooks live on one boundary module."""

    def __init__(
        self,
        index: int,
        path: str,
        module: nn.Module,
        params: list[DedicatedParam],
        comm: Collectives,
        collectives: str = "broadcast",
        auto: bool = False,
    ):
        self.index = index
        self.path = path
        self.module = module
        self.params = params
        self.comm = comm
        self.mesh = comm.mesh
        by_column: dict[int, list[DedicatedParam]] = {}
        for p in params:
            if not p.stacked:
                by_column.setdefault(p.owner_shard, []).append(p)
        self.buckets = [OwnerBucket(s, by_column[s]) for s in sorted(by_column)]
        self.stacks = [
            ExpertStack(p, self.mesh.grid_size, self.mesh.grid_rank) for p in params if p.stacked
        ]
        if collectives not in ("broadcast", "gather"):
            raise ValueError(f"collectives must be 'broadcast' or 'gather', got {collectives!r}")
        #: ``"broadcast"`` or ``"gather"`` (module doc); the same on every rank. It concerns
        #: the buckets: a boundary of stacks alone has none to move.
        self.collectives = collectives if self.buckets else "broadcast"
        #: chosen by ``collectives="auto"``: may fall back to "broadcast" (mixed dtypes)
        self.auto = auto
        #: "gather": elements per shard rank's slot, weights and gradients (incl. flags)
        self.slot_numel = max((b.numel for b in self.buckets), default=0)
        self.reduce_slot_numel = max((b.reduce_numel for b in self.buckets), default=0)
        self._buffers: list[torch.Tensor] = []  # the buckets' weight storage
        self.num_trainable = sum(1 for p in params if p.owned.requires_grad)
        self.unshard_state = UnshardState.FREED
        self.training_state = TrainingState.IDLE
        self._pending: list[Pending] = []
        self._version_guard = None  # the buffers' version counters, restored after a refill
        self._replicate_pending: list[Pending] = []
        self.hook_handles: list = []  # forward hooks, on ``module`` or a wrapper of it
        self.hook_module: nn.Module | None = None  # the module holding them
        #: Z2: unsharded by a training forward since the last backward, kept for backward
        self.held_for_backward = False
        #: indices of the parameters whose gradient arrived in the current backward
        self.grads_ready: set[int] = set()

    @property
    def gathered(self) -> bool:
        return self.collectives == "gather"

    @property
    def name(self) -> str:
        """How messages name this boundary."""
        return f"boundary {self.path or '<root>'!r}"

    @property
    def active(self) -> bool:
        """Between its forward pre- and post-hook (its buffers are in use)."""
        return self.training_state is TrainingState.FORWARD

    def lazy_init(self) -> None:
        """Buffers, once the parameters' mixed-precision dtypes are known."""
        device = self.mesh.device
        for bucket in self.buckets:
            bucket.resolve_dtypes()
        if self.gathered and self.auto:
            if len({(b.param_dtype, b.reduce_dtype) for b in self.buckets}) != 1:
                # One buffer needs one dtype. The policies are the same on every rank, so is
                # this fallback.
                self.collectives = "broadcast"
        if self.gathered:
            self.param_dtype, self.reduce_dtype = common_dtypes(
                [p for b in self.buckets for p in b.params],
                f"{self.name}, collectives 'gather': use collectives='broadcast'",
            )
            buffer = torch.empty(
                self.mesh.shard_size * self.slot_numel, dtype=self.param_dtype, device=device
            )
            for bucket in self.buckets:
                start = bucket.owner_shard * self.slot_numel
                bucket.attach(buffer[start : start + bucket.numel])
            self._buffers = [buffer]
        else:
            self._buffers = []
            for bucket in self.buckets:
                buffer = torch.empty(bucket.numel, dtype=bucket.param_dtype, device=device)
                bucket.attach(buffer)
                self._buffers.append(buffer)
        for stack in self.stacks:
            stack.lazy_init(device)
        self._free()

    @property
    def _storage(self) -> list[torch.Tensor]:
        """Every buffer that holds full-size weights: the buckets', then the stacks'."""
        return self._buffers + [stack.buffer for stack in self.stacks]

    def _allocate(self) -> None:
        for buffer in self._storage:
            storage = buffer.untyped_storage()
            nbytes = buffer.numel() * buffer.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)

    def _free(self) -> None:
        for buffer in self._storage:
            buffer.untyped_storage().resize_(0)

    # ---------------------------------------------------------------- weights in
    def unshard(self, phase: str, refresh: bool = False) -> None:
        """Issue the collectives that make every full-size parameter current (async).

        Without ``refresh`` nothing happens unless the storage is freed. With it the
        collectives are issued whatever the state (the schedule decided that this rank joins
        them; its copy is current already, or unused): an earlier one in flight is waited
        for first, and the caller makes sure nothing reads the buffer meanwhile.
        """
        if self.unshard_state is not UnshardState.FREED:
            if not refresh:
                return
            self.wait_unshard()
        self.wait_replicate()  # the masters must hold the last step's update first
        self._allocate()
        # The unsharded params alias the buffers and may be saved for backward: refilling them
        # must not bump their version counter (autograd would reject it). The counters are
        # put back once the collectives are waited for: gloo's all-gather copies into its
        # output (a bump) on its own thread, after the call returns.
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(tuple(self._storage))
        comm = self.comm
        for bucket in self.buckets:
            if bucket.holds_source:
                bucket.fill_from_owned()
            if not self.gathered:
                self._pending.append(
                    comm.broadcast(bucket.buffer, bucket.owner_shard, phase, what=self.name)
                )
        if self.gathered:
            self._pending.append(comm.all_gather_slots(self._buffers[0], phase, what=self.name))
        for stack in self.stacks:
            self._pending.append(stack.unshard(comm, phase, self.name))
        self.unshard_state = UnshardState.PENDING

    def wait_unshard(self) -> None:
        if self.unshard_state is UnshardState.PENDING:
            for pending in self._pending:
                pending.wait()
            self._pending.clear()
            self._version_guard.__exit__(None, None, None)
            self._version_guard = None
            self.unshard_state = UnshardState.READY

    def reshard(self) -> None:
        """Drop the full-size storage (column ranks keep their masters)."""
        if self.unshard_state is UnshardState.FREED:
            return
        self.wait_unshard()
        self._free()
        self.unshard_state = UnshardState.FREED

    # ---------------------------------------------------------------- lifecycle
    def pre_forward(self) -> None:
        """Its forward begins: the full-size weights (scheduled already) are waited for and
        swapped into the modules."""
        self.wait_unshard()
        for p in self.params:
            p.install()
        self.training_state = TrainingState.FORWARD

    def post_forward(self, free: bool) -> None:
        """Its forward ended: the modules get their masters/placeholders back; ``free``
        (Z3, or a forward without gradients) drops the full-size storage."""
        for p in self.params:
            p.uninstall()
        self.training_state = TrainingState.IDLE
        if free:
            self.reshard()

    def pre_backward(self) -> None:
        """Its backward begins (the weights are current: waited for here), and they are in
        the modules until its gradients are final: a checkpoint of the modules' ``forward``
        (Hugging Face's gradient checkpointing, inside the boundary's hooks) recomputes with
        them."""
        self.wait_unshard()
        for p in self.params:
            p.install()
        self.training_state = TrainingState.PRE_BACKWARD

    def recompute(self) -> None:
        """Activation checkpointing re-runs its forward inside backward."""
        self.wait_unshard()
        for p in self.params:
            p.install()

    def end_recompute(self) -> None:
        for p in self.params:
            p.uninstall()

    def post_backward(self, sync: bool, free: bool) -> list[PendingReduce]:
        """Its gradients are final on this rank: reduced to their owners (``sync``; not
        under ``no_sync``), then, if ``free``, the storage dropped."""
        # A recompute that activation checkpointing stopped early (torch's non-reentrant
        # checkpoint stops once it has what backward needs) never reached the forward
        # post-hook that hands the modules their masters back: done here.
        self.end_recompute()
        issued = self.reduce_grads() if sync else []
        if free:
            self.reshard()
            self.held_for_backward = False
        self.training_state = TrainingState.POST_BACKWARD
        return issued

    def end_backward(self, keep: bool = False) -> None:
        """The whole backward is over: per-backward records reset and, unless ``keep``
        (pipelining: later microbatches use them), nothing full-size stays."""
        if not keep:
            self.reshard()
            self.held_for_backward = False
        self.end_recompute()  # (as in post_backward)
        self.grads_ready.clear()
        self.training_state = TrainingState.IDLE

    @property
    def grads_final(self) -> bool:
        """Every trainable parameter's gradient arrived in this backward."""
        return len(self.grads_ready) == self.num_trainable

    # ---------------------------------------------------------------- gradients out
    def reduce_grads(self) -> list[PendingReduce]:
        """Stage 1 (shard ranks, to the column) and, with replicas, stage 2 (across replicas,
        to the global owner) for every bucket (``bucket_reduce.py``); returns what owners
        unpack later."""
        issued = [stack.reduce_grads(self.comm, self.name) for stack in self.stacks]
        if self.gathered:
            return issued + reduce_gathered(
                self.comm, self.buckets, self.reduce_slot_numel, self.reduce_dtype, self.name
            )
        for bucket in self.buckets:
            issued.append(reduce_bucket(self.comm, bucket, self.name))
        return issued

    # ---------------------------------------------------------------- updates back to replicas
    def broadcast_updates(self) -> None:
        """After the step: each global owner's updated masters to the other replicas (async);
        with tensor parallelism each rank of the owner's row sends its tp-shard copy."""
        for bucket in self.buckets:
            if not bucket.holds_source:
                continue
            for segment in bucket.segments:
                for p in segment.params:
                    self._replicate_pending.append(
                        self.comm.broadcast(
                            p.source.detach(),
                            segment.replica,
                            "replicate_broadcast",
                            group="replicate",
                            stream="replicate",
                            what=self.name,
                        )
                    )

    def wait_replicate(self) -> None:
        for pending in self._replicate_pending:
            pending.wait()
        self._replicate_pending.clear()
