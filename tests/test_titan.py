"""The torchtitan 0.2.2 plugin, end to end: real ``torchrun`` launches of the toy config on
CPU ranks (gloo), checkpoints through torchtitan's CheckpointManager and DCP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "toy_dmuon.toml"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from dmuon_titan.titan.data import ensure_tokenizer

    return ensure_tokenizer(tmp_path_factory.mktemp("assets") / "tokenizer")


def torchrun(nproc: int, *args: str, script: str | None = None, timeout: int = 600):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    target = [script] if script else ["-m", "torchtitan.train"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *target,
        *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def toy_args(tokenizer_dir, dump: Path, *extra: str) -> list[str]:
    return [
        "--job.config_file",
        str(TOY),
        "--job.dump_folder",
        str(dump),
        "--model.hf_assets_path",
        str(tokenizer_dir),
        "--debug.seed",
        "1234",
        "--metrics.enable_tensorboard",
        *extra,
    ]


def tb_losses(dump: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses: dict[int, float] = {}
    for events in sorted((dump / "tb").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "loss_metrics/global_avg_loss" in acc.Tags()["scalars"]:
            for e in acc.Scalars("loss_metrics/global_avg_loss"):
                losses[e.step] = e.value
    return losses


def read_checkpoint(path: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def run_ok(nproc: int, *args: str, **kw) -> str:
    rc, out = torchrun(nproc, *args, **kw)
    assert rc == 0, out[-6000:]
    return out


def test_toy_dmuon_trains_checkpoints_and_resumes(tokenizer_dir, tmp_path):
    """20 steps with falling loss; stop at 10 and resume → steps 11–20 bit-identical to the
    uninterrupted run; the step-10 checkpoint loads on 1 and 3 ranks with identical weights
    and momentum, and training continues on 1 rank."""
    common = [
        "--lr_scheduler.total_steps",
        "20",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "10",
        "--checkpoint.no-last-save-model-only",
        "--validation.freq",
        "10",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    run_ok(2, *toy_args(tokenizer_dir, a, *common, "--training.steps", "20"))
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
        probe_out = tmp_path / f"probe{nproc}.pt"
        run_ok(
            nproc,
            str(probe_out),
            *toy_args(tokenizer_dir, b, *common, "--checkpoint.load_step", "10", *reshard),
            script=str(REPO / "tests" / "titan_probe.py"),
        )
        probe = torch.load(probe_out, weights_only=False)
        assert probe["step"] == 10 and probe["plan"]["world_size"] == nproc
        for k in model_keys:
            assert torch.equal(probe["model"][k], saved[k]), (nproc, k)
        for fqn, entry in probe["optim"]["state"].items():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    assert torch.equal(value, saved["optimizer"][f"state.{fqn}.{name}"]), (
                        nproc,
                        fqn,
                        name,
                    )
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
