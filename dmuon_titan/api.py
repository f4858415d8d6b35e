"""Public entry points: ``dedicate_params``, ``no_sync``, ``wait_all_replicate_broadcasts``,
``summarize_plan``.

``dedicate_params`` is validate → plan → build runtime → install hooks, in that order: every
input error is raised before the first collective, and the only collective at setup is the
check that all ranks computed the same plan.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .options import DedicateOptions
from .plan import ParamSpec, plan_partition, select_boundaries
from .plan.collectives import boundary_collectives
from .plan.partition import DEFAULT_SMALL_PARAM_NUMEL
from .plan.report import plan_report
from .qk_clip import not_tracked
from .runtime.collectives import Collectives
from .runtime.fsdp import install_fully_shard_patch, install_replicate_patch, register_tied
from .runtime.group import BoundaryGroup
from .runtime.mesh import MeshInfo, mesh_info
from .runtime.modules import clean_fqn, compile_wrappers
from .runtime.owned_param import DedicatedParam
from .runtime.state import STATE_ATTR, DMuonState, get_state
from .runtime.tensor_parallel import install_tensor_parallel_patch

ParamPredicate = Callable[[str, nn.Parameter], bool]
ModulePredicate = Callable[[nn.Module], bool]


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh | None,
    predicate: ParamPredicate,
    hook_boundary_predicate: ModulePredicate | None = None,
    hook_boundary_strict: bool = True,
    reshard_after_forward: bool = True,
    replicate_mesh: DeviceMesh | None = None,
    *,
    replicate_async: bool = True,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
    ns_algorithm: str = "plain",
    collectives: str = "broadcast",
    expert_mesh: DeviceMesh | None = None,
    allow_empty: bool = False,
    tp_mesh: DeviceMesh | None = None,
    tp_ns: str = "auto",
) -> dict[str, Any] | None:
    """Give each selected matrix one owner rank and install the hooks that serve it.

    Call it before ``fully_shard`` (which then skips the dedicated parameters) and, with a meta
    model, before ``to_empty``: afterwards only the owner (and, with replicas, one rank of the
    owner's shard column per replica) holds storage for each dedicated weight.

    Args:
        model: the root module (the one you will call forward on).
        mesh: 1-D data-parallel shard mesh (FSDP's; for HSDP its shard dimension). ``None``
            with ``replicate_mesh`` for pure replication (DDP-style).
        predicate: ``(fqn, param) -> bool`` selecting the Muon matrices; each must be
            trainable, not shared between modules, and 2-D, or 3-D: a stack of matrices
            (mixture-of-experts ``[experts, out, in]``: dim 0 is the stack), each
            orthogonalized on its own and owned expert by expert over every rank.
        hook_boundary_predicate: ``(module) -> bool``; a parameter's hooks go to its lowest
            ancestor (itself included) for which it is true. Default: the first
            ``layers.N``/``blocks.N`` ancestor, else the parameter's module.
        hook_boundary_strict: raise if the predicate leaves parameters uncovered.
        reshard_after_forward: ``True`` (Z3) frees non-owned weights after forward and
            re-broadcasts them before backward; ``False`` (Z2) keeps them until backward.
        replicate_mesh: 1-D replicate mesh (HSDP's replicate dimension). Owners are planned
            over all replicate × shard ranks; gradients are reduced within the shard group,
            then across replicas to the owner; the owner's update returns to the replicas.
        replicate_async: with replicas, send updates asynchronously after ``step()`` and wait
            in the next forward of each layer (default), or wait right away (debugging).
        small_param_numel: matrices with at most this many elements are packed per boundary
            onto one owner.
        ns_algorithm: the ``ns_algorithm`` you will give :class:`~dmuon_titan.Muon`; owners are
            balanced by the FLOPs of that Newton–Schulz algorithm per shape (``"gram"``/``"auto"``
            make wide matrices cheaper than plain NS does). Only the balance depends on it.
        collectives: how each boundary's weights and gradients move in the shard group:
            ``"broadcast"`` (one broadcast from and one reduce to each owner, in turn),
            ``"gather"`` (owners' buckets padded to the largest, one all-gather and one
            reduce-scatter, all links busy at once) or ``"auto"`` (per boundary, the one with
            less traffic on the busiest link); see :mod:`dmuon_titan.plan.collectives`.
            Results are identical; only speed and padding differ.
        expert_mesh: 1-D expert-parallel mesh (its ranks among the data-parallel ones, or
            with ``tp_mesh`` among the data-parallel × tensor-parallel ones) that
            cuts every expert stack along dim 0, as EP's ``Shard(0)`` does: each rank computes
            with its share of the experts, which is what forward sees (a ``Shard(0)`` DTensor
            on this mesh), and that share's pieces are owned over the data-parallel (×
            tensor-parallel) ranks of the same expert coordinate. The expert count must be
            divisible by its size. Your expert parallelism then only dispatches tokens: it
            must leave the dedicated stacks as they are (the torchtitan plugin makes
            torchtitan's ``ExpertParallel`` do so).
        allow_empty: a predicate that selects nothing is an error unless this is set. Every
            rank of the world must call ``dedicate_params`` equally often (it creates process
            groups, which takes every rank): under pipeline parallelism once per stage part
            it holds, and for a part without Muon matrices with ``allow_empty=True`` (the
            part then has no DMuon state; its parameters are AdamW's). Then see
            :func:`prepare_pipeline_stage`.
        tp_mesh: 1-D tensor-parallel mesh, when you will apply torch's tensor parallelism
            (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``) after this
            call. Owners are then balanced over data-parallel × tensor-parallel ranks, so
            every rank runs Newton–Schulz on about 1/(dp·tp) of the matrices, each on the
            whole matrix. Every dedicated matrix must then be in the tensor-parallel plan
            (placed ``Shard(0)`` or ``Shard(1)``, the degree dividing that dim): DMuon reads
            the placements from ``parallelize_module``, nothing else to pass. Needed here,
            not discovered later, because the owners (and so what each rank stores) are
            decided by this call. Expert stacks combine with it only through expert
            parallelism: ``expert_mesh`` then spans data-parallel × tensor-parallel ranks (as
            torchtitan's ``ep`` mesh does), and the stacks stay out of the tensor-parallel
            plan.
        tp_ns: with ``tp_mesh``, who runs each matrix's Newton–Schulz: ``"owner"`` (its
            owner alone, on the whole matrix), ``"shared"`` (the tp ranks of the owner's row
            together, each on a column block: plain NS, whatever ``ns_algorithm`` says, with
            an m×m all-reduce and all-gather over the row per iteration), or ``"auto"``
            (``"shared"`` where it is estimated faster: where there are too few matrices for
            the owner slots, see :func:`dmuon_titan.plan.plan_partition`).

    Returns:
        :func:`summarize_plan` of the result (``None`` when nothing was selected).
    """
    options = DedicateOptions(
        hook_boundary_strict=hook_boundary_strict,
        reshard_after_forward=reshard_after_forward,
        replicate_async=replicate_async,
        small_param_numel=small_param_numel,
        ns_algorithm=ns_algorithm,
        collectives=collectives,
        tp_ns=tp_ns,
    )
    _check_model_and_meshes(model, mesh, replicate_mesh, expert_mesh, tp_mesh)
    if tp_ns == "shared" and tp_mesh is None:
        warnings.warn(
            'dedicate_params(tp_ns="shared") without tp_mesh: there is no tensor-parallel row '
            "to share Newton-Schulz with, each owner runs its own",
            stacklevel=2,
        )
    # Validate → plan → build the runtime → install hooks: every input error comes before the
    # first collective, the check that all ranks computed the same plan.
    selected = _select_params(model, predicate, allow_empty)
    if not selected:  # join the world's group creation, nothing else
        mesh_info(mesh, replicate_mesh, expert_mesh=expert_mesh, tp_mesh=tp_mesh)
        return None
    modules = dict(model.named_modules())
    boundaries = select_boundaries(
        [fqn for fqn, *_ in selected], modules, hook_boundary_predicate, hook_boundary_strict
    )
    specs = [ParamSpec(clean_fqn(fqn), tuple(p.shape), boundaries[fqn]) for fqn, p, *_ in selected]
    _check_expert_counts(specs, expert_mesh)
    plan, moved_by = _plan(specs, options, mesh, replicate_mesh, expert_mesh, tp_mesh)
    install_fully_shard_patch()  # fully_shard / replicate now skip dedicated parameters
    install_replicate_patch()
    # parallelize_module records dedicated placements (and refuses them without tp_mesh)
    install_tensor_parallel_patch()
    stacks = any(spec.stacked for spec in specs)
    where = mesh_info(mesh, replicate_mesh, grid=stacks, expert_mesh=expert_mesh, tp_mesh=tp_mesh)
    state = _build_runtime(model, plan, selected, modules, where, moved_by, options)
    setattr(model, STATE_ATTR, state)
    return summarize_plan(model)


def _check_model_and_meshes(
    model: nn.Module, mesh, replicate_mesh, expert_mesh, tp_mesh=None
) -> None:
    if hasattr(model, STATE_ATTR):
        raise ValueError("dedicate_params was already applied to this model")
    meshes = (
        ("mesh", mesh),
        ("replicate_mesh", replicate_mesh),
        ("expert_mesh", expert_mesh),
        ("tp_mesh", tp_mesh),
    )
    for name, m in meshes:
        if m is not None and (not isinstance(m, DeviceMesh) or m.ndim != 1):
            raise ValueError(
                f"{name} must be a 1-D DeviceMesh, got {type(m).__name__} with shape "
                f"{getattr(m, 'shape', None)}"
            )
    if mesh is None and replicate_mesh is None:
        raise ValueError("mesh must be a 1-D DeviceMesh (the data-parallel mesh), got None")
    _reject_already_sharded(model)


def _plan(
    specs: list[ParamSpec],
    options: DedicateOptions,
    mesh: DeviceMesh | None,
    replicate_mesh: DeviceMesh | None,
    expert_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
):
    """(the owner plan, how each boundary's weights and gradients move), checked to be the
    same on every rank of the meshes (the first collective of ``dedicate_params``)."""
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    _check_tensor_parallel(specs, tp_size, expert_mesh)
    shard_size = mesh.size() if mesh is not None else 1
    replicate_size = replicate_mesh.size() if replicate_mesh is not None else 1
    plan = plan_partition(
        specs,
        shard_size * replicate_size * tp_size,
        small_param_numel=options.small_param_numel,
        ns_algorithm=options.ns_algorithm,
        tp_size=tp_size,
        tp_ns=options.tp_ns,
    )
    moved_by = boundary_collectives(plan, shard_size, options.collectives)
    # Everything that decides which collectives run must agree across ranks, or they hang.
    fingerprint = plan.fingerprint(
        f"reshard_after_forward={options.reshard_after_forward}",
        *(f"{boundary}={how}" for boundary, how in moved_by.items()),
    )
    for m in (mesh, replicate_mesh, tp_mesh):
        if m is not None:
            _check_same_plan_everywhere(fingerprint, m)
    return plan, moved_by


def _build_runtime(
    model: nn.Module,
    plan,
    selected: list,
    modules: dict[str, nn.Module],
    mesh: MeshInfo,
    moved_by: dict[str, str],
    options: DedicateOptions,
) -> DMuonState:
    """One :class:`DedicatedParam` per selected matrix (placeholders where not kept), one
    :class:`BoundaryGroup` per boundary, the root state, and their hooks."""
    comm = Collectives(mesh)
    boundary_paths = list(dict.fromkeys(spec.boundary for spec in plan.specs))
    boundary_index = {path: i for i, path in enumerate(boundary_paths)}
    params = [
        DedicatedParam(
            i,
            spec.fqn,
            module,
            attr,
            p,
            owner,
            mesh,
            boundary_index[spec.boundary],
            shared_ns=plan.is_shared(i),
        )
        for i, ((_, p, module, attr), spec, owner) in enumerate(
            zip(selected, plan.specs, plan.owners, strict=True)
        )
    ]
    groups = [
        BoundaryGroup(
            i,
            path,
            modules[path],
            [p for p in params if p.boundary_index == i],
            comm,
            collectives=moved_by[path],
            auto=options.collectives == "auto",
        )
        for i, path in enumerate(boundary_paths)
    ]
    state = DMuonState(model, plan, params, groups, comm, options)
    state.install_hooks(modules, boundary_paths)
    return state


def _reject_already_sharded(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(
            "fully_shard was applied before dedicate_params (FSDP modules: "
            f"{sharded[:5]}{'...' if len(sharded) > 5 else ''}); call dedicate_params first"
        )
    dtensors = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        raise ValueError(
            f"parameters are already DTensors (sharded) before dedicate_params: {dtensors[:5]}"
        )


def _select_params(model: nn.Module, predicate: ParamPredicate, allow_empty: bool = False):
    """(fqn, param, module, attr) for each selected parameter, in registration order."""
    places: dict[nn.Parameter, list[tuple[str, nn.Module, str]]] = {}
    for mod_path, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                fqn = f"{mod_path}.{attr}" if mod_path else attr
                places.setdefault(p, []).append((fqn, module, attr))
    selected = []
    for p, where in places.items():
        # A tied weight has several names; the predicate may pick it by any of them.
        picked = [w[0] for w in where if predicate(w[0], p)]
        if not picked:
            continue
        fqn, module, attr = where[0]
        if len(where) > 1:
            raise ValueError(
                f"dedicated parameter {picked[0]!r} is shared between modules (tied: "
                f"{[w[0] for w in where]}); tied weights cannot be dedicated, exclude every "
                "one of its names in the predicate (it then stays on AdamW)"
            )
        _check_matrix_shape(fqn, p, module)
        if not p.requires_grad:
            raise ValueError(
                f"dedicated parameter {fqn!r} does not require grad; exclude frozen "
                "parameters in the predicate"
            )
        selected.append((fqn, p, module, attr))
    if not selected and not allow_empty:
        raise ValueError(
            "predicate selected no parameters to dedicate (a pipeline stage without Muon "
            "matrices: pass allow_empty=True)"
        )
    for p, where in places.items():  # validated: tied weights stay on AdamW, in the FSDP2
        if len(where) > 1:  # group of their holders' common ancestor
            register_tied(p, _common_ancestor(model, [fqn for fqn, *_ in where]))
    return selected


def _check_expert_counts(specs: list[ParamSpec], expert_mesh: DeviceMesh | None) -> None:
    """Expert parallelism cuts every stack into equal shares: its degree must divide them."""
    if expert_mesh is None:
        return
    degree = expert_mesh.size()
    for spec in specs:
        if spec.stacked and spec.shape[0] % degree:
            raise ValueError(
                f"dedicated expert stack {spec.fqn!r} has {spec.shape[0]} experts, which the "
                f"expert-parallel degree {degree} (expert_mesh) does not divide: use a degree "
                "that divides the expert count"
            )


def _check_tensor_parallel(specs: list[ParamSpec], tp_size: int, expert_mesh) -> None:
    """Tensor parallelism serves 2-D matrices, each sharded along a dim the degree divides,
    and expert stacks that expert parallelism (not TP) cuts."""
    if tp_size == 1:
        return
    for spec in specs:
        if spec.stacked:
            if expert_mesh is None:
                raise ValueError(
                    f"dedicated expert stack {spec.fqn!r} with tp_mesh and no expert_mesh: "
                    "expert stacks are not tensor-parallelized by DMuon; cut them by expert "
                    "parallelism (expert_mesh), or exclude them or drop tp_mesh"
                )
            continue
        if all(dim % tp_size for dim in spec.shape):
            raise ValueError(
                f"dedicated parameter {spec.fqn!r} of shape {spec.shape}: the tensor-parallel "
                f"degree {tp_size} divides neither dim; exclude it or change the degree"
            )


def _common_ancestor(model: nn.Module, fqns: list[str]) -> nn.Module:
    """The lowest module whose subtree holds every parameter named in ``fqns``."""
    paths = [fqn.split(".")[:-1] for fqn in fqns]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return model.get_submodule(".".join(common))


def _check_matrix_shape(fqn: str, p: nn.Parameter, module: nn.Module) -> None:
    """2-D matrices, or 3-D stacks of them; a 3-D weight of one of torch's own layers (a
    convolution kernel) is not a stack of matrices."""
    if p.ndim == 3 and type(module).__module__.startswith("torch.nn"):
        raise ValueError(
            f"dedicated parameter {fqn!r} of shape {tuple(p.shape)} is a "
            f"{type(module).__name__} weight, not a stack of matrices (a 3-D parameter is "
            "taken as [experts, out, in]); exclude it in the predicate"
        )
    if p.ndim not in (2, 3) or 0 in p.shape:
        raise ValueError(
            f"dedicated parameter {fqn!r} has shape {tuple(p.shape)}; Muon needs 2-D "
            "matrices or 3-D stacks of them ([experts, out, in]), exclude it in the predicate"
        )


def _check_same_plan_everywhere(fingerprint: int, mesh: DeviceMesh) -> None:
    """One tiny all-gather on ``mesh``: a rank whose plan differs fails on every rank instead
    of hanging."""
    group = mesh.get_group()
    world = dist.get_world_size(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    values = [int(t.item()) for t in gathered]
    if len(set(values)) != 1:
        raise RuntimeError(
            "DMuon plans differ across ranks (fingerprints per group rank: "
            f"{values}); the model's parameter names, shapes or boundaries, or the "
            "dedicate_params arguments (reshard_after_forward, collectives), differ between ranks"
        )


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (dedicated params and FSDP2 alike); the next backward
    outside the context reduces everything accumulated."""
    from torch.distributed.fsdp import FSDPModule

    state = getattr(model, STATE_ATTR, None)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if state is not None:
        state.requires_gradient_sync = False
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        if state is not None:
            state.requires_gradient_sync = True
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def set_gradient_divide_factor(model: nn.Module, factor: float) -> None:
    """Divide reduced dedicated gradients by ``factor`` (default: the world size, i.e. the mean).

    Mirrors ``FSDPModule.set_gradient_divide_factor``: keep both equal. ``1.0`` sums, which is
    right when the loss is already normalized by the global token count (torchtitan).
    """
    if not factor > 0:
        raise ValueError(f"gradient divide factor must be > 0, got {factor!r}")
    state = get_state(model)
    if state.direct and factor != 1:
        raise ValueError(
            "set_gradient_divide_factor after the first forward of a one-rank model (whose "
            "gradients are not reduced, so not divided either): call it before the first forward"
        )
    state.gradient_divide_factor = float(factor)


def move_hooks_outside_compile(model: nn.Module) -> int:
    """Move DMuon's hooks from compiled blocks to their ``torch.compile`` wrappers.

    Call it after compiling blocks (``torch.compile(block, fullgraph=True)``, possibly around an
    activation-checkpoint wrapper) and before the first forward: the hooks issue collectives
    and swap parameters, so they must run outside the compiled region, like FSDP2's. Returns
    the number of boundaries whose hooks moved. (The torchtitan plugin calls it for you.)
    """
    state = get_state(model)
    compiled = compile_wrappers(model)
    moved = 0
    for group in state.groups:
        wrapper = compiled.get(group.module)
        if wrapper is not None:
            state.hook_boundary(group, wrapper)
            moved += 1
    return moved


def prepare_pipeline_stage(stage) -> bool:
    """Serve a ``torch.distributed.pipelining`` stage whose submodule has dedicated matrices.

    Call it once the stage's ``submod`` is final (after ``fully_shard``), before its first
    step. The schedule runs several microbatches per step, interleaving their forwards and
    backwards; DMuon then does what FSDP2 does under the schedules: the weights come in with
    the step's first forward and stay until the stage's ``perform_reduce_grad`` (the end of
    its last backward of the step), each backward only accumulates, and the step's
    gradients reach their owners once, there, before the schedule scales gradients. Returns
    whether the stage has dedicated matrices (``False``: nothing to do).

    Schedules that split backward into input and weight parts (the zero-bubble ones,
    DualPipeV) compute weight gradients for ``submod.parameters()`` outside the forward that
    used the full-size weights, which DMuon cannot serve: :func:`check_pipeline_schedule`
    refuses them.
    """
    state = getattr(stage.submod, STATE_ATTR, None)
    if state is None:
        return False
    _untrack_metadata_inference(stage)
    original = stage.perform_reduce_grad
    if getattr(original, "_dmuon", False):
        return True
    state.enable_pipelining()

    def perform_reduce_grad(grad_scale_factor: int) -> None:
        state.reduce_step_gradients()
        original(grad_scale_factor)

    perform_reduce_grad._dmuon = True
    stage.perform_reduce_grad = perform_reduce_grad
    return True


#: the stage methods (torch 2.13, torch <= 2.12) that run its forward on stand-in inputs
#: to learn the shapes it sends
_METADATA_INFERENCE = ("_forward_metadata_inference", "_shape_inference")


def _untrack_metadata_inference(stage) -> None:
    """QK-clip must not track the forward a stage runs on uninitialized stand-ins."""
    for name in _METADATA_INFERENCE:
        original = getattr(stage, name, None)
        if original is None or getattr(original, "_dmuon", False):
            continue

        def untracked(*args, _original=original, **kwargs):
            with not_tracked():
                return _original(*args, **kwargs)

        untracked._dmuon = True
        setattr(stage, name, untracked)


def check_pipeline_schedule(schedule_class: type) -> None:
    """Raise ``ValueError`` for schedules :func:`prepare_pipeline_stage` cannot serve."""
    if schedule_class.__name__ in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"{schedule_class.__name__} splits backward into input and weight passes, whose "
            "weight gradients DMuon's dedicated matrices cannot receive; use 1F1B, GPipe, "
            "Interleaved1F1B or LoopedBFS"
        )


#: torch 2.13's schedules that run weight gradients apart from the rest of backward
SPLIT_BACKWARD_SCHEDULES = (
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Wait for the owners' asynchronous update broadcasts to the replicas (HSDP/DDP), and
    for an optimizer step still running on its own stream (``Muon(async_step=True)``, one
    GPU): the current stream waits for them, the host does not.

    Call it before reading weights outside the model's forward (a checkpoint); the
    state-dict functions and the torchtitan plugin's checkpoint hook do. Without either, a
    no-op.
    """
    get_state(model).wait_all_replicate_broadcasts()


def summarize_plan(
    model: nn.Module,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    *,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_steps: int = 5,
    ns_preconditioner: str = "frobenius",
) -> dict[str, Any]:
    """JSON-friendly description of who owns what and what it costs, per step.

    Bytes use the compute/reduce dtypes resolved at the first forward (from the FSDP2
    mixed-precision policy); before that, pass them to get the figures of the coming run.
    ``ns_dtype``, ``ns_steps`` and ``ns_preconditioner`` (:class:`~dmuon_titan.Muon`'s)
    size the traffic of a shared Newton–Schulz (``tp_ns``). See
    :func:`dmuon_titan.plan.report.plan_report`.
    """
    return plan_report(
        get_state(model), param_dtype, reduce_dtype, ns_dtype, ns_steps, ns_preconditioner
    )
