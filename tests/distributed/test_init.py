"""Initialization of dedicated matrices under ``dmuon.independent_init``: with every rank
seeded alike (as torchtitan seeds them), each matrix's initial value depends on its name and
the seed only — the same at any world size, and no two matrices (or experts of a stack)
alike. Without it, owners that reach their matrices at the same point of their streams give
them the same values (the bug the context fixes; shown here so the test can fail)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon_titan as dmuon
from tests.helpers.harness import run_ranks
from tests.helpers.models import (
    GroupedMoETransformer,
    ToyTransformer,
    dedicated_predicate,
    grouped_moe_predicate,
)

MODELS = {
    "toy": (ToyTransformer, dedicated_predicate),
    "moe": (GroupedMoETransformer, grouped_moe_predicate),
}


def init_like_torchtitan(model: nn.Module) -> None:
    """Every rank seeded alike, then each matrix drawn from the local stream in module order
    (torchtitan's init_weights: trunc_normal_ on Linear weights and expert stacks); the
    FSDP2 parameters are filled with ones (their randomness is DTensor's, not at issue)."""
    torch.manual_seed(1234)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if isinstance(p, DTensor):
                p.to_local().fill_(1.0)
            elif p.ndim >= 2:
                nn.init.trunc_normal_(p, std=0.02)


def initial_weights(rank: int, world_size: int, independent: bool) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, (cls, predicate) in MODELS.items():
        with torch.device("meta"):
            model = cls(vocab=64)
        dmuon.dedicate_params(model, mesh, predicate, small_param_numel=0)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with dmuon.independent_init(model) if independent else contextlib.nullcontext():
            init_like_torchtitan(model)
        dedicated = {p.fqn for p in model._dmuon_state.params}
        full = dmuon.get_model_state_dict(model)
        out[name] = {k: v for k, v in full.items() if k in dedicated}
    return out if rank == 0 else None


def _alike(weights: dict[str, torch.Tensor]) -> list:
    """Pairs of equal matrices (expert slices of stacks counted as matrices)."""
    matrices = []
    for k, v in weights.items():
        matrices += [(f"{k}[{e}]", v[e]) for e in range(v.shape[0])] if v.ndim == 3 else [(k, v)]
    return [
        (a, b)
        for i, (a, x) in enumerate(matrices)
        for b, y in matrices[i + 1 :]
        if x.shape == y.shape and torch.equal(x, y)
    ]


def test_independent_init_does_not_depend_on_owners_or_world_size():
    by_world = {n: run_ranks(initial_weights, n, True)[0] for n in (1, 2, 3)}
    for name in MODELS:
        one = by_world[1][name]
        assert len(one) >= 12 and _alike(one) == [], name
        for n in (2, 3):
            assert sorted(by_world[n][name]) == sorted(one)
            for k, v in one.items():
                assert torch.equal(by_world[n][name][k], v), (name, n, k)
            assert 0.015 < torch.cat([v.flatten() for v in one.values()]).std() < 0.025


def test_without_it_owners_at_the_same_stream_point_init_alike():
    """The two ranks' pieces of each expert stack start at the same point of their streams:
    experts 2-3 come out equal to experts 0-1."""
    weights = run_ranks(initial_weights, 2, False)[0]
    alike = _alike(weights["moe"])
    assert ("layers.0.moe.experts.w1[0]", "layers.0.moe.experts.w1[2]") in alike, alike
