"""Training runs shared by the tests: DMuon on N ranks, and the single-process reference.

The reference is what DMuon promises to equal: ``torch.optim.Muon`` on the dedicated matrices
and ``torch.optim.AdamW`` on everything else, one process, the whole global batch.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, replace
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon_titan as dmuon

from .models import (
    BRANCH_TOKEN,
    BranchTransformer,
    GroupedMoETransformer,
    LatentTransformer,
    MoETransformer,
    ReuseTransformer,
    TiedTransformer,
    ToyTransformer,
    dedicated_predicate,
    grouped_moe_predicate,
    loss_fn,
    moe_boundary,
    moe_predicate,
    sliced_to_stacked,
    stacked_to_sliced,
)

MODELS = {
    "toy": ToyTransformer,
    # deeper and shallower toys, for pipeline stages (tests/helpers/pipeline.py)
    "toy2": functools.partial(ToyTransformer, n_layers=2),
    "toy4": functools.partial(ToyTransformer, n_layers=4),
    # as many key/value heads as heads: tensor parallelism up to 4 ranks keeps heads whole
    "toy_mha": functools.partial(ToyTransformer, n_kv_heads=4),
    "reuse": ReuseTransformer,
    "branch": BranchTransformer,
    "moe": MoETransformer,
    "grouped_moe": GroupedMoETransformer,
    "tied": TiedTransformer,
    "mla": functools.partial(LatentTransformer, n_layers=2),
}
#: the Muon matrices of each model (the reference's torch.optim.Muon gets the same; for
#: "grouped_moe" every expert slice of the 3-D stacks as a matrix of its own)
PREDICATES = {"moe": moe_predicate, "grouped_moe": grouped_moe_predicate}
#: hook_boundary_predicate per model (default: the layers.N heuristic)
BOUNDARIES = {"moe": moe_boundary}


@dataclass(frozen=True)
class RunConfig:
    steps: int = 5
    batch: int = 24  # global; divisible by 1..4 ranks and, per rank, by 2 micro-batches
    seq: int = 16
    vocab: int = 64
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    micro_batches: int = 1  # >1: gradient accumulation under dmuon.no_sync
    ns_dtype: torch.dtype = torch.float32
    ns_algorithm: str = "plain"  # DMuon's; the reference is always torch.optim.Muon's plain NS
    param_dtype: torch.dtype = torch.float32  # the model's (master) dtype
    small_param_numel: int = 0  # 0: every matrix its own unit (exercise multi-owner boundaries)
    lr: float = 0.02
    adamw_lr: float = 3e-3
    weight_decay: float = 0.1
    adjust_lr_fn: str | None = None
    ns_coefficients: tuple = (3.4445, -4.7750, 2.0315)
    ns_preconditioner: str = "frobenius"  # Muon(ns_preconditioner=...); the reference's too
    mixed_precision: bool = False
    max_norm: float | None = None  # clip gradients by the global norm before each step
    defer_clip: bool = False  # clip_grad_norm_(defer_owned=True): the step applies it
    model: str = "toy"  # a key of MODELS
    meta_init: bool = True
    device: str = "cpu"
    compile_backend: str | None = None  # torch.compile each block (fullgraph) with this backend
    replicate: int = 1  # HSDP replicas: ranks form a (replicate, shard) grid
    ddp: bool = False  # dedicate_params(mesh=None, replicate_mesh=all ranks): replication only
    replicate_async: bool = True
    collectives: str = "broadcast"  # dedicate_params(collectives=...): stage-1 layout
    optimizer_first: bool = False  # build Muon after fully_shard but before to_empty
    ep: int = 1  # expert parallelism ("grouped_moe"): ranks (fsdp // ep, ep), experts cut by ep
    tp: int = 1  # tensor parallelism: ranks (replicate, shard, tp), the blocks colwise/rowwise
    tp_ns: str = "auto"  # dedicate_params(tp_ns=...): who runs NS under TP
    cuda_graph: bool = True  # Muon(cuda_graph=...): one rank on a GPU captures the step
    async_step: bool = True  # Muon(async_step=...): the captured step on a side stream
    qk_clip: float | None = None  # dmuon.QKClip's threshold (the reference: plain_qk_clip_)


#: MoE data: the expert residues (token % 4) each block of rows may use. Whatever the world
#: size (1-4, 24 rows), every rank's rows miss one of experts 0-2, and no row uses expert 3.
MOE_ROW_EXPERTS = ((range(0, 8), (1, 2)), (range(8, 16), (2,)), (range(16, 24), (0, 2)))
#: branch data: only these rows start with BRANCH_TOKEN (so only the first rank's slice)
BRANCH_ROWS = 6


def batch(cfg: RunConfig, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    if cfg.model == "branch":
        first = tokens[:, 0]
        first[first == BRANCH_TOKEN] += 1
        first[:BRANCH_ROWS] = BRANCH_TOKEN
    elif cfg.model in ("moe", "grouped_moe"):
        assert cfg.batch == 24 and cfg.vocab % 4 == 0
        for rows, experts in MOE_ROW_EXPERTS:
            allowed = torch.tensor(experts)
            pick = torch.randint(0, len(experts), (len(rows), cfg.seq), generator=g)
            tokens[rows.start : rows.stop] = (
                4 * (tokens[rows.start : rows.stop] // 4) + allowed[pick]
            )
    return tokens


# ---------------------------------------------------------------------- reference
def ns_in(dtype: torch.dtype, preconditioner: str = "frobenius"):
    """torch.optim.Muon's Newton–Schulz with its bfloat16 cast replaced by ``dtype``;
    ``preconditioner="aol"``: its normalization replaced by AOL's row scaling, written out
    (each row divided by the root of its absolute row sum of X·Xᵀ, clamped at eps²)."""

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.to(dtype)
        if grad.size(0) > grad.size(1):
            x = x.T
        if preconditioner == "aol":
            x = x / (x @ x.T).abs().sum(dim=1, keepdim=True).clamp(min=eps * eps).sqrt()
        else:
            x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if grad.size(0) > grad.size(1) else x

    return zeropower


def train_reference(
    cfg: RunConfig, ns_precision: str = "float64", chunks: int = 1
) -> dict[str, torch.Tensor]:
    """Single process, whole batch. ``ns_precision``: ``"float64"`` (float64 model and NS),
    ``"float32"`` (float32 model and NS) or ``"torch"`` (float32 model, ``torch.optim.Muon``
    exactly as shipped, i.e. bfloat16 NS). ``chunks > 1`` accumulates the same batch in
    chunks: the same math, summed in another order (a rounding-noise probe)."""
    dtype = torch.float64 if ns_precision == "float64" else torch.float32
    sliced = cfg.model == "grouped_moe"
    if sliced:  # the stacked model's initial weights, one 2-D parameter per expert
        model = MODELS[cfg.model](vocab=cfg.vocab, sliced=True)
        model.load_state_dict(stacked_to_sliced(initial_state(cfg)))
    else:
        model = MODELS[cfg.model](vocab=cfg.vocab)
        model.init_weights()
    model.to(dtype)
    selected = PREDICATES.get(cfg.model, dedicated_predicate)
    muon_params = [p for n, p in model.named_parameters() if selected(n, p)]
    other_params = [p for n, p in model.named_parameters() if not selected(n, p)]
    muon = torch.optim.Muon(
        muon_params,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        ns_coefficients=cfg.ns_coefficients,
        adjust_lr_fn=cfg.adjust_lr_fn,
    )
    adamw = torch.optim.AdamW(
        other_params, lr=cfg.adamw_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay
    )
    seen = record_queries_keys(model) if cfg.qk_clip is not None else None
    patch = (
        contextlib.nullcontext()
        if ns_precision == "torch"
        else mock.patch.object(
            torch.optim._muon,
            "_zeropower_via_newtonschulz",
            ns_in(dtype, cfg.ns_preconditioner),
        )
    )
    with patch:
        for step in range(cfg.steps):
            tokens = batch(cfg, step)
            for chunk in tokens.chunk(chunks):
                (loss_fn(model(chunk), chunk) / chunks).backward()
            if cfg.max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
            muon.step()
            adamw.step()
            if seen is not None:
                plain_qk_clip_(model, seen, cfg.qk_clip)
            muon.zero_grad()
            adamw.zero_grad()
    result = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return sliced_to_stacked(result) if sliced else result


def record_queries_keys(model: nn.Module) -> dict[str, list]:
    """attention module name -> the (q, k) its kernel received in training forwards since the
    last clear."""
    seen: dict[str, list] = {}
    for name, module in model.named_modules():
        if hasattr(module, "inner_attention"):
            seen[name] = []
            module.inner_attention.register_forward_pre_hook(
                lambda m, args, name=name: (
                    seen[name].append((args[0].detach(), args[1].detach()))
                    if torch.is_grad_enabled()
                    else None
                )
            )
    return seen


@torch.no_grad()
def plain_qk_clip_(model: nn.Module, seen: dict[str, list], threshold: float) -> None:
    """MuonClip written out: per query head the largest causal softmax logit q·k/√d over
    everything its kernel saw, γ = min(1, τ/S); wq's head rows × √γ, wk's rows of each key
    head × √(min γ of the query heads it serves). Clears ``seen``."""
    modules = dict(model.named_modules())
    for name, pairs in seen.items():
        attn = modules[name]
        if hasattr(attn, "wkv_b"):
            _plain_latent_clip_(attn, pairs, threshold)
            continue
        heads, kv_heads, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        best = torch.full((heads,), -math.inf, dtype=torch.float64)
        for q, k in pairs:
            t = q.shape[2]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            for h in range(heads):
                kh = k[:, h // (heads // kv_heads)]
                logits = (q[:, h].double() @ kh.double().transpose(-1, -2)) / math.sqrt(d)
                best[h] = max(best[h], logits[:, causal].max())
        gamma = [min(1.0, threshold / s) if s > threshold else 1.0 for s in best.tolist()]
        wq = attn.wq.weight.view(heads, d, -1)
        wk = attn.wk.weight.view(kv_heads, d, -1)
        for h in range(heads):
            wq[h] *= gamma[h] ** 0.5
        group = heads // kv_heads
        for g in range(kv_heads):
            wk[g] *= min(gamma[g * group : (g + 1) * group]) ** 0.5
        pairs.clear()


def _plain_latent_clip_(attn: nn.Module, pairs: list, threshold: float) -> None:
    """MuonClip on an MLA module written out (Kimi K2's rule): per head the largest causal
    logit q·k·softmax_scale, γ = min(1, τ/S); the query's content rows × √γ and rotary rows
    × γ, the rows of wkv_b making the key's content part × √γ, the shared rotary key and the
    values untouched. Clears ``pairs``."""
    heads, nope = attn.n_heads, attn.qk_nope_head_dim
    best = [-math.inf] * heads
    for q, k in pairs:
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        for h in range(heads):
            logits = (q[:, h].double() @ k[:, h].double().transpose(-1, -2)) * attn.softmax_scale
            best[h] = max(best[h], logits[:, causal].max().item())
    query = attn.wq if attn.q_lora_rank == 0 else attn.wq_b
    wq = query.weight.view(heads, attn.qk_head_dim, -1)
    wkv = attn.wkv_b.weight.view(heads, nope + attn.v_head_dim, -1)
    for h in range(heads):
        gamma = threshold / best[h] if best[h] > threshold else 1.0
        wq[h, :nope] *= gamma**0.5
        wq[h, nope:] *= gamma
        wkv[h, :nope] *= gamma**0.5
    pairs.clear()


def initial_state(cfg: RunConfig) -> dict[str, torch.Tensor]:
    model = MODELS[cfg.model](vocab=cfg.vocab)
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- DMuon
#: the blocks' tensor-parallel plan (torchtitan's llama3 plan without sequence parallelism)
TP_PLAN = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}


def apply_tp(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.layers:
        plan = {name: styles[style]() for name, style in TP_PLAN.items()}
        moe = getattr(layer, "moe", None)
        if moe is not None:  # (a grouped MoE block: the shared expert for the feed-forward)
            plan = {
                name.replace("feed_forward.", "moe.shared_expert."): style
                for name, style in plan.items()
            }
        parallelize_module(layer, tp_mesh, plan)


def data_rank(cfg: RunConfig, rank: int, world_size: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, data-parallel size): tensor-parallel ranks (the
    innermost mesh dim) share one batch slice."""
    return rank // cfg.tp, world_size // cfg.tp


def build_dmuon(cfg: RunConfig, world_size: int):
    """Meta model → dedicate → (TP) → (AC) → fully_shard → to_empty → init_weights → Muon."""
    tp_mesh = None
    if cfg.tp > 1:
        dims = (cfg.replicate, world_size // (cfg.replicate * cfg.tp), cfg.tp)
        world = init_device_mesh(cfg.device, dims, mesh_dim_names=("replicate", "shard", "tp"))
        tp_mesh, shard_mesh = world["tp"], world["shard"]
        replicate_mesh = world["replicate"] if cfg.replicate > 1 else None
        fsdp_mesh = world["replicate", "shard"] if cfg.replicate > 1 else shard_mesh
    elif cfg.replicate > 1 or cfg.ddp:
        replicas = world_size if cfg.ddp else cfg.replicate
        grid = init_device_mesh(
            cfg.device, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
        fsdp_mesh, shard_mesh, replicate_mesh = grid, grid["shard"], grid["replicate"]
        if cfg.ddp:
            shard_mesh = None  # DMuon replicates; FSDP2 (1 shard) all-reduces the rest
    else:
        fsdp_mesh = shard_mesh = init_device_mesh(cfg.device, (world_size,))
        replicate_mesh = None
    expert_mesh = None
    if cfg.ep > 1:  # torchtitan's layout: the expert mesh inside the data-parallel ranks
        expert_mesh = init_device_mesh(
            cfg.device, (world_size // cfg.ep, cfg.ep), mesh_dim_names=("efsdp", "ep")
        )["ep"]
    ctx = torch.device("meta") if cfg.meta_init else torch.device(cfg.device)
    with ctx:
        model = MODELS[cfg.model](vocab=cfg.vocab).to(cfg.param_dtype)
    dmuon.dedicate_params(
        model,
        shard_mesh,
        PREDICATES.get(cfg.model, dedicated_predicate),
        hook_boundary_predicate=BOUNDARIES.get(cfg.model),
        reshard_after_forward=cfg.reshard_after_forward,
        replicate_mesh=replicate_mesh,
        replicate_async=cfg.replicate_async,
        small_param_numel=cfg.small_param_numel,
        ns_algorithm=cfg.ns_algorithm,
        collectives=cfg.collectives,
        expert_mesh=expert_mesh,
        tp_mesh=tp_mesh,
        tp_ns=cfg.tp_ns,
    )
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    if expert_mesh is not None:
        for layer in model.layers:
            layer.moe.experts.ep_group = expert_mesh.get_group()
            if tp_mesh is not None:  # (each tp rank routes its share of the tokens)
                layer.moe.tp_group = tp_mesh.get_group()
    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    if cfg.compile_backend is not None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=cfg.compile_backend, fullgraph=True)
        assert dmuon.move_hooks_outside_compile(model) == len(model.layers)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mixed_precision
        else MixedPrecisionPolicy()
    )
    if cfg.model == "tied":  # torchtitan's wrapping: embedding and head in groups of their own
        fully_shard(model.tok_embeddings, mesh=fsdp_mesh, mp_policy=mp)
        fully_shard([model.norm, model.output], mesh=fsdp_mesh, mp_policy=mp)
    for layer in model.layers:
        experts = getattr(getattr(layer, "moe", None), "experts", ())
        for expert in experts if isinstance(experts, nn.ModuleList) else ():
            fully_shard(expert, mesh=fsdp_mesh, mp_policy=mp)  # the seed's MoE wrapping
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
    if cfg.optimizer_first:
        optimizer = build_optimizer(cfg, model)
    if cfg.meta_init:
        model.to_empty(device=cfg.device)
    model.init_weights()
    if not cfg.optimizer_first:
        optimizer = build_optimizer(cfg, model)
    return model, optimizer


def build_optimizer(cfg: RunConfig, model, qk_clip_group=None) -> dmuon.Muon:
    """DMuon for ``cfg``, with its QK-clip when ``cfg.qk_clip`` (``qk_clip_group``: the ranks
    whose maxima it combines, None: all; given, a model part without attention is served
    empty, as a pipeline stage may be)."""
    optimizer = dmuon.Muon(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        ns_dtype=cfg.ns_dtype,
        ns_algorithm=cfg.ns_algorithm,
        ns_coefficients=cfg.ns_coefficients,
        ns_preconditioner=cfg.ns_preconditioner,
        adjust_lr_fn=cfg.adjust_lr_fn,
        adamw_lr=cfg.adamw_lr,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-8,
        adamw_weight_decay=cfg.weight_decay,
        cuda_graph=cfg.cuda_graph,
        async_step=cfg.async_step,
    )
    if cfg.qk_clip is not None:
        # (the optimizer's update hook holds it)
        dmuon.QKClip(
            model,
            optimizer,
            cfg.qk_clip,
            process_group=qk_clip_group,
            allow_empty=qk_clip_group is not None,
        )
    return optimizer


def local_slice(cfg: RunConfig, tokens: torch.Tensor, rank: int, world_size: int):
    per_rank = cfg.batch // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank].to(cfg.device)


def train_step(cfg: RunConfig, model, optimizer, step: int, rank: int, world_size: int) -> None:
    tokens = local_slice(cfg, batch(cfg, step), *data_rank(cfg, rank, world_size))
    chunks = tokens.chunk(cfg.micro_batches)
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        with contextlib.nullcontext() if last else dmuon.no_sync(model):
            (loss_fn(model(chunk), chunk) / len(chunks)).backward()
    if cfg.max_norm is not None:
        dmuon.clip_grad_norm_(model, cfg.max_norm, defer_owned=cfg.defer_clip)
    optimizer.step()
    optimizer.zero_grad()


def train_dmuon(rank: int, world_size: int, cfg: RunConfig) -> dict:
    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(cfg.steps):
        train_step(cfg, model, optimizer, step, rank, world_size)
    return {
        "weights": dmuon.get_model_state_dict(model),
        "plan": dmuon.summarize_plan(model),
    }


def train_dmuon_logged(rank: int, world_size: int, cfg: RunConfig):
    """``train_dmuon`` that also returns, per DMuon process group, (its ranks, every collective
    this rank issued on it) for the whole run."""
    model, optimizer = build_dmuon(cfg, world_size)
    comm = model._dmuon_state.comm
    comm.log = []
    calls: dict[str, int] = {}  # forward calls per module of interest (training forwards)
    for name, module in model.named_modules():
        name = dmuon.api.clean_fqn(name)
        if name.endswith((".branch", ".o_proj")) or ".experts." in name:
            calls[name] = 0
            module.register_forward_pre_hook(
                lambda m, a, name=name: (
                    calls.__setitem__(name, calls[name] + 1) if torch.is_grad_enabled() else None
                )
            )
    for step in range(cfg.steps):
        train_step(cfg, model, optimizer, step, rank, world_size)
    logs = {"calls": calls}
    for kind, group in comm.groups.items():
        if group is not None:
            entries = [e for e in comm.log if e[0] == kind]
            logs[kind] = (tuple(dist.get_process_group_ranks(group)), entries)
    return dmuon.get_model_state_dict(model), logs


def parity_suite(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """Several configurations in one process group (process start-up is the slow part)."""
    results = []
    for cfg in configs:
        weights = train_dmuon(rank, world_size, cfg)["weights"]
        results.append(weights if rank == 0 else None)
        dist.barrier()
    return results


def with_(cfg: RunConfig, **changes) -> RunConfig:
    return replace(cfg, **changes)
