"""On one GPU: the captured Muon step (``Muon(cuda_graph=True)``, DMuon's direct path).

Skipped cleanly without CUDA; run on one H200 (result in docs/benchmarks.md)."""

import pytest
import torch

import dmuon_titan as dmuon

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def graph_and_eager(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    out = []
    for cfg in configs:
        model, optimizer = build_dmuon(cfg, world_size)
        for step in range(cfg.steps):
            train_step(cfg, model, optimizer, step, rank, world_size)
        record = optimizer.step_graph
        out.append(
            {
                "weights": dmuon.get_model_state_dict(model),  # (FSDP2's DTensors made whole)
                "direct": model._dmuon_state.direct,
                "captures": record.captures,
                "replays": record.replays,
                "disabled": record.disabled,
            }
        )
    return out


def test_captured_step_equals_the_reference_and_the_eager_step():
    """float64 on one GPU, 5 steps, Z3 and a tall/wide/square mix (the toy): with the graph
    (captured once after the first step, replayed for the other four) the weights equal the
    single-process reference within 1e-10 of the weight change, and the eager step's within
    1e-12."""
    exact = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64, device="cuda")
    graph, eager = run_ranks(
        graph_and_eager, 1, [exact, with_(exact, cuda_graph=False)], backend="nccl"
    )[0]
    assert graph["direct"] and graph["captures"] == 1 and graph["replays"] == 4
    assert not graph["disabled"] and eager["replays"] == 0
    init = initial_state(exact)
    reference = train_reference(exact)
    assert max(relative_errors(graph["weights"], reference, init).values()) <= 1e-10
    assert max(relative_errors(graph["weights"], eager["weights"], init).values()) <= 1e-12
