"""QK-clip (MuonClip): the math against logits written out, and DMuon with the clip on gloo
ranks against the single-process reference (``torch.optim.Muon`` + AdamW, then the clip
written plainly: ``training.plain_qk_clip_``) at a threshold every step clips."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

import dmuon_titan as dmuon
from dmuon_titan.ops import qk_clip as ops

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.pipeline import PipelineConfig, stage_modules, train_pipelined
from ..helpers.training import (
    RunConfig,
    batch,
    build_dmuon,
    initial_state,
    train_reference,
    train_step,
    with_,
)

#: the toy's largest logits start near 0.5 and grow past 1 under this learning rate: a
#: threshold of 0.4 clips heads at every step
CLIP = RunConfig(
    steps=5,
    lr=0.2,
    param_dtype=torch.float64,
    ns_dtype=torch.float64,
    qk_clip=0.4,
)


def _explicit_maxima(q, k, causal, scale):
    heads, kv = q.shape[1], k.shape[1]
    out = []
    for h in range(heads):
        logits = q[:, h] @ k[:, h // (heads // kv)].transpose(-1, -2) * scale
        if causal:
            n_q, n_k = logits.shape[-2:]
            seen = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
            logits = logits[:, seen]
        out.append(logits.max())
    return torch.stack(out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads, n_q, n_k, chunk", [(4, 9, 9, 4), (2, 9, 9, 256), (1, 5, 7, 2)])
def test_max_logits_equal_the_logits_written_out(causal, kv_heads, n_q, n_k, chunk):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, n_q, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, kv_heads, n_k, 8, generator=g, dtype=torch.float64)
    found = ops.max_logits(q, k, causal=causal, scale=0.3, query_chunk=chunk)
    assert found.dtype == torch.float64
    assert torch.allclose(found, _explicit_maxima(q, k, causal, 0.3), rtol=1e-14, atol=0)


def test_after_the_clip_every_heads_logit_is_at_most_the_threshold():
    """Grouped-query attention (2 query heads per key head), with each rescale applied to
    the projections: on the same inputs, no head's maximum exceeds τ, and a head under τ
    whose key head's group clipped still moves only downwards."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 16, generator=g, dtype=torch.float64)
    wq = torch.randn(4 * 8, 16, generator=g, dtype=torch.float64)
    wk = torch.randn(2 * 8, 16, generator=g, dtype=torch.float64)

    def maxima():
        q = (x @ wq.T).view(2, 12, 4, 8).transpose(1, 2)
        k = (x @ wk.T).view(2, 12, 2, 8).transpose(1, 2)
        return ops.max_logits(q, k)

    before = maxima()
    tau = float(before.sort().values[1])  # (two heads above τ, two at or under it)
    q_scale, k_scale = ops.query_key_scales(ops.head_scales(before, tau), 2)
    ops.scale_head_rows_(wq, q_scale)
    ops.scale_head_rows_(wk, k_scale)
    after = maxima()
    assert (before > tau).sum() == 2
    assert torch.all(after <= tau * (1 + 1e-12)), (before, after, tau)
    assert torch.all(after <= before.clamp(min=0) + 1e-12)


def test_head_scales():
    maxima = torch.tensor([-math.inf, 0.5, 2.0, 8.0], dtype=torch.float64)
    assert ops.head_scales(maxima, 2.0).tolist() == [1.0, 1.0, 1.0, 0.25]


#: the torch.distributed calls whose sequence every rank of a group must issue alike
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


@contextlib.contextmanager
def _recorded_collectives(log: list):
    """Append (group's ranks, call, elements, dtype, reduce op) of every collective issued
    inside."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recording(name):
        def call(tensor, *args, **kwargs):
            op = kwargs.get("op", args[0] if name == "all_reduce" and args else None)
            group = kwargs.get("group")
            ranks = tuple(
                dist.get_process_group_ranks(group) if group else range(dist.get_world_size())
            )
            numel = None if name == "all_to_all_single" else tensor.numel()  # (uneven splits)
            log.append((ranks, name, numel, str(tensor.dtype), str(op)))
            return originals[name](tensor, *args, **kwargs)

        return call

    try:
        for name in COLLECTIVES:
            setattr(dist, name, recording(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _clipped_run(rank, world_size, cfg):
    model, optimizer = build_dmuon(cfg, world_size)
    (clip,) = [h.__self__ for h in optimizer._update_hooks]
    counts, issued = [], []
    with _recorded_collectives(issued):
        for step in range(cfg.steps):
            train_step(cfg, model, optimizer, step, rank, world_size)
            counts.append(clip.figures()[1])
    return {"weights": dmuon.get_model_state_dict(model), "clipped": counts, "issued": issued}


def _clipped_suite(rank, world_size, configs):
    out = []
    for cfg in configs:
        out.append(_clipped_run(rank, world_size, cfg))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def clip_reference():
    """model name -> (the reference with the clip, without it, the initial weights)."""
    cache = {}

    def reference(model: str):
        if model not in cache:
            cfg = with_(CLIP, model=model)
            clipped, unclipped = train_reference(cfg), train_reference(with_(cfg, qk_clip=None))
            cache[model] = clipped, unclipped, initial_state(cfg)
        return cache[model]

    return reference


@pytest.mark.parametrize(
    "world_size, configs",
    [
        (1, [CLIP]),
        (
            2,
            [
                CLIP,
                with_(CLIP, reshard_after_forward=False),
                with_(CLIP, micro_batches=2, activation_checkpointing=True),
            ],
        ),
        (3, [CLIP]),
        (4, [with_(CLIP, replicate=2), with_(CLIP, tp=2)]),
        (2, [with_(CLIP, model="mla"), with_(CLIP, model="mla", micro_batches=2)]),
        (3, [with_(CLIP, model="mla", reshard_after_forward=False)]),
    ],
    ids=["one_rank", "fsdp2_z3_z2_accumulated", "fsdp3", "hsdp2x2_tp2xdp2", "mla2", "mla3_z2"],
)
def test_qk_clip_equals_the_reference(clip_reference, world_size, configs):
    """Also: the ranks of every process group issue the same sequence of collectives on it,
    the clip's MAX of every head's maximum (4 heads a layer, float64) once a step over all
    ranks among them. tp 2 x dp 2: each rank's kernel sees 2 of the 4 query heads and 1 of
    the 2 key heads (grouped-query). mla: deepseek_v3's latent attention, a block with wq
    and one with wq_a/q_norm/wq_b, a softmax scale of its own (the reference:
    ``training._plain_latent_clip_``)."""
    reference, unclipped, init = clip_reference(configs[0].model)
    # (the clip changes the run: the comparison is not of two unclipped runs)
    assert max(relative_errors(unclipped, reference, init).values()) > 1e-3
    results = run_ranks(_clipped_suite, world_size, configs, timeout=300)
    heads = 4 * sum(k.endswith("wo.weight") for k in init)  # (4 query heads a layer)
    clip_max = ("all_reduce", heads, "torch.float64", str(dist.ReduceOp.MAX))
    for i, (cfg, result) in enumerate(zip(configs, results[0], strict=True)):
        assert all(c > 0 for c in result["clipped"]), result["clipped"]
        assert [r[i]["clipped"] for r in results] == [result["clipped"]] * world_size
        issued = [r[i]["issued"] for r in results]
        for group in {entry[0] for log in issued for entry in log}:
            per_rank = [[e for e in issued[rank] if e[0] == group] for rank in group]
            assert per_rank == [per_rank[0]] * len(group), group
        everyone = tuple(range(world_size))
        assert issued[0].count((everyone, *clip_max)) == cfg.steps, issued[0]
        errors = relative_errors(result["weights"], reference, init)
        assert max(errors.values()) <= 1e-10, (cfg, sorted(errors.items(), key=lambda e: -e[1])[:3])


def _clipped_pipelined(rank, world_size, cfg, pcfg):
    issued = []
    with _recorded_collectives(issued):
        result = train_pipelined(rank, world_size, cfg, pcfg)
    return {**result, "issued": issued}


@pytest.mark.parametrize(
    "pcfg",
    [PipelineConfig(pp=2), PipelineConfig(pp=2, schedule="Interleaved1F1B", stages_per_rank=2)],
    ids=["pp2xdp2-1F1B", "pp2xdp2-Interleaved1F1B"],
)
def test_qk_clip_under_pipeline_parallelism(pcfg):
    """4 layers cut into 2 or 4 stages on pp 2 x dp 2, 4 microbatches a step: each stage's
    maxima are combined over its data-parallel ranks alone (one float64 MAX of its layers'
    heads per stage and step) and its owners clip; the weights of every stage equal the
    single-process reference with the clip within 1e-10 after 5 steps, and every process
    group's collectives are issued alike by its ranks."""
    cfg = with_(CLIP, model="toy4")
    reference, init = train_reference(cfg), initial_state(cfg)
    assert (
        max(relative_errors(train_reference(with_(cfg, qk_clip=None)), reference, init).values())
        > 1e-3
    )
    results = run_ranks(_clipped_pipelined, 4, cfg, pcfg, timeout=300)
    weights = {}
    for r in results:
        weights.update(r["weights"] or {})
    errors = relative_errors(weights, reference, init)
    assert max(errors.values()) <= 1e-10, sorted(errors.items(), key=lambda e: -e[1])[:3]
    issued = [r["issued"] for r in results]
    for group in {entry[0] for log in issued for entry in log}:
        per_rank = [[e for e in issued[rank] if e[0] == group] for rank in group]
        assert per_rank == [per_rank[0]] * len(group), group
    modules = stage_modules(pcfg)
    for rank, log in enumerate(issued):
        pp_rank, stage_ranks = rank // 2, (rank // 2 * 2, rank // 2 * 2 + 1)
        mine = modules[pp_rank :: pcfg.pp]
        layers = [sum(m.startswith("layers.") for m in part) for part in mine]
        clip_maxima = [
            e
            for e in log
            if e[1:] and e[1] == "all_reduce" and e[3:] == ("torch.float64", str(dist.ReduceOp.MAX))
        ]
        assert {e[0] for e in clip_maxima} == {stage_ranks}
        assert sorted(e[2] for e in clip_maxima) == sorted(
            4 * n for n in layers for _ in range(cfg.steps)
        )


class _Kernel(torch.nn.Module):
    def forward(self, q, k, v):
        return v


class _Attention(torch.nn.Module):
    def __init__(self, norms=False, bias=False, heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, 1, 4
        self.wq = torch.nn.Linear(8, 8, bias=bias)
        self.wk = torch.nn.Linear(8, 4, bias=False)
        self.inner_attention = _Kernel()
        if norms:
            self.q_norm, self.k_norm = torch.nn.RMSNorm(4), torch.nn.RMSNorm(4)


class _Stub:
    def register_update_hook(self, hook):
        self.hook = hook


@pytest.mark.parametrize(
    "attention, message",
    [
        (_Attention(norms=True), "query/key norms"),
        (_Attention(bias=True), "biases"),
        (_Attention(heads=None), "n_heads"),
        (torch.nn.Linear(2, 2), "no attention module"),
    ],
)
def test_what_the_clip_does_not_serve_is_one_line(attention, message):
    with pytest.raises(ValueError, match=message) as err:
        dmuon.QKClip(torch.nn.Sequential(attention), _Stub(), 1.0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("threshold, alpha", [(0.0, 0.5), (math.inf, 0.5), (1.0, 1.5)])
def test_bad_clip_options_are_one_line(threshold, alpha):
    with pytest.raises(ValueError, match="threshold|alpha"):
        dmuon.QKClip(torch.nn.Sequential(_Attention()), _Stub(), threshold, alpha=alpha)


@pytest.mark.parametrize(
    "tp_dim, heads, kv_heads, message",
    [
        (None, 4, 2, "build QKClip after parallelize_module"),
        (1, 4, 2, "rowwise"),
        (0, 4, 1, "does not divide its 4 query and 1 key heads"),
        (0, 4, 2, None),
    ],
)
def test_tensor_parallel_layouts_served_or_one_line(tp_dim, heads, kv_heads, message):
    """Colwise wq/wk whose heads the degree divides are served; the rest is named."""
    from types import SimpleNamespace

    from dmuon_titan.qk_clip import _tensor_parallel_problem

    owner = SimpleNamespace(tp_dim=tp_dim, tp_size=2)
    problem = _tensor_parallel_problem("wk", owner, heads, kv_heads)
    assert problem is None if message is None else message in problem


@pytest.mark.parametrize("world, balanced", [(2, True), (3, True), (2, False), (4, True)])
def test_context_parallel_maxima_are_the_whole_sequences(world, balanced):
    """Each context-parallel rank's rows (torch's head-tail load balancer when balanced,
    contiguous slices otherwise) against every rank's keys in rank order: the maximum over
    the ranks equals the whole sequence's causal maximum, with GQA; a key seen past its
    place (keys growing along the sequence) would win."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    g = torch.Generator().manual_seed(0)
    seq = 24 * world
    q = torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64).abs()
    k = torch.randn(2, 2, seq, 8, generator=g, dtype=torch.float64).abs()
    k = k * torch.linspace(1, 4, seq, dtype=torch.float64)[:, None]
    expected = ops.max_logits(q, k, causal=True, scale=0.3)
    if balanced:
        order = _HeadTailLoadBalancer(seq, world, "cpu")._generate_indices()[0]
        q_cp, k_cp = q[:, :, order], k[:, :, order]
    else:
        q_cp, k_cp = q, k
    per_rank = [
        ops.context_parallel_max_logits(
            q_cp.chunk(world, dim=2)[r],
            k_cp,
            rank=r,
            world=world,
            load_balanced=balanced,
            scale=0.3,
        )
        for r in range(world)
    ]
    assert torch.equal(torch.stack(per_rank).amax(0), expected)


def _context_parallel_run(rank, world_size, cfg):
    """DMuon with the clip on ``world_size`` context-parallel ranks, which are also the
    data-parallel ranks of the parameters (torchtitan's layout): torch's ring attention on
    each attention kernel, every sequence cut head-tail, the loss a global token mean."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    from dmuon_titan.toy.cpu import install_cp_cpu_shim

    install_cp_cpu_shim()
    _enable_context_parallel_dispatcher()
    _cp_options.convert_to_f32 = False  # (float64 stays float64 in the ring's merges)
    model, optimizer = build_dmuon(cfg, world_size)
    cp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for layer in model.layers:
        parallelize_module(
            layer.attention.inner_attention,
            cp_mesh,
            _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA),
        )
    balancer = _HeadTailLoadBalancer(cfg.seq, world_size, "cpu")
    issued = []
    with _recorded_collectives(issued):
        _context_parallel_steps(cfg, model, optimizer, cp_mesh, balancer, world_size)
    return {"weights": dmuon.get_model_state_dict(model), "issued": issued}


def _context_parallel_steps(cfg, model, optimizer, cp_mesh, balancer, world_size) -> None:
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard

    for step in range(cfg.steps):
        tokens = batch(cfg, step)
        labels = torch.full_like(tokens, -100)
        labels[:, :-1] = tokens[:, 1:]
        tokens, labels = _context_parallel_shard(cp_mesh, [tokens, labels], [1, 1], balancer)
        logits = model(tokens).to(torch.float64)
        total = labels.shape[0] * (cfg.seq - 1)  # (the global batch's predicted tokens)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum"
        )
        (loss * world_size / total).backward()  # (FSDP2 and DMuon average over the ranks)
        optimizer.step()
        optimizer.zero_grad()


def test_qk_clip_under_context_parallelism(clip_reference):
    """cp 2 (the sequence of 16 cut head-tail into 4 chunks of 4), float64, 5 steps at a
    threshold that clips every step: the weights equal the single-process reference with
    the clip written out within 1e-10 (each rank's query rows held against every rank's
    keys; the maximum over the ranks is the whole sequence's); both ranks issue the same
    collectives, the clip's float64 MAX once a step."""
    reference, unclipped, init = clip_reference("toy")
    results = run_ranks(_context_parallel_run, 2, CLIP, timeout=300)
    assert results[0]["issued"] == results[1]["issued"]
    heads = 4 * sum(k.endswith("wo.weight") for k in init)
    clip_max = ((0, 1), "all_reduce", heads, "torch.float64", str(dist.ReduceOp.MAX))
    assert results[0]["issued"].count(clip_max) == CLIP.steps, results[0]["issued"]
    errors = relative_errors(results[0]["weights"], reference, init)
    assert max(errors.values()) <= 1e-10, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_a_step_without_a_tracked_forward_clips_nothing():
    """The clip after a step whose forwards were not tracked (evaluation only) finds every
    head at −inf and leaves the weights as they are, MLA modules with wq_b included."""
    from ..helpers.models import LatentAttention

    model = torch.nn.ModuleDict({"a": LatentAttention(32, 4, q_lora_rank=12)}).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stub = _Stub()
    clip = dmuon.QKClip(model, stub, 0.1)
    stub.hook()
    assert clip.figures() == (-math.inf, 0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
