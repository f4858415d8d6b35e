"""The collectives DMuon issues: broadcast from an owner, reduce to an owner.

One code path for every backend. On CUDA each kind of collective runs on its own stream and
the consumer waits on a CUDA event (no host synchronization); on CPU (gloo) the collective is
issued asynchronously and the consumer waits on the ``Work``. Every issued collective is
counted, so communication volume is measured, not assumed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


class Pending:
    """A collective in flight. ``wait()`` makes its result visible to the current stream/thread."""

    __slots__ = ("_event", "_work", "_tensor")

    def __init__(self, event=None, work=None, tensor: Tensor | None = None) -> None:
        self._event = event
        self._work = work
        # Keeps the buffer alive while gloo's worker thread may still touch it.
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
    """Payload bytes issued per phase ("forward", "backward_unshard", "reduce", ...).

    A broadcast or reduce of S bytes among N ranks moves (N-1)·S bytes in total: every rank but
    the root receives (or contributes) S once. :meth:`moved_bytes_per_rank` reports that total
    divided by N, the usual per-rank communication volume.
    """

    world_size: int
    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, phase: str, nbytes: int, ops: int = 1) -> None:
        self.payload_bytes[phase] += nbytes
        self.ops[phase] += ops

    def moved_bytes_per_rank(self, phase: str | None = None) -> float:
        n = self.world_size
        total = sum(self.payload_bytes.values()) if phase is None else self.payload_bytes[phase]
        return total * (n - 1) / n

    def reset(self) -> None:
        self.payload_bytes.clear()
        self.ops.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"payload_bytes": dict(self.payload_bytes), "ops": dict(self.ops)}


class Collectives:
    """Broadcast/reduce over one process group, with streams (CUDA) or async work (gloo)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        self.stats = CommStats(self.world_size)
        self._use_streams = device.type == "cuda"
        if self._use_streams:
            self.unshard_stream = torch.cuda.Stream(device=device, priority=-1)
            self.reduce_stream = torch.cuda.Stream(device=device, priority=-1)

    def broadcast(self, tensor: Tensor, src: int, phase: str) -> Pending:
        """Broadcast ``tensor`` in place from group rank ``src``."""
        self.stats.record(phase, tensor.numel() * tensor.element_size())
        if self.world_size == 1:
            return Pending()
        if self._use_streams:
            return self._on_stream(
                self.unshard_stream,
                tensor,
                lambda: dist.broadcast(tensor, group_src=src, group=self.group),
            )
        work = dist.broadcast(tensor, group_src=src, group=self.group, async_op=True)
        return Pending(work=work, tensor=tensor)

    def reduce_sum(self, tensor: Tensor, dst: int, phase: str, trailer_numel: int = 0) -> Pending:
        """Sum ``tensor`` over the group into group rank ``dst`` (gloo has no AVG: callers scale).

        The last ``trailer_numel`` elements are bookkeeping riding along (gradient presence
        flags); they are counted under ``phase + "_flags"`` so payload volume stays exact.
        """
        size = tensor.element_size()
        self.stats.record(phase, (tensor.numel() - trailer_numel) * size)
        if trailer_numel:
            self.stats.record(phase + "_flags", trailer_numel * size, ops=0)
        if self.world_size == 1:
            return Pending()
        if self._use_streams:
            return self._on_stream(
                self.reduce_stream,
                tensor,
                lambda: dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=self.group),
            )
        work = dist.reduce(
            tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        return Pending(work=work, tensor=tensor)

    def _on_stream(self, stream, tensor: Tensor, issue) -> Pending:
        # The collective must see everything the compute stream wrote into ``tensor``. Issued
        # synchronously under ``stream``, NCCL makes ``stream`` (not the host) wait for it.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            issue()
            event = stream.record_event()
        # The tensor was allocated on the compute stream; tell the allocator it is in use on
        # ``stream`` too, so dropping our reference early never lets it be reused too soon.
        tensor.record_stream(stream)
        return Pending(event=event)
