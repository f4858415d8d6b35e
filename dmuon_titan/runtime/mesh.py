"""The one description of where dedicated matrices live, passed everywhere.

The data-parallel ranks form a replicate × shard grid (plain FSDP is 1 × S, DDP R × 1). The
plan numbers its owner *slots* ``replicate · S + shard``; a matrix owned by slot (r, s) is kept
whole by the ranks of shard column s (one per replica, the owner among them), broadcast
inside each replica, and its gradient reduced over the shard ranks and then across replicas.

Tensor parallelism (T ranks) adds a third coordinate: slots ``(replicate · S + shard) · T +
tp``. A matrix owned by slot (r, s, t) is kept whole by its owner alone; every other rank of
shard column s (any replica, any tp coordinate t') keeps a copy of its tensor-parallel shard
t', which it broadcasts in its replica's shard group of tp coordinate t'. Gradient shards go
the same way back (shard ranks, then replicas) and are gathered on the owner by the ranks of
its *row* (r, s, ·) over the tp group; the owner's update returns to the row the same way
and then to the replicas. Expert parallelism extends this object too (more groups), not
copies of it.
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
    over the ranks a stack's pieces are spread over (its *grid*): every slot, or with expert
    parallelism the slots of this rank's expert-parallel coordinate (the ranks that hold the
    same experts); ``None`` for a group of one rank. See :func:`new_process_groups` for why
    DMuon has groups of its own.

    Expert parallelism (an ``expert_size``-rank mesh inside the grid, EP's ``Shard(0)`` of
    every stack): this rank computes with experts ``expert_rank``'s share of each stack, and
    those experts' pieces live over the grid groups.
    """

    shard_size: int = 1
    shard_rank: int = 0
    replicate_size: int = 1
    replicate_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: this rank's place in the grid groups (the rank of ``grid_unshard``: its members sorted
    #: by global rank, as ``new_group`` numbers them); the slot on replica-major meshes
    grid_rank: int = 0
    #: ranks in the grid groups (every slot, or with expert parallelism world / expert_size)
    grid_size: int = 1
    #: expert-parallel degree and this rank's coordinate in it (1 and 0 without EP)
    expert_size: int = 1
    expert_rank: int = 0
    #: with expert parallelism: the global ranks by (expert coordinate, grid rank), the layout
    #: of the 2-D DeviceMesh whose (Shard(0), Shard(0)) DTensor a stack's pieces form
    expert_layout: tuple[tuple[int, ...], ...] = ()
    #: tensor-parallel degree and this rank's coordinate in it (1 and 0 without TP)
    tp_size: int = 1
    tp_rank: int = 0
    groups: dict[str, dist.ProcessGroup | None] = field(
        default_factory=lambda: dict.fromkeys(("unshard", "reduce", "replicate", "tp"))
    )
    #: the user's (shard, replicate, expert, tensor-parallel) DeviceMeshes, for DTensors
    device_meshes: tuple[DeviceMesh | None, ...] = (None, None, None, None)

    @property
    def world_size(self) -> int:
        """The number of owner slots: every data-parallel × tensor-parallel rank."""
        return self.shard_size * self.replicate_size * self.tp_size

    @property
    def slot(self) -> int:
        """This rank's owner slot."""
        return (self.replicate_rank * self.shard_size + self.shard_rank) * self.tp_size + (
            self.tp_rank
        )

    def owner_coordinates(self, slot: int) -> tuple[int, int]:
        """(replica, shard column) of owner ``slot``."""
        return divmod(slot // self.tp_size, self.shard_size)

    def owner_tp_rank(self, slot: int) -> int:
        """The tensor-parallel coordinate of owner ``slot``."""
        return slot % self.tp_size

    def holds_weight(self, slot: int) -> bool:
        """Whether this rank keeps the whole master of a matrix owned by ``slot``: without TP
        the ranks of the owner's shard column (the owner, or its copy in another replica);
        with TP the owner alone (the others keep tensor-parallel shards)."""
        if self.tp_size > 1:
            return slot == self.slot
        return self.owner_coordinates(slot)[1] == self.shard_rank

    def holds_source(self, slot: int) -> bool:
        """Whether this rank is the source of its replica's stage-1 broadcast of a matrix
        owned by ``slot`` (of its tensor-parallel shard with TP): a rank of the owner's shard
        column."""
        return self.owner_coordinates(slot)[1] == self.shard_rank

    def in_owner_row(self, slot: int) -> bool:
        """Whether the reduced gradient of a matrix owned by ``slot`` ends on this rank (of
        its tensor-parallel shard with TP, then gathered on the owner): the owner's replica
        and shard column."""
        return self.owner_coordinates(slot) == (self.replicate_rank, self.shard_rank)

    def size(self, group: str) -> int:
        """Ranks in DMuon group ``group`` (``"unshard"``/``"reduce"``: the shard ranks)."""
        if group.startswith("grid"):
            return self.grid_size
        if group == "tp":
            return self.tp_size
        return self.replicate_size if group == "replicate" else self.shard_size

    def rank(self, group: str) -> int:
        if group.startswith("grid"):
            return self.grid_rank
        if group == "tp":
            return self.tp_rank
        return self.replicate_rank if group == "replicate" else self.shard_rank


def mesh_info(
    mesh: DeviceMesh | None,
    replicate_mesh: DeviceMesh | None,
    grid: bool = False,
    expert_mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> MeshInfo:
    """The grid of a 1-D shard mesh and a 1-D replicate mesh (either may be ``None``), with
    DMuon's own process groups created on it (every rank of the world must call this);
    ``grid``: also the groups a stack's pieces are spread over; ``expert_mesh``: the 1-D
    expert-parallel mesh that already cuts the stacks (its ranks are data-parallel ranks);
    ``tp_mesh``: the 1-D tensor-parallel mesh (its ranks outside the data-parallel ones)."""
    shard_group = mesh.get_group() if mesh is not None else None
    replicate_group = replicate_mesh.get_group() if replicate_mesh is not None else None
    tp_group = tp_mesh.get_group() if tp_mesh is not None else None
    device_type = (mesh or replicate_mesh).device_type
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device(device_type)
    )
    expert = (expert_mesh.size(), expert_mesh.get_local_rank()) if expert_mesh else (1, 0)
    groups, layout = new_process_groups(shard_group, replicate_group, grid, expert, tp_group)
    grid_group = groups.get("grid_unshard")
    # (the ranks a stack's experts are spread over: every data-parallel × tensor-parallel
    # rank; with TP the experts are not tensor-parallel, EP cuts them across the tp ranks)
    world = (
        (mesh.size() if mesh is not None else 1)
        * (replicate_mesh.size() if replicate_mesh is not None else 1)
        * (tp_mesh.size() if tp_mesh is not None else 1)
    )
    return MeshInfo(
        grid_rank=dist.get_rank(grid_group) if grid_group is not None else 0,
        grid_size=world // expert[0],
        expert_size=expert[0],
        expert_rank=expert[1],
        expert_layout=layout,
        shard_size=mesh.size() if mesh is not None else 1,
        shard_rank=mesh.get_local_rank() if mesh is not None else 0,
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        replicate_rank=replicate_mesh.get_local_rank() if replicate_mesh is not None else 0,
        tp_size=tp_mesh.size() if tp_mesh is not None else 1,
        tp_rank=tp_mesh.get_local_rank() if tp_mesh is not None else 0,
        device=device,
        groups=groups,
        device_meshes=(mesh, replicate_mesh, expert_mesh, tp_mesh),
    )


def new_process_groups(
    shard_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    grid: bool = False,
    expert: tuple[int, int] = (1, 0),
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, dist.ProcessGroup | None], tuple[tuple[int, ...], ...]]:
    """DMuon's own groups: ``unshard`` and ``reduce`` with the ranks of ``shard_group``,
    ``replicate`` with those of ``replicate_group``, ``tp`` with those of ``tp_group`` (the
    gradient gathers and update scatters of tensor parallelism), and with ``grid`` ``grid_unshard`` and
    ``grid_reduce`` with the ranks of the replicate × shard grid that share this rank's
    expert-parallel coordinate (``expert``: degree, coordinate; all of them without EP)
    (``None`` for a group of one rank). Also, with EP, the global ranks by (expert
    coordinate, grid rank).

    Collectives on one process group must be issued in the same order on every rank. FSDP2's
    own collectives, DMuon's weight broadcasts (the forward/backward schedule) and its
    gradient reduces (issued as each rank's gradients become final) each follow an order of
    their own, so each gets a group of its own.

    ``new_group`` must be entered by every rank of the world for every group, in one order;
    each rank knows only its own groups, so the rank lists are gathered first (one all-gather
    on the default group, at setup).
    """

    mine = {
        "unshard": _ranks_of(shard_group),
        "reduce": _ranks_of(shard_group),
        "replicate": _ranks_of(replicate_group),
        "tp": _ranks_of(tp_group),
        "expert": expert[1],
        "grid": grid,
    }
    kinds = ("unshard", "reduce", "replicate", "tp")
    grid_kinds = ("grid_unshard", "grid_reduce")
    result: dict[str, dist.ProcessGroup | None] = dict.fromkeys(
        (*kinds, *grid_kinds) if grid else kinds
    )
    if dist.get_world_size() == 1:
        return result, ()
    everyone = _gather_groups(mine)
    mine = everyone[dist.get_rank()]
    layout: tuple[tuple[int, ...], ...] = ()
    if grid and expert[0] > 1:  # over this rank's data-parallel world (not other stages')
        layout = _expert_layout(everyone, expert[0])
    for kind, ranks in _wanted_groups(everyone, (*kinds, *grid_kinds)):
        group = dist.new_group(list(ranks))
        if mine.get(kind) == ranks:
            result[kind] = group
    return result, layout


def _ranks_of(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    """The global ranks of ``group``, or ``None`` for no group or a group of one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return tuple(dist.get_process_group_ranks(group))


def _gather_groups(mine: dict) -> list[dict]:
    """Every rank's group entry (``mine`` on this rank), each with its grid groups."""
    # Every rank gathers, even one whose groups are all of one rank: ranks of another
    # pipeline stage may have groups to create, and creating them takes every rank.
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    # Each rank's grid groups follow from its own entry (stages differ in having stacks).
    return [
        _with_grid(theirs, x, everyone) if theirs["grid"] else theirs
        for x, theirs in enumerate(everyone)
    ]


def _expert_layout(everyone: list, expert_size: int) -> tuple[tuple[int, ...], ...]:
    """The global ranks of this rank's stack world by (expert coordinate, grid rank)."""
    world = _stack_world(dist.get_rank(), everyone)
    grids = {everyone[r]["expert"]: everyone[r]["grid_unshard"] for r in world}
    return tuple(tuple(grids[c] or ()) for c in range(expert_size))


def _wanted_groups(everyone: list, kinds: tuple[str, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Every (kind, ranks) group of several ranks that any rank needs, sorted: one order."""
    return sorted(
        {(kind, r) for theirs in everyone for kind, r in theirs.items() if kind in kinds and r}
    )


def _stack_world(rank: int, everyone: list) -> list[int]:
    """The ranks rank ``rank``'s expert stacks are spread over, from what every rank gathered:
    the shard ranks of each of its replicas, and the tensor-parallel ranks of each of those
    (every slot of its data-parallel × tensor-parallel grid; not other pipeline stages')."""
    replicas = everyone[rank]["replicate"] or (rank,)
    shards = [r for x in replicas for r in (everyone[x]["unshard"] or (x,))]
    return [t for r in shards for t in (everyone[r]["tp"] or (r,))]


def _with_grid(theirs: dict, rank: int, everyone: list) -> dict:
    """``theirs`` (rank ``rank``'s groups) with its grid groups, derived from what every rank
    gathered: the ranks of its stack world (:func:`_stack_world`) that share its expert
    coordinate, sorted (``new_group``'s numbering)."""
    slots = _stack_world(rank, everyone)
    slots = tuple(sorted(r for r in slots if everyone[r]["expert"] == theirs["expert"]))
    grid = slots if len(slots) > 1 else None
    return {**theirs, "grid_unshard": grid, "grid_reduce": grid}


def grid_device_mesh(mesh: MeshInfo) -> DeviceMesh:
    """The DeviceMesh whose ``Shard(0)`` on every dimension a stack's pieces form, made from
    existing groups without a collective: 1-D over the grid ranks, or with expert
    parallelism 2-D (expert coordinate, grid rank)."""
    shard, replicate, expert, _ = mesh.device_meshes
    device_type = (shard or replicate).device_type
    grid = mesh.groups["grid_unshard"]
    if mesh.expert_size == 1:
        return DeviceMesh.from_group(grid, device_type)
    if grid is None:  # one rank per expert coordinate: the expert mesh is the whole grid
        return expert
    return DeviceMesh.from_group(
        [expert.get_group(), grid],
        device_type,
        mesh=torch.tensor(mesh.expert_layout),
        mesh_dim_names=("ep", "grid"),
    )
