"""One dedicated parameter: whole on its owner, empty elsewhere, full-size only while in use.

Each matrix has one global owner slot (r_o, s_o) of the replicate × shard grid
(:class:`~dmuon_titan.runtime.mesh.MeshInfo`), the only rank that keeps its optimizer state and
updates it. The ranks of shard column s_o (one per replica, the owner among them) hold the full
master weight and broadcast it inside their replica; every other rank holds an empty
placeholder (so ``to_empty`` allocates and ``init_weights`` writes only there).

A 3-D parameter is a stack of matrices (experts, dim 0), owned piece by piece: each slot keeps
the master of its own experts (``piece``, see :func:`~dmuon_titan.plan.partition.stack_pieces`)
and steps them; the pieces are gathered into the full-size stack for forward and backward.

Outside a boundary's active window the module holds ``owned`` (master or placeholder). Inside
it the module holds ``unsharded``: a full-size parameter in the compute dtype whose storage is
a view into its bucket's broadcast buffer; autograd accumulates this rank's gradient into
``unsharded.grad``.

With tensor parallelism ``parallelize_module`` later tells each matrix its placement on the
tp mesh (``Shard(0)`` colwise, ``Shard(1)`` rowwise; see ``tensor_parallel.py``): ``unsharded``
is then this rank's tensor-parallel shard, as a DTensor on the tp mesh; only the owner keeps
the whole master, and the other ranks of its shard column keep ``tp_copy``, the master's
shard of their tp coordinate, the source of their stage-1 broadcasts.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..plan.partition import SHARDED, stack_pieces
from .mesh import MeshInfo

#: Attribute that marks dedicated parameters (owned, placeholder and unsharded alike): their
#: :class:`DedicatedParam`. FSDP2's ``fully_shard`` skips every parameter that carries it (see
#: ``runtime/fsdp.py``).
DEDICATED_ATTR = "_dmuon_dedicated"


# module -> names of its dedicated parameter slots. The slot is what is dedicated: the object
# in it changes when ``to_empty`` materializes a meta model.
_DEDICATED_SLOTS: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
# module -> slot name -> (a weak reference to) its DedicatedParam
_SLOT_PARAMS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def is_dedicated(param: torch.Tensor) -> bool:
    return hasattr(param, DEDICATED_ATTR)


def dedicated_of(param: torch.Tensor) -> DedicatedParam | None:
    """The :class:`DedicatedParam` behind a dedicated parameter tensor, else ``None``."""
    return getattr(param, DEDICATED_ATTR, None)


def dedicated_slots_of(module: nn.Module) -> set[str]:
    """Names of ``module``'s own dedicated parameter slots."""
    return set(_DEDICATED_SLOTS.get(module, ()))


def dedicated_slot_owner(module: nn.Module, attr: str) -> DedicatedParam | None:
    """The :class:`DedicatedParam` of ``module``'s dedicated slot ``attr``: whatever object
    the slot holds now (a style may have wrapped it in a new ``Parameter``)."""
    found = _SLOT_PARAMS.get(module, {}).get(attr)
    return found() if found is not None else None


def dedicated_params_of(module: nn.Module) -> list[torch.Tensor]:
    """The parameters currently in ``module``'s own dedicated slots (not its children's)."""
    slots = _DEDICATED_SLOTS.get(module, ())
    return [module._parameters[a] for a in slots if module._parameters.get(a) is not None]


class DedicatedParam:
    """Runtime state of one dedicated matrix on this rank."""

    def __init__(
        self,
        index: int,
        fqn: str,
        module: nn.Module,
        attr: str,
        param: nn.Parameter,
        owner: int,
        mesh: MeshInfo,
        boundary_index: int,
        shared_ns: bool = False,
    ) -> None:
        self.index = index
        self.fqn = fqn
        self.module = module
        self.attr = attr
        self.shape = torch.Size(param.shape)
        self.numel = param.numel()
        self.orig_dtype = param.dtype
        self.owner = owner  # the global slot (see MeshInfo), or SHARDED for a stack
        #: a stack of matrices (3-D), owned expert by expert
        self.stacked = owner == SHARDED
        #: what forward and backward see: the whole matrix, or with expert parallelism this
        #: rank's experts of a stack (EP's Shard(0): the experts it computes with)
        self.unsharded_shape = self.shape
        if self.stacked:
            self._place_stack(mesh)
        else:
            self._place_matrix(owner, mesh)
        #: shape and elements of ``owned`` (the whole matrix, a stack's piece, or empty)
        self.owned_shape = torch.Size(self.owned_shape)
        self.owned_numel = self.owned_shape.numel()
        self._init_tensor_parallel(mesh)
        self.boundary_index = boundary_index
        #: its Newton–Schulz is shared by the tp ranks of its owner's row (the plan's
        #: ``tp_ns``; see ``runtime/shared_ns.py``), not run by the owner alone
        self.shared_ns = shared_ns
        #: the model's runtime state (a weak reference; set when the state is built)
        self.state_ref = None
        # Compute and reduce dtypes; FSDP2's MixedPrecisionPolicy of the nearest fully_shard
        # ancestor decides them at lazy init.
        self.param_dtype = param.dtype
        self.reduce_dtype = param.dtype
        self._take_slot(module, attr, param)
        self.unsharded: nn.Parameter | None = None
        #: with expert parallelism, the expert mesh: the unsharded stack is its Shard(0)
        self.expert_mesh = mesh.device_meshes[2] if self.stacked else None
        #: whether this rank had a gradient when the boundary last packed its gradients
        self.packed_local_grad = False

    def _place_stack(self, mesh: MeshInfo) -> None:
        """A stack's place on this rank: the experts it computes with and the piece it owns."""
        experts = self.shape[0]
        first, last = 0, experts
        if mesh.expert_size > 1:
            first, last = stack_pieces(experts, mesh.expert_size)[mesh.expert_rank]
            self.unsharded_shape = torch.Size((last - first, *self.shape[1:]))
        start, stop = stack_pieces(last - first, mesh.grid_size)[mesh.grid_rank]
        #: this rank's experts [start, stop) of the stack, global indices (stacks only)
        self.piece = (first + start, first + stop)
        self.owner_replica = self.owner_shard = SHARDED
        self.holds_weight = self.is_owner = self.piece[1] > self.piece[0]
        self.holds_source = self.in_owner_row = self.holds_weight
        self.owner_tp_rank = 0
        self.owned_shape = torch.Size((self.piece[1] - self.piece[0], *self.shape[1:]))

    def _place_matrix(self, owner: int, mesh: MeshInfo) -> None:
        """A matrix's place on this rank: its owner's coordinates and what this rank holds."""
        self.owner_replica, self.owner_shard = mesh.owner_coordinates(owner)
        self.owner_tp_rank = mesh.owner_tp_rank(owner)
        #: this rank holds the whole master weight (without TP its replica's copy, or the
        #: owner's own; with TP the owner alone)
        self.holds_weight = mesh.holds_weight(owner)
        #: this rank is its replica's stage-1 source (of its tensor-parallel shard)
        self.holds_source = mesh.holds_source(owner)
        #: the reduced gradient (of its tensor-parallel shard) ends here
        self.in_owner_row = mesh.in_owner_row(owner)
        #: this rank is the global owner: it keeps the optimizer state and steps the matrix
        self.is_owner = owner == mesh.slot
        # Zero rows but the same trailing dims where not held, so ``fan_in``-style
        # initializers and ``ndim`` checks keep working; ``to_empty`` allocates nothing.
        self.owned_shape = self.shape if self.holds_weight else (0, *self.shape[1:])

    def _init_tensor_parallel(self, mesh: MeshInfo) -> None:
        """Tensor-parallel degree, coordinate and mesh (the placement comes later, from TP)."""
        #: tensor parallelism: its degree and this rank's coordinate; the matrix's sharded
        #: dim (0 colwise, 1 rowwise) once ``parallelize_module`` placed it (else ``None``).
        #: Not of a stack: expert parallelism cuts stacks across the tp ranks instead.
        tensor_parallel = mesh.tp_size > 1 and not self.stacked
        self.tp_size, self.tp_rank = (mesh.tp_size, mesh.tp_rank) if tensor_parallel else (1, 0)
        self.tp_mesh = mesh.device_meshes[3] if tensor_parallel else None
        self.tp_dim: int | None = None
        #: elements of ``unsharded`` (known before the placement: the degree divides a dim)
        self.unsharded_numel = (
            self.unsharded_shape.numel() if self.stacked else self.numel // self.tp_size
        )
        #: with TP, on the ranks of the owner's shard column: this tp coordinate's shard of
        #: the master (made at lazy init, filled from the owner)
        self.tp_copy: torch.Tensor | None = None

    def _take_slot(self, module: nn.Module, attr: str, param: nn.Parameter) -> None:
        """Put ``owned`` in the module's slot (``param`` itself if whole) and register it."""
        if self.owned_shape == self.shape:
            self._owned = param
        else:
            # A stack's piece (its values, if the model has any yet) or the empty placeholder.
            start, stop = self.piece if self.stacked else (0, 0)
            self._owned = nn.Parameter(
                param.detach()[start:stop].clone(), requires_grad=param.requires_grad
            )
            module._parameters[attr] = self._owned
        setattr(self._owned, DEDICATED_ATTR, self)
        _DEDICATED_SLOTS.setdefault(module, set()).add(attr)
        _SLOT_PARAMS.setdefault(module, {})[attr] = weakref.ref(self)

    @property
    def owned(self) -> nn.Parameter:
        """The master weight on its owner's shard column, the empty placeholder elsewhere:
        whatever the module's slot holds outside the boundary's active window.

        ``to_empty``/``.to()`` from the meta device create new ``Parameter`` objects (a meta
        tensor cannot be re-pointed at real storage); the slot, not the object, is what is
        dedicated, so a same-shaped replacement is followed here. Anything else is an error.
        """
        current = self.module._parameters.get(self.attr)
        if current is self._owned or (current is not None and current is self.unsharded):
            return self._owned
        expected = self.owned_shape
        if current is None or tuple(current.shape) != tuple(expected):
            raise RuntimeError(
                f"dedicated parameter {self.fqn!r} was replaced on its module after "
                f"dedicate_params() by {None if current is None else tuple(current.shape)} "
                f"(expected {tuple(expected)}); modify it in place (e.g. with .copy_()) instead"
            )
        setattr(current, DEDICATED_ATTR, self)
        self._owned = current
        self.orig_dtype = current.dtype
        return current

    def resolve_dtypes(self, policy) -> None:
        """Compute and reduce dtypes from FSDP2's ``MixedPrecisionPolicy`` (``None``: none):
        compute in ``param_dtype``, reduce in ``reduce_dtype`` (default: the compute dtype);
        the owner's master and optimizer state stay in the original dtype."""
        self.param_dtype = (policy.param_dtype if policy else None) or self.orig_dtype
        self.reduce_dtype = (policy.reduce_dtype if policy else None) or self.param_dtype

    def check_materialized(self) -> None:
        if self.tp_mesh is not None and self.tp_dim is None:
            raise ValueError(
                f"dedicated parameter {self.fqn!r} was not tensor-parallelized, but "
                "dedicate_params was given a tp_mesh: put it in the parallelize_module plan "
                "(ColwiseParallel or RowwiseParallel) or exclude it from the predicate"
            )
        if self.holds_weight and self.owned.is_meta:
            raise RuntimeError(
                f"dedicated parameter {self.fqn!r} is still on the meta device; call "
                "model.to_empty(device=...) and initialize the weights before the first forward"
            )

    def set_tensor_parallel(self, mesh, placements) -> None:
        """``parallelize_module`` places this matrix on ``mesh`` (see ``tensor_parallel.py``):
        checked against the tp mesh given to ``dedicate_params``; the forward then computes
        with this rank's shard."""
        from torch.distributed.tensor import Shard

        if self.stacked:
            raise ValueError(
                f"dedicated expert stack {self.fqn!r}: tensor parallelism of expert stacks is "
                "not supported; leave the experts out of the tensor-parallel plan (expert "
                "parallelism cuts them across the tp ranks)"
            )
        if self.tp_mesh is None and mesh.size() == 1:
            raise ValueError(
                f"dedicated parameter {self.fqn!r} is being tensor-parallelized on a 1-rank "
                "mesh: at tensor-parallel degree 1 leave parallelize_module out (torchtitan "
                "does), DMuon then serves the matrix as a data-parallel one"
            )
        if self.tp_mesh is None:
            raise ValueError(
                f"dedicated parameter {self.fqn!r} is being tensor-parallelized on a "
                f"{mesh.size()}-rank mesh, but dedicate_params was given no tp_mesh: pass "
                "tp_mesh=<the tensor-parallel DeviceMesh> to dedicate_params"
            )
        same = mesh.ndim == 1 and sorted(mesh.mesh.flatten().tolist()) == sorted(
            self.tp_mesh.mesh.flatten().tolist()
        )
        placement = placements[0] if len(placements) == 1 else None
        if not same or not (isinstance(placement, Shard) and placement.dim in (0, 1, -1, -2)):
            raise ValueError(
                f"dedicated parameter {self.fqn!r}: tensor parallelism places it as "
                f"{list(placements)} on mesh {mesh.mesh.tolist()}; DMuon serves Shard(0) "
                "(colwise) or Shard(1) (rowwise) on the tp_mesh given to dedicate_params "
                f"({self.tp_mesh.mesh.tolist()}): change the plan or exclude the parameter"
            )
        dim = placement.dim % 2
        if self.shape[dim] % self.tp_size:
            raise ValueError(
                f"dedicated parameter {self.fqn!r} of shape {tuple(self.shape)}: dim {dim} "
                f"is not divisible by the tensor-parallel degree {self.tp_size}; use a degree "
                "that divides it or exclude the parameter"
            )
        self.tp_dim = dim
        local = list(self.shape)
        local[dim] //= self.tp_size
        self.unsharded_shape = torch.Size(local)

    def tp_slice(self, whole: torch.Tensor, tp_rank: int | None = None) -> torch.Tensor:
        """Shard ``tp_rank`` (default: this rank's) of a whole-matrix tensor, a view."""
        rank = self.tp_rank if tp_rank is None else tp_rank
        size = self.shape[self.tp_dim] // self.tp_size
        return whole.narrow(self.tp_dim, rank * size, size)

    @property
    def source(self) -> torch.Tensor:
        """What this rank copies into its stage-1 broadcast buffer (a source rank): the
        master, or with TP its shard copy."""
        return self.tp_copy if self.tp_size > 1 else self.owned

    def make_unsharded(self, flat_view: torch.Tensor) -> None:
        """Create the full-size compute parameter over ``flat_view`` (its bucket's buffer);
        with expert parallelism a ``Shard(0)`` DTensor on the expert mesh, as EP makes it;
        with tensor parallelism this rank's shard as a DTensor on the tp mesh, as
        ``parallelize_module`` makes it."""
        data = flat_view.view(self.unsharded_shape)
        if self.tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            data = DTensor.from_local(
                data,
                self.tp_mesh,
                [Shard(self.tp_dim)],
                run_check=False,
                shape=self.shape,
                stride=torch.empty(self.shape, device="meta").stride(),
            )
        elif self.expert_mesh is not None and self.expert_mesh.size() > 1:
            from torch.distributed.tensor import DTensor, Shard

            data = DTensor.from_local(
                data,
                self.expert_mesh,
                [Shard(0)],
                run_check=False,
                shape=self.shape,
                stride=torch.empty(self.shape, device="meta").stride(),
            )
        self.unsharded = nn.Parameter(data, requires_grad=self.owned.requires_grad)
        setattr(self.unsharded, DEDICATED_ATTR, self)

    def install(self) -> None:
        self.module._parameters[self.attr] = self.unsharded

    def uninstall(self) -> None:
        self.module._parameters[self.attr] = self.owned
