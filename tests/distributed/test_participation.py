"""Data-dependent participation: boundaries and matrices that run on some ranks only.

A dedicated matrix that gets a gradient on some ranks only (a branch taken by one rank's
samples), experts that get no tokens on a rank and are not called there at all (the seed's
MoE example: each expert its own hook boundary), a matrix no rank uses. Every rank must issue
the same collectives in the same order whatever its data did (counted here), and the result
must equal the single-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` reference (float64,
≤ 1e-10). A hang fails through the harness's timeout.
"""

import time

import pytest
import torch

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.scenarios import participation_suite, reuse_beyond_schedule
from ..helpers.training import RunConfig, initial_state, train_reference, with_

EXACT = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64)
BRANCH, MOE = with_(EXACT, model="branch"), with_(EXACT, model="moe")


def _fsdp_cases():
    cases = []
    for base in (BRANCH, MOE):
        for collectives in ("broadcast", "gather", "auto"):
            for z3 in (True, False):
                cases.append(with_(base, collectives=collectives, reshard_after_forward=z3))
    cases += [
        with_(MOE, activation_checkpointing=True),
        with_(MOE, micro_batches=2, reshard_after_forward=False),
        with_(BRANCH, micro_batches=2, max_norm=0.5),
    ]
    return cases


def _ddp_cases():
    return [
        with_(base, ddp=True, reshard_after_forward=z3, collectives=collectives)
        for base in (BRANCH, MOE)
        for z3, collectives in ((True, "broadcast"), (False, "broadcast"), (True, "gather"))
    ]


def _hsdp_cases():
    return [
        with_(base, replicate=2, collectives=collectives, reshard_after_forward=z3)
        for base in (BRANCH, MOE)
        for collectives, z3 in (("broadcast", True), ("gather", False), ("auto", True))
    ]


def _check(cases, results, world_size):
    init = {m: initial_state(with_(EXACT, model=m)) for m in ("branch", "moe")}
    references = {}
    for i, cfg in enumerate(cases):
        key = (cfg.model, cfg.max_norm)
        if key not in references:
            references[key] = train_reference(with_(EXACT, model=cfg.model, max_norm=cfg.max_norm))
        weights = results[0][i]["weights"]
        errors = relative_errors(weights, references[key], init[cfg.model])
        assert max(errors.values()) <= 1e-10, (world_size, cfg, max(errors, key=errors.get))
        if cfg.model == "moe":  # expert 3 gets no token anywhere: never stepped, never decayed
            for k, v in weights.items():
                if ".experts.3." in k:
                    assert torch.equal(v, init["moe"][k].double()), k
        # Participation really differs between ranks (counted forward calls).
        calls = [r[i]["logs"].pop("calls") for r in results]
        if cfg.model == "branch":
            ran = [c["layers.1.branch"] > 0 for c in calls]
            assert ran[0] and not all(ran), (cfg, ran)
        else:
            for c in calls:
                experts = [c[f"layers.0.moe.experts.{e}"] for e in range(4)]
                assert experts[3] == 0 and 0 in experts[:3] and max(experts) > 0, (cfg, c)
        # The same collectives, in the same order, on every member of every DMuon group.
        by_group: dict = {}
        for rank_results in results:
            for kind, (ranks, entries) in rank_results[i]["logs"].items():
                by_group.setdefault((kind, ranks), []).append(entries)
        assert by_group, cfg
        for (kind, ranks), logs in by_group.items():
            assert len(logs) == len(ranks), (cfg, kind, ranks)
            assert all(log == logs[0] for log in logs), (cfg, kind, ranks)
            assert logs[0], (cfg, kind)  # something was issued there


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_and_ddp_exact_and_same_collectives_everywhere(world_size):
    cases = _fsdp_cases() + _ddp_cases()
    results = run_ranks(participation_suite, world_size, cases, timeout=400)
    _check(cases, results, world_size)


def test_hsdp_2x2_exact_and_same_collectives_everywhere():
    cases = _hsdp_cases()
    results = run_ranks(participation_suite, 4, cases, timeout=400)
    _check(cases, results, 4)


def test_reuse_beyond_the_recorded_order_fails_every_rank_with_one_line():
    """A boundary run more often than in the recorded order, on one rank: that rank raises a
    one-line error naming the boundary before issuing anything out of order; the others fail
    soon after (their peer is gone), none hangs."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(reuse_beyond_schedule, 2, with_(EXACT, model="reuse"), timeout=120)
    assert time.monotonic() - start < 60
    report = str(failure.value)
    assert "distributed run failed" in report, report
    assert "ScheduleError: DMuon: boundary 'layers.0' ran again after its last scheduled use" in (
        report
    )
