"""scripts/analysis/pool_rounds.py: pairing runs into rounds, the pooled statistics."""

from __future__ import annotations

import pytest

from ..helpers import analysis_script

pool_rounds = analysis_script("pool_rounds")

HEADER = (
    "| run | steps | step time (s) | tok/s/device | peak mem (GiB) | optimizer (ms) | NS (ms) "
    "| step time / first | validation tok/s (median) |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
)


def _row(name: str, tok_s: int) -> str:
    return f"| /out/{name} | 200 | 0.050 | {tok_s:,} | 8.0 | - | - | 1.000 | 300,000 |\n"


def test_rounds_pair_by_number_within_a_file(tmp_path):
    one = tmp_path / "one.md"
    one.write_text(
        HEADER
        + _row("throughput_dmuon_auto_1.log", 90_000)
        + _row("throughput_adamw_1.log", 100_000)
        + _row("throughput_dmuon_1.log", 120_000)
        + _row("throughput_adamw_2.log", 80_000)
        + _row("throughput_dmuon_2.log", 60_000)
        + _row("throughput_dmuon_3.log", 70_000)  # no AdamW run in round 3: left out
        + _row("throughput_dmuon_z3_2.log", 40_000)  # a variant name with a digit
    )
    two = tmp_path / "two.md"  # round 1 again, another file: a round of its own
    two.write_text(
        HEADER + _row("throughput_adamw_1.log", 50_000) + _row("throughput_dmuon_1.log", 45_000)
    )
    rounds = pool_rounds.paired_rounds([one, two])
    assert [(r["round"], r["base"]) for r in rounds] == [(1, 100_000), (2, 80_000), (1, 50_000)]
    assert rounds[0]["dmuon_auto"] == 0.9 and rounds[0]["dmuon"] == 1.2
    assert rounds[1]["dmuon"] == 0.75 and "dmuon_auto" not in rounds[1]
    assert rounds[1]["dmuon_z3"] == 0.5
    assert rounds[2]["dmuon"] == 0.9


def test_another_baseline(tmp_path):
    worker = tmp_path / "worker.md"
    worker.write_text(
        HEADER
        + _row("throughput_adamw_1.log", 150_000)
        + _row("throughput_adamw_w_1.log", 200_000)
        + _row("throughput_dmuon_auto_w_1.log", 170_000)
    )
    (record,) = pool_rounds.paired_rounds([worker], baseline="adamw_w")
    assert record["base"] == 200_000
    assert record["adamw"] == 0.75 and record["dmuon_auto_w"] == 0.85


def test_a_run_listed_twice_is_refused(tmp_path):
    twice = tmp_path / "twice.md"
    twice.write_text(HEADER + _row("throughput_adamw_1.log", 1) + _row("throughput_adamw_1.log", 2))
    with pytest.raises(SystemExit, match="listed twice"):
        pool_rounds.read_runs(twice)


def test_sign_test_and_bootstrap():
    assert pool_rounds.sign_test(3, 3) == 1 / 8  # all three heads
    assert pool_rounds.sign_test(2, 3) == 4 / 8  # three ways to get two, one to get three
    assert abs(pool_rounds.sign_test(14, 22) - 0.1431) < 1e-4
    assert pool_rounds.sign_test(0, 5) == 1.0
    low, high = pool_rounds.bootstrap_median([1.0] * 7, 200, 0)
    assert low == high == 1.0
    # the median of 0..40 has a standard error of about 2.3: a 95 % interval of about ±4.5,
    # well inside the range (0, 40) and the quartiles (10, 30)
    low, high = pool_rounds.bootstrap_median([float(v) for v in range(41)], 20000, 0)
    assert 13 <= low <= 18 and 22 <= high <= 27
