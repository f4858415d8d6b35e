"""DMuon composed with the rest of torchtitan: float8 linears (torchao, emulated on CPU) and
context parallelism (on CPU through the toy harness's ring-attention shim)."""

from __future__ import annotations

import pytest

from .test_titan import checkpointed_args, run_ok, seed_checkpoint, tb_losses, toy_args

FLOAT8 = ["--model.converters", "quantize.linear.float8,dmuon", "--quantize.linear.float8.emulate"]


def test_float8_linears_with_dmuon_equal_the_naive_path(tokenizer_dir, tmp_path):
    """float8 linears (emulated) on 2 ranks from one seed checkpoint: the owners keep fp32
    masters and forward casts the broadcast weights to float8 as it casts FSDP2's, so the
    first step's loss (same weights) equals the naive path's (every weight on FSDP2,
    all-gathered) within 1e-6, later steps within 1e-3 (float8 rounding amplifies the 1e-7
    differences of batched vs single Newton–Schulz: 5e-5 seen at step 5), and they fall."""
    pytest.importorskip("torchao")
    seed, _ = seed_checkpoint(tokenizer_dir, tmp_path / "seed")
    losses = {}
    for mode in ("dedicated", "naive"):
        dump = tmp_path / mode
        out = run_ok(
            2,
            *toy_args(
                tokenizer_dir,
                dump,
                *FLOAT8,
                "--training.steps",
                "6",
                "--dmuon.mode",
                mode,
                "--validation.no-enable",
                "--checkpoint.enable",
                "--checkpoint.interval",
                "1000",
                "--checkpoint.initial_load_path",
                seed,
            ),
        )
        assert "Swapped to Float8Linear" in out
        losses[mode] = tb_losses(dump)
    assert sorted(losses["dedicated"]) == list(range(1, 7))
    for step in range(1, 7):
        d, n = losses["dedicated"][step], losses["naive"][step]
        assert abs(d - n) <= (1e-6 if step == 1 else 1e-3), (step, d, n)
    assert losses["dedicated"][6] < losses["dedicated"][1]


def test_context_parallel_equals_one_rank_and_resumes(tokenizer_dir, tmp_path):
    """Context parallelism 2 on 2 CPU ranks (the CP ranks are data-parallel ranks for the
    parameters: owners planned and gradients reduced over them) from one seed checkpoint:
    losses equal the one-rank run's (same global batch) within 1e-5 over 10 steps; stopped
    at 5 and resumed, steps 6-10 are bit-identical."""
    seed, _ = seed_checkpoint(tokenizer_dir, tmp_path / "seed")
    common = [
        "--validation.no-enable",
        *checkpointed_args(total_steps=10, interval=5, validation_freq=100),
        "--checkpoint.initial_load_path",
        seed,
        "--dmuon.ns_dtype",
        "float32",
    ]
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    one, a, b = tmp_path / "one", tmp_path / "a", tmp_path / "b"
    run_ok(1, *toy_args(tokenizer_dir, one, *common, "--training.steps", "10"))
    run_ok(2, *toy_args(tokenizer_dir, a, *common, *cp2, "--training.steps", "10"))
    run_ok(2, *toy_args(tokenizer_dir, b, *common, *cp2, "--training.steps", "5"))
    out = run_ok(2, *toy_args(tokenizer_dir, b, *common, *cp2, "--training.steps", "10"))
    assert "Training starts at step 6" in out
    lone, la, lb = tb_losses(one), tb_losses(a), tb_losses(b)
    assert sorted(la) == list(range(1, 11)) and la[10] < la[1]
    for step in range(1, 11):
        assert abs(la[step] - lone[step]) <= 1e-5, (step, la[step], lone[step])
    assert [la[s] for s in range(6, 11)] == [lb[s] for s in range(6, 11)]
