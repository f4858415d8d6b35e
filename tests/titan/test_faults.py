"""Faults that must end in one line: a bad tensor-parallel degree, a checkpoint whose files
are missing or truncated, another torchtitan release, the plugin's lines on a machine without
a GPU. Each launched by plain torchrun and by ``python -m dmuon_titan.launch`` (fresh
interpreters, as a user runs them): a non-zero exit, the key or file named once, and no
traceback from the ranks (plain torchrun prints its own launcher's, which is not ours)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_titan import JOB_ENV, REPO, TOY, run_ok, toy_args

LAUNCHERS = {
    "torchrun": ["-m", "torch.distributed.run"],
    "dmuon_titan.launch": ["-m", "dmuon_titan.launch"],
}


def _launch(launcher: str, nproc: int, args: list[str], env: dict | None = None):
    """(exit status, output) of torchtitan on ``nproc`` CPU ranks under ``launcher``."""
    env = {
        **os.environ,
        **JOB_ENV,
        **(env or {}),
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (env.get("PYTHONPATH_FIRST", ""), str(REPO), os.environ.get("PYTHONPATH", ""))
        if p
    )
    cmd = [sys.executable, *LAUNCHERS[launcher], "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "torchtitan.train", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def rank_tracebacks(out: str) -> list[str]:
    """The Python tracebacks in ``out`` that are not torchrun's own (its launcher raises
    ``ChildFailedError`` out of ``torch/distributed/run.py`` when a rank fails)."""
    blocks = out.split("Traceback (most recent call last):")[1:]
    launcher = ("torch/distributed/run.py", "torch/distributed/elastic")
    return [b for b in blocks if not any(frame in b for frame in launcher)]


def assert_one_line(rc: int, out: str, *named: str) -> None:
    assert rc != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "dmuon_titan config error" in line]
    assert len(lines) == 1, out[-3000:]
    for text in named:
        assert text in lines[0], (text, lines[0])
    assert not rank_tracebacks(out), out[-3000:]


@pytest.fixture(scope="module")
def saved_run(tokenizer_dir, tmp_path_factory) -> Path:
    """A 2-rank DMuon run with a checkpoint at step 1 (its dump folder)."""
    dump = tmp_path_factory.mktemp("faults") / "saved"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1", "--training.steps", "1"]
    run_ok(2, *toy_args(tokenizer_dir, dump, *ckpt, "--validation.no-enable"))
    return dump


def _resume_args(tokenizer_dir, dump: Path) -> list[str]:
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1", "--training.steps", "2"]
    return toy_args(tokenizer_dir, dump, *ckpt, "--validation.no-enable")


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("fault", ["truncated", "deleted"])
def test_an_unreadable_checkpoint_is_one_line(tokenizer_dir, tmp_path, saved_run, fault, launcher):
    """A shard of the step-1 checkpoint cut to half its size, or deleted: resuming ends in one
    line naming the step folder and the file, before DCP reads anything."""
    dump = tmp_path / "run"
    shutil.copytree(saved_run, dump)
    shard = dump / "checkpoint" / "step-1" / "__1_0.distcp"
    if fault == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    else:
        shard.unlink()
    rc, out = _launch(launcher, 2, _resume_args(tokenizer_dir, dump))
    word = "truncated" if fault == "truncated" else "missing"
    assert_one_line(rc, out, str(dump / "checkpoint" / "step-1"), f"__1_0.distcp is {word}")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_another_torchtitan_release_is_one_line(tokenizer_dir, tmp_path, launcher):
    """torchtitan 0.3.0's metadata found first on the path (the 0.2.2 modules stay
    importable): one line naming the installed and the supported release."""
    fake = tmp_path / "site"
    info = fake / "torchtitan-0.3.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchtitan\nVersion: 0.3.0\n")
    args = toy_args(tokenizer_dir, tmp_path / "out", "--training.steps", "1")
    rc, out = _launch(launcher, 2, args, env={"PYTHONPATH_FIRST": str(fake)})
    assert_one_line(rc, out, "torchtitan 0.3.0 is installed", "torchtitan 0.2.2")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_plugin_lines_on_a_machine_without_a_gpu_are_one_line(
    tokenizer_dir, tmp_path, launcher
):
    """The README's lines (``custom_import = "dmuon_titan.titan"``) on CPU: torchtitan 0.2.2
    trains on CUDA only, so one line saying to import ``dmuon_titan.toy`` instead."""
    config = tmp_path / "readme_lines.toml"
    config.write_text(
        TOY.read_text().replace(
            'custom_import = "dmuon_titan.toy"', 'custom_import = "dmuon_titan.titan"'
        )
    )
    assert 'custom_import = "dmuon_titan.titan"' in config.read_text()
    args = toy_args(tokenizer_dir, tmp_path / "out", "--training.steps", "1", config=config)
    rc, out = _launch(launcher, 2, args)
    assert_one_line(rc, out, "no GPU", 'custom_import = "dmuon_titan.toy"')


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_tensor_parallel_degree_that_divides_no_matrix_is_one_line(
    tokenizer_dir, tmp_path, launcher
):
    """``tensor_parallel_degree = 3`` on 3 ranks, which divides no dimension of the toy's
    matrices (``dedicate_params``' own check, before any collective): one line naming the
    degree, printed once."""
    args = toy_args(
        tokenizer_dir,
        tmp_path / "out",
        "--training.steps",
        "1",
        "--parallelism.tensor_parallel_degree",
        "3",
    )
    rc, out = _launch(launcher, 3, args)
    assert_one_line(rc, out, "tensor_parallel_degree")
