"""QK-clip in torchtitan (``[dmuon] qk_clip_threshold``): the toy config on 2 CPU ranks at a
learning rate where its attention logits grow (0.65 at step 1, about 2.8 by step 12)."""

from __future__ import annotations

import shutil

import pytest

from .test_titan import (
    CONFIG_SEQ_LEN,
    checkpointed_args,
    from_seed,
    run_ok,
    tb_losses,
    tb_scalars,
    toy_args,
)

STEPS = 12
TAU = 1.5
HOT = ["--optimizer.lr", "3e-2", "--lr_scheduler.warmup_steps", "1", "--validation.freq", "100"]
HOT += CONFIG_SEQ_LEN


def _run(tokenizer_dir, dump, *extra, steps=STEPS, ranks=2):
    args = toy_args(tokenizer_dir, dump, *HOT, "--training.steps", str(steps), *extra)
    out = run_ok(ranks, *args)
    return out, tb_scalars(dump, "dmuon/max_attention_logit"), tb_losses(dump)


def _clipped(tokenizer_dir, dump, *extra, steps=STEPS, ranks=2):
    clip = ("--dmuon.qk_clip_threshold", str(TAU))
    return _run(tokenizer_dir, dump, *clip, *extra, steps=steps, ranks=ranks)


def test_qk_clip_holds_the_logits_and_changes_nothing_else(tokenizer_dir, tmp_path):
    """Tracking with a threshold no logit reaches changes no bit of training (the losses of
    the run without the clip) and logs logits growing past 1.8 τ. With τ heads are clipped
    and the logged maxima stay under 1.5 τ, ending below 0.8 of the unclipped run's: each
    step's maximum is measured in its forward, before its own clip, on weights that the
    last clip brought to τ for the last batch and one update then moved (at this learning
    rate an update raises the toy's logits by up to 30 %)."""
    _, _, off = _run(tokenizer_dir, tmp_path / "off")
    out, tracked, same = _run(
        tokenizer_dir, tmp_path / "tracked", "--dmuon.qk_clip_threshold", "1e9"
    )
    assert same == off
    assert sorted(tracked) == list(range(1, STEPS + 1))
    assert tracked[1] < TAU and max(tracked.values()) > 1.8 * TAU, tracked
    out, clipped, losses = _clipped(tokenizer_dir, tmp_path / "clipped")
    heads = tb_scalars(tmp_path / "clipped", "dmuon/clipped_heads")
    assert "DMuon QK-clip: threshold 1.5 on 6 attention modules" in out
    assert max(clipped.values()) <= 1.5 * TAU, clipped
    assert clipped[STEPS] < 0.8 * tracked[STEPS], (clipped, tracked)
    assert sum(heads.values()) > 0 and "clipped heads:" in out
    assert losses[STEPS] < losses[1]


def test_qk_clip_under_tensor_parallelism(tokenizer_dir, tmp_path):
    """tp 2 on 2 ranks, 4 sequences a step as the data-parallel runs above (each rank tracks
    half of every layer's heads, the owners rescale whole masters; exactness is
    tests/distributed/test_qk_clip.py's at tp 2 x dp 2): with the clip every attention module
    is served, heads are clipped, and the last maximum ends below 0.8 of the run with
    tracking alone (which grows past 1.8 τ)."""
    tp_args = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
    _, tracked, _ = _run(
        tokenizer_dir, tmp_path / "tracked", "--dmuon.qk_clip_threshold", "1e9", *tp_args
    )
    out, clipped, losses = _clipped(tokenizer_dir, tmp_path / "tp", *tp_args)
    heads = tb_scalars(tmp_path / "tp", "dmuon/clipped_heads")
    assert "DMuon QK-clip: threshold 1.5 on 6 attention modules" in out
    assert sorted(clipped) == list(range(1, STEPS + 1))
    assert max(tracked.values()) > 1.8 * TAU, tracked
    assert clipped[STEPS] < 0.8 * tracked[STEPS], (clipped, tracked)
    assert sum(heads.values()) > 0 and losses[STEPS] < losses[1]


def _figures(dump):
    """(losses, logged maximum logits, clipped heads) per step, from a run's TensorBoard."""
    return (
        tb_losses(dump),
        tb_scalars(dump, "dmuon/max_attention_logit"),
        tb_scalars(dump, "dmuon/clipped_heads"),
    )


def _one_rank_and_two(tokenizer_dir, tmp_path, common, two_ranks):
    """:func:`_figures` of the run of ``common`` on one rank, and on 2 with ``two_ranks``."""
    figures = []
    for name, ranks, extra in (("one", 1, []), ("two", 2, two_ranks)):
        run_ok(ranks, *toy_args(tokenizer_dir, tmp_path / name, *common, *extra))
        figures.append(_figures(tmp_path / name))
    return figures


def test_qk_clip_under_pipeline_parallelism(tokenizer_dir, tmp_path, toy_seed):
    """pp 2 on 2 ranks, Interleaved1F1B (4 stages, two a rank; each stage's maxima combined
    over its own ranks, the logged figures over the stages), from one seed checkpoint:
    every step's loss, logged maximum logit and clipped heads equal the one-rank run's
    (loss and logit within 1e-5; max_norm 0.1 makes the PP gradients comparable, see
    test_compose's pipeline test), and heads are clipped."""
    common = [
        *HOT,
        *from_seed(toy_seed, 8),
        "--training.max_norm",
        "0.1",
        "--dmuon.qk_clip_threshold",
        str(TAU),
    ]
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    pp += ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    one, two = _one_rank_and_two(tokenizer_dir, tmp_path, common, pp)
    (loss, logit, heads), (pp_loss, pp_logit, pp_heads) = one, two
    assert sorted(pp_logit) == list(range(1, 9)) and sum(heads.values()) > 0, (logit, heads)
    assert pp_heads == heads, (pp_heads, heads)
    for step in range(1, 9):
        assert abs(pp_loss[step] - loss[step]) <= 1e-5, (step, pp_loss[step], loss[step])
        assert abs(pp_logit[step] - logit[step]) <= 1e-5, (step, pp_logit[step], logit[step])


def test_qk_clip_under_context_parallelism(tokenizer_dir, tmp_path, toy_seed):
    """cp 2 on 2 ranks (torch's ring attention, the sequence laid out head-tail), from one
    seed checkpoint: each rank's query rows are held against every rank's keys, so every
    step's loss, logged maximum logit and clipped heads equal the one-rank run's (loss within
    1e-5, float32 NS, as test_compose's context-parallel test; the logit within 2e-5 of
    itself), and heads are clipped."""
    common = [*HOT, *from_seed(toy_seed, 8), "--dmuon.ns_dtype", "float32"]
    common += ["--dmuon.qk_clip_threshold", str(TAU)]
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    one, two = _one_rank_and_two(tokenizer_dir, tmp_path, common, cp2)
    (loss, logit, heads), (cp_loss, cp_logit, cp_heads) = one, two
    assert sorted(cp_logit) == list(range(1, 9)) and sum(heads.values()) > 0, (logit, heads)
    assert cp_heads == heads, (cp_heads, heads)
    for step in range(1, 9):
        assert abs(cp_loss[step] - loss[step]) <= 1e-5, (step, cp_loss[step], loss[step])
        # (the runs drift by ring attention's float32 rounding: 1.4e-5 of 1.52 by step 6)
        assert abs(cp_logit[step] - logit[step]) <= 2e-5 * logit[step], (step, cp_logit, logit)


@pytest.mark.slow
def test_qk_clip_on_latent_attention_under_expert_parallelism(tokenizer_dir, tmp_path):
    """deepseek_v3 debugmodel (MLA: wq and wkv_b's per-head rows, the shared rotary key
    untouched; its own softmax scale) at ep 2 on 2 ranks, 8 steps at the hot learning rate,
    where one update can double its logits: tracking alone sees them grow past 1.8 τ; with
    τ heads are clipped, the largest and the last maxima end below 0.7 and 0.8 of the
    tracked run's, and the loss falls."""
    from .test_models import EP2, model_args

    common = [*model_args("deepseek_v3", "debugmodel", 8), *HOT, "--training.steps", "8", *EP2]
    figures = {}
    for name, tau in (("tracked", "1e9"), ("clipped", str(TAU))):
        dump = tmp_path / name
        out = run_ok(2, *toy_args(tokenizer_dir, dump, *common, "--dmuon.qk_clip_threshold", tau))
        assert "on 6 attention modules (layers.0.attention" in out
        figures[name] = _figures(dump)
    (_, tracked, _), (losses, clipped, heads) = figures["tracked"], figures["clipped"]
    assert sorted(clipped) == list(range(1, 9)) and max(tracked.values()) > 1.8 * TAU, tracked
    assert sum(heads.values()) > 0, heads
    assert max(clipped.values()) < 0.7 * max(tracked.values()), (clipped, tracked)
    assert clipped[8] < 0.8 * tracked[8] and losses[8] < losses[1], (clipped, losses)


@pytest.mark.slow
def test_qk_clip_resumes_bit_exactly(tokenizer_dir, tmp_path):
    """Stopped at step 6 and resumed: steps 7-12 (losses and logged maxima) bit-identical to
    the uninterrupted run."""
    saving = checkpointed_args(total_steps=STEPS, interval=6, validation_freq=100)
    _, whole_max, whole = _clipped(tokenizer_dir, tmp_path / "whole", *saving)
    _clipped(tokenizer_dir, tmp_path / "parts", *saving, steps=6)
    shutil.rmtree(tmp_path / "parts" / "tb")
    _, part_max, part = _clipped(tokenizer_dir, tmp_path / "parts", *saving)
    assert sorted(part) == list(range(7, STEPS + 1)), part
    assert all(part[s] == whole[s] and part_max[s] == whole_max[s] for s in part)
