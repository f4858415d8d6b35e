"""DMuon composed with the rest of torchtitan: float8 linears (torchao, emulated on CPU) and
context parallelism (on CPU through the toy harness's ring-attention shim)."""

from __future__ import annotations

import pytest
import torch

from .test_titan import (
    CONFIG_SEQ_LEN,
    checkpointed_from,
    from_seed,
    optimizer_tensors,
    read_checkpoint,
    run_ok,
    run_probe,
    seed_checkpoint,
    tb_losses,
    tb_scalars,
    toy_args,
)

FLOAT8 = ["--model.converters", "quantize.linear.float8,dmuon", "--quantize.linear.float8.emulate"]


def test_float8_linears_with_dmuon_equal_the_naive_path(tokenizer_dir, tmp_path, toy_seed):
    """float8 linears (emulated) on 2 ranks from one seed checkpoint: the owners keep fp32
    masters and forward casts the broadcast weights to float8 as it casts FSDP2's, so the
    first step's loss (same weights) equals the naive path's (every weight on FSDP2,
    all-gathered) within 1e-6, later steps within 1e-3 (float8 rounding amplifies the 1e-7
    differences of batched vs single Newton–Schulz: 5e-5 seen at step 5), and they fall."""
    pytest.importorskip("torchao")
    losses = {}
    for mode in ("dedicated", "naive"):
        dump = tmp_path / mode
        out = run_ok(
            2,
            *toy_args(
                tokenizer_dir,
                dump,
                *FLOAT8,
                "--dmuon.mode",
                mode,
                "--validation.no-enable",
                *from_seed(toy_seed, 6),
            ),
        )
        assert "Swapped to Float8Linear" in out
        losses[mode] = tb_losses(dump)
    assert sorted(losses["dedicated"]) == list(range(1, 7))
    for step in range(1, 7):
        d, n = losses["dedicated"][step], losses["naive"][step]
        assert abs(d - n) <= (1e-6 if step == 1 else 1e-3), (step, d, n)
    assert losses["dedicated"][6] < losses["dedicated"][1]


def test_context_parallel_equals_one_rank_and_resumes(tokenizer_dir, tmp_path, toy_seed):
    """Context parallelism 2 on 2 CPU ranks (the CP ranks are data-parallel ranks for the
    parameters: owners planned and gradients reduced over them) from one seed checkpoint:
    losses equal the one-rank run's (same global batch) within 1e-5 over 10 steps; stopped
    at 5 and resumed, steps 6-10 are bit-identical."""
    common = [
        *checkpointed_from(toy_seed, 10, 5),
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


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]


def test_pipeline_parallel_equals_one_stage_and_the_naive_path(tokenizer_dir, tmp_path, toy_seed):
    """Pipeline parallelism from one seed checkpoint, 2 microbatches per step: pp 2 (2
    ranks) and pp 2 x dp 2 (4 ranks), 1F1B and Interleaved1F1B (4 stages): the losses of
    every step equal the pp 1 run's of the same global batch within 1e-5, and the naive
    path's (every weight on FSDP2) under the same PP within 1e-5.

    torchtitan's PP gradients come out global-token-count times larger than without PP
    (pytorch/torchtitan#2972: the schedule's loss is not divided by the token count); DMuon's
    are scaled exactly like FSDP2's of the same run. Clipping at max_norm 0.1, active at
    every step with and without PP (asserted), makes the two comparable."""
    common = ["--validation.no-enable", *from_seed(toy_seed, 5), "--training.max_norm", "0.1"]
    runs = {
        "pp1": (1, []),
        "pp2": (2, PP2),
        "pp2-interleaved": (2, [*PP2, *INTERLEAVED]),
        "pp2-interleaved-naive": (2, [*PP2, *INTERLEAVED, "--dmuon.mode", "naive"]),
        "dp2": (2, []),
        "pp2xdp2": (4, PP2),
        "pp2xdp2-interleaved": (4, [*PP2, *INTERLEAVED]),
        "pp2xdp2-naive": (4, [*PP2, "--dmuon.mode", "naive"]),
    }
    losses, norms = {}, {}
    for name, (n, extra) in runs.items():
        out = run_ok(n, *toy_args(tokenizer_dir, tmp_path / name, *common, *extra))
        if "pp2" in name:
            assert "Using pipeline schedule" in out
        losses[name] = tb_losses(tmp_path / name)
        norms[name] = tb_scalars(tmp_path / name, "grad_norm")
        assert sorted(losses[name]) == list(range(1, 6)), name
        assert min(norms[name].values()) > 0.1, (name, norms[name])  # clipping active
    pairs = [(name, "dp2" if "dp2" in name else "pp1") for name in runs]
    pairs += [("pp2-interleaved", "pp2-interleaved-naive"), ("pp2xdp2", "pp2xdp2-naive")]
    for name, ref in pairs:
        for step in range(1, 6):
            assert abs(losses[name][step] - losses[ref][step]) <= 1e-5, (name, ref, step)
    assert losses["pp2xdp2"][5] < losses["pp2xdp2"][1]


def test_pipeline_parallel_resumes_and_loads_at_other_degrees(tokenizer_dir, tmp_path, toy_seed):
    """pp 2 x dp 2, Interleaved1F1B: stopped at 3 and resumed, steps 4-6 are bit-identical
    to the uninterrupted run; its step-3 checkpoint loads at pp 2 x dp 1, pp 1 x dp 2 and on
    one rank with identical weights and momentum (torchtitan's data loader state cannot
    change its data-parallel degree: left out, as in the DP tests)."""
    layouts = {"pp2xdp1": (2, PP2), "pp1xdp2": (2, []), "pp1": (1, [])}
    _resumes_at_3_and_loads(tokenizer_dir, tmp_path, toy_seed, [*PP2, *INTERLEAVED], layouts)


def _resumes_at_3_and_loads(tokenizer_dir, tmp_path, seed: str, layout: list, layouts) -> None:
    """On 4 ranks with the overrides ``layout``, from ``seed``, clipping active: stopped at 3
    and resumed, steps 4-6 are bit-identical to the uninterrupted run, and its step-3
    checkpoint holds exactly the saved weights and momentum loaded at each of ``layouts``."""
    common = [
        *checkpointed_from(seed, 6, 3),
        "--training.max_norm",
        "0.1",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    run_ok(4, *toy_args(tokenizer_dir, a, *common, *layout, "--training.steps", "6"))
    run_ok(4, *toy_args(tokenizer_dir, b, *common, *layout, "--training.steps", "3"))
    out = run_ok(4, *toy_args(tokenizer_dir, b, *common, *layout, "--training.steps", "6"))
    assert "Training starts at step 4" in out
    la, lb = tb_losses(a), tb_losses(b)
    assert [la[s] for s in range(4, 7)] == [lb[s] for s in range(4, 7)]
    _check_loads_identically(tokenizer_dir, tmp_path, a, 3, common, layouts)


@pytest.mark.slow
def test_pipeline_parallel_with_hsdp_and_with_expert_parallelism(tokenizer_dir, tmp_path):
    """(slow: 8 and 4 CPU ranks) From one seed checkpoint, clipping active, 4 steps: pp 2 x
    HSDP (2 replicas x 2 shards, 8 ranks) equals HSDP alone (4 ranks) within 1e-5 per step;
    deepseek_v3's debug model (experts) with pp 2 x EP 2 (4 ranks) equals EP 2 alone (2
    ranks) within 1e-4. (Top-k routing turns rounding into discrete differences: AdamW alone,
    same comparison, drifts 1.2e-5 / 5.4e-5 / 8.4e-5 at steps 2-4; DMuon 3e-6 / 2e-6 / 1.7e-5.)"""
    hsdp = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ]
    moe = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    cases = {
        "llama3": ([], [(4, hsdp), (8, [*PP2, *hsdp])], 1e-5),
        "deepseek_v3": (moe, [(2, ep2), (4, [*PP2, *ep2])], 1e-4),
    }
    for model, (model_args, (base, piped), tolerance) in cases.items():
        seed, _ = seed_checkpoint(
            tokenizer_dir, tmp_path / f"seed_{model}", *model_args, "--validation.no-enable"
        )
        common = [
            *model_args,
            "--validation.no-enable",
            *from_seed(seed, 4),
            "--training.max_norm",
            "0.1",
        ]
        losses = []
        for n, extra in (base, piped):
            dump = tmp_path / f"{model}_{n}"
            run_ok(n, *toy_args(tokenizer_dir, dump, *common, *extra))
            losses.append(tb_losses(dump))
            assert min(tb_scalars(dump, "grad_norm").values()) > 0.1, model
        for step in range(1, 5):
            assert abs(losses[0][step] - losses[1][step]) <= tolerance, (model, step, losses)


TP2 = ["--parallelism.tensor_parallel_degree", "2"]


def test_tensor_parallel_equals_the_naive_path_resumes_and_loads_at_other_degrees(
    tokenizer_dir, tmp_path, toy_seed
):
    """tp 2 x dp 2 (4 ranks) from one seed checkpoint, fp32 NS, clipping on: the loss falls
    and equals the naive path's (every weight on FSDP2 x TP, all-gathered, NS on every rank)
    within 1e-5 per step over 6 steps; stopped at 3 and resumed, steps 4-6 are
    bit-identical; the step-3 checkpoint loads at tp 1 x dp 2 and tp 2 x dp 1 with identical
    weights and momentum. With ``[dmuon] tp_ns = "shared"`` (each row's two ranks share
    every Newton–Schulz) the losses equal the naive path's within 1e-5 as well."""
    common = [
        *checkpointed_from(toy_seed, 6, 3),
        "--dmuon.ns_dtype",
        "float32",
        "--training.max_norm",
        "0.5",
    ]
    a, naive, b = tmp_path / "a", tmp_path / "naive", tmp_path / "b"
    out = run_ok(4, *toy_args(tokenizer_dir, a, *common, *TP2, "--training.steps", "6"))
    assert "x 2 tensor-parallel" in out
    run_ok(
        4,
        *toy_args(
            tokenizer_dir, naive, *common, *TP2, "--dmuon.mode", "naive", "--training.steps", "6"
        ),
    )
    shared = tmp_path / "shared"
    out = run_ok(
        4,
        *toy_args(
            tokenizer_dir,
            shared,
            *common,
            *TP2,
            "--dmuon.tp_ns",
            "shared",
            "--training.steps",
            "6",
        ),
    )
    assert "Newton-Schulz shared by each owner's tensor-parallel row" in out
    run_ok(4, *toy_args(tokenizer_dir, b, *common, *TP2, "--training.steps", "3"))
    out = run_ok(4, *toy_args(tokenizer_dir, b, *common, *TP2, "--training.steps", "6"))
    assert "Training starts at step 4" in out
    la, ln, lb, ls = tb_losses(a), tb_losses(naive), tb_losses(b), tb_losses(shared)
    assert sorted(la) == list(range(1, 7)) and la[6] < la[1]
    for step in range(1, 7):
        assert abs(la[step] - ln[step]) <= 1e-5, (step, la[step], ln[step])
        assert abs(ls[step] - ln[step]) <= 1e-5, (step, ls[step], ln[step])
    assert [la[s] for s in range(4, 7)] == [lb[s] for s in range(4, 7)]
    layouts = {"tp1xdp2": (2, []), "tp2xdp1": (2, TP2)}
    _check_loads_identically(tokenizer_dir, tmp_path, a, 3, common, layouts)


def _check_loads_identically(tokenizer_dir, tmp_path, dump, step: int, common, layouts) -> None:
    """The toy's step-``step`` DCP checkpoint under ``dump``, loaded at each of ``layouts``
    (name -> (ranks, overrides)), holds exactly the saved weights and momentum (torchtitan's
    data loader state cannot change its data-parallel degree: left out)."""
    saved = read_checkpoint(dump / "checkpoint" / f"step-{step}", tmp_path)
    model_keys = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
    momentum = [k for k in saved["optimizer"] if k.endswith(".momentum_buffer")]
    assert "layers.5.feed_forward.w2.weight" in model_keys and len(momentum) == 6 * 7
    reshard = ["--checkpoint.exclude_from_loading", "dataloader"]
    for name, (n, extra) in layouts.items():
        args = [*common, *extra, "--checkpoint.load_step", str(step), *reshard]
        probe = run_probe(n, tmp_path / f"probe-{name}.pt", *toy_args(tokenizer_dir, dump, *args))
        assert probe["step"] == step, name
        assert sorted(probe["model"]) == sorted(model_keys), name
        for k in model_keys:
            assert torch.equal(probe["model"][k], saved[k]), (name, k)
        loaded = optimizer_tensors(probe)
        assert sum(key == "momentum_buffer" for _, key, _ in loaded) == 6 * 7, name
        for fqn, key, value in loaded:
            assert torch.equal(value, saved["optimizer"][f"state.{fqn}.{key}"]), (name, fqn, key)


def test_tensor_parallel_with_pipeline_parallel_equals_the_naive_path(
    tokenizer_dir, tmp_path, toy_seed
):
    """tp 2 x pp 2 (4 ranks) from one seed checkpoint, fp32 NS, clipping active, 4 steps:
    DMuon (1F1B), DMuon with each row sharing its Newton–Schulz (``tp_ns = "shared"``,
    Interleaved1F1B over 4 stages) and the naive path (every weight on FSDP2 x TP, NS on
    every rank; 1F1B) take the same losses within 1e-5 per step, and the loss falls."""
    common = [
        "--validation.no-enable",
        *from_seed(toy_seed, 4),
        "--training.max_norm",
        "0.1",
        "--dmuon.ns_dtype",
        "float32",
        *TP2,
        *PP2,
    ]
    runs = {
        "dmuon": [],
        "shared": ["--dmuon.tp_ns", "shared", *INTERLEAVED],
        "naive": ["--dmuon.mode", "naive"],
    }
    losses = {}
    for name, extra in runs.items():
        out = run_ok(4, *toy_args(tokenizer_dir, tmp_path / name, *common, *extra))
        assert "Using pipeline schedule" in out
        if name != "naive":
            assert "x 2 tensor-parallel" in out
        losses[name] = tb_losses(tmp_path / name)
        assert sorted(losses[name]) == list(range(1, 5)), name
        assert min(tb_scalars(tmp_path / name, "grad_norm").values()) > 0.1, name
    assert losses["dmuon"][4] < losses["dmuon"][1]
    for name in ("dmuon", "shared"):
        for step in range(1, 5):
            assert abs(losses[name][step] - losses["naive"][step]) <= 1e-5, (name, step)


@pytest.mark.slow
def test_tensor_parallel_with_pipeline_parallel_resumes_loads_and_adds_data_parallelism(
    tokenizer_dir, tmp_path, toy_seed
):
    """(slow: 8 CPU ranks) tp 2 x pp 2: stopped at 3 and resumed, steps 4-6 are
    bit-identical; its step-3 checkpoint loads at tp 2 x pp 1, tp 1 x pp 2 and on one rank
    with identical weights and momentum. tp 2 x pp 2 x dp 2 (8 ranks) equals tp 2 x dp 2
    (4 ranks) within 1e-5 per step over 4 steps."""
    mine = [*TP2, *PP2]
    layouts = {"tp2xpp1": (2, TP2), "tp1xpp2": (2, PP2), "one": (1, [])}
    _resumes_at_3_and_loads(tokenizer_dir, tmp_path, toy_seed, mine, layouts)

    plain = ["--validation.no-enable", *from_seed(toy_seed, 4), "--training.max_norm", "0.1"]
    losses = []
    for n, extra in ((4, TP2), (8, mine)):
        dump = tmp_path / f"dp2_{n}"
        run_ok(n, *toy_args(tokenizer_dir, dump, *plain, *extra))
        losses.append(tb_losses(dump))
    for step in range(1, 5):
        assert abs(losses[0][step] - losses[1][step]) <= 1e-5, (step, losses)


def _tensor_parallel_float8_runs(tokenizer_dir, tmp_path, toy_seed, nproc: int, layout: list):
    """DMuon and the naive path with float8 linears (emulated) on ``layout``, from one seed
    checkpoint, fp32 NS, clipping on, 4 steps with a checkpoint after each: (DMuon's dump,
    the naive path's dump, DMuon's output, the common overrides)."""
    pytest.importorskip("torchao")
    common = [
        *FLOAT8,
        *CONFIG_SEQ_LEN,
        *layout,
        *checkpointed_from(toy_seed, 4, 1),
        "--dmuon.ns_dtype",
        "float32",
        "--training.max_norm",
        "0.5",
        "--training.steps",
        "4",
    ]
    dmuon_dump, naive_dump = tmp_path / "dedicated", tmp_path / "naive"
    out = run_ok(nproc, *toy_args(tokenizer_dir, dmuon_dump, *common))
    assert "Swapped to Float8Linear" in out and "x 2 tensor-parallel" in out
    run_ok(nproc, *toy_args(tokenizer_dir, naive_dump, *common, "--dmuon.mode", "naive"))
    return dmuon_dump, naive_dump, common


def _check_float8_step_one_and_losses(tmp_path, dmuon_dump, naive_dump) -> None:
    """DMuon's first step equals the naive path's: the same loss at step 1 (within 1e-6),
    and after step 1 every Muon matrix and its momentum within 1e-6 of the naive path's
    (relative to the matrix's largest entry). From there float8 rounding, which turns 1e-7
    differences into whole float8 steps for some entries, lets the two drift: step 2's loss
    within 1e-4 (0 on one CPU, 2.9e-5 on another: which entries flip depends on the CPU's
    float32 kernels), later losses within 3e-3 (7.5e-4 seen at step 4; the naive path drifts
    from a one-rank float8 run as much), and the loss falls."""
    ld, ln = tb_losses(dmuon_dump), tb_losses(naive_dump)
    assert sorted(ld) == sorted(ln) == [1, 2, 3, 4]
    assert abs(ld[1] - ln[1]) <= 1e-6, (ld[1], ln[1])
    assert abs(ld[2] - ln[2]) <= 1e-4, (ld[2], ln[2])
    for step in (3, 4):
        assert abs(ld[step] - ln[step]) <= 3e-3, (step, ld[step], ln[step])
    assert ld[4] < ld[1]
    saved = [
        read_checkpoint(d / "checkpoint" / "step-1", tmp_path / d.name)
        for d in (dmuon_dump, naive_dump)
    ]
    momentum = [k for k in saved[1]["optimizer"] if k.endswith(".momentum_buffer")]
    assert len(momentum) == 6 * 7
    for key in momentum:
        weight = key[len("state.") : -len(".momentum_buffer")]
        for mine, theirs in (
            (saved[0][weight], saved[1][weight]),
            (saved[0]["optimizer"][key], saved[1]["optimizer"][key]),
        ):
            assert theirs.abs().max() > 0, key
            assert (mine - theirs).abs().max() <= 1e-6 * theirs.abs().max(), key


def test_tensor_parallel_with_float8_linears_equals_the_naive_path_and_resumes(
    tokenizer_dir, tmp_path, toy_seed
):
    """float8 linears (emulated) under tp 2 (2 CPU ranks; torchtitan 0.2.2 runs them under the
    plain colwise/rowwise styles): DMuon's first step equals the naive path's (every weight on
    FSDP2 x TP, NS on every rank), later losses stay within float8's drift and fall (see
    ``_check_float8_step_one_and_losses``); stopped after step 2 and resumed, steps 3-4 are
    bit-identical. (The one-rank run is no reference here: float8 under TP quantizes other
    tensors than on one rank, and the naive path's first momentum is 4 % off the one-rank
    run's, DMuon's equally.)"""
    dmuon_dump, naive_dump, common = _tensor_parallel_float8_runs(
        tokenizer_dir, tmp_path, toy_seed, 2, TP2
    )
    _check_float8_step_one_and_losses(tmp_path, dmuon_dump, naive_dump)
    resumed = tmp_path / "resumed"
    stop = [*common, "--training.steps", "2"]
    run_ok(2, *toy_args(tokenizer_dir, resumed, *stop))
    out = run_ok(2, *toy_args(tokenizer_dir, resumed, *common))
    assert "Training starts at step 3" in out
    la, lb = tb_losses(dmuon_dump), tb_losses(resumed)
    assert [la[s] for s in (3, 4)] == [lb[s] for s in (3, 4)]


@pytest.mark.slow
def test_tensor_parallel_with_data_parallelism_and_float8_linears_equals_the_naive_path(
    tokenizer_dir, tmp_path, toy_seed
):
    """(slow: 4 CPU ranks) dp 2 x tp 2 with float8 linears (emulated): as the 2-rank test,
    DMuon's first step equals the naive path's and later losses stay within float8's drift."""
    dmuon_dump, naive_dump, _ = _tensor_parallel_float8_runs(
        tokenizer_dir, tmp_path, toy_seed, 4, TP2
    )
    _check_float8_step_one_and_losses(tmp_path, dmuon_dump, naive_dump)
