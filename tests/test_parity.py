"""Parity: DMuon on 1–4 gloo ranks equals the single-process reference.

The reference is ``torch.optim.Muon`` on the dedicated matrices + ``torch.optim.AdamW`` on the
rest, one process, the whole global batch (``workers.train_reference``). Errors are measured
per parameter as ‖W_dmuon − W_ref‖ / ‖W_ref − W_0‖ (relative to the total weight change).

- float64 model and float64 NS: the distributed algorithm must be exact (≤ 1e-10).
- float64 model, ``ns_dtype=float32``: ≤ 1e-5 of the float64 reference.
- float32 model, float32 NS: ≤ 1e-5 of the float32 single-process run. (A float32 model
  cannot get within 1e-5 of a *float64* reference even on one process: that gap, ~1.7e-5 on
  this model, is float32 arithmetic amplified by Newton–Schulz, not distribution.)
- float32 model, default bfloat16 NS: within bfloat16 tolerance of ``torch.optim.Muon``,
  where the tolerance is measured, not guessed: twice the largest difference between
  ``torch.optim.Muon`` and itself when the same batch gradient is summed in 2 or 3 chunks
  (bfloat16 NS turns float32 summation-order noise into ~1e-2 relative differences).
"""

import pytest
import torch

from .dist_harness import run_ranks
from .workers import RunConfig, initial_state, parity_suite, train_reference, with_

EXACT = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64)

#: (name, config, reference precision, tolerance)
CASES = [
    ("z3", EXACT, "float64", 1e-10),
    ("z2", with_(EXACT, reshard_after_forward=False), "float64", 1e-10),
    ("z3+ac", with_(EXACT, activation_checkpointing=True), "float64", 1e-10),
    (
        "z2+ac",
        with_(EXACT, reshard_after_forward=False, activation_checkpointing=True),
        "float64",
        1e-10,
    ),
    ("z3+no_sync", with_(EXACT, micro_batches=2), "float64", 1e-10),
    (
        "z2+ac+no_sync",
        with_(EXACT, reshard_after_forward=False, activation_checkpointing=True, micro_batches=2),
        "float64",
        1e-10,
    ),
    ("z3+packed", with_(EXACT, small_param_numel=1 << 16), "float64", 1e-10),
    # Stage 1 by one all-gather / reduce-scatter per boundary instead of per-owner broadcasts
    # and reduces; "auto" picks it per boundary (here: on 2 and 3 ranks, not on 4).
    ("z3+gather", with_(EXACT, collectives="gather"), "float64", 1e-10),
    (
        "z2+ac+no_sync+gather",
        with_(
            EXACT,
            reshard_after_forward=False,
            activation_checkpointing=True,
            micro_batches=2,
            collectives="gather",
        ),
        "float64",
        1e-10,
    ),
    ("z3+auto_collectives", with_(EXACT, collectives="auto"), "float64", 1e-10),
    ("z3+clip", with_(EXACT, max_norm=0.5), "float64", 1e-10),
    (
        "z3+ac+compile",
        with_(EXACT, activation_checkpointing=True, compile_backend="aot_eager"),
        "float64",
        1e-10,
    ),
    # Gram NS is the same polynomial: exact against torch.optim.Muon's plain NS in float64.
    ("gram", with_(EXACT, ns_algorithm="gram"), "float64", 1e-10),
    ("ns_float32", with_(EXACT, ns_dtype=torch.float32), "float64", 1e-5),
    ("fp32", RunConfig(ns_dtype=torch.float32), "float32", 1e-5),
    ("bf16_default", RunConfig(ns_dtype=torch.bfloat16), "torch", None),  # measured below
]


def relative_errors(weights, reference, init):
    errors = {}
    for key, ref in reference.items():
        change = (ref.double() - init[key].double()).norm()
        errors[key] = ((weights[key].double() - ref.double()).norm() / change).item()
    return errors


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


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity(world_size, references, bf16_tolerance):
    results = run_ranks(parity_suite, world_size, [cfg for _, cfg, _, _ in CASES], timeout=600)[0]
    failures = []
    for (name, _, _, tol), weights in zip(CASES, results, strict=True):
        tol = bf16_tolerance if tol is None else tol
        reference, init = references[name]
        assert set(weights) == set(reference)
        errors = relative_errors(weights, reference, init)
        worst = max(errors, key=errors.get)
        if not errors[worst] <= tol:
            failures.append(f"{name}: {worst} off by {errors[worst]:.2e} > {tol:.0e}")
    assert not failures, "\n".join(failures)
