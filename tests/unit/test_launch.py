"""``python -m dmuon_titan.launch``'s line: the rank that failed first is named first."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from dmuon_titan.launch import _first_failure


def _failure(exitcode: int, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


def test_a_rank_stopped_by_sigterm_is_not_the_first_failure():
    """torchrun stops the other ranks with SIGTERM once one fails, in the same second: rank 1's
    own failure is the first, not rank 0's SIGTERM."""
    failures = {0: _failure(-signal.SIGTERM, 100), 1: _failure(1, 100)}
    assert _first_failure(failures)[0] == 1


def test_otherwise_the_earliest_then_the_lowest_rank():
    failures = {0: _failure(1, 101), 1: _failure(1, 100), 2: _failure(-signal.SIGTERM, 99)}
    assert _first_failure(failures)[0] == 1
    assert _first_failure({3: _failure(2, 5), 2: _failure(1, 5)})[0] == 2
