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

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.parity import CASES
from ..helpers.training import parity_suite


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
