"""Expert stacks: 3-D ``[experts, out, in]`` parameters owned expert by expert.

The reference is the single-process ``torch.optim.Muon`` stepping every expert slice as a
matrix of its own (the same model with one 2-D parameter per expert) and
``torch.optim.AdamW`` on the rest (float64, ≤ 1e-10 after 5 steps). The data leaves one
expert without tokens on each rank and one (expert 3) without tokens anywhere.
"""

import pytest
import torch

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.scenarios import (
    bytes_measured_and_predicted,
    dcp_load,
    dcp_save,
    expert_count_not_divisible,
    resume_load,
    resume_save,
)
from ..helpers.training import RunConfig, initial_state, parity_suite, train_reference, with_

EXPERTS = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64, model="grouped_moe")

#: FSDP layouts (every world size)
FSDP_CASES = [
    EXPERTS,
    with_(EXPERTS, reshard_after_forward=False, collectives="gather"),
    with_(EXPERTS, collectives="auto", activation_checkpointing=True),
    with_(EXPERTS, micro_batches=2, reshard_after_forward=False, max_norm=0.5),
]
#: layouts with replicas (DDP on 2 ranks, HSDP 2 × 2 on 4) and expert parallelism (the
#: expert mesh cuts the stacks; each share's pieces are owned over the ranks that hold it),
#: also with tensor parallelism (the expert mesh spans the tp ranks, as torchtitan's does;
#: each tp rank routes its share of the tokens)
REPLICA_CASES = {
    2: [
        with_(EXPERTS, ddp=True),
        with_(EXPERTS, ddp=True, reshard_after_forward=False),
        with_(EXPERTS, ep=2),
        with_(EXPERTS, tp=2, ep=2),
        with_(EXPERTS, ep=2, ns_preconditioner="aol"),
    ],
    4: [
        with_(EXPERTS, replicate=2),
        with_(EXPERTS, replicate=2, collectives="gather"),
        with_(EXPERTS, ep=2),
        with_(EXPERTS, ep=2, reshard_after_forward=False, activation_checkpointing=True),
        with_(EXPERTS, ep=4),
        with_(EXPERTS, ep=2, replicate=2),
        with_(EXPERTS, tp=2, ep=2, max_norm=0.5),
        with_(EXPERTS, tp=2, ep=4),
    ],
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_expert_stacks_equal_torch_muon_on_every_slice(world_size):
    cases = FSDP_CASES + REPLICA_CASES.get(world_size, [])
    results = run_ranks(parity_suite, world_size, cases)[0]
    init = initial_state(EXPERTS)
    references = {}
    for cfg, weights in zip(cases, results, strict=True):
        key = (cfg.max_norm, cfg.ns_preconditioner)
        if key not in references:
            references[key] = train_reference(
                with_(EXPERTS, max_norm=cfg.max_norm, ns_preconditioner=cfg.ns_preconditioner)
            )
        errors = relative_errors(weights, references[key], init)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-10, (world_size, cfg, worst, errors[worst])
        # Expert 3 gets no token anywhere: a zero gradient, so only weight decay moves it.
        for key in ("layers.0.moe.experts.w1", "layers.1.moe.experts.w2"):
            decay = (1 - cfg.lr * cfg.weight_decay) ** cfg.steps
            expected = init[key][3].double() * decay
            assert torch.allclose(weights[key][3], expected, rtol=1e-12, atol=0), key


@pytest.mark.slow
def test_expert_stacks_with_hsdp_tensor_and_expert_parallelism():
    """(slow: 8 gloo ranks) 2 replicas x 2 shards x tp 2 with ep 2 and ep 4: equal to
    ``torch.optim.Muon`` on every slice within 1e-10 after 5 steps."""
    cases = [with_(EXPERTS, replicate=2, tp=2, ep=2), with_(EXPERTS, replicate=2, tp=2, ep=4)]
    results = run_ranks(parity_suite, 8, cases)[0]
    init, reference = initial_state(EXPERTS), train_reference(EXPERTS)
    for cfg, weights in zip(cases, results, strict=True):
        errors = relative_errors(weights, reference, init)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-10, (cfg, worst, errors[worst])


def test_expert_stacks_resume_at_another_world_size():
    """Full state dicts: save on 3 ranks (8 experts would split 3/3/2; 4 split 2/2/0), load on
    2; the continuation ends where the uninterrupted 3-rank run ends."""
    cfg, at = EXPERTS, 3
    saved = run_ranks(resume_save, 3, cfg, at)[0]
    resumed = run_ranks(resume_load, 2, cfg, saved, at)[0]
    for k, v in saved["model"].items():
        assert torch.equal(resumed["model"][k], v), k
    stacks = [k for k, v in saved["optim"]["state"].items() if ".experts.w" in k]
    assert len(stacks) == 6
    for k in stacks:
        momentum = saved["optim"]["state"][k]["momentum_buffer"]
        assert momentum.shape == saved["model"][k].shape and momentum.abs().sum() > 0, k
        assert torch.equal(resumed["optim"]["state"][k]["momentum_buffer"], momentum), k
    errors = relative_errors(resumed["final"], saved["final"], initial_state(cfg))
    assert max(errors.values()) <= 1e-12


@pytest.mark.parametrize(
    "save_on, save_ep, load_on, load_ep", [(3, 1, 2, 1), (2, 1, 4, 4), (4, 2, 2, 1), (2, 2, 4, 2)]
)
def test_expert_stacks_dcp_checkpoint_reshards(tmp_path, save_on, save_ep, load_on, load_ep):
    """The DCP form holds each stack as the Shard(0) DTensor of its pieces (with expert
    parallelism, of the expert mesh and then the grid): saved at one world size and expert
    degree, loaded at another, weights and momentum bit for bit."""
    saved = run_ranks(dcp_save, save_on, with_(EXPERTS, ep=save_ep), str(tmp_path), 3)[0]
    loaded = run_ranks(dcp_load, load_on, with_(EXPERTS, ep=load_ep), str(tmp_path))[0]
    assert saved["model"].keys() == loaded["model"].keys()
    for k, v in saved["model"].items():
        assert torch.equal(v, loaded["model"][k]), k
    for k, entry in saved["optim"]["state"].items():
        for name, v in entry.items():
            assert torch.equal(v, loaded["optim"]["state"][k][name]), (k, name)


def test_expert_count_that_expert_parallelism_does_not_divide():
    messages = run_ranks(expert_count_not_divisible, 2)
    for message in messages:
        assert "'layers.0.moe.experts.w1' has 3 experts" in message, message
        assert "expert-parallel degree 2" in message, message


@pytest.mark.parametrize("world_size, ep", [(2, 1), (3, 1), (4, 2)])
def test_expert_stack_bytes_per_step(world_size, ep):
    """Each stack moves by one all-gather per unshard and one reduce-scatter per step over
    its grid: (G-1)/G of its slots (padding included) per rank and phase, with G the grid
    size (world / ep). Counted from the collectives issued, equal to summarize_plan's."""
    for z3 in (True, False):
        cfg = with_(EXPERTS, ep=ep, reshard_after_forward=z3)
        for r in run_ranks(bytes_measured_and_predicted, world_size, cfg):
            moved, predicted = r["moved"], r["predicted"]
            assert moved["forward"] == pytest.approx(predicted["forward_broadcast"], rel=1e-12)
            assert moved.get("backward_unshard", 0.0) == pytest.approx(
                predicted["backward_rebroadcast"], rel=1e-12
            )
            assert moved["reduce"] == pytest.approx(predicted["reduce"], rel=1e-12)
            # The stacks' own collectives: per phase, 6 stacks of G slots of ceil(E/G)
            # experts each (E: this rank's EP share of the model's 4 experts).
            grid = r["grid"]
            assert grid == world_size // ep
            if grid > 1:
                experts = 4 // ep
                padded = grid * -(-experts // grid) / experts  # slots over experts
                stack_elements = r["stack_numel"] * padded
                assert r["grid_numel"]["forward"] == stack_elements
                assert r["grid_numel"]["reduce"] == stack_elements + 6 * grid  # + flags
                assert r["grid_numel"].get("backward_unshard", 0) == (stack_elements if z3 else 0)
            else:
                assert r["grid_numel"] == {}  # a grid of one rank moves nothing
