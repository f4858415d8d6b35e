"""The torchtitan 0.2.2 plugin, end to end: multi-rank launches of the toy config on CPU ranks
(gloo), checkpoints through torchtitan's CheckpointManager and DCP. Ranks are forked from one
server that imported torchtitan (``tests/helpers/processes.py``); three bad-config tests and
one training use real ``torchrun``, and ``DMUON_TESTS_FRESH_PROCESSES=1`` (or a CUDA machine)
puts every launch under it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchtitan  # noqa: F401  (a dependency: a failed import must fail, not skip)

from ..helpers import processes

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "configs" / "toy_dmuon.toml"


JOB_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def torchrun(nproc: int, *args: str, script: str | None = None, timeout: int = 600):
    """A real torchrun launch (fresh interpreters): (exit status, output)."""
    env = {
        **os.environ,
        **JOB_ENV,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    target = [script] if script else ["-m", "torchtitan.train"]
    cmd = [
        sys.executable,
        "-m",
        "dmuon_titan.launch",  # torchrun's own launcher, failed ranks reported in one line
        "--standalone",
        f"--nproc_per_node={nproc}",
        *target,
        *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


#: the toy's sequences in the tests: a quarter of the config's 256, a quarter of the
#: forward and backward (most of a CPU step; the step's Newton–Schulz does not change)
TEST_SEQ_LEN = ["--training.seq_len", "64", "--validation.seq_len", "64"]
#: the config's own sequences, for the tests whose bounds were set on them (float8's drift,
#: QK-clip's logits)
CONFIG_SEQ_LEN = ["--training.seq_len", "256", "--validation.seq_len", "256"]


def toy_args(tokenizer_dir, dump: Path, *extra: str, config: Path = TOY) -> list[str]:
    return [
        "--job.config_file",
        str(config),
        "--job.dump_folder",
        str(dump),
        "--model.hf_assets_path",
        str(tokenizer_dir),
        "--debug.seed",
        "1234",
        "--metrics.enable_tensorboard",
        *TEST_SEQ_LEN,
        *extra,
    ]


def tb_scalars(dump: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for events in sorted((dump / "tb").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                values[e.step] = e.value
    return values


def checkpointed_args(total_steps: int, interval: int, validation_freq: int) -> list[str]:
    """Overrides for a stop-and-resume test: the LR schedule fixed to ``total_steps`` (so a
    shorter first run follows the same schedule), full checkpoints every ``interval`` steps."""
    return [
        "--lr_scheduler.total_steps",
        str(total_steps),
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(interval),
        "--checkpoint.no-last-save-model-only",
        "--validation.freq",
        str(validation_freq),
    ]


def checkpointed_from(seed: str, total_steps: int, interval: int) -> list[str]:
    """Overrides for a run from the seed checkpoint ``seed`` that saves every ``interval``
    steps (LR schedule fixed to ``total_steps``), validation off."""
    return [
        "--validation.no-enable",
        *checkpointed_args(total_steps=total_steps, interval=interval, validation_freq=100),
        "--checkpoint.initial_load_path",
        seed,
    ]


def from_seed(seed: str, steps: int) -> list[str]:
    """Overrides for a run of ``steps`` steps that starts from the seed checkpoint ``seed``
    (checkpointing on, so that it can load one, but no interval save within the run)."""
    return [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.initial_load_path",
        seed,
        "--training.steps",
        str(steps),
    ]


def run_probe(nproc: int, out: Path, *args: str) -> dict:
    """``tests/titan/titan_probe.py`` on ``nproc`` ranks with torchtitan ``args``: the step
    and the full model and optimizer state after torchtitan's checkpoint load (or init)."""
    run_ok(nproc, str(out), *args, script=str(REPO / "tests" / "titan" / "titan_probe.py"))
    return torch.load(out, weights_only=False)


def optimizer_tensors(probe: dict) -> list[tuple[str, str, torch.Tensor]]:
    """(fqn, state key, value) of every non-scalar optimizer state tensor a probe holds."""
    return [
        (fqn, key, value)
        for fqn, entry in probe["optim"]["state"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor) and value.ndim > 0
    ]


def tb_losses(dump: Path) -> dict[int, float]:
    return tb_scalars(dump, "loss_metrics/global_avg_loss")


def read_checkpoint(path: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def model_size(out: str) -> int:
    """The parameter count torchtitan logs at start-up (the same on every rank, or an error)."""
    sizes = {int(n.replace(",", "")) for n in re.findall(r"size: ([\d,]+) total parameters", out)}
    assert len(sizes) == 1, sizes
    return sizes.pop()


def flops_per_token(dump: Path) -> float:
    """FLOPs per token behind the logged TFLOPS: tflops / tokens per second, every step."""
    tflops, tps = tb_scalars(dump, "tflops"), tb_scalars(dump, "throughput(tps)")
    ratios = [tflops[s] * 1e12 / tps[s] for s in tflops]  # TensorBoard keeps float32
    assert max(ratios) - min(ratios) <= 1e-6 * max(ratios), ratios
    return sum(ratios) / len(ratios)


def seed_checkpoint(tokenizer_dir, path: Path, *extra: str) -> tuple[str, str]:
    """A one-rank AdamW seed checkpoint (every run started from it has the same weights):
    (its path, the run's output)."""
    out = run_ok(
        1,
        "--job.config_file",
        str(REPO / "configs" / "toy_adamw.toml"),
        "--job.dump_folder",
        str(path),
        "--model.hf_assets_path",
        str(tokenizer_dir),
        *extra,
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
    )
    return str(path / "checkpoint" / "step-0"), out


def launch(nproc: int, *args: str, script: str | None = None, timeout: int = 600):
    """torchtitan (or ``script``) on ``nproc`` forked CPU ranks, as torchrun would run it:
    (exit status, output). Real torchrun where ``processes.FRESH`` says so."""
    if processes.FRESH:
        return torchrun(nproc, *args, script=script, timeout=timeout)
    target = script or "torchtitan.train"
    return processes.launch(nproc, target, list(args), JOB_ENV, REPO, timeout)


def run_ok(nproc: int, *args: str, **kw) -> str:
    rc, out = launch(nproc, *args, **kw)
    assert rc == 0, out[-6000:]
    return out


def test_toy_dmuon_trains_checkpoints_and_resumes(tokenizer_dir, tmp_path):
    """20 steps with falling loss; stop at 10 and resume → steps 11–20 bit-identical to the
    uninterrupted run; the step-10 checkpoint loads on 1 and 3 ranks with identical weights
    and momentum, and training continues on 1 rank. (Blocks by all-gather/reduce-scatter
    where "auto" picks it, so the checkpoint moves between layouts too.)"""
    common = [
        *checkpointed_args(total_steps=20, interval=10, validation_freq=10),
        "--dmuon.collectives",
        "auto",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    out = run_ok(2, *toy_args(tokenizer_dir, a, *common, "--training.steps", "20"))
    assert (
        "DMuon: 42 matrices on 2 ranks (1 replica x 2 shards), 6 hook boundaries" in out
    )  # the partition, at start-up
    assert "by all-gather" in out  # "auto" moved some blocks by all-gather on 2 ranks
    assert "dmuon step: 20  optimizer:" in out  # the per-step line
    for tag in ("dmuon/optimizer_ms", "dmuon/ns_ms"):
        times = tb_scalars(a, tag)
        assert sorted(times) == list(range(1, 21)) and all(t > 0 for t in times.values()), tag
    run_ok(2, *toy_args(tokenizer_dir, b, *common, "--training.steps", "10"))
    out = run_ok(2, *toy_args(tokenizer_dir, b, *common, "--training.steps", "20"))
    assert "Training starts at step 11" in out

    la, lb = tb_losses(a), tb_losses(b)
    assert sorted(la) == list(range(1, 21)) and sorted(lb) == list(range(1, 21))
    first, last = sum(la[s] for s in range(1, 6)) / 5, sum(la[s] for s in range(16, 21)) / 5
    assert last < first - 0.2, (first, last)
    assert [la[s] for s in range(11, 21)] == [lb[s] for s in range(11, 21)]

    ca = read_checkpoint(a / "checkpoint" / "step-20", tmp_path)
    cb = read_checkpoint(b / "checkpoint" / "step-20", tmp_path)
    model_keys = [k for k, v in ca.items() if isinstance(v, torch.Tensor)]
    assert "layers.0.attention.wq.weight" in model_keys
    for k in model_keys:
        assert torch.equal(ca[k], cb[k]), k
    momentum = [k for k in ca["optimizer"] if k.endswith(".momentum_buffer")]
    assert len(momentum) == 6 * 7
    for k, v in ca["optimizer"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, cb["optimizer"][k]), k

    saved = read_checkpoint(b / "checkpoint" / "step-10", tmp_path)
    # torchtitan's data loader cannot change its data-parallel degree; everything else can.
    reshard = ["--checkpoint.exclude_from_loading", "dataloader"]
    for nproc in (1, 3):
        probe = run_probe(
            nproc,
            tmp_path / f"probe{nproc}.pt",
            *toy_args(tokenizer_dir, b, *common, "--checkpoint.load_step", "10", *reshard),
        )
        assert probe["step"] == 10 and probe["plan"]["world_size"] == nproc
        for k in model_keys:
            assert torch.equal(probe["model"][k], saved[k]), (nproc, k)
        for fqn, name, value in optimizer_tensors(probe):
            assert torch.equal(value, saved["optimizer"][f"state.{fqn}.{name}"]), (nproc, fqn, name)
        assert sum("momentum_buffer" in e for e in probe["optim"]["state"].values()) == 6 * 7

    c = tmp_path / "c"
    run_ok(
        1,
        *toy_args(
            tokenizer_dir,
            c,
            *common,
            "--training.steps",
            "12",
            "--checkpoint.initial_load_path",
            str(b / "checkpoint" / "step-10"),
            "--checkpoint.no-initial-load-model-only",
            *reshard,
        ),
    )
    lc = tb_losses(c)
    assert sorted(lc) == [11, 12] and all(v == v and v < 10 for v in lc.values()), lc

    # Narrowing [dmuon] params mid-run: the feed-forward matrices move to AdamW; the step-10
    # checkpoint still loads (their weights as saved, fresh AdamW moments), said in one line.
    d = tmp_path / "d"
    out = run_ok(
        2,
        *toy_args(
            tokenizer_dir,
            d,
            *common,
            "--training.steps",
            "12",
            "--dmuon.params",
            r"layers\.\d+\.attention\.[^.]+\.weight",
            "--checkpoint.initial_load_path",
            str(b / "checkpoint" / "step-10"),
            "--checkpoint.no-initial-load-model-only",
        ),
    )
    assert "18 matrices (layers.0.feed_forward.w1.weight" in out and "moved to AdamW" in out
    ld = tb_losses(d)
    assert sorted(ld) == [11, 12] and abs(ld[11] - lb[11]) < 0.5, (ld, lb[11])


def test_dmuon_equals_the_naive_path_inside_torchtitan(tokenizer_dir, tmp_path):
    """Same seed checkpoint, fp32 params and NS, 2 ranks: DMuon's loss trajectory equals the
    naive path's (every param on FSDP2, all-gather + NS on every rank) within 1e-5 per step."""
    seed, seed_out = seed_checkpoint(tokenizer_dir, tmp_path / "seed", "--debug.seed", "7")
    losses, sizes, flops = {}, {}, {}
    for mode in ("dedicated", "naive"):
        dump = tmp_path / mode
        out = run_ok(
            2,
            *toy_args(
                tokenizer_dir,
                dump,
                "--dmuon.mode",
                mode,
                "--dmuon.ns_dtype",
                "float32",
                "--validation.freq",
                "100",
                *from_seed(seed, 10),
            ),
        )
        losses[mode] = tb_losses(dump)
        sizes[mode], flops[mode] = model_size(out), flops_per_token(dump)
    # The logged model size, FLOPs per token, TFLOPS and MFU count every matrix once: the
    # same with DMuon as with everything on FSDP2 (naive) and as AdamW's seed run.
    assert sizes["dedicated"] == sizes["naive"] == model_size(seed_out) == 6_163_712
    assert flops["dedicated"] == pytest.approx(flops["naive"], rel=1e-6)
    assert sorted(losses["dedicated"]) == list(range(1, 11))
    worst = max(abs(losses["dedicated"][s] - losses["naive"][s]) for s in range(1, 11))
    print(f"largest per-step loss difference, DMuon vs naive: {worst:.2e}")
    for step in range(1, 11):
        d, n = losses["dedicated"][step], losses["naive"][step]
        assert abs(d - n) <= 1e-5, (step, d, n)
    assert losses["dedicated"][10] < losses["dedicated"][1]


# ------------------------------------------------------------------ invalid configurations
BAD_VALUES = [
    (["--dmuon.ns_steps", "0"], "[dmuon] ns_steps"),
    (["--dmuon.ns_steps", "100"], "[dmuon] ns_steps"),
    (["--dmuon.ns_coefficients", "cubic"], "[dmuon] ns_coefficients"),
    (["--dmuon.ns_dtype", "float8"], "[dmuon] ns_dtype"),
    (["--dmuon.momentum", "1.0"], "[dmuon] momentum"),
    (["--dmuon.momentum", "-0.1"], "[dmuon] momentum"),
    (["--dmuon.adjust_lr_fn", "rms"], "[dmuon] adjust_lr_fn"),
    (["--dmuon.mode", "fast"], "[dmuon] mode"),
    (["--dmuon.hook_boundary", "layer"], "[dmuon] hook_boundary"),
    (["--dmuon.params", "(("], "[dmuon] params"),
    (["--dmuon.lr", "-1"], "[dmuon] lr"),
    (["--dmuon.weight_decay", "-0.5"], "[dmuon] weight_decay"),
    (["--dmuon.ns_eps", "0"], "[dmuon] ns_eps"),
    (["--dmuon.small_param_numel", "-1"], "[dmuon] small_param_numel"),
    (["--dmuon.ns_batch_numel", "-5"], "[dmuon] ns_batch_numel"),
    (["--dmuon.ns_algorithm", "fast"], "[dmuon] ns_algorithm"),
    (["--dmuon.collectives", "ring"], "[dmuon] collectives"),
    (["--dmuon.qk_clip_threshold", "-1"], "[dmuon] qk_clip_threshold"),
]


@pytest.mark.parametrize("override, key", BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_bad_dmuon_value_is_named_at_parse_time(override, key):
    from torchtitan.config import ConfigManager

    with pytest.raises(SystemExit) as err:
        ConfigManager().parse_args(["--job.config_file", str(TOY), *override])
    assert key in str(err.value)


def test_bad_toml_values_and_keys_are_named(tmp_path):
    from torchtitan.config import ConfigManager

    cases = [
        ("[dmuon]\nns_step = 3\n", "ns_step"),
        ("[dmuon]\nns_steps = 'five'\n", "[dmuon] ns_steps"),
        ("[dmuon]\nparams = 'layers'\n", "[dmuon] params"),
        ("[dmuon]\nnesterov = 1\n", "[dmuon] nesterov"),
        ("[muon]\nlr = 1\n", "muon"),
    ]
    base = TOY.read_text().split("\n[dmuon]")[0] + "\n"
    for i, (section, key) in enumerate(cases):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(base + section)
        with pytest.raises(SystemExit) as err:
            ConfigManager().parse_args(["--job.config_file", str(path)])
        assert key in str(err.value), (section, str(err.value))


#: (config, overrides, what the one line names), by id: a mistake of each kind the plugin checks,
#: from the config alone (parse time, converter) or with the model built (selection)
BAD_CONFIGS = {
    "no-match": (
        "toy_dmuon.toml",
        ["--dmuon.params", "layers\\.\\d+\\.moe\\..*"],
        "matches no parameter",
    ),
    "not-2d": (
        "toy_dmuon.toml",
        ["--dmuon.params", "layers\\.\\d+\\.attention_norm\\.weight"],
        "2-D",
    ),
    "converter-without-dmuon": (
        "toy_dmuon.toml",
        ["--optimizer.name", "AdamW"],
        "[optimizer] name",
    ),
    "dmuon-without-converter": ("toy_adamw.toml", ["--optimizer.name", "DMuon"], "converters"),
    "ns_steps": ("toy_dmuon.toml", ["--dmuon.ns_steps", "0"], "[dmuon] ns_steps"),
    "no-config-module": ("no-config-module", [], "custom_config_module"),
    "unserved-model": (
        "toy_dmuon.toml",
        ["--model.name", "llama3_ft"],
        "[model] name = 'llama3_ft'",
    ),
    "tied-weight": (
        "toy_dmuon.toml",
        ["--model.name", "qwen3", "--dmuon.params", "output\\.weight"],
        "'output.weight', a tied weight",
    ),
    "float8-after-dmuon": (
        "toy_dmuon.toml",
        ["--model.converters", "dmuon,quantize.linear.float8"],
        'put "dmuon" after "quantize.linear.float8"',
    ),
    "mx": (
        "toy_dmuon.toml",
        ["--model.converters", "dmuon,quantize.linear.mx"],
        "['quantize.linear.mx'] not supported with DMuon",
    ),
    "pp-zero-bubble": (
        "toy_dmuon.toml",
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
        ],
        "parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble'",
    ),
    "float8-all-gather": (
        "toy_dmuon.toml",
        [
            "--model.converters",
            "quantize.linear.float8,dmuon",
            "--quantize.linear.float8.emulate",
            "--quantize.linear.float8.enable_fsdp_float8_all_gather",
        ],
        "quantize.linear.float8.enable_fsdp_float8_all_gather = true",
    ),
}
#: the ones launched under real torchrun, for the launcher's line: one per stage of checking
UNDER_TORCHRUN = ["ns_steps", "float8-after-dmuon", "no-match"]


def _bad_config_args(tokenizer_dir, tmp_path, config: str, override: list[str]) -> list[str]:
    path = REPO / "configs" / config
    if config == "no-config-module":  # the four lines minus custom_config_module, no [dmuon]
        text = TOY.read_text().split("\n[dmuon]")[0]
        path = tmp_path / "no_config_module.toml"
        path.write_text(
            "\n".join(line for line in text.splitlines() if "custom_config_module" not in line)
        )
    return [
        "--job.config_file",
        str(path),
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--model.hf_assets_path",
        str(tokenizer_dir),
        *override,
    ]


def _assert_one_clean_line(rc: int, out: str, key: str) -> None:
    assert rc != 0
    assert out.count("dmuon_titan config error") == 1 and key in out, out[-3000:]
    assert "Traceback (most recent call last)" not in out, out[-3000:]


@pytest.mark.parametrize("name", [n for n in BAD_CONFIGS if n not in UNDER_TORCHRUN])
def test_bad_config_exits_in_one_line(tokenizer_dir, tmp_path, name):
    """Each mistake on 2 ranks: a non-zero exit, one line naming the key printed once (by
    rank 0), no Python traceback from any rank."""
    config, override, key = BAD_CONFIGS[name]
    rc, out = launch(2, *_bad_config_args(tokenizer_dir, tmp_path, config, override), timeout=300)
    _assert_one_clean_line(rc, out, key)


@pytest.mark.parametrize("name", UNDER_TORCHRUN)
def test_bad_config_exits_cleanly_under_torchrun(tokenizer_dir, tmp_path, name):
    """As above, under real torchrun, and no traceback from the launcher either
    (``python -m dmuon_titan.launch``, torchrun's launcher with failed ranks in one line)."""
    config, override, key = BAD_CONFIGS[name]
    rc, out = torchrun(2, *_bad_config_args(tokenizer_dir, tmp_path, config, override), timeout=300)
    _assert_one_clean_line(rc, out, key)
    assert "dmuon_titan launch: torchtitan.train failed: rank " in out, out[-3000:]


def test_resuming_another_optimizers_checkpoint_is_one_line(tokenizer_dir, tmp_path):
    """An AdamW run's checkpoint resumed with DMuon (the optimizer state cannot carry over):
    one line naming the way to start from its weights, printed once, no traceback."""
    dump = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1", "--validation.freq", "100"]
    adamw = REPO / "configs" / "toy_adamw.toml"
    run_ok(1, *toy_args(tokenizer_dir, dump, *ckpt, "--training.steps", "1", config=adamw))
    rc, out = launch(2, *toy_args(tokenizer_dir, dump, *ckpt, "--training.steps", "2"))
    _assert_one_clean_line(rc, out, "initial_load_model_only")


def test_every_dcp_save_drains_first(cpu_mesh):
    """The CheckpointManager hook: wait_all_replicate_broadcasts runs before the save."""
    from unittest import mock

    from torchtitan.components.checkpoint import CheckpointManager

    import dmuon_titan as dmuon
    import dmuon_titan.titan  # noqa: F401  (installs the hooks)
    from dmuon_titan.titan import checkpoint as plugin

    from ..helpers.models import ToyTransformer, dedicated_predicate

    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    calls = []
    manager = mock.Mock(states={"model": plugin.DMuonModelWrapper([model])})
    with mock.patch.object(
        plugin, "wait_all_replicate_broadcasts", side_effect=lambda m: calls.append(("drain", m))
    ):
        inner = mock.Mock(side_effect=lambda *a, **k: calls.append(("save",)))
        plugin._draining(inner)(manager, {"x": 1}, checkpoint_id="c")
    assert calls == [("drain", model), ("save",)]
    assert getattr(CheckpointManager.dcp_save, "_dmuon_draining", False)
    # and the model state dict handed to DCP is the owner-only form
    sd = manager.states["model"].state_dict()
    assert set(sd) == set(dmuon.get_model_state_dict(model, full=False))


def test_hsdp_toy_trains_and_resumes_on_4_ranks(tokenizer_dir, tmp_path):
    """data_parallel_replicate_degree = 2 on 4 CPU ranks (2 replicas x 2 shards): trains, and
    resuming from step 3 reproduces steps 4-6 bit for bit."""
    common = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        *checkpointed_args(total_steps=6, interval=3, validation_freq=100),
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    out = run_ok(4, *toy_args(tokenizer_dir, a, *common, "--training.steps", "6"))
    assert "DMuon: 42 matrices on 4 ranks (2 replicas x 2 shards)" in out
    run_ok(4, *toy_args(tokenizer_dir, b, *common, "--training.steps", "3"))
    out = run_ok(4, *toy_args(tokenizer_dir, b, *common, "--training.steps", "6"))
    assert "Training starts at step 4" in out
    la, lb = tb_losses(a), tb_losses(b)
    assert sorted(la) == list(range(1, 7)) and la[6] < la[1]
    assert [la[s] for s in (4, 5, 6)] == [lb[s] for s in (4, 5, 6)]


def test_ddp_toy_trains(tokenizer_dir, tmp_path):
    """Pure replication (torchtitan's DDP): DMuon plans over the 2 replicas. Under real
    torchrun, as the README's command runs: a training that ends well exits with status 0
    (fresh interpreters, whose teardown ``dmuon_titan.toy.exit`` shortens)."""
    rc, out = torchrun(
        2,
        *toy_args(
            tokenizer_dir,
            tmp_path,
            "--training.steps",
            "4",
            "--validation.freq",
            "100",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ),
    )
    assert rc == 0, out[-6000:]
    assert "DMuon: 42 matrices on 2 ranks (2 replicas x 1 shard)" in out
    losses = tb_losses(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]


def test_dedicated_matrices_initialize_alike_at_any_world_size(tokenizer_dir, tmp_path):
    """torchtitan seeds every rank alike; the plugin initializes each dedicated matrix from
    its name and that seed (``dmuon.independent_init``): the 42 matrices of a fresh toy model
    are the same on 1 and 2 ranks, and no two are equal."""
    weights = {}
    for nproc in (1, 2):
        probe = run_probe(
            nproc, tmp_path / f"init{nproc}.pt", *toy_args(tokenizer_dir, tmp_path / f"run{nproc}")
        )
        assert probe["step"] == 0
        dedicated = {p["fqn"] for p in probe["plan"]["params"]}
        weights[nproc] = {k: v for k, v in probe["model"].items() if k in dedicated}
    one, two = weights[1], weights[2]
    assert len(one) == 42 and sorted(one) == sorted(two)
    for k, v in one.items():
        assert torch.equal(two[k], v), k
    values = list(one.values())
    for i, a in enumerate(values):
        for b in values[i + 1 :]:
            assert a.shape != b.shape or not torch.equal(a, b)
