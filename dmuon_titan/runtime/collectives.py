"""The collectives DMuon issues: broadcasts from and reduces to owners, in two groups.

``shard`` is the group a layer's weights are broadcast in and its gradients first reduced in
(the FSDP shard group); ``replicate`` (HSDP/DDP replicas) carries the second reduce stage and
the owner's updated weights back to the replicas. A missing group has one rank and costs
nothing.

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


class Pending:
    """A collective in flight. ``wait()`` makes its result visible to the current stream/thread."""

    __slots__ = ("_event", "_work", "_tensor")

    def __init__(self, event=None, work=None, tensor: Tensor | tuple | None = None) -> None:
        self._event = event
        self._work = work
        # Keeps the buffer(s) alive while gloo's worker thread may still touch them.
        self._tensor = tensor

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        if self._work is not None:
            self._work.wait()
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
    """Broadcast/reduce over the shard and replicate groups, with streams or async work."""

    def __init__(
        self,
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.groups = {"shard": shard_group, "replicate": replicate_group}
        self.sizes = {
            k: dist.get_world_size(g) if g is not None else 1 for k, g in self.groups.items()
        }
        self.ranks = {k: dist.get_rank(g) if g is not None else 0 for k, g in self.groups.items()}
        self.device = device
        self.stats = CommStats()
        self._use_streams = device.type == "cuda"
        if self._use_streams:
            self.streams = {
                "unshard": torch.cuda.Stream(device=device, priority=-1),
                "reduce": torch.cuda.Stream(device=device, priority=-1),
                "replicate": torch.cuda.Stream(device=device, priority=-1),
            }

    @property
    def shard_size(self) -> int:
        return self.sizes["shard"]

    @property
    def replicate_size(self) -> int:
        return self.sizes["replicate"]

    def broadcast(
        self, tensor: Tensor, src: int, phase: str, group: str = "shard", stream: str = "unshard"
    ) -> Pending:
        """Broadcast ``tensor`` in place from ``src`` (a rank of ``group``)."""
        pg = self.groups[group]
        self.stats.record(phase, tensor.numel() * tensor.element_size(), self.sizes[group])
        if self.sizes[group] == 1:
            return Pending()
        if self._use_streams:
            return self._on_stream(
                stream, tensor, lambda: dist.broadcast(tensor, group_src=src, group=pg)
            )
        work = dist.broadcast(tensor, group_src=src, group=pg, async_op=True)
        return Pending(work=work, tensor=tensor)

    def reduce_sum(
        self, tensor: Tensor, dst: int, phase: str, trailer_numel: int = 0, group: str = "shard"
    ) -> Pending:
        """Sum ``tensor`` over ``group`` into its rank ``dst`` (gloo has no AVG: callers scale).

        The last ``trailer_numel`` elements are bookkeeping riding along (gradient presence
        flags); they are counted under ``phase + "_flags"`` so payload volume stays exact.
        Reduces share one stream, so a second stage issued after a first is ordered after it.
        """
        pg = self.groups[group]
        size = tensor.element_size()
        n = self.sizes[group]
        self.stats.record(phase, (tensor.numel() - trailer_numel) * size, n)
        if trailer_numel:
            self.stats.record(phase + "_flags", trailer_numel * size, n, ops=0)
        if n == 1:
            return Pending()
        if self._use_streams:
            return self._on_stream(
                "reduce",
                tensor,
                lambda: dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=pg),
            )
        work = dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return Pending(work=work, tensor=tensor)

    def all_gather_slots(self, buffer: Tensor, phase: str, group: str = "shard") -> Pending:
        """All-gather in place: ``buffer`` is one equal slot per rank of ``group``, in rank
        order; this rank's slot goes to every rank's copy."""
        pg, n = self.groups[group], self.sizes[group]
        self.stats.record(phase, buffer.numel() * buffer.element_size(), n)
        if n == 1:
            return Pending()
        slot = buffer.view(n, -1)[self.ranks[group]]
        if self._use_streams:
            return self._on_stream(
                "unshard", buffer, lambda: dist.all_gather_into_tensor(buffer, slot, group=pg)
            )
        work = dist.all_gather_into_tensor(buffer, slot, group=pg, async_op=True)
        return Pending(work=work, tensor=buffer)

    def reduce_scatter_slots(
        self, buffer: Tensor, out: Tensor, phase: str, trailer_numel: int = 0, group: str = "shard"
    ) -> Pending:
        """Sum ``buffer`` (one equal slot per rank of ``group``, in rank order) over ``group``;
        this rank's slot of the sum lands in ``out``. ``trailer_numel``: bookkeeping elements
        inside ``buffer`` (presence flags), counted under ``phase + "_flags"`` as in
        :meth:`reduce_sum`."""
        pg, n = self.groups[group], self.sizes[group]
        size = buffer.element_size()
        self.stats.record(phase, (buffer.numel() - trailer_numel) * size, n)
        if trailer_numel:
            self.stats.record(phase + "_flags", trailer_numel * size, n, ops=0)
        if n == 1:
            if out.data_ptr() != buffer.data_ptr():
                out.copy_(buffer)
            return Pending()
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
        return Pending(work=work, tensor=(buffer, out))

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
        """Blocking all-reduce over the whole data-parallel world (shard, then replicate)."""
        for group in ("shard", "replicate"):
            if self.sizes[group] > 1:
                dist.all_reduce(tensor, op=op, group=self.groups[group])

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
