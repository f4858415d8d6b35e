"""Per-rank bodies of the distributed tests other than plain parity (see test_distributed.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon_titan as dmuon
from dmuon_titan.runtime.group import UnshardState

from .models import ToyTransformer, dedicated_predicate, init_value, loss_fn
from .training import RunConfig, batch, build_dmuon, local_slice, train_step


def _dedicated_payload_bytes(state) -> int:
    return sum(p.numel * p.param_dtype.itemsize for p in state.params)


def accounting_and_storage(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """Per config: storage after the meta flow, bytes of one training step, storage after it."""
    out = []
    for cfg in configs:
        model, optimizer = build_dmuon(cfg, world_size)
        state = model._dmuon_state
        for p in state.params:
            if p.is_owner:
                expected = init_value(p.fqn, p.shape).to(p.owned.device, p.owned.dtype)
                assert torch.equal(p.owned.detach(), expected), (
                    f"{p.fqn}: not what init_weights wrote"
                )
            else:
                assert p.owned.numel() == 0 and p.owned.untyped_storage().nbytes() == 0, p.fqn
        train_step(cfg, model, optimizer, 0, rank, world_size)  # records the forward order
        state.comm.stats.reset()
        train_step(cfg, model, optimizer, 1, rank, world_size)
        stats = state.comm.stats
        for g in state.groups:
            assert g.unshard_state is UnshardState.FREED, g.path
            for bucket in g.buckets:
                assert bucket.buffer.untyped_storage().nbytes() == 0, g.path
        assert state.presence_syncs == 0  # every owner had its own gradients
        for p in state.params:
            assert p.unsharded.grad is None and p.owned.grad is None, p.fqn
            if not p.is_owner:
                assert p.owned.numel() == 0 and p.owned not in optimizer.state, p.fqn
        out.append(
            {
                "moved": {k: stats.moved_bytes_per_rank(k) for k in stats.payload_bytes},
                "ops": dict(stats.ops),
                "P_M": _dedicated_payload_bytes(state),
                "buckets": sum(len(g.buckets) for g in state.groups),
                "summary": dmuon.summarize_plan(model),
            }
        )
        dist.barrier()
    return out


def clip_norm_first_step(rank: int, world_size: int, cfg: RunConfig) -> float:
    model, optimizer = build_dmuon(cfg, world_size)
    tokens = local_slice(cfg, batch(cfg, 0), rank, world_size)
    loss_fn(model(tokens), tokens).backward()
    return dmuon.clip_grad_norm_(model, max_norm=1e9).item()


def resume_save(rank: int, world_size: int, cfg: RunConfig, at: int) -> dict:
    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(at):
        train_step(cfg, model, optimizer, step, rank, world_size)
    saved = {
        "model": dmuon.get_model_state_dict(model),
        "optim": dmuon.get_optimizer_state_dict(model, optimizer),
    }
    for step in range(at, cfg.steps):
        train_step(cfg, model, optimizer, step, rank, world_size)
    return {**saved, "final": dmuon.get_model_state_dict(model)}


def resume_load(rank: int, world_size: int, cfg: RunConfig, saved: dict, at: int) -> dict:
    model, optimizer = build_dmuon(cfg, world_size)
    dmuon.set_model_state_dict(model, saved["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, saved["optim"])
    reexported = {
        "model": dmuon.get_model_state_dict(model),
        "optim": dmuon.get_optimizer_state_dict(model, optimizer),
    }
    for step in range(at, cfg.steps):
        train_step(cfg, model, optimizer, step, rank, world_size)
    return {**reexported, "final": dmuon.get_model_state_dict(model)}


def mixed_precision(rank: int, world_size: int, device: str = "cpu") -> dict:
    """DMuon vs plain FSDP2 under MixedPrecisionPolicy(bf16 compute, fp32 reduce)."""
    cfg = RunConfig(mixed_precision=True, device=device)
    model, optimizer = build_dmuon(cfg, world_size)
    state = model._dmuon_state
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        plain = ToyTransformer()
    for layer in plain.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(plain, mesh=mesh, mp_policy=mp)
    plain.to_empty(device=device)
    plain.init_weights()

    seen = {}

    def record_dtype(module, args):
        seen["dtype"] = module.weight.dtype

    handle = model.layers[0].attention.wq.register_forward_pre_hook(record_dtype)
    tokens = local_slice(cfg, batch(cfg, 0), rank, world_size)
    loss_fn(model(tokens), tokens).backward()
    loss_fn(plain(tokens), tokens).backward()
    handle.remove()

    worst = 0.0
    plain_params = dict(plain.named_parameters())
    for p in state.params:
        expected = plain_params[p.fqn].grad.full_tensor()
        got = p.owned.grad if p.is_owner else torch.empty_like(expected)
        if p.is_owner:
            assert got.dtype == torch.float32
        dist.broadcast(got, group_src=p.owner, group=state.comm.groups["unshard"])
        worst = max(worst, ((got - expected).norm() / expected.norm()).item())
    optimizer.step()
    momentum_dtypes = {
        str(optimizer.state[p.owned]["momentum_buffer"].dtype) for p in state.owned_params()
    }
    return {
        "compute_dtype": str(seen["dtype"]),
        "master_dtypes": sorted({str(p.owned.dtype) for p in state.params}),
        "momentum_dtypes": sorted(momentum_dtypes),
        "grad_rel_error": worst,
        "payload": dict(state.comm.stats.payload_bytes),
        "dedicated_numel": sum(p.numel for p in state.params),
    }


def count_host_syncs(rank: int, world_size: int, cfg: RunConfig) -> dict:
    """CUDA only: synchronizing calls during forward and during backward of a warm step."""
    import warnings

    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(2):  # the second step uses the recorded order (prefetch)
        train_step(cfg, model, optimizer, step, rank, world_size)
    tokens = local_slice(cfg, batch(cfg, 2), rank, world_size)
    counts = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = loss_fn(model(tokens), tokens)
            counts["forward"] = sum("synchronizing" in str(w.message) for w in caught)
            caught.clear()
            loss.backward()
            counts["backward"] = sum("synchronizing" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


def plan_mismatch(rank: int, world_size: int, what: str = "params") -> str:
    """Ranks whose plans or collective choices differ must all fail at setup, not hang later:
    ``what="params"``: each rank dedicates different parameters; ``"collectives"``: rank 0
    moves boundaries by broadcasts, the others by all-gathers; ``"reshard"``: Z3 on rank 0,
    Z2 elsewhere."""
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = ToyTransformer()
    last = f"layers.{rank}."  # each rank leaves out a different layer
    predicate, kwargs = dedicated_predicate, {}
    if what == "params":

        def predicate(name, p):
            return dedicated_predicate(name, p) and not name.startswith(last)

    elif what == "collectives":
        kwargs = {"collectives": "broadcast" if rank == 0 else "gather"}
    else:
        kwargs = {"reshard_after_forward": rank == 0}
    try:
        dmuon.dedicate_params(model, mesh, predicate, **kwargs)
    except RuntimeError as err:
        return str(err)
    return "no error"


def owned_grad_storage(rank: int, world_size: int, cfg: RunConfig) -> dict:
    """After one backward: bytes of storage the owned gradients keep alive, and what they
    need (their elements plus one presence flag each)."""
    model, _ = build_dmuon(cfg, world_size)
    tokens = local_slice(cfg, batch(cfg, 0), rank, world_size)
    loss_fn(model(tokens), tokens).backward()
    state = model._dmuon_state
    held = {}
    for p in state.owned_params():
        storage = p.owned.grad.untyped_storage()
        held[storage.data_ptr()] = storage.nbytes()
    owned = state.owned_params()
    itemsize = owned[0].owned.grad.element_size() if owned else 0
    return {
        "held": sum(held.values()),
        "needed": (sum(p.numel for p in owned) + len(owned)) * itemsize,
        "owned": len(owned),
    }


def dcp_save(rank: int, world_size: int, cfg: RunConfig, path: str, at: int) -> dict:
    """Train ``at`` steps, save the owner-only (DCP) form with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(at):
        train_step(cfg, model, optimizer, step, rank, world_size)
    model_sd = dmuon.get_model_state_dict(model, full=False)
    optim_sd = dmuon.get_optimizer_state_dict(model, optimizer, full=False)
    state = model._dmuon_state
    for p in state.params:  # each dedicated key lives on its owner only (a stack: everywhere,
        # as the Shard(0) DTensor of its pieces)
        expected = p.stacked or p.is_owner
        assert (p.fqn in model_sd) == expected, p.fqn
        assert (f"state.{p.fqn}.momentum_buffer" in optim_sd) == expected, p.fqn
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {
        "model": dmuon.get_model_state_dict(model),
        "optim": dmuon.get_optimizer_state_dict(model, optimizer),
    }


def dcp_load(rank: int, world_size: int, cfg: RunConfig, path: str) -> dict:
    """Fresh model and optimizer on another world size, load the DCP form in place."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = build_dmuon(cfg, world_size)
    target = {
        "model": dmuon.get_model_state_dict(model, full=False),
        "optim": dmuon.get_optimizer_state_dict(model, optimizer, full=False),
    }
    dcp.load(target, checkpoint_id=path)
    dmuon.set_model_state_dict(model, target["model"], full=False)
    dmuon.set_optimizer_state_dict(model, optimizer, target["optim"], full=False)
    return {
        "model": dmuon.get_model_state_dict(model),
        "optim": dmuon.get_optimizer_state_dict(model, optimizer),
    }


def hsdp_after_async_step(rank: int, world_size: int, cfg: RunConfig, path: str) -> dict:
    """Right after an async step: full and owner-only (DCP) state on every rank; the DCP form
    is saved to ``path``. Replica copies of non-owner columns are scrambled before the first
    forward to check that the global owner's values win."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = build_dmuon(cfg, world_size)
    state = model._dmuon_state
    with torch.no_grad():
        for p in state.params:
            if p.holds_weight and not p.is_owner:
                p.owned.add_(1000.0)  # a different "init_weights" on this replica
    state.comm.stats.reset()
    for step in range(cfg.steps):
        train_step(cfg, model, optimizer, step, rank, world_size)
    stats = state.comm.stats.as_dict()
    full = {
        "model": dmuon.get_model_state_dict(model),
        "optim": dmuon.get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(
        {
            "model": dmuon.get_model_state_dict(model, full=False),
            "optim": dmuon.get_optimizer_state_dict(model, optimizer, full=False),
        },
        checkpoint_id=path,
    )
    return {**full, "stats": stats, "summary": dmuon.summarize_plan(model)}


def step_is_collective_free(rank: int, world_size: int, cfg: RunConfig) -> dict:
    """``step()`` on one rank only, with no gradients, returns (no collective inside); with
    zero gradients and lr 0 on every rank (what torch's optimizer-state-dict code does) it
    changes no weight."""
    model, optimizer = build_dmuon(cfg, world_size)
    train_step(cfg, model, optimizer, 0, rank, world_size)
    before = dmuon.get_model_state_dict(model)
    if rank == 0:
        optimizer.step()  # the other ranks do not call it: must not hang
    dist.barrier()
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dmuon.get_model_state_dict(model)
    return {k: torch.equal(v, after[k]) for k, v in before.items()}


def state_dicts_after_evaluation(rank: int, world_size: int, cfg: RunConfig) -> dict:
    """Two training steps, then the optimizer state dicts (full and sharded, as DCP takes
    them) before and after a forward without backward (an evaluation, after which FSDP2
    leaves the root's unsharded parameters registered): {form: whether every entry agrees}."""
    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(2):
        train_step(cfg, model, optimizer, step, rank, world_size)
    forms = {"full": True, "sharded": False}

    def take(full: bool) -> dict:
        flat = dmuon.get_optimizer_state_dict(model, optimizer, full=full)
        if full:
            flat = {(k, n): v for k, e in flat["state"].items() for n, v in e.items()}
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in flat.items()}

    before = {form: take(full) for form, full in forms.items()}
    with torch.no_grad():
        model(local_slice(cfg, batch(cfg, 7), rank, world_size))
    out = {}
    for form, full in forms.items():
        after = take(full)
        out[form] = after.keys() == before[form].keys() and all(
            torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]
            for k, v in before[form].items()
        )
    return out


def participation_suite(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """Per config: the trained weights (full, on rank 0) and, per DMuon process group, its
    members and every collective this rank issued on it over all the steps."""
    from .training import train_dmuon_logged

    out = []
    for cfg in configs:
        weights, logs = train_dmuon_logged(rank, world_size, cfg)
        out.append({"weights": weights if rank == 0 else None, "logs": logs})
        dist.barrier()
    return out


def reuse_beyond_schedule(rank: int, world_size: int, cfg: RunConfig) -> None:
    """From the second step on, rank 1 runs ``layers.0`` once more per forward than the
    order recorded in the first step allows: a situation no schedule can serve."""
    model, optimizer = build_dmuon(cfg, world_size)
    train_step(cfg, model, optimizer, 0, rank, world_size)
    if rank == 1:
        model.order = (0, 1, 0, 0, 2)
    train_step(cfg, model, optimizer, 1, rank, world_size)


def expert_count_not_divisible(rank: int, world_size: int) -> str:
    """dedicate_params with 3 experts per stack and an expert mesh of 2: the error message,
    raised before any collective (every collective is patched to fail)."""
    from unittest import mock

    from .models import GroupedMoETransformer, grouped_moe_predicate

    mesh = init_device_mesh("cpu", (world_size,))
    expert_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("efsdp", "ep"))["ep"]
    with torch.device("meta"):
        model = GroupedMoETransformer(n_experts=3)
    names = ("all_gather", "all_gather_object", "broadcast", "all_reduce", "new_group")
    patches = [mock.patch.object(dist, n, side_effect=AssertionError(n)) for n in names]
    for p in patches:
        p.start()
    try:
        dmuon.dedicate_params(model, mesh, grouped_moe_predicate, expert_mesh=expert_mesh)
    except ValueError as err:
        return str(err)
    finally:
        for p in patches:
            p.stop()
    return "no error"


def bytes_measured_and_predicted(rank: int, world_size: int, cfg: RunConfig) -> dict:
    """One training step after the first: the bytes each phase's collectives moved (counted
    as issued) and what ``summarize_plan`` predicts, per rank."""
    model, optimizer = build_dmuon(cfg, world_size)
    state = model._dmuon_state
    train_step(cfg, model, optimizer, 0, rank, world_size)  # records the forward order
    state.comm.stats.reset()
    state.comm.log = []
    train_step(cfg, model, optimizer, 1, rank, world_size)
    stats = state.comm.stats
    grid_numel: dict[str, int] = {}  # elements the stacks' collectives carried, per phase
    for group, _, phase, numel, _ in state.comm.log:
        if group.startswith("grid"):
            grid_numel[phase] = grid_numel.get(phase, 0) + numel
    return {
        "moved": {k: stats.moved_bytes_per_rank(k) for k in stats.payload_bytes},
        "grid_numel": grid_numel,
        "ops": dict(stats.ops),
        "predicted": dmuon.summarize_plan(model)["bytes_per_rank_per_step"],
        "stack_numel": sum(p.unsharded_shape.numel() for p in state.params if p.stacked),
        "grid": state.mesh.grid_size,
    }
