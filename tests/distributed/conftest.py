"""Fixtures of the parity tests: single-process references and the measured bf16 noise."""

import pytest

from ..helpers import relative_errors
from ..helpers.parity import CASES
from ..helpers.training import initial_state, train_reference


def worst(errors):
    return max(errors.values())


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, cfg, precision, _ in CASES:
        out[name] = (train_reference(cfg, precision), initial_state(cfg))
    return out


@pytest.fixture(scope="module")
def bf16_tolerance(references):
    cfg = dict((name, cfg) for name, cfg, _, _ in CASES)["bf16_default"]
    reference, init = references["bf16_default"]
    floor = max(
        worst(relative_errors(train_reference(cfg, "torch", chunks=k), reference, init))
        for k in (2, 3)
    )
    assert 1e-4 < floor < 0.05, f"unexpected bf16 noise floor {floor:.2e}"
    return 2 * floor
