"""Benchmark timing helpers (scripts/bench/gpu_timing.py): the interval union on CPU; the spin that
keeps timed replays off the power cap on a GPU."""

import pytest
import torch

from ..helpers import bench_script

timing = bench_script("gpu_timing")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_interval_union_counts_overlaps_once():
    spans = [(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.75), (3.0, 3.5)]
    assert timing.interval_union(spans) == pytest.approx(4.5)  # [0, 3.5] and [5, 6]
    assert timing.interval_union([]) == 0.0


@cuda
def test_spin_lasts_about_as_long_as_asked():
    """``cool_ms``'s spin: the cycles calibrated for 5 ms take 5 ms, within a factor of 2
    (the clock may move), and a cooled timing still times the call."""
    device = torch.device("cuda")
    cycles = timing._sleep_cycles(5.0, device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    assert 2.5 <= start.elapsed_time(end) <= 10.0
    x = torch.randn(2048, 2048, device=device)
    cooled = timing.graph_median_milliseconds(lambda: x @ x, device, 1, 5, calls=2, cool_ms=5.0)
    plain = timing.graph_median_milliseconds(lambda: x @ x, device, 1, 5, calls=2)
    assert 0.0 < cooled < 2.5  # the spin is not counted (one 2048² product is far below it)
    assert 0.0 < plain < 2.5
