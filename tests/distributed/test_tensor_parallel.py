"""Tensor parallelism: DMuon's owners over data-parallel × tensor-parallel ranks, the blocks
under torch's ColwiseParallel/RowwiseParallel plan, on gloo ranks. float64 parity with the
single-process torch.optim.Muon + AdamW reference; every matrix orthogonalized whole, by one
rank; the bytes each phase moved equal summarize_plan's formula."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import relative_errors
from tests.helpers.harness import run_ranks
from tests.helpers.scenarios import resume_load, resume_save
from tests.helpers.tensor_parallel import tp_refusals, train_tp_counted
from tests.helpers.training import TP_PLAN, RunConfig, initial_state, train_reference, with_

EXACT = RunConfig(steps=5, param_dtype=torch.float64, ns_dtype=torch.float64, tp=2)
#: (name, config); each config's weights must equal the reference within 1e-10
SUITES = {
    # dp 2 x tp 2
    4: [
        ("z3", EXACT),
        ("z2", with_(EXACT, reshard_after_forward=False)),
        ("z3+ac+clip", with_(EXACT, activation_checkpointing=True, max_norm=0.05)),
        (
            "z2+no_sync+gather",
            with_(EXACT, reshard_after_forward=False, micro_batches=2, collectives="gather"),
        ),
        # dp 1 x tp 4
        ("tp4-z3", with_(EXACT, tp=4, model="toy_mha")),
        ("tp4-z2", with_(EXACT, tp=4, model="toy_mha", reshard_after_forward=False)),
        # Newton–Schulz shared by each owner's tp row
        ("shared-z3", with_(EXACT, tp_ns="shared")),
        (
            "shared-z2+clip",
            with_(EXACT, tp_ns="shared", reshard_after_forward=False, max_norm=0.05),
        ),
        ("tp4-shared-z3", with_(EXACT, tp=4, model="toy_mha", tp_ns="shared")),
        ("shared-aol-z3", with_(EXACT, tp_ns="shared", ns_preconditioner="aol")),
    ],
    # replicate 2 x shard 2 x tp 2
    8: [
        ("hsdp-z3", with_(EXACT, replicate=2)),
        ("hsdp-z2+clip", with_(EXACT, replicate=2, reshard_after_forward=False, max_norm=0.05)),
        ("hsdp-shared-z3", with_(EXACT, replicate=2, tp_ns="shared")),
    ],
}


def _max_error(weights, reference) -> float:
    assert sorted(weights) == sorted(reference)
    return max(
        ((weights[k].to(ref.dtype) - ref).abs().max() / max(1.0, ref.abs().max())).item()
        for k, ref in reference.items()
    )


@pytest.mark.parametrize("world", sorted(SUITES))
def test_tensor_parallel_equals_single_process_reference(world):
    """5 steps each: weights within 1e-10 of the reference; every step, every matrix ran
    Newton–Schulz on exactly one rank of the world (on its whole matrix: the owner's is the
    only whole copy), or with ``tp_ns="shared"`` on the T ranks of its owner's row and on no
    other (each on a column block); colwise/rowwise placements as the plan says; the bytes
    every phase moved, averaged over the ranks, equal ``summarize_plan``'s formula, and the
    tensor-parallel exchange is one all-to-all per step each way."""
    suite = SUITES[world]
    results = run_ranks(train_tp_counted, world, [cfg for _, cfg in suite], timeout=600)
    for i, (name, cfg) in enumerate(suite):
        runs = [r[i] for r in results]
        error = _max_error(runs[0]["weights"], train_reference(cfg))
        assert error <= 1e-10, (name, error)
        for run in runs[1:]:  # every rank reports the same full weights
            assert all(torch.equal(run["weights"][k], v) for k, v in runs[0]["weights"].items())
        summary = runs[0]["summary"]
        shared = cfg.tp_ns == "shared"
        assert all(p["shared_ns"] == shared for p in summary["params"]), name
        # each once, somewhere; shared: by the tp ranks of its owner's row
        matrices = sorted(
            p["fqn"] for p in summary["params"] for _ in range(cfg.tp if shared else 1)
        )
        for step in range(cfg.steps):
            ran = sorted(f for run in runs for f in run["orthogonalized"][step])
            assert ran == matrices, (name, step)
            if shared:
                for rank, run in enumerate(runs):
                    row = rank // cfg.tp
                    mine = {p["fqn"] for p in summary["params"] if p["owner"] // cfg.tp == row}
                    assert set(run["orthogonalized"][step]) == mine, (name, step, rank)
        for fqn, dim in runs[0]["tp_placements"].items():
            style = TP_PLAN[fqn.split(".", 2)[2].rsplit(".", 1)[0]]
            assert dim == {"colwise": 0, "rowwise": 1}[style], (name, fqn)
        predicted = summary["bytes_per_rank_per_step"]
        phases = {  # measured phase -> summarize_plan's key
            "forward": "forward_broadcast",
            "backward_unshard": "backward_rebroadcast",
            "reduce": "reduce",
            "reduce_replicate": "reduce_replicate",
            "replicate_broadcast": "replicate_broadcast",
            "tp_gather": "tp_gather",
            "tp_scatter": "tp_scatter",
            "tp_ns": "tp_ns",
        }
        for phase, key in phases.items():
            measured = sum(run["moved"].get(phase, 0.0) for run in runs) / world
            expected = predicted[key]
            if phase in ("forward", "backward_unshard"):  # once per micro-batch (no_sync)
                expected *= cfg.micro_batches
            assert measured == pytest.approx(expected, rel=1e-12, abs=1e-9), (name, phase)
        assert predicted["tp_gather"] > 0 and predicted["tp_scatter"] > 0
        assert (predicted["tp_ns"] > 0) == shared, name
        for run in runs:
            assert run["ops"]["tp_gather"] == run["ops"]["tp_scatter"] == 1, name


def test_full_state_dicts_move_between_tensor_parallel_layouts():
    """Full model and optimizer state dicts saved on dp 2 x tp 2 after 3 steps load on 3
    ranks without TP and on dp 1 x tp 2: re-exported, they are bit-identical to what was
    saved, and both continuations end where the uninterrupted run ends (within 1e-12 of the
    weight change: Newton–Schulz batches differ by layout)."""
    cfg, at = EXACT, 3
    saved = run_ranks(resume_save, 4, cfg, at)[0]
    momentum = [k for k, v in saved["optim"]["state"].items() if "momentum_buffer" in v]
    assert len(momentum) == 21
    init = initial_state(cfg)
    for world, layout in ((3, with_(cfg, tp=1)), (2, cfg)):
        loaded = run_ranks(resume_load, world, layout, saved, at)[0]
        for k, v in saved["model"].items():
            assert torch.equal(loaded["model"][k], v), (world, k)
        for k, v in saved["optim"]["state"].items():
            for name, t in v.items():
                assert torch.equal(loaded["optim"]["state"][k][name], t), (world, k, name)
        errors = relative_errors(loaded["final"], saved["final"], init)
        assert max(errors.values()) <= 1e-12, world


def test_tensor_parallel_mistakes_are_refused_naming_the_parameter():
    """On dp 1 x tp 2: tensor parallelism without tp_mesh, a dedicated matrix replicated by
    a style, one left out of the plan, and one whose sharded dim the degree does not divide
    each raise one ValueError naming the parameter and the fix, on every rank."""
    results = run_ranks(tp_refusals, 2)
    assert results[0] == results[1]
    messages = results[0]
    expected = {
        "no tp_mesh": ("'layers.0.attention.wq.weight'", "pass tp_mesh="),
        "replicated": ("'layers.0.attention.wq.weight'", "Shard(0) (colwise) or Shard(1)"),
        "not in the plan": ("'layers.0.attention.wq.weight' was not tensor-parallelized",),
        "indivisible": ("'layers.0.weight'", "not divisible by the tensor-parallel degree 2"),
    }
    assert sorted(messages) == sorted(expected)
    for name, parts in expected.items():
        for part in parts:
            assert part in messages[name], (name, messages[name])
        assert "\n" not in messages[name]
