"""Keeping the copies of the owners' masters equal to them: the other replicas (HSDP) and
the tensor-parallel shard copies of the owners' rows."""

from __future__ import annotations

import torch


class ReplicaSync:
    """The copies of one model's masters on this rank (``state``: its DMuon root state)."""

    def __init__(self, state) -> None:
        self.state = state
        self.synced = False

    def make_tp_copies(self) -> None:
        """With tensor parallelism, the tp-shard copies of the owner's shard column (filled
        from the owners by :meth:`sync`)."""
        state = self.state
        if state.tp_exchange is None:
            return
        for p in state.params:
            if p.holds_source and p.tp_size > 1 and p.tp_copy is None:  # (not a stack)
                p.tp_copy = torch.empty(p.unsharded_shape, dtype=p.orig_dtype, device=state.device)

    def send_updates(self) -> None:
        """Send the owners' updated masters to the other replicas: asynchronously (waited for
        in the next forward of each boundary, hidden behind earlier layers), or right away
        with ``replicate_async=False``. With tensor parallelism their shards go to the
        owners' rows first (waited for here)."""
        state = self.state
        if state.tp_exchange is not None:
            state.tp_exchange.scatter_weights()
        if state.mesh.replicate_size == 1:
            return
        for group in state.groups:
            group.broadcast_updates()
        if not state.options.replicate_async:
            state.wait_all_replicate_broadcasts()

    def sync(self, initialized: bool) -> None:
        """Make every replica's master (and every tp-shard copy) equal the global owner's,
        now (after init or a load). Before lazy init the copies do not exist yet: it syncs
        then."""
        state = self.state
        if state.tp_exchange is not None:
            if not initialized:
                self.synced = False
                return
            state.tp_exchange.scatter_weights(phase="tp_sync")
        self.synced = True
        if state.mesh.replicate_size == 1:
            return
        for group in state.groups:
            group.broadcast_updates()
        state.wait_all_replicate_broadcasts()
        if state.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
