"""QK-clip (MuonClip): the math against logits written out, and DMuon with the clip on gloo
ranks against the single-process reference (``torch.optim.Muon`` + AdamW, then the clip
written plainly: ``training.plain_qk_clip_``) at a threshold every step clips."""

import math

import pytest
import torch
import torch.distributed as dist

import dmuon_titan as dmuon
from dmuon_titan.ops import qk_clip as ops

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.training import (
    RunConfig,
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


def _clipped_run(rank, world_size, cfg):
    model, optimizer = build_dmuon(cfg, world_size)
    (clip,) = [h.__self__ for h in optimizer._update_hooks]
    counts = []
    for step in range(cfg.steps):
        train_step(cfg, model, optimizer, step, rank, world_size)
        counts.append(int(clip.clipped_heads))
    return {"weights": dmuon.get_model_state_dict(model), "clipped": counts}


def _clipped_suite(rank, world_size, configs):
    out = []
    for cfg in configs:
        out.append(_clipped_run(rank, world_size, cfg))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def clip_reference():
    return train_reference(CLIP), train_reference(with_(CLIP, qk_clip=None)), initial_state(CLIP)


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
        (4, [with_(CLIP, replicate=2)]),
    ],
    ids=["one_rank", "fsdp2_z3_z2_accumulated", "fsdp3", "hsdp2x2"],
)
def test_qk_clip_equals_the_reference(clip_reference, world_size, configs):
    reference, unclipped, init = clip_reference
    # (the clip changes the run: the comparison is not of two unclipped runs)
    assert max(relative_errors(unclipped, reference, init).values()) > 1e-3
    results = run_ranks(_clipped_suite, world_size, configs, timeout=300)
    for i, (cfg, result) in enumerate(zip(configs, results[0], strict=True)):
        assert all(c > 0 for c in result["clipped"]), result["clipped"]
        assert [r[i]["clipped"] for r in results] == [result["clipped"]] * world_size
        errors = relative_errors(result["weights"], reference, init)
        assert max(errors.values()) <= 1e-10, (cfg, sorted(errors.items(), key=lambda e: -e[1])[:3])


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
