"""DMuon under pipeline parallelism (torch.distributed.pipelining) on gloo ranks: each
stage's part dedicates its own matrices over its data-parallel mesh; float64 parity with the
single-process torch.optim.Muon + AdamW reference of the whole model and batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import run_ranks
from tests.helpers.pipeline import PipelineConfig, train_pipelined
from tests.helpers.training import RunConfig, train_reference

CFG = RunConfig(steps=5, batch=24, param_dtype=torch.float64, ns_dtype=torch.float64, model="toy4")


def _merged(results) -> dict:
    weights = {}
    for r in results:
        if r["weights"] is not None:
            weights.update(r["weights"])
    return weights


def _check(weights, reference, tol=1e-10):
    assert sorted(weights) == sorted(reference)
    for k, ref in reference.items():
        err = (weights[k].to(ref.dtype) - ref).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), (k, err)


@pytest.mark.parametrize(
    "world,pcfg",
    [
        (4, PipelineConfig(pp=2, schedule="1F1B")),
        (4, PipelineConfig(pp=2, schedule="Interleaved1F1B", stages_per_rank=2)),
        (4, PipelineConfig(pp=2, schedule="LoopedBFS", stages_per_rank=2)),
        (3, PipelineConfig(pp=3, schedule="GPipe", n_layers=3, micro_batches=2)),
        (3, PipelineConfig(pp=1, schedule="1F1B", micro_batches=2)),
    ],
    ids=[
        "pp2xdp2-1F1B",
        "pp2xdp2-Interleaved1F1B",
        "pp2xdp2-LoopedBFS",
        "pp3-GPipe",
        "pp1xdp3-1F1B",
    ],
)
def test_pipeline_equals_single_process_reference(world, pcfg):
    """5 steps with microbatches: the weights of every stage equal the reference's within
    1e-10; on each data-parallel group each boundary's weights came in once per step (one
    broadcast per bucket) and its gradients left once per step (one reduce per bucket),
    whatever the number of microbatches."""
    cfg = RunConfig(**{**CFG.__dict__, "model": {3: "toy", 4: "toy4"}[pcfg.n_layers]})
    results = run_ranks(train_pipelined, world, cfg, pcfg)
    _check(_merged(results), train_reference(cfg))
    dp = world // pcfg.pp
    for r in results:
        assert r["direct"] == [dp == 1] * pcfg.stages_per_rank
        for stage, log in r["logs"].items():
            phases = [e[2] for e in log if e[2] != "state_dict"]  # (the final full weights)
            buckets = r["buckets"][stage]
            if dp == 1:  # direct: the modules hold the masters, nothing moves
                assert phases == []
                continue
            # Once per step each, whatever the microbatches: the weights in, the gradients out
            # (+1: the first step's one gather of the recorded forward orders; torch <= 2.12
            # first infers the stages' shapes by a forward without gradients: one more set).
            once = cfg.steps * buckets
            assert phases.count("reduce") == once, phases
            assert phases.count("forward") in (once, once + buckets), phases
            assert len(phases) == phases.count("forward") + once + 1, phases


def test_pipeline_stage_without_muon_matrix_and_clipping():
    """pp 2 x dp 2, the first stage holding only the embedding (no Muon matrix: no DMuon
    state, AdamW alone), the second everything else; gradients clipped by the global norm
    over both stages (``pp_mesh``), active at every step: the weights equal the reference's
    (clipped by torch) within 1e-10, and every rank reports the same norms."""
    pcfg = PipelineConfig(
        pp=2,
        schedule="1F1B",
        n_layers=2,
        stage_modules=(("tok_embeddings",), ("layers.0", "layers.1", "norm", "output")),
        max_norm=0.05,
    )
    cfg = RunConfig(**{**CFG.__dict__, "max_norm": 0.05, "model": "toy2"})
    results = run_ranks(train_pipelined, 4, cfg, pcfg)
    assert [bool(r["buckets"]) for r in results] == [False, False, True, True]  # (pp, dp) ranks
    _check(_merged(results), train_reference(cfg))
    norms = {tuple(r["norms"]) for r in results}
    assert len(norms) == 1 and min(norms.pop()) > 0.05


def test_zero_bubble_schedules_are_refused():
    from torch.distributed.pipelining.schedules import get_schedule_class

    import dmuon_titan as dmuon

    for name in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"):
        with pytest.raises(ValueError, match="splits backward into input and weight"):
            dmuon.check_pipeline_schedule(get_schedule_class(name))
    for name in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"):
        dmuon.check_pipeline_schedule(get_schedule_class(name))
