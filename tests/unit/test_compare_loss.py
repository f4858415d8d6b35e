"""scripts/analysis/compare_loss.py: parsing torchtitan logs and the steps-to-reach
comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..helpers import analysis_script

compare_loss = analysis_script("compare_loss")

ESC = "\x1b"


def _log(path: Path, train: dict[int, float], valid: dict[int, float], t0: int = 0) -> Path:
    """A log in torchtitan 0.2.2's console format (colour codes included), 1 s per step."""
    lines = ["[rank0]:[titan] 2026-11-30 10:00:00,000 - root - INFO - Starting job"]
    for step, loss in train.items():
        sec = t0 + step
        stamp = f"2026-11-30 10:{sec // 60:02d}:{sec % 60:02d},500"
        lines.append(
            f"[rank0]:[titan] {stamp} - root - INFO - {ESC}[31mstep: {step:2}  {ESC}[32mloss: "
            f"{loss:8.5f}  {ESC}[38;2;54;234;195mmemory:  1.00GiB(1.0%)  {ESC}[34mtps: 1,000{ESC}[39m"
        )
        if step in valid:
            lines.append(
                f"[rank0]:[titan] {stamp} - root - INFO - {ESC}[33mvalidate step: {step:2}  "
                f"{ESC}[32mloss: {valid[step]:7.4f}  {ESC}[34mtps: 9,000{ESC}[39m"
            )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parse_and_compare(tmp_path):
    base = _log(
        tmp_path / "adamw_lr0.002.log",
        {s: 10.0 - s * 0.1 for s in range(1, 41)},
        {10: 6.0, 20: 5.0, 30: 4.5, 40: 4.2},
    )
    fast = _log(
        tmp_path / "dmuon_lr0.002.log",
        {s: 10.0 - s * 0.2 for s in range(1, 41)},
        {10: 5.5, 20: 4.6, 30: 4.0, 40: 3.8},
    )
    runs = [compare_loss.parse_log(base), compare_loss.parse_log(fast)]
    assert (runs[0].optimizer, runs[0].lr, runs[1].optimizer) == ("adamw", 0.002, "dmuon")
    assert len(runs[0].train) == 40 and runs[0].train[4] == (5, 4.0, pytest.approx(9.5))
    assert [v[0] for v in runs[1].valid] == [10, 20, 30, 40]
    assert runs[1].valid[-1][1] == 39.0  # seconds since the first training step
    (row,) = compare_loss.compare(runs, "adamw")
    # 4.2 lies between step 20 (4.6) and step 30 (4.0): 20 + 10 * 0.4 / 0.6
    assert row["challenger_steps_to_baseline_final"] == pytest.approx(20 + 10 * 0.4 / 0.6)
    assert row["step_ratio"] == pytest.approx((20 + 10 * 0.4 / 0.6) / 40)
    # The baseline never reaches the challenger's final loss.
    assert compare_loss.steps_to_reach(runs[0], runs[1].final_valid) is None


def test_not_a_log(tmp_path):
    (tmp_path / "x.log").write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no training steps"):
        compare_loss.parse_log(tmp_path / "x.log")


def test_170m_flavor_registered():
    torch = pytest.importorskip("torch")
    from torchtitan.protocols.train_spec import get_train_spec

    import dmuon_titan.toy  # noqa: F401  (registers the flavor)

    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["170M"])
    assert sum(p.numel() for p in model.parameters()) == 170_943_488


def test_8b_8layers_flavor_is_8b_with_fewer_blocks():
    torch = pytest.importorskip("torch")
    from torchtitan.protocols.train_spec import get_train_spec

    import dmuon_titan.toy  # noqa: F401  (registers the flavor)

    spec = get_train_spec("llama3")
    with torch.device("meta"):
        small = spec.model_cls(spec.model_args["8B_8layers"])
        full = spec.model_cls(spec.model_args["8B"])
    assert len(small.layers) == 8 and len(full.layers) == 32
    assert {n: p.shape for n, p in small.layers["7"].named_parameters()} == {
        n: p.shape for n, p in full.layers["7"].named_parameters()
    }
    assert small.tok_embeddings.weight.shape == full.tok_embeddings.weight.shape == (128256, 4096)


def test_challenger_lr_without_baseline_run_uses_the_best_baseline(tmp_path):
    good = _log(tmp_path / "adamw_lr0.001.log", {1: 9.0, 2: 8.0}, {2: 4.0})
    bad = _log(tmp_path / "adamw_lr0.004.log", {1: 9.0, 2: 8.0}, {2: 5.0})
    other = _log(tmp_path / "dmuon_lr0.002.log", {1: 9.0, 2: 8.0}, {1: 4.5, 2: 3.5})
    runs = [compare_loss.parse_log(p) for p in (good, bad, other)]
    (row,) = compare_loss.compare(runs, "adamw")
    assert row["baseline"] == "adamw_lr0.001"
    assert row["challenger_steps_to_baseline_final"] == pytest.approx(1.5)
