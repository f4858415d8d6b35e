"""Reading torchtitan 0.2.2 console logs (shared by the analysis scripts).

The lines they need: a training step (``step: N  loss: L  memory: M GiB ... tps: T``), a
validation (``validate step: N  loss: L``), DMuon's per-step timings (``dmuon step: N
optimizer: X ms  ns: Y ms``) and the converter's plan line (``NS GFLOP per rank [...]``,
``plain-NS GFLOP G in all``). Colour codes are stripped first.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
TRAIN = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([-\d.naif]+)")
VALID = re.compile(r"validate step:\s*(\d+)\s+loss:\s*([-\d.naif]+)")
#: a training step with its memory and throughput fields
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
PLAN = re.compile(r"NS GFLOP per rank \[([\d., ]+)\]")
PLAIN = re.compile(r"plain-NS GFLOP ([\d.]+) in all")
DMUON = re.compile(r"dmuon step:\s*(\d+)\s+optimizer:\s*([\d.]+)ms\s+ns:\s*([\d.]+)ms")


def lines(path: str | Path) -> Iterator[str]:
    """The log's lines without colour codes."""
    with open(path, errors="replace") as f:
        for line in f:
            yield ANSI.sub("", line)


def timestamp(line: str) -> float | None:
    """Seconds since the epoch of the line's torchtitan time stamp, if it has one."""
    stamp = STAMP.search(line)
    if not stamp:
        return None
    return dt.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
