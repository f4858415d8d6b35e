"""What several test modules share: the small transformer and its variants (``models``), the
training runs and the single-process reference (``training``), per-rank scenarios
(``scenarios``), the process launcher (``harness``), the parity cases (``parity``), and the
two functions below."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ANALYSIS = Path(__file__).resolve().parents[2] / "scripts" / "analysis"
BENCH = ANALYSIS.parent / "bench"


def relative_errors(weights, reference, init) -> dict[str, float]:
    """Per parameter, ‖W − W_ref‖ / ‖W_ref − W_0‖: the error relative to the total change."""
    errors = {}
    for key, ref in reference.items():
        change = (ref.double() - init[key].double()).norm()
        errors[key] = ((weights[key].double() - ref.double()).norm() / change).item()
    return errors


def bench_script(name: str):
    """Import ``scripts/bench/<name>.py`` as the module ``name`` (its siblings too)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def analysis_script(name: str):
    """Import ``scripts/analysis/<name>.py`` as the module ``name`` (its siblings too)."""
    if str(ANALYSIS) not in sys.path:
        sys.path.insert(0, str(ANALYSIS))
    return importlib.import_module(name)
