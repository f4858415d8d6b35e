"""Accumulating phase timers that never synchronize the host while measuring.

On CUDA each interval is a pair of events recorded on the current stream; the durations are
read (one synchronization) only when someone asks for them, e.g. at a logging step. On CPU
the wall clock is exact because the work is synchronous.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    """Per-phase time of the intervals between :meth:`start` and :meth:`stop`, accumulated
    until :meth:`reset` and read (in milliseconds) by :meth:`milliseconds`."""

    def __init__(self, device: torch.device | str) -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._open: dict[str, object] = {}
        self._intervals: dict[str, list] = defaultdict(list)

    def reset(self) -> None:
        self._open.clear()
        self._intervals.clear()

    def start(self, phase: str) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[phase] = event
        else:
            self._open[phase] = time.perf_counter()

    def stop(self, phase: str, stream: torch.cuda.Stream | None = None) -> None:
        """End ``phase``; on CUDA its end is recorded on ``stream`` (default: the current
        one), for a phase whose work finishes on another stream."""
        begin = self._open.pop(phase)
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._intervals[phase].append((begin, end))
        else:
            self._intervals[phase].append((begin, time.perf_counter()))

    def milliseconds(self) -> dict[str, float]:
        """Total milliseconds per phase since the last reset."""
        out = {}
        for phase, intervals in self._intervals.items():
            if self._cuda:
                if intervals:
                    intervals[-1][1].synchronize()
                out[phase] = sum(b.elapsed_time(e) for b, e in intervals)
            else:
                out[phase] = sum(e - b for b, e in intervals) * 1e3
        return out
