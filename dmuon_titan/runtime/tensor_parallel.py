"""Tensor parallelism: how ``parallelize_module`` places dedicated matrices, and the exchange
of tp shards between each owner and its row.

``dedicate_params(..., tp_mesh=...)`` plans owners over data-parallel × tensor-parallel slots
(``mesh.py``). Torch's tensor-parallel styles then distribute each linear's weight with
``distribute_tensor`` (``Shard(0)`` colwise, ``Shard(1)`` rowwise); for a dedicated matrix the
patch below records that placement instead, and leaves the parameter as it is: its storage is
DMuon's (the whole master on its owner, tp-shard copies on its shard column), and its
forward value is this rank's shard, broadcast in the shard group of its tp coordinate.

After backward the shards of each matrix's reduced gradient sit on the owner's *row*, the
ranks (owner replica, owner column, every tp coordinate). :class:`TensorParallelExchange`
gathers them on the owner — one all-to-all per dtype over the tp group, every rank of a row
sending each owner its shards at once — so Newton–Schulz sees the whole matrix; after the
step it returns the updated master's shards to the row's copies the same way.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Replicate

from .collectives import Collectives
from .owned_param import DedicatedParam, dedicated_of, dedicated_slot_owner, dedicated_slots_of

_PATCHED_FLAG = "_dmuon_patched"


def install_tensor_parallel_patch() -> None:
    """Idempotent: make torch's tensor-parallel styles (and their subclasses, e.g. torchao's
    float8 ones) record the placement of dedicated matrices instead of distributing them.

    The styles call ``distribute_tensor`` through their module's namespace at call time, so
    wrapping it there reaches every call, whatever was imported before."""
    from torch.distributed.tensor.parallel import style

    fn = style.distribute_tensor
    if getattr(fn, _PATCHED_FLAG, False):
        return
    style.distribute_module = _skip_dedicated_in_distribute_module(style.distribute_module)

    @functools.wraps(fn)
    def distribute_tensor(tensor, device_mesh=None, placements=None, *args, **kwargs):
        dedicated = dedicated_of(tensor)
        if dedicated is None:
            return fn(tensor, device_mesh, placements, *args, **kwargs)
        dedicated.set_tensor_parallel(device_mesh, placements)
        return tensor  # DMuon's storage; forward sees its shard (DedicatedParam.make_unsharded)

    setattr(distribute_tensor, _PATCHED_FLAG, True)
    style.distribute_tensor = distribute_tensor


def _skip_dedicated_in_distribute_module(fn):
    """``distribute_module`` replicates every parameter its ``partition_fn`` left a plain
    tensor (on the mesh, as a DTensor): dedicated slots are hidden from that pass and put
    back afterwards. A style that does not place a dedicated matrix itself is an error."""

    @functools.wraps(fn)
    def distribute_module(module, device_mesh=None, partition_fn=None, *args, **kwargs):
        hidden: list[tuple] = []

        def partition(name, submod, mesh):
            if partition_fn is not None:
                partition_fn(name, submod, mesh)
            for attr in dedicated_slots_of(submod):
                param = submod._parameters.get(attr)
                if param is None:
                    continue
                dedicated = dedicated_slot_owner(submod, attr)
                if dedicated is not None and dedicated.tp_dim is None:
                    dedicated.set_tensor_parallel(mesh, [Replicate()] * mesh.ndim)  # refused
                hidden.append((submod, attr, param))
                submod._parameters[attr] = None

        try:
            return fn(module, device_mesh, partition, *args, **kwargs)
        finally:
            for submod, attr, param in hidden:
                submod._parameters[attr] = param

    return distribute_module


class TensorParallelExchange:
    """The all-to-alls between owners and their rows, over the tp group.

    Each rank's row holds the matrices owned by the slots (its replica, its shard column,
    any tp coordinate); the tp group of the row is the same T ranks for all of them, so one
    all-to-all per dtype carries every shard of the row: rank t' sends owner t its shard t'
    of each matrix t owns, in parameter order. The layout is the plan's, the same on every
    rank of the group.
    """

    def __init__(self, params: list[DedicatedParam], comm: Collectives) -> None:
        self.comm = comm
        self.tp_size = comm.mesh.tp_size
        self.tp_rank = comm.mesh.tp_rank
        #: the row's matrices by owner tp coordinate, in parameter order
        self.row: list[list[DedicatedParam]] = [[] for _ in range(self.tp_size)]
        for p in params:
            if not p.stacked and p.in_owner_row:
                self.row[p.owner_tp_rank].append(p)
        self.owned = self.row[self.tp_rank]
        self._row_indices = {p.index for part in self.row for p in part}

    def dtypes(self, dtype_of) -> list[torch.dtype]:
        """Every dtype of the row's matrices (the same list, in one order, on every rank of
        the row)."""
        return sorted({dtype_of(p) for part in self.row for p in part}, key=str)

    @torch.no_grad()
    def gather_grads(
        self, local: dict[int, torch.Tensor], phase: str = "tp_gather"
    ) -> dict[int, torch.Tensor]:
        """The row's reduced tp-shard gradients ``local`` (parameter index -> shard, reduce
        dtype; zeros where this rank had none) to their owners: returns the whole gradient
        of each matrix this rank owns, by index. What is not the row's passes through as it
        is: an expert stack's piece (expert parallelism, not TP, cuts stacks across the tp
        ranks)."""
        device = self.comm.device
        whole = {i: g for i, g in local.items() if i not in self._row_indices}
        for dtype in self.dtypes(lambda p: p.reduce_dtype):
            send_parts = [
                [p for p in part if p.reduce_dtype == dtype] for part in self.row
            ]  # by destination
            in_splits = [sum(p.unsharded_numel for p in part) for part in send_parts]
            mine = send_parts[self.tp_rank]
            per_source = sum(p.unsharded_numel for p in mine)
            send = torch.empty(sum(in_splits), dtype=dtype, device=device)
            offset = 0
            for part in send_parts:
                for p in part:
                    send[offset : offset + p.unsharded_numel].copy_(local[p.index].reshape(-1))
                    offset += p.unsharded_numel
            recv = torch.empty(per_source * self.tp_size, dtype=dtype, device=device)
            self.comm.all_to_all(
                recv, send, [per_source] * self.tp_size, in_splits, phase, group="tp"
            ).wait()
            for t in range(self.tp_size):
                offset = t * per_source
                for p in mine:
                    if p.index not in whole:
                        whole[p.index] = torch.empty(p.shape, dtype=dtype, device=device)
                    piece = recv[offset : offset + p.unsharded_numel].view(p.unsharded_shape)
                    p.tp_slice(whole[p.index], t).copy_(piece)
                    offset += p.unsharded_numel
        return whole

    @torch.no_grad()
    def scatter_weights(self, phase: str = "tp_scatter") -> None:
        """Each owner's masters, shard by shard, into the tp copies of its row (its own
        shard copied locally)."""
        device = self.comm.device
        for p in self.owned:
            p.tp_copy.copy_(p.tp_slice(p.owned.detach()))
        for dtype in self.dtypes(lambda p: p.orig_dtype):
            mine = [p for p in self.owned if p.orig_dtype == dtype]
            per_dest = sum(p.unsharded_numel for p in mine)
            send = torch.empty(per_dest * self.tp_size, dtype=dtype, device=device)
            offset = 0
            for t in range(self.tp_size):
                for p in mine:
                    piece = send[offset : offset + p.unsharded_numel].view(p.unsharded_shape)
                    piece.copy_(p.tp_slice(p.owned.detach(), t))
                    offset += p.unsharded_numel
            recv_parts = [[p for p in part if p.orig_dtype == dtype] for part in self.row]
            out_splits = [sum(p.unsharded_numel for p in part) for part in recv_parts]
            recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
            self.comm.all_to_all(
                recv, send, out_splits, [per_dest] * self.tp_size, phase, group="tp"
            ).wait()
            offset = 0
            for t, part in enumerate(recv_parts):
                for p in part:
                    if t != self.tp_rank:
                        p.tp_copy.copy_(
                            recv[offset : offset + p.unsharded_numel].view(p.unsharded_shape)
                        )
                    offset += p.unsharded_numel
