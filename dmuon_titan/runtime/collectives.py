"""The collectives DMuon issues: broadcasts from and reduces to owners, on its own groups.

The shard ranks (the FSDP shard group) broadcast a layer's weights and first reduce its
gradients; the replicas (HSDP/DDP) carry the second reduce stage and the owner's updated
weights back. A missing group has one rank and costs nothing.

Collectives on one process group must be issued in the same order on every rank. FSDP2's own
collectives, DMuon's weight broadcasts (the forward/backward schedule) and its gradient
reduces (issued as each rank's gradients become final) each follow an order of their own, so
each gets a process group of its own (:func:`new_process_groups`): ``unshard`` and ``reduce``
over the shard ranks, ``replicate`` over the replicas.

One code path for every backend. On CUDA each kind of collective runs on its own stream and
the consumer waits on a CUDA event (no host synchronization); on CPU (gloo) the collective is
issued asynchronously and the consumer waits on the ``Work``. Every issued collective is
counted, so communication volume is measured, not assumed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .mesh import MeshInfo


class Pending:
    """A collective in flight. ``wait()`` makes its result visible to the current stream/thread."""

    __slots__ = ("_event", "_work", "_tensor", "_what")

    def __init__(
        self, event=None, work=None, tensor: Tensor | tuple | None = None, what: str = ""
    ) -> None:
        self._event = event
        self._work = work
        # Keeps the buffer(s) alive while gloo's worker thread may still touch them.
        self._tensor = tensor
        self._what = what  # named in the error if the collective fails or times out

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as err:
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err)
                raise RuntimeError(
                    f"DMuon collective {self._what} failed: {reason} (every rank must run "
                    "the same DMuon steps; a rank that stopped or diverged leaves the others "
                    "waiting here)"
                ) from err
            self._work = None
        self._tensor = None


@dataclass
class CommStats:
    """What this rank's collectives carried, per phase.

    ``payload_bytes``: the tensors' sizes. ``moved_bytes``: a broadcast or reduce of S bytes
    among n ranks moves (n-1)·S bytes in all, (n-1)/n·S per participant; this rank's share.
    Averaged over all ranks this is the usual per-rank communication volume.
    """

    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    moved_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, phase: str, nbytes: int, group_size: int, ops: int = 1) -> None:
        self.payload_bytes[phase] += nbytes
        self.moved_bytes[phase] += nbytes * (group_size - 1) / group_size
        self.ops[phase] += ops

    def record_moved(self, phase: str, nbytes: int, moved: int, ops: int = 1) -> None:
        """A collective whose moved bytes are known exactly (an all-to-all: what this rank
        sends to the others)."""
        self.payload_bytes[phase] += nbytes
        self.moved_bytes[phase] += moved
        self.ops[phase] += ops

    def moved_bytes_per_rank(self, phase: str | None = None) -> float:
        if phase is None:
            return sum(self.moved_bytes.values())
        return self.moved_bytes.get(phase, 0.0)

    def reset(self) -> None:
        self.payload_bytes.clear()
        self.moved_bytes.clear()
        self.ops.clear()

    def as_dict(self) -> dict[str, dict]:
        return {
            "payload_bytes": dict(self.payload_bytes),
            "moved_bytes": dict(self.moved_bytes),
            "ops": dict(self.ops),
        }


class Collectives:
    """Broadcast/reduce over DMuon's groups (``"unshard"``, ``"reduce"``, ``"replicate"``),
    with streams or async work, on the grid ``mesh`` describes."""

    def __init__(self, mesh: MeshInfo) -> None:
        self.mesh = mesh
        self.groups = mesh.groups
        self.device = mesh.device
        self.stats = CommStats()
        #: when a list, every collective issued is appended as (group, op, phase, elements,
        #: what): the tests compare it across ranks
        self.log: list[tuple] | None = None
        self._use_streams = self.device.type == "cuda"
        if self._use_streams:
            self.streams = {
                "unshard": torch.cuda.Stream(device=self.device, priority=-1),
                "reduce": torch.cuda.Stream(device=self.device, priority=-1),
                "replicate": torch.cuda.Stream(device=self.device, priority=-1),
                "tp": torch.cuda.Stream(device=self.device, priority=-1),
            }

    def _issued(self, group: str, op: str, phase: str, numel: int, what: str) -> str:
        if self.log is not None:
            self.log.append((group, op, phase, numel, what))
        return f"{op} ({phase}, {what or 'no boundary'}, group {group!r})"

    def broadcast(
        self,
        tensor: Tensor,
        src: int,
        phase: str,
        group: str = "unshard",
        stream: str = "unshard",
        what: str = "",
    ) -> Pending:
        """Broadcast ``tensor`` in place from ``src`` (a rank of ``group``)."""
        pg = self.groups[group]
        self.stats.record(phase, tensor.numel() * tensor.element_size(), self.mesh.size(group))
        if self.mesh.size(group) == 1:
            return Pending()
        what = self._issued(group, "broadcast", phase, tensor.numel(), what)
        if self._use_streams:
            return self._on_stream(
                stream, tensor, lambda: dist.broadcast(tensor, group_src=src, group=pg)
            )
        work = dist.broadcast(tensor, group_src=src, group=pg, async_op=True)
        return Pending(work=work, tensor=tensor, what=what)

    def reduce_sum(
        self,
        tensor: Tensor,
        dst: int,
        phase: str,
        trailer_numel: int = 0,
        group: str = "reduce",
        what: str = "",
    ) -> Pending:
        """Sum ``tensor`` over ``group`` into its rank ``dst`` (gloo has no AVG: callers scale).

        The last ``trailer_numel`` elements are bookkeeping riding along (gradient presence
        flags); they are counted under ``phase + "_flags"`` so payload volume stays exact.
        Reduces share one stream, so a second stage issued after a first is ordered after it.
        """
        pg = self.groups[group]
        size = tensor.element_size()
        n = self.mesh.size(group)
        self.stats.record(phase, (tensor.numel() - trailer_numel) * size, n)
        if trailer_numel:
            self.stats.record(phase + "_flags", trailer_numel * size, n, ops=0)
        if n == 1:
            return Pending()
        what = self._issued(group, "reduce", phase, tensor.numel(), what)
        if self._use_streams:
            return self._on_stream(
                "reduce",
                tensor,
                lambda: dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=pg),
            )
        work = dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return Pending(work=work, tensor=tensor, what=what)

    def all_gather_slots(
        self, buffer: Tensor, phase: str, group: str = "unshard", what: str = ""
    ) -> Pending:
        """All-gather in place: ``buffer`` is one equal slot per rank of ``group``, in rank
        order; this rank's slot goes to every rank's copy."""
        pg, n = self.groups[group], self.mesh.size(group)
        self.stats.record(phase, buffer.numel() * buffer.element_size(), n)
        if n == 1:
            return Pending()
        slot = buffer.view(n, -1)[self.mesh.rank(group)]
        what = self._issued(group, "all_gather", phase, buffer.numel(), what)
        if self._use_streams:
            return self._on_stream(
                "unshard", buffer, lambda: dist.all_gather_into_tensor(buffer, slot, group=pg)
            )
        work = dist.all_gather_into_tensor(buffer, slot, group=pg, async_op=True)
        return Pending(work=work, tensor=buffer, what=what)

    def reduce_scatter_slots(
        self,
        buffer: Tensor,
        out: Tensor,
        phase: str,
        trailer_numel: int = 0,
        group: str = "reduce",
        what: str = "",
    ) -> Pending:
        """Sum ``buffer`` (one equal slot per rank of ``group``, in rank order) over ``group``;
        this rank's slot of the sum lands in ``out``. ``trailer_numel``: bookkeeping elements
        inside ``buffer`` (presence flags), counted under ``phase + "_flags"`` as in
        :meth:`reduce_sum`."""
        pg, n = self.groups[group], self.mesh.size(group)
        size = buffer.element_size()
        self.stats.record(phase, (buffer.numel() - trailer_numel) * size, n)
        if trailer_numel:
            self.stats.record(phase + "_flags", trailer_numel * size, n, ops=0)
        if n == 1:
            if out.data_ptr() != buffer.data_ptr():
                out.copy_(buffer)
            return Pending()
        what = self._issued(group, "reduce_scatter", phase, buffer.numel(), what)
        if self._use_streams:
            pending = self._on_stream(
                "reduce",
                buffer,
                lambda: dist.reduce_scatter_tensor(out, buffer, op=dist.ReduceOp.SUM, group=pg),
            )
            out.record_stream(self.streams["reduce"])
            return pending
        work = dist.reduce_scatter_tensor(
            out, buffer, op=dist.ReduceOp.SUM, group=pg, async_op=True
        )
        return Pending(work=work, tensor=(buffer, out), what=what)

    def all_to_all(
        self,
        out: Tensor,
        tensor: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        phase: str,
        group: str = "tp",
        what: str = "",
    ) -> Pending:
        """``tensor``'s ``in_splits[k]`` elements (in rank order) to rank ``k`` of ``group``;
        ``out`` receives ``out_splits[k]`` elements from each rank ``k``, in rank order. On
        its own stream (the tensor-parallel exchange of owners and their rows)."""
        pg, n = self.groups[group], self.mesh.size(group)
        size = tensor.element_size()
        own = in_splits[self.mesh.rank(group)]
        self.stats.record_moved(phase, tensor.numel() * size, (tensor.numel() - own) * size)
        if n == 1:
            out.copy_(tensor)
            return Pending()
        what = self._issued(group, "all_to_all", phase, tensor.numel(), what)

        def issue(async_op: bool = False):
            return dist.all_to_all_single(
                out, tensor, out_splits, in_splits, group=pg, async_op=async_op
            )

        if self._use_streams:
            pending = self._on_stream("tp", tensor, issue)
            out.record_stream(self.streams["tp"])
            return pending
        return Pending(work=issue(async_op=True), tensor=(tensor, out), what=what)

    def group_all_reduce(self, tensor: Tensor, phase: str, group: str = "tp") -> None:
        """Blocking sum of ``tensor`` over ``group``, in place (the steps of a Newton–Schulz
        the group shares): on the compute stream, which the next operation needs anyway."""
        n = self.mesh.size(group)
        self.stats.record(phase, tensor.numel() * tensor.element_size(), n)
        if n == 1:
            return
        self._issued(group, "all_reduce", phase, tensor.numel(), "")
        dist.all_reduce(tensor, group=self.groups[group])

    def group_all_gather(self, tensor: Tensor, phase: str, group: str = "tp") -> Tensor:
        """Blocking: every rank's ``tensor`` of ``group`` stacked on a new dim 0, in rank
        order (as :meth:`group_all_reduce`)."""
        n = self.mesh.size(group)
        out = torch.empty((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        self.stats.record(phase, out.numel() * out.element_size(), n)
        if n == 1:
            out[0].copy_(tensor)
            return out
        self._issued(group, "all_gather", phase, out.numel(), "")
        dist.all_gather_into_tensor(out.view(-1), tensor.reshape(-1), group=self.groups[group])
        return out

    def compact(self, tensor: Tensor, after: list[Pending]) -> tuple[Tensor, Pending]:
        """A copy of ``tensor`` (a slice of a larger reduce buffer) made once the reduces
        ``after`` are done, so the buffer's other elements can be freed without waiting for the
        optimizer step. On CUDA the copy is queued on the reduce stream behind them."""
        if not self._use_streams:
            for pending in after:
                pending.wait()
            return tensor.clone(), Pending()
        stream = self.streams["reduce"]
        with torch.cuda.stream(stream):
            copy = tensor.clone()
            event = stream.record_event()
        # Allocated on the reduce stream, consumed (and freed) on the compute stream.
        copy.record_stream(torch.cuda.current_stream())
        return copy, Pending(event=event)

    def all_reduce(self, tensor: Tensor, op=dist.ReduceOp.SUM) -> None:
        """Blocking all-reduce over every slot (shard, then replicate, then tensor-parallel
        ranks). Outside backward only: it runs on the ``reduce`` group, after the step's
        reduces (and on the ``tp`` group after the gradient gather)."""
        for group in ("reduce", "replicate", "tp"):
            if self.mesh.size(group) > 1:
                self._issued(group, "all_reduce", "all_reduce", tensor.numel(), "")
                dist.all_reduce(tensor, op=op, group=self.groups[group])

    def all_gather_objects(self, obj) -> list:
        """Every data-parallel rank's ``obj`` (shard group, then replicate group), in slot
        order (replicate index major). Blocking; outside any step's collectives."""
        gathered = [obj]
        for group in ("reduce", "replicate"):
            n = self.mesh.size(group)
            if n > 1:
                self._issued(group, "all_gather_object", "schedule", 0, "")
                out: list = [None] * n
                dist.all_gather_object(out, gathered, group=self.groups[group])
                gathered = [item for part in out for item in part]
        return gathered

    def _on_stream(self, name: str, tensor: Tensor, issue: Callable[[], object]) -> Pending:
        # The collective must see everything the compute stream wrote into ``tensor``. Issued
        # synchronously under ``stream``, NCCL makes ``stream`` (not the host) wait for it.
        stream = self.streams[name]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            issue()
            event = stream.record_event()
        # The tensor was allocated on the compute stream; tell the allocator it is in use on
        # ``stream`` too, so dropping our reference early never lets it be reused too soon.
        tensor.record_stream(stream)
        return Pending(event=event)
