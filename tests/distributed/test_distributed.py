"""Distributed behaviour beyond plain parity: communication volume, storage ownership, state
dicts across world sizes, mixed precision, reused and unused boundaries (gloo, CPU)."""

import pytest
import torch

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.models import ToyTransformer, loss_fn
from ..helpers.scenarios import (
    accounting_and_storage,
    clip_norm_first_step,
    dcp_load,
    dcp_save,
    mixed_precision,
    owned_grad_storage,
    plan_mismatch,
    resume_load,
    resume_save,
    state_dicts_after_evaluation,
    step_is_collective_free,
)
from ..helpers.training import RunConfig, batch, initial_state, parity_suite, train_reference, with_

EXACT = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_per_step_and_owner_only_storage(world_size):
    configs = [
        ("z2", with_(EXACT, reshard_after_forward=False), 2),
        ("z3", EXACT, 3),
        ("z2+ac", with_(EXACT, reshard_after_forward=False, activation_checkpointing=True), 2),
        ("z3+ac", with_(EXACT, activation_checkpointing=True), 3),
        ("z3+no_sync", with_(EXACT, micro_batches=2), None),
    ]
    results = run_ranks(accounting_and_storage, world_size, [c for _, c, _ in configs])
    n = world_size
    for rank_results in results:
        for (name, _, factor), r in zip(configs, rank_results, strict=True):
            moved, P = r["moved"], r["P_M"]
            dedicated = moved["forward"] + moved.get("backward_unshard", 0.0) + moved["reduce"]
            assert "recompute" not in moved, name  # AC recompute reuses the unsharded weights
            if factor is not None:
                assert dedicated == pytest.approx(factor * (n - 1) / n * P, rel=1e-12), name
                # one broadcast and one reduce per (boundary, owner) bucket
                assert r["ops"]["forward"] == r["buckets"] == r["ops"]["reduce"], name
            else:
                # two micro-batches: each unshards for forward and backward, one reduce at the end
                assert moved["forward"] == pytest.approx(2 * (n - 1) / n * P, rel=1e-12)
                assert moved["backward_unshard"] == pytest.approx(2 * (n - 1) / n * P, rel=1e-12)
                assert moved["reduce"] == pytest.approx((n - 1) / n * P, rel=1e-12)
            # gradient-presence flags ride along: one element per dedicated matrix
            assert moved["reduce_flags"] == pytest.approx(21 * 8 * (n - 1) / n), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_layout_bytes_per_step(world_size):
    """collectives="gather": per boundary one all-gather of one slot per rank (the largest
    owner bucket, padding included) per unshard and one reduce-scatter; the bytes counted
    from the collectives issued equal that, and what summarize_plan predicts."""
    configs = [
        ("z3", with_(EXACT, collectives="gather"), 2),
        ("z2", with_(EXACT, collectives="gather", reshard_after_forward=False), 1),
    ]
    results = run_ranks(accounting_and_storage, world_size, [c for _, c, _ in configs])
    n = world_size
    for rank_results in results:
        for (name, _, unshards), r in zip(configs, rank_results, strict=True):
            summary = r["summary"]
            # bucket sizes by owner column, from the plan
            numel: dict[tuple[str, int], int] = {}
            count: dict[tuple[str, int], int] = {}
            for p in summary["params"]:
                key = (p["boundary"], p["owner"])
                numel[key] = numel.get(key, 0) + p["shape"][0] * p["shape"][1]
                count[key] = count.get(key, 0) + 1
            boundaries = [b["path"] for b in summary["boundaries"]]
            assert {b["collectives"] for b in summary["boundaries"]} == {"gather"}
            slot = {b: max(v for (k, _), v in numel.items() if k == b) for b in boundaries}
            reduce_slot = {
                b: max(v + count[key] for key, v in numel.items() if key[0] == b)
                for b in boundaries
            }
            per_unshard = sum((n - 1) * slot[b] * 8 for b in boundaries)
            reduce = sum(
                (n - 1)
                / n
                * (n * reduce_slot[b] - sum(c for (k, _), c in count.items() if k == b))
                * 8
                for b in boundaries
            )
            moved = r["moved"]
            assert moved["forward"] == pytest.approx(per_unshard, rel=1e-12), name
            assert moved.get("backward_unshard", 0.0) == pytest.approx(
                (unshards - 1) * per_unshard, rel=1e-12
            ), name
            assert moved["reduce"] == pytest.approx(reduce, rel=1e-12), name
            assert moved["reduce_flags"] == pytest.approx(21 * 8 * (n - 1) / n), name
            # one collective per boundary and phase, whatever the number of owners
            assert r["ops"]["forward"] == r["ops"]["reduce"] == len(boundaries), name
            predicted = summary["bytes_per_rank_per_step"]
            assert predicted["forward_broadcast"] == pytest.approx(moved["forward"], rel=1e-12)
            assert predicted["backward_rebroadcast"] == pytest.approx(
                moved.get("backward_unshard", 0.0), rel=1e-12
            )
            assert predicted["reduce"] == pytest.approx(moved["reduce"], rel=1e-12)
            # padding is real: the gather layout moves more bytes than the broadcasts would
            assert per_unshard > (n - 1) / n * r["P_M"], name


def test_clip_norm_is_the_global_norm():
    cfg = EXACT
    model = ToyTransformer()
    model.init_weights()
    model.double()
    tokens = batch(cfg, 0)
    loss_fn(model(tokens), tokens).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    norms = run_ranks(clip_norm_first_step, 3, cfg)
    assert norms == pytest.approx([expected] * 3, rel=1e-12)


def test_state_dicts_move_between_world_sizes():
    """Save on 3 ranks after 3 steps; load on 1 rank; export again; load that on 2 ranks.
    Both continuations end where the uninterrupted 3-rank run ends."""
    cfg = with_(EXACT, steps=5)
    at = 3
    saved = run_ranks(resume_save, 3, cfg, at)
    first = saved[0]
    for other in saved[1:]:  # every rank returns the same full dicts
        for k, v in first["model"].items():
            assert torch.equal(v, other["model"][k]), k

    single = run_ranks(resume_load, 1, cfg, first, at)[0]
    back = run_ranks(resume_load, 2, cfg, single, at)[0]

    for k, v in first["model"].items():
        assert torch.equal(single["model"][k], v), k
    for k, v in first["optim"]["state"].items():
        for name, t in v.items():
            assert torch.equal(single["optim"]["state"][k][name], t), (k, name)
    momentum = [k for k, v in first["optim"]["state"].items() if "momentum_buffer" in v]
    assert len(momentum) == 21

    init = initial_state(cfg)
    for result in (single, back):
        errors = relative_errors(result["final"], first["final"], init)
        assert max(errors.values()) <= 1e-12

    # The full model state dict is a plain single-device state dict.
    plain = ToyTransformer().double()
    plain.load_state_dict(first["model"], strict=True)


def test_optimizer_state_dicts_after_an_evaluation_forward():
    """A forward without backward leaves FSDP2's unsharded root parameters registered; the
    optimizer state dicts (full and sharded) taken then equal those taken before it."""
    for result in run_ranks(state_dicts_after_evaluation, 2, EXACT):
        assert result == {"full": True, "sharded": True}


def test_mixed_precision_matches_fsdp2():
    for r in run_ranks(mixed_precision, 2):
        assert r["compute_dtype"] == "torch.bfloat16"
        assert r["master_dtypes"] == ["torch.float32"]
        assert r["momentum_dtypes"] == ["torch.float32"]
        assert r["grad_rel_error"] < 1e-6
        numel = r["dedicated_numel"]
        assert r["payload"]["forward"] == 2 * numel  # broadcast in bf16
        assert r["payload"]["reduce"] == 4 * numel  # reduce in fp32


@pytest.mark.parametrize("world_size", [2, 3])
def test_reused_boundary_and_unused_matrix(world_size):
    base = with_(EXACT, model="reuse")
    cases = [
        base,
        with_(base, reshard_after_forward=False),
        with_(base, activation_checkpointing=True),
        with_(base, micro_batches=2),
    ]
    reference = train_reference(base)
    init = initial_state(base)
    results = run_ranks(parity_suite, world_size, cases)[0]
    for cfg, weights in zip(cases, results, strict=True):
        spare = "layers.1.spare.weight"
        assert torch.equal(weights[spare], init[spare].double()), (
            cfg
        )  # never stepped, never decayed
        errors = relative_errors(
            {k: v for k, v in weights.items() if k != spare},
            {k: v for k, v in reference.items() if k != spare},
            init,
        )
        assert max(errors.values()) <= 1e-10, (cfg, max(errors, key=errors.get))


@pytest.mark.parametrize("what", ["params", "collectives", "reshard"])
def test_plans_that_differ_across_ranks_fail_everywhere(what):
    for message in run_ranks(plan_mismatch, 2, what, timeout=60):
        assert "plans differ across ranks" in message


@pytest.mark.parametrize(
    "world_size, cfg",
    [
        (2, with_(EXACT, collectives="gather")),  # padded slots
        (3, with_(EXACT, collectives="gather")),
        (4, with_(EXACT, replicate=2)),  # HSDP: the other replica's segments
        (4, with_(EXACT, replicate=2, collectives="gather")),
    ],
)
def test_owned_gradients_keep_only_their_own_storage(world_size, cfg):
    """Owned gradients are views of the reduce buffer; where that buffer holds more than the
    owner's segment (gather padding, other replicas' segments) the segment is copied out, so
    the rest is freed during backward instead of when the gradients are."""
    results = run_ranks(owned_grad_storage, world_size, cfg)
    assert sum(r["owned"] for r in results) == 21
    for r in results:
        assert r["held"] == r["needed"], r


@pytest.mark.parametrize("save_on, load_on", [(3, 2), (2, 3)])
def test_dcp_owner_only_checkpoint_reshards(tmp_path, save_on, load_on):
    """torch.distributed.checkpoint with the owner-only form: what one world size saves,
    another loads (new owners), bit for bit, weights and momentum."""
    cfg = EXACT
    saved = run_ranks(dcp_save, save_on, cfg, str(tmp_path), 3)[0]
    loaded = run_ranks(dcp_load, load_on, cfg, str(tmp_path))[0]
    assert saved["model"].keys() == loaded["model"].keys()
    for k, v in saved["model"].items():
        assert torch.equal(v, loaded["model"][k]), k
    assert saved["optim"]["state"].keys() == loaded["optim"]["state"].keys()
    for k, entry in saved["optim"]["state"].items():
        for name, v in entry.items():
            assert torch.equal(v, loaded["optim"]["state"][k][name]), (k, name)


def test_step_without_grads_is_local_and_a_no_op():
    for unchanged in run_ranks(step_is_collective_free, 3, EXACT, timeout=120):
        assert all(unchanged.values()), [k for k, v in unchanged.items() if not v]


def test_optimizer_built_before_to_empty_trains_and_checkpoints():
    """``Muon(model)`` after fully_shard but before to_empty (a meta model): to_empty
    replaces the dedicated parameter objects; the optimizer follows them, so the run equals
    the reference and the optimizer state dict has every matrix's momentum."""
    cfg = with_(EXACT, optimizer_first=True)
    out = run_ranks(resume_save, 2, cfg, 3)[0]
    errors = relative_errors(out["final"], train_reference(cfg), initial_state(cfg))
    assert max(errors.values()) <= 1e-10
    momentum = [k for k, v in out["optim"]["state"].items() if "momentum_buffer" in v]
    assert len(momentum) == 21


def test_tied_weight_stays_on_adamw_in_one_fsdp_group():
    """An output head tied to the embedding, sharded like torchtitan shards them (each in a
    group of its own, which torch 2.13's FSDP2 refuses for one parameter): the tied weight is
    managed once, by the root's group, and training equals the reference."""
    cfg = with_(EXACT, model="tied")
    weights = run_ranks(parity_suite, 2, [cfg])[0][0]
    reference = train_reference(cfg)
    errors = relative_errors(weights, reference, initial_state(cfg))
    assert max(errors.values()) <= 1e-10, max(errors, key=errors.get)
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
