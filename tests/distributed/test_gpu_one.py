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


def test_shared_newton_schulz_in_bfloat16_on_the_gpu():
    """The math of a tensor-parallel row's shared Newton–Schulz (``tp_ns="shared"``; four
    ranks stood in for by threads) on CUDA in bf16, llama-like wide and tall shapes: its
    distance from float64 NS is within 1.25× the whole-matrix bf16 NS's (cuBLAS's rounding,
    which the CPU unit test does not see)."""
    from dmuon_titan import newton_schulz as ns

    from ..unit.test_shared_newton_schulz import shared_orthogonalize

    generator = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((1024, 4096), (2816, 1024)):
        matrix = torch.randn(shape, device="cuda", generator=generator)
        exact = ns.zeropower_via_newtonschulz(
            matrix.double(), (ns.JORDAN_COEFFICIENTS,), 5, 1e-7, dtype=torch.float64
        )
        whole = ns.zeropower_via_newtonschulz(matrix, (ns.JORDAN_COEFFICIENTS,), 5, 1e-7)
        shared, _ = shared_orthogonalize(matrix, 4, torch.bfloat16)
        whole_error = ((whole.double() - exact).norm() / exact.norm()).item()
        shared_error = ((shared.double() - exact).norm() / exact.norm()).item()
        assert shared_error <= 1.25 * whole_error, (shape, shared_error, whole_error)
