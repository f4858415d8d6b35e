"""One hook boundary: its dedicated parameters grouped by owner, with coalesced collectives.

The parameters of a boundary whose owners sit in the same shard column form an
:class:`OwnerBucket`. Inside a bucket the parameters are ordered by owner replica into
*segments*; with replicas (HSDP/DDP) each segment is reduced once more across the replicate
group to its global owner (stage 2), and after the optimizer step the owner broadcasts the
segment's updated weights back to the replicas.

Stage 1 (the shard group) has two layouts, chosen per boundary by
:func:`dmuon_titan.plan.choose_boundary_collectives`:

- ``"broadcast"``: each bucket has its own flat buffer, broadcast from its column (forward,
  and again before backward under Z3) and reduced to it (backward), bucket after bucket;
- ``"gather"``: one buffer of one equal slot per shard rank, each bucket at its column's slot
  (padded to the largest bucket); one all-gather fills it, one reduce-scatter returns each
  column its bucket's gradient sum, every rank sending at once.

The order of everything is the plan's, identical on every rank, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from .collectives import Collectives, Pending
from .owned_param import DedicatedParam


class UnshardState(enum.Enum):
    FREED = "freed"  # no full-size storage (column ranks still hold their masters)
    PENDING = "pending"  # broadcast issued, not waited for
    READY = "ready"  # full-size params hold current weights


class OwnerBucket:
    """The parameters of one boundary owned in one shard column."""

    def __init__(self, owner_shard: int, params: list[DedicatedParam]) -> None:
        self.owner_shard = owner_shard
        self.params = sorted(params, key=lambda p: (p.owner_replica, p.index))
        self.numel = sum(p.numel for p in self.params)
        self.holds_weight = self.params[0].holds_weight
        # (owner replica, params, offset in the reduce buffer, elements incl. flags)
        self.segments: list[tuple[int, list[DedicatedParam], int, int]] = []
        offset = 0
        for replica in sorted({p.owner_replica for p in self.params}):
            members = [p for p in self.params if p.owner_replica == replica]
            size = sum(p.numel for p in members) + len(members)
            self.segments.append((replica, members, offset, size))
            offset += size
        #: elements of the bucket's gradient buffer: the gradients plus one flag per parameter
        self.reduce_numel = offset
        #: flat, param dtype: a view into the boundary's weight buffer (``attach``)
        self.buffer: torch.Tensor | None = None

    def resolve_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(param dtype, reduce dtype), the same for every parameter of the bucket."""
        dtypes = {(p.param_dtype, p.reduce_dtype) for p in self.params}
        if len(dtypes) != 1:
            names = [p.fqn for p in self.params]
            raise ValueError(
                f"dedicated parameters {names} share a hook boundary and owner but have "
                f"different mixed-precision dtypes {sorted(map(str, dtypes))}"
            )
        self.param_dtype, self.reduce_dtype = next(iter(dtypes))
        return self.param_dtype, self.reduce_dtype

    def attach(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (``numel`` elements, param dtype) the storage of the full-size
        parameters."""
        self.buffer = buffer
        offset = 0
        for p in self.params:
            p.make_unsharded(buffer[offset : offset + p.numel])
            offset += p.numel

    @torch.no_grad()
    def fill_from_owned(self) -> None:
        """Column ranks: copy (and cast) the master weights into the broadcast buffer."""
        offset = 0
        for p in self.params:
            self.buffer[offset : offset + p.numel].copy_(p.owned.reshape(-1))
            offset += p.numel

    @torch.no_grad()
    def pack_grads(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's gradients (zeros where none) plus one presence flag per parameter,
        segment by segment, into ``flat`` (``reduce_numel`` elements; new if ``None``).

        The flags are summed by the reduces, so the owner learns whether *any* rank produced a
        gradient, and keeps ``grad=None`` (skipped, as torch.optim does) when none did.
        """
        if flat is None:
            flat = torch.empty(
                self.reduce_numel, dtype=self.reduce_dtype, device=self.buffer.device
            )
        for _, members, start, size in self.segments:
            flags = flat[start + size - len(members) : start + size]
            flags.zero_()
            offset = start
            for i, p in enumerate(members):
                grad = p.unsharded.grad
                view = flat[offset : offset + p.numel]
                # Known here, on the host: if the owner itself had a gradient, the flags
                # need not be read (see DMuonState.finalize_reduces).
                p.packed_local_grad = grad is not None
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.reshape(-1))
                    flags[i : i + 1].fill_(1)  # a kernel, not a host-to-device copy
                    p.unsharded.grad = None
                offset += p.numel
        return flat

    def owned_segment(self) -> tuple[list[DedicatedParam], torch.Tensor] | None:
        """(params, slice bounds) of the segment this rank owns globally, if any."""
        for _, members, start, size in self.segments:
            if members[0].is_owner:
                return members, (start, size)
        return None

    @torch.no_grad()
    def reduced_grads(
        self, members: list[DedicatedParam], segment: torch.Tensor, divide_factor: float
    ) -> list[torch.Tensor]:
        """Owner only: the summed gradients of ``members`` in ``segment`` divided by
        ``divide_factor``, as views shaped like the parameters (cast to their dtype if the
        reduce dtype differs). Needs no host synchronization: the presence flags decide later
        which of them become ``owned.grad``."""
        if divide_factor != 1:  # the gradients, not the presence flags after them
            segment[: segment.numel() - len(members)].div_(divide_factor)
        grads, offset = [], 0
        for p in members:
            grad = segment[offset : offset + p.numel].view(p.shape)
            grads.append(grad if grad.dtype == p.orig_dtype else grad.to(p.orig_dtype))
            offset += p.numel
        return grads


class PendingReduce:
    """What the global owner must do with a reduced segment once it has arrived.

    ``rest``: without CUDA streams, the second stage (replicas) and the owner's copy wait for
    the first stage on the host, so they are left for :meth:`complete` at the end of
    backward: a rank blocked inside backward on its own reduce could wait on a peer that is
    itself waiting for this rank's next weight broadcast.
    """

    __slots__ = ("bucket", "members", "segment", "handles", "rest")

    def __init__(self, bucket, members, segment, handles, rest=None) -> None:
        self.bucket, self.members, self.segment, self.handles = bucket, members, segment, handles
        self.rest = rest

    def complete(self) -> PendingReduce:
        """Issue what was left for later (in the order the reduces were issued: every rank
        does the same); returns the reduce to wait for."""
        if self.rest is None:
            return self
        for handle in self.handles:
            handle.wait()
        return self.rest()


class BoundaryGroup:
    """The dedicated parameters whose hooks live on one boundary module."""

    def __init__(
        self,
        index: int,
        path: str,
        module: nn.Module,
        params: list[DedicatedParam],
        shard_size: int = 1,
        layout: str = "broadcast",
        auto: bool = False,
    ):
        self.index = index
        self.path = path
        self.module = module
        self.params = params
        by_column: dict[int, list[DedicatedParam]] = {}
        for p in params:
            by_column.setdefault(p.owner_shard, []).append(p)
        self.buckets = [OwnerBucket(s, by_column[s]) for s in sorted(by_column)]
        self.shard_size = shard_size
        if layout not in ("broadcast", "gather"):
            raise ValueError(f"layout must be 'broadcast' or 'gather', got {layout!r}")
        #: stage-1 layout, ``"broadcast"`` or ``"gather"`` (module doc); the same on every rank
        self.layout = layout
        #: chosen by ``collectives="auto"``: may fall back to "broadcast" (mixed dtypes)
        self.auto = auto
        #: "gather": elements per shard rank's slot, weights and gradients (incl. flags)
        self.slot_numel = max(b.numel for b in self.buckets)
        self.reduce_slot_numel = max(b.reduce_numel for b in self.buckets)
        self._buffers: list[torch.Tensor] = []  # what holds the weight storage
        self.num_trainable = sum(1 for p in params if p.owned.requires_grad)
        self.unshard_state = UnshardState.FREED
        self._pending: list[Pending] = []
        self._version_guard = None  # the buffers' version counters, restored after a refill
        self._replicate_pending: list[Pending] = []
        self.hook_handles: list = []  # forward hooks, on ``module`` or a wrapper of it
        #: between this boundary's forward pre- and post-hook (its buffer is in use)
        self.active = False
        #: Z2: unsharded by a training forward since the last backward, kept for backward
        self.held_for_backward = False
        #: indices of the parameters whose gradient arrived in the current backward
        self.grads_ready: set[int] = set()

    @property
    def gathered(self) -> bool:
        return self.layout == "gather"

    @property
    def name(self) -> str:
        """How messages name this boundary."""
        return f"boundary {self.path or '<root>'!r}"

    def lazy_init(self, device: torch.device) -> None:
        dtypes = {bucket.resolve_dtypes() for bucket in self.buckets}
        if self.gathered and len(dtypes) != 1 and self.auto:
            # One buffer needs one dtype. The policies are the same on every rank, so is this.
            self.layout = "broadcast"
        if self.gathered:
            if len(dtypes) != 1:
                raise ValueError(
                    f"boundary {self.path or '<root>'!r} moves its weights in one buffer "
                    "(collectives 'gather') but its parameters have different mixed-precision "
                    f"dtypes {sorted(map(str, dtypes))}; use collectives='broadcast'"
                )
            self.param_dtype, self.reduce_dtype = dtypes.pop()
            buffer = torch.empty(
                self.shard_size * self.slot_numel, dtype=self.param_dtype, device=device
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
        self._free()

    def _allocate(self) -> None:
        for buffer in self._buffers:
            storage = buffer.untyped_storage()
            nbytes = buffer.numel() * buffer.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)

    def _free(self) -> None:
        for buffer in self._buffers:
            buffer.untyped_storage().resize_(0)

    # ---------------------------------------------------------------- weights in
    def unshard(self, comm: Collectives, phase: str, refresh: bool = False) -> None:
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
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(tuple(self._buffers))
        for bucket in self.buckets:
            if bucket.holds_weight:
                bucket.fill_from_owned()
            if not self.gathered:
                self._pending.append(
                    comm.broadcast(bucket.buffer, bucket.owner_shard, phase, what=self.name)
                )
        if self.gathered:
            self._pending.append(comm.all_gather_slots(self._buffers[0], phase, what=self.name))
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

    def install(self) -> None:
        for p in self.params:
            p.install()

    def uninstall(self) -> None:
        for p in self.params:
            p.uninstall()

    # ---------------------------------------------------------------- gradients out
    def reduce_grads(self, comm: Collectives) -> list[PendingReduce]:
        """Stage 1 (shard group, to the column) and, with replicas, stage 2 (replicate group,
        to the global owner) for every bucket; returns what owners unpack later."""
        if self.gathered:
            return self._reduce_grads_gathered(comm)
        issued = []
        for bucket in self.buckets:
            flat = bucket.pack_grads()
            stage1 = comm.reduce_sum(
                flat, bucket.owner_shard, "reduce", len(bucket.params), what=self.name
            )
            issued.append(self._stage2(comm, bucket, flat, stage1, flat))
        return issued

    def _reduce_grads_gathered(self, comm: Collectives) -> list[PendingReduce]:
        """One reduce-scatter: every bucket packed at its column's slot (padding zeroed);
        this rank receives its column's bucket summed, in a tensor of its own (so the other
        slots are freed once the collective is done)."""
        slot = self.reduce_slot_numel
        flat = torch.empty(
            self.shard_size * slot, dtype=self.reduce_dtype, device=self.buckets[0].buffer.device
        )
        by_column = {bucket.owner_shard: bucket for bucket in self.buckets}
        for column in range(self.shard_size):
            region = flat[column * slot : (column + 1) * slot]
            bucket = by_column.get(column)
            used = 0 if bucket is None else bucket.reduce_numel
            if bucket is not None:
                bucket.pack_grads(region[:used])
            if used < slot:
                region[used:].zero_()
        mine = by_column.get(comm.ranks["shard"])
        # One rank: nothing to scatter, the packed buffer is the sum.
        out = flat if self.shard_size == 1 else torch.empty_like(flat[:slot])
        stage1 = comm.reduce_scatter_slots(
            flat, out, "reduce", sum(len(b.params) for b in self.buckets), what=self.name
        )
        if mine is None:
            return [PendingReduce(None, None, None, [stage1])]
        return [self._stage2(comm, mine, out[: mine.reduce_numel], stage1, out)]

    def _stage2(
        self,
        comm: Collectives,
        bucket: OwnerBucket,
        flat: torch.Tensor,
        stage1,
        base: torch.Tensor,
    ) -> PendingReduce:
        """After stage 1 left ``bucket``'s column sum in ``flat`` (a slice of ``base``, on the
        column's ranks): with replicas, each segment to its global owner; what the owner
        unpacks later. The owned gradients become ``owned.grad`` as views, so when they are
        only part of ``base`` (other replicas' segments, a gather slot's padding) they are
        copied out first: otherwise all of ``base`` would stay allocated until the gradients
        are freed, for every boundary at once by the end of backward.

        On CUDA stage 2 and the copy queue behind stage 1 on the reduce stream; without
        streams they need stage 1 done on the host, so they wait for
        :meth:`PendingReduce.complete` (see there why not now)."""

        def rest() -> PendingReduce:
            handles = [stage1]
            if comm.replicate_size > 1 and bucket.holds_weight:
                for replica, members, start, size in bucket.segments:
                    handles.append(
                        comm.reduce_sum(
                            flat[start : start + size],
                            replica,
                            "reduce_replicate",
                            len(members),
                            group="replicate",
                            what=self.name,
                        )
                    )
            owned = bucket.owned_segment()
            if owned is None:
                return PendingReduce(bucket, None, None, handles)
            members, (start, size) = owned
            segment = flat[start : start + size]
            if size < base.numel():
                segment, done = comm.compact(segment, handles)
                handles = [*handles, done]
            return PendingReduce(bucket, members, segment, handles)

        if comm.device.type == "cuda":
            return rest()
        return PendingReduce(bucket, None, None, [stage1], rest=rest)

    # ---------------------------------------------------------------- updates back to replicas
    def broadcast_updates(self, comm: Collectives) -> None:
        """After the step: each global owner's updated masters to the other replicas (async)."""
        for bucket in self.buckets:
            if not bucket.holds_weight:
                continue
            for replica, members, _, _ in bucket.segments:
                for p in members:
                    self._replicate_pending.append(
                        comm.broadcast(
                            p.owned.data,
                            replica,
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

    def reset_step(self) -> None:
        self.grads_ready.clear()
        self.held_for_backward = False

    @property
    def grads_final(self) -> bool:
        """Every trainable parameter's gradient arrived in this backward."""
        return len(self.grads_ready) == self.num_trainable
