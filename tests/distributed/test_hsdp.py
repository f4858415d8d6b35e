"""HSDP and replicate-only meshes (gloo, 4 ranks): owners planned over the whole replicate ×
shard grid, two-stage reduce, the owner's update broadcast back to the replicas (async by
default), checkpoints across layouts."""

import pytest
import torch

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.scenarios import dcp_load, hsdp_after_async_step
from ..helpers.training import RunConfig, initial_state, parity_suite, train_reference, with_

EXACT = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64)
LAYOUTS = {"2x2": 2, "4x1": 4, "1x4": 1}  # replicas x shards on 4 ranks


@pytest.fixture(scope="module")
def reference():
    return train_reference(EXACT), initial_state(EXACT)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_and_async_equals_sync(layout, reference):
    base = with_(EXACT, replicate=LAYOUTS[layout])
    cases = [
        base,
        with_(base, replicate_async=False),
        with_(base, reshard_after_forward=False, activation_checkpointing=True),
        with_(base, micro_batches=2, max_norm=0.5),
        with_(base, collectives="gather"),
    ]
    results = run_ranks(parity_suite, 4, cases, timeout=600)[0]
    ref, init = reference
    exact = [0, 1, 2, 4]
    for cfg, weights in zip([cases[i] for i in exact], [results[i] for i in exact], strict=True):
        errors = relative_errors(weights, ref, init)
        assert max(errors.values()) <= 1e-10, (layout, cfg, max(errors, key=errors.get))
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), (layout, "async != sync", k)
    clipped = train_reference(with_(EXACT, max_norm=0.5))
    errors = relative_errors(results[3], clipped, init)
    assert max(errors.values()) <= 1e-10, (layout, "no_sync + clip")


def test_checkpoint_after_async_step_and_resume_on_another_layout(tmp_path, reference):
    """2x2, async: right after the last step every rank's full state is the post-step state
    (the drain works), equal to the reference; the owner-only DCP checkpoint loads on 1x2
    (other owners) with identical weights and momentum."""
    cfg = with_(EXACT, replicate=2)
    out = run_ranks(hsdp_after_async_step, 4, cfg, str(tmp_path))
    ref, init = reference
    for r in out:  # every rank, every replica
        errors = relative_errors(r["model"], ref, init)
        assert max(errors.values()) <= 1e-10
        for k, v in out[0]["model"].items():
            assert torch.equal(v, r["model"][k]), k
    loaded = run_ranks(dcp_load, 2, with_(EXACT, replicate=1), str(tmp_path))[0]
    for k, v in out[0]["model"].items():
        assert torch.equal(v, loaded["model"][k]), k
    # and back onto 2x2: the owner-only load reaches the other replica's copies too
    for r in run_ranks(dcp_load, 4, with_(EXACT, replicate=2), str(tmp_path)):
        for k, v in out[0]["model"].items():
            assert torch.equal(v, r["model"][k]), k
    saved_state = out[0]["optim"]["state"]
    assert sum("momentum_buffer" in e for e in saved_state.values()) == 21
    for fqn, entry in saved_state.items():
        for name, v in entry.items():
            assert torch.equal(v, loaded["optim"]["state"][fqn][name]), (fqn, name)


@pytest.mark.parametrize("replicas", [2, 4])
def test_hsdp_bytes_per_phase(tmp_path, replicas):
    """Bytes counted from the collectives issued, averaged over the 4 ranks, equal the
    documented per-phase formulas (per step, Z3, fp64 here)."""
    cfg = with_(EXACT, replicate=replicas, steps=1)
    out = run_ranks(hsdp_after_async_step, 4, cfg, str(tmp_path))
    shard = 4 // replicas
    # dedicated bytes (fp64 here: broadcast, reduce and master copies all 8 bytes)
    P = sum(
        v.numel() * 8
        for k, v in initial_state(cfg).items()
        if k.startswith("layers.") and v.ndim == 2
    )
    expected = {
        "forward": P * (shard - 1) / shard,
        "backward_unshard": P * (shard - 1) / shard,
        "reduce": P * (shard - 1) / shard,
        "reduce_replicate": P * (replicas - 1) / (replicas * shard),
        "replicate_broadcast": P * (replicas - 1) / (replicas * shard),
    }
    # the first step also pays the start-up sync of the replica copies (one more broadcast)
    expected["replicate_broadcast"] *= 2
    for phase, value in expected.items():
        average = sum(r["stats"]["moved_bytes"].get(phase, 0.0) for r in out) / 4
        assert average == pytest.approx(value, rel=1e-12), phase
    summary = out[0]["summary"]["bytes_per_rank_per_step"]
    for phase in ("reduce_replicate", "replicate_broadcast"):
        assert summary[phase] == pytest.approx(P * (replicas - 1) / (replicas * shard), rel=1e-12)
