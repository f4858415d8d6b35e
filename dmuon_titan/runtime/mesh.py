"""The one description of where dedicated matrices live, passed everywhere.

The data-parallel ranks form a replicate × shard grid (plain FSDP is 1 × S, DDP R × 1). The
plan numbers its owner *slots* ``replicate · S + shard``; a matrix owned by slot (r, s) is kept
whole by the ranks of shard column s (one per replica, the owner among them), broadcast
inside each replica, and its gradient reduced over the shard ranks and then across replicas.
Tensor and expert parallelism extend this object (more slots, more groups), not copies of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshInfo:
    """This rank's place in the data-parallel grid, and the process groups DMuon uses on it.

    ``groups``: ``"unshard"`` and ``"reduce"`` over the shard ranks, ``"replicate"`` over the
    replicas, and, when the model has expert stacks, ``"grid_unshard"`` and ``"grid_reduce"``
    over every slot (group rank = slot: the stacks' pieces are all-gathered and
    reduce-scattered over the whole grid); ``None`` for a group of one rank. See
    :func:`new_process_groups` for why DMuon has groups of its own.
    """

    shard_size: int = 1
    shard_rank: int = 0
    replicate_size: int = 1
    replicate_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: this rank's place in the grid groups (the rank of ``grid_unshard``: its members sorted
    #: by global rank, as ``new_group`` numbers them); the slot on replica-major meshes
    grid_rank: int = 0
    groups: dict[str, dist.ProcessGroup | None] = field(
        default_factory=lambda: dict.fromkeys(("unshard", "reduce", "replicate"))
    )
    #: the user's (shard, replicate) DeviceMeshes, for DTensors of stack pieces
    device_meshes: tuple[DeviceMesh | None, DeviceMesh | None] = (None, None)

    @property
    def world_size(self) -> int:
        """The number of owner slots: every data-parallel rank."""
        return self.shard_size * self.replicate_size

    @property
    def slot(self) -> int:
        """This rank's owner slot."""
        return self.replicate_rank * self.shard_size + self.shard_rank

    def owner_coordinates(self, slot: int) -> tuple[int, int]:
        """(replica, shard column) of owner ``slot``."""
        return divmod(slot, self.shard_size)

    def holds_weight(self, slot: int) -> bool:
        """Whether this rank keeps the full master of a matrix owned by ``slot`` (it is in the
        owner's shard column: the owner, or its copy in another replica)."""
        return self.owner_coordinates(slot)[1] == self.shard_rank

    def size(self, group: str) -> int:
        """Ranks in DMuon group ``group`` (``"unshard"``/``"reduce"``: the shard ranks)."""
        if group.startswith("grid"):
            return self.world_size
        return self.replicate_size if group == "replicate" else self.shard_size

    def rank(self, group: str) -> int:
        if group.startswith("grid"):
            return self.grid_rank
        return self.replicate_rank if group == "replicate" else self.shard_rank


def mesh_info(
    mesh: DeviceMesh | None, replicate_mesh: DeviceMesh | None, grid: bool = False
) -> MeshInfo:
    """The grid of a 1-D shard mesh and a 1-D replicate mesh (either may be ``None``), with
    DMuon's own process groups created on it (every rank of the world must call this);
    ``grid``: also the groups over every slot (expert stacks)."""
    shard_group = mesh.get_group() if mesh is not None else None
    replicate_group = replicate_mesh.get_group() if replicate_mesh is not None else None
    device_type = (mesh or replicate_mesh).device_type
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device(device_type)
    )
    groups = new_process_groups(shard_group, replicate_group, grid)
    grid_group = groups.get("grid_unshard")
    return MeshInfo(
        grid_rank=dist.get_rank(grid_group) if grid_group is not None else 0,
        shard_size=mesh.size() if mesh is not None else 1,
        shard_rank=mesh.get_local_rank() if mesh is not None else 0,
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        replicate_rank=replicate_mesh.get_local_rank() if replicate_mesh is not None else 0,
        device=device,
        groups=groups,
        device_meshes=(mesh, replicate_mesh),
    )


def new_process_groups(
    shard_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    grid: bool = False,
) -> dict[str, dist.ProcessGroup | None]:
    """DMuon's own groups: ``unshard`` and ``reduce`` with the ranks of ``shard_group``,
    ``replicate`` with those of ``replicate_group``, and with ``grid`` ``grid_unshard`` and
    ``grid_reduce`` with every rank of the replicate × shard grid in slot order (``None`` for
    a group of one rank).

    Collectives on one process group must be issued in the same order on every rank. FSDP2's
    own collectives, DMuon's weight broadcasts (the forward/backward schedule) and its
    gradient reduces (issued as each rank's gradients become final) each follow an order of
    their own, so each gets a group of its own.

    ``new_group`` must be entered by every rank of the world for every group, in one order;
    each rank knows only its own groups, so the rank lists are gathered first (one all-gather
    on the default group, at setup).
    """

    def ranks_of(group) -> tuple[int, ...] | None:
        if group is None or dist.get_world_size(group) == 1:
            return None
        return tuple(dist.get_process_group_ranks(group))

    mine = {
        "unshard": ranks_of(shard_group),
        "reduce": ranks_of(shard_group),
        "replicate": ranks_of(replicate_group),
    }
    kinds = (*mine, "grid_unshard", "grid_reduce") if grid else tuple(mine)
    result: dict[str, dist.ProcessGroup | None] = dict.fromkeys(kinds)
    if dist.get_world_size() == 1 or all(r is None for r in mine.values()):
        return result
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if grid:
        everyone = [_with_grid(theirs, x, everyone) for x, theirs in enumerate(everyone)]
        mine = everyone[dist.get_rank()]
    wanted = sorted({(kind, r) for theirs in everyone for kind, r in theirs.items() if r})
    for kind, ranks in wanted:
        group = dist.new_group(list(ranks))
        if mine[kind] == ranks:
            result[kind] = group
    return result


def _with_grid(theirs: dict, rank: int, everyone: list) -> dict:
    """``theirs`` (rank ``rank``'s groups) with its grid groups, derived from what every rank
    gathered: the shard ranks of each of its replicas, in replica order (slot order)."""
    replicas = theirs["replicate"] or (rank,)
    slots = tuple(r for x in replicas for r in (everyone[x]["unshard"] or (x,)))
    grid = slots if len(slots) > 1 else None
    return {**theirs, "grid_unshard": grid, "grid_reduce": grid}


def grid_device_mesh(mesh: MeshInfo) -> DeviceMesh:
    """A 1-D DeviceMesh over every slot whose coordinates are grid ranks (a stack's pieces
    are its ``Shard(0)``), made from the grid group without a collective."""
    shard, replicate = mesh.device_meshes
    device_type = (shard or replicate).device_type
    return DeviceMesh.from_group(mesh.groups["grid_unshard"], device_type)
