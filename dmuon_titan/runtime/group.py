"""One hook boundary: its dedicated parameters grouped by owner, with coalesced collectives.

Each owner's parameters in a boundary form an :class:`OwnerBucket`: one flat buffer, one
broadcast in (forward, and again before backward under Z3), one reduce out (backward). The
order of buckets is the plan's, identical on every rank, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from .collectives import Collectives, Pending
from .owned_param import DedicatedParam


class UnshardState(enum.Enum):
    FREED = "freed"  # no full-size storage (the owner still has its master)
    PENDING = "pending"  # broadcast issued, not waited for
    READY = "ready"  # full-size params hold current weights


class OwnerBucket:
    """The parameters one owner contributes to one boundary."""

    def __init__(self, owner: int, params: list[DedicatedParam]) -> None:
        self.owner = owner
        self.params = params
        self.numel = sum(p.numel for p in params)
        self.is_owner = params[0].is_owner
        self.buffer: torch.Tensor | None = None  # flat, param dtype; storage freed when FREED

    def lazy_init(self, device: torch.device) -> None:
        dtypes = {(p.param_dtype, p.reduce_dtype) for p in self.params}
        if len(dtypes) != 1:
            names = [p.fqn for p in self.params]
            raise ValueError(
                f"dedicated parameters {names} share a hook boundary and owner but have "
                f"different mixed-precision dtypes {sorted(map(str, dtypes))}"
            )
        self.param_dtype, self.reduce_dtype = dtypes.pop()
        self.buffer = torch.empty(self.numel, dtype=self.param_dtype, device=device)
        offset = 0
        for p in self.params:
            p.make_unsharded(self.buffer[offset : offset + p.numel])
            offset += p.numel
        self.free()

    def allocate(self) -> None:
        storage = self.buffer.untyped_storage()
        nbytes = self.numel * self.buffer.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    @torch.no_grad()
    def fill_from_owned(self) -> None:
        """Owner only: copy (and cast) the master weights into the broadcast buffer."""
        offset = 0
        for p in self.params:
            self.buffer[offset : offset + p.numel].copy_(p.owned.reshape(-1))
            offset += p.numel

    @torch.no_grad()
    def pack_grads(self) -> torch.Tensor:
        """This rank's gradients (zeros where none) plus one presence flag per parameter.

        The flags are summed by the reduce, so the owner learns whether *any* rank produced a
        gradient, and keeps ``grad=None`` (skipped, as torch.optim does) when none did.
        """
        n = len(self.params)
        flat = torch.empty(self.numel + n, dtype=self.reduce_dtype, device=self.buffer.device)
        flags = flat[self.numel :]
        flags.zero_()
        offset = 0
        for i, p in enumerate(self.params):
            grad = p.unsharded.grad
            view = flat[offset : offset + p.numel]
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.reshape(-1))
                flags[i : i + 1].fill_(1)  # a kernel, not a host-to-device copy
                p.unsharded.grad = None
            offset += p.numel
        return flat

    @torch.no_grad()
    def presence_flags(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.numel :]

    @torch.no_grad()
    def unpack_reduced(
        self, flat: torch.Tensor, divide_factor: float, present: list[float]
    ) -> None:
        """Owner only: divide the summed gradients into ``owned.grad`` (accumulating);
        ``present`` are the summed presence flags, already on the host."""
        if divide_factor != 1:
            flat.div_(divide_factor)
        offset = 0
        for p, flag in zip(self.params, present, strict=True):
            if flag > 0:
                grad = flat[offset : offset + p.numel].view(p.shape)
                if grad.dtype != p.orig_dtype:
                    grad = grad.to(p.orig_dtype)
                if p.owned.grad is None:
                    p.owned.grad = grad
                else:
                    p.owned.grad.add_(grad)
            offset += p.numel


class BoundaryGroup:
    """The dedicated parameters whose hooks live on one boundary module."""

    def __init__(self, index: int, path: str, module: nn.Module, params: list[DedicatedParam]):
        self.index = index
        self.path = path
        self.module = module
        self.params = params
        by_owner: dict[int, list[DedicatedParam]] = {}
        for p in params:
            by_owner.setdefault(p.owner, []).append(p)
        self.buckets = [OwnerBucket(o, by_owner[o]) for o in sorted(by_owner)]
        self.num_trainable = sum(1 for p in params if p.owned.requires_grad)
        self.unshard_state = UnshardState.FREED
        self._pending: list[Pending] = []
        self.hook_handles: list = []  # forward hooks, on ``module`` or a wrapper of it
        # Per-step bookkeeping, reset at the end of every backward.
        self.forward_count = 0
        self.grads_ready: set[int] = set()
        self.backward_done = False

    def lazy_init(self, device: torch.device) -> None:
        for bucket in self.buckets:
            bucket.lazy_init(device)

    def unshard(self, comm: Collectives, phase: str) -> None:
        """Issue the broadcasts that make every full-size parameter current (async)."""
        if self.unshard_state is not UnshardState.FREED:
            return
        for bucket in self.buckets:
            bucket.allocate()
            # The unsharded params alias ``bucket.buffer`` and may be saved for backward: a
            # write here must not bump their version counter (autograd would reject it).
            with torch.autograd._unsafe_preserve_version_counter(bucket.buffer):
                if bucket.is_owner:
                    bucket.fill_from_owned()
                self._pending.append(comm.broadcast(bucket.buffer, bucket.owner, phase))
        self.unshard_state = UnshardState.PENDING

    def wait_unshard(self) -> None:
        if self.unshard_state is UnshardState.PENDING:
            for pending in self._pending:
                pending.wait()
            self._pending.clear()
            self.unshard_state = UnshardState.READY

    def reshard(self) -> None:
        """Drop the full-size storage (the owner keeps its master)."""
        if self.unshard_state is UnshardState.FREED:
            return
        self.wait_unshard()
        for bucket in self.buckets:
            bucket.free()
        self.unshard_state = UnshardState.FREED

    def install(self) -> None:
        for p in self.params:
            p.install()

    def uninstall(self) -> None:
        for p in self.params:
            p.uninstall()

    def reduce_grads(self, comm: Collectives) -> list[tuple[OwnerBucket, torch.Tensor, Pending]]:
        """Issue one reduce per owner bucket; returns what the owner must unpack later."""
        issued = []
        for bucket in self.buckets:
            flat = bucket.pack_grads()
            pending = comm.reduce_sum(flat, bucket.owner, "reduce", len(bucket.params))
            if bucket.is_owner:
                issued.append((bucket, flat, pending))
            else:
                issued.append((bucket, None, pending))
        return issued

    def reset_step(self) -> None:
        self.forward_count = 0
        self.grads_ready.clear()
        self.backward_done = False
