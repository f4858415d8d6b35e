"""GPU timing helpers of the benchmarks: the median of timed calls, graph-replayed kernels
timed without host time (and kept off the power cap), the GPU's busy time of a call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dmuon_titan.timing import PhaseTimer


def median_milliseconds(
    fn: Callable[[], object], device: torch.device | str, warmup: int, reps: int
) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones
    (benchmarks; on CUDA each call is read back, one synchronization per call)."""
    timer, times = PhaseTimer(device), []
    for i in range(warmup + reps):
        timer.reset()
        timer.start("call")
        fn()
        timer.stop("call")
        if i >= warmup:
            times.append(timer.milliseconds()["call"])
    return statistics.median(times)


def graph_median_milliseconds(
    fn: Callable[[], object],
    device: torch.device | str,
    warmup: int,
    reps: int,
    calls: int = 10,
    cool_ms: float = 0.0,
) -> float:
    """GPU milliseconds per call of ``fn`` with no host time in them (benchmarks of kernels
    shorter than their launch): ``calls`` calls captured in one CUDA graph, the graph
    replayed ``reps`` times, the median replay divided by ``calls``. Per-call events
    (:func:`median_milliseconds`) count the host's launch of each call too, which for
    sub-millisecond kernels is a share of the time that differs from launcher to launcher
    (docs/design_notes.md#kernel-timing). Off CUDA: :func:`median_milliseconds`.

    ``cool_ms``: before each timed replay the GPU spins one thread for about that long
    (``torch.cuda._sleep``: busy, so its clock stays up, at little power). Replays back to
    back hold an H200 at its power cap, its clock down to 1140 MHz, where a 170M model's
    training step runs its Newton–Schulz at 1980 MHz (docs/design_notes.md#kernel-timing): spaced out, the replays run as they do there."""
    if torch.device(device).type != "cuda":
        return median_milliseconds(fn, device, warmup, reps)
    for _ in range(warmup):  # (compiles, allocates, loads the kernels: not in the capture)
        fn()
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    spin = _sleep_cycles(cool_ms, device) if cool_ms > 0 else 0
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin:
            torch.cuda._sleep(spin)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


_CYCLES_PER_MS: dict[int, float] = {}


def _sleep_cycles(ms: float, device: torch.device | str) -> int:
    """``torch.cuda._sleep`` cycles that take about ``ms`` milliseconds on ``device``
    (measured once per device)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CYCLES_PER_MS:
        probe = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)  # (the first call loads the kernel)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[index] = probe / max(start.elapsed_time(end), 1e-3)
    return int(ms * _CYCLES_PER_MS[index])


def gpu_busy_milliseconds(fn: Callable[[], object], device: torch.device | str) -> float:
    """Milliseconds in which the GPU ran anything (kernels, copies, fills; their union over
    every stream) during one call of ``fn``, by torch's profiler: the call's GPU work without
    the host's gaps, which is what it takes when the GPU, not the host, is what limits the
    loop. Off CUDA: the call's wall clock."""
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize(device)
    on_device = torch.autograd.DeviceType.CUDA
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in profile.events()
        if e.device_type == on_device
    ]
    return interval_union(spans) / 1e3


def interval_union(spans) -> float:
    """The length of the union of ``(begin, end)`` intervals (any order, any overlap), in
    their unit."""
    busy, reached = 0.0, float("-inf")
    for begin, end in sorted(spans):
        if end > reached:
            busy += end - max(begin, reached)
            reached = end
    return busy
