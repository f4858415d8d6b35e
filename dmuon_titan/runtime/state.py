"""Per-model DMuon runtime state: the groups, the collectives and one step's bookkeeping.

Every decision that issues a collective is taken here from rank-consistent facts only (the
plan, the recorded forward order, which boundaries ran), never from local data or timing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Variable

from ..plan import Plan
from .collectives import Collectives
from .group import BoundaryGroup, PendingReduce, UnshardState
from .owned_param import DedicatedParam

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
        self.forward_order: list[int] | None = None  # recorded on the first step
        self._step_sequence: list[int] = []
        self._end_of_backward_queued = False
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
    def pre_forward(self, group: BoundaryGroup) -> None:
        self.lazy_init()
        if in_backward() or not torch.is_grad_enabled():
            # Activation-checkpoint recompute, or an inference forward: just make it current.
            self._ensure_ready(group, "recompute" if in_backward() else "forward")
            group.install()
            return
        self._ensure_ready(group, "forward")
        self._step_sequence.append(group.index)
        group.forward_count += 1
        self._prefetch_forward_after(group)
        group.install()

    def post_forward(self, group: BoundaryGroup, output):
        group.uninstall()
        if in_backward():
            return output  # recompute inside backward: the backward is about to use them
        if not torch.is_grad_enabled():
            group.reshard()
            return output
        output = _register_pre_backward(self, group, output)
        if self.reshard_after_forward:
            group.reshard()
        return output

    def _ensure_ready(self, group: BoundaryGroup, phase: str) -> None:
        group.unshard(self.comm, phase)
        group.wait_unshard()

    def _prefetch_forward_after(self, group: BoundaryGroup) -> None:
        if self.forward_order is None:
            return
        try:
            pos = self.forward_order.index(group.index)
        except ValueError:
            return
        if pos + 1 < len(self.forward_order):
            self.groups[self.forward_order[pos + 1]].unshard(self.comm, "forward")

    # ------------------------------------------------------------------ backward
    def pre_backward(self, group: BoundaryGroup) -> None:
        if not self._end_of_backward_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_of_backward_queued = True
        if group.backward_done:
            return
        self._ensure_ready(group, "backward_unshard")
        self._prefetch_backward_before(group)

    def _prefetch_backward_before(self, group: BoundaryGroup) -> None:
        seq = self._step_sequence
        for pos in range(len(seq) - 1, -1, -1):
            if seq[pos] == group.index:
                if pos > 0:
                    prev = self.groups[seq[pos - 1]]
                    if not prev.backward_done:
                        prev.unshard(self.comm, "backward_unshard")
                return

    def grad_accumulated(self, group: BoundaryGroup, param: DedicatedParam) -> None:
        group.grads_ready.add(param.index)
        if len(group.grads_ready) == group.num_trainable and not group.backward_done:
            self._post_backward(group)

    def _post_backward(self, group: BoundaryGroup) -> None:
        group.backward_done = True
        if self.requires_gradient_sync:
            self._pending_reduces.extend(group.reduce_grads(self.comm))
        group.reshard()

    def _end_of_backward(self) -> None:
        # Boundaries that ran forward but whose gradients did not all arrive (unused params,
        # outputs outside the loss) are reduced here, in plan order: every rank agrees.
        for group in self.groups:
            if group.forward_count > 0 and not group.backward_done:
                self._post_backward(group)
            elif group.unshard_state is not UnshardState.FREED:
                group.reshard()  # an unused prefetch
        self.finalize_reduces()
        if self.forward_order is None and self._step_sequence:
            self.forward_order = list(dict.fromkeys(self._step_sequence))
        self._step_sequence = []
        for group in self.groups:
            group.reset_step()
        self._end_of_backward_queued = False

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

    def zero_unsharded_grads(self) -> None:
        """Drop gradients accumulated locally (under ``no_sync``) but not reduced yet."""
        for p in self.params:
            if p.unsharded is not None:
                p.unsharded.grad = None

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


def _register_pre_backward(state: DMuonState, group: BoundaryGroup, output):
    tensors = [
        t
        for t in torch.utils._pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]

    def hook(grad: torch.Tensor) -> None:
        state.pre_backward(group)

    for t in tensors:
        t.register_hook(hook)
    return output
