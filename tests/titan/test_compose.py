"""DMuon composed with the rest of torchtitan: float8 linears (torchao, emulated on CPU)."""

from __future__ import annotations

import pytest

from .test_titan import REPO, run_ok, tb_losses, toy_args

FLOAT8 = ["--model.converters", "quantize.linear.float8,dmuon", "--quantize.linear.float8.emulate"]


def test_float8_linears_with_dmuon_equal_the_naive_path(tokenizer_dir, tmp_path):
    """float8 linears (emulated) on 2 ranks from one seed checkpoint: the owners keep fp32
    masters and forward casts the broadcast weights to float8 as it casts FSDP2's, so the
    first step's loss (same weights) equals the naive path's (every weight on FSDP2,
    all-gathered) within 1e-6, later steps within 1e-3 (float8 rounding amplifies the 1e-7
    differences of batched vs single Newton–Schulz: 5e-5 seen at step 5), and they fall."""
    pytest.importorskip("torchao")
    seed = tmp_path / "seed"
    run_ok(
        1,
        "--job.config_file",
        str(REPO / "configs" / "toy_adamw.toml"),
        "--job.dump_folder",
        str(seed),
        "--model.hf_assets_path",
        str(tokenizer_dir),
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
    )
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
                str(seed / "checkpoint" / "step-0"),
            ),
        )
        assert "Swapped to Float8Linear" in out
        losses[mode] = tb_losses(dump)
    assert sorted(losses["dedicated"]) == list(range(1, 7))
    for step in range(1, 7):
        d, n = losses["dedicated"][step], losses["naive"][step]
        assert abs(d - n) <= (1e-6 if step == 1 else 1e-3), (step, d, n)
    assert losses["dedicated"][6] < losses["dedicated"][1]
