"""The distributed tests on CUDA with NCCL (collectives on their own streams, event waits).

Skipped cleanly without two CUDA devices; run on 2×H200 (results in docs/benchmarks.md, "GPU
tests").
"""

import pytest
import torch

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.parity import CASES
from ..helpers.scenarios import accounting_and_storage, count_host_syncs, mixed_precision
from ..helpers.training import RunConfig, parity_suite, with_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

GPU_CASES = [
    c
    for c in CASES
    if c[0]
    in (
        "z3",
        "z2",
        "gram",
        "z3+ac",
        "z2+ac+no_sync",
        "z3+clip",
        "z3+ac+compile",
        "ns_float32",
        "fp32",
        "bf16_default",
        "z3+gather",
        "z2+ac+no_sync+gather",
        "z3+auto_collectives",
    )
]


def test_parity_nccl(references, bf16_tolerance):
    configs = [with_(cfg, device="cuda") for _, cfg, _, _ in GPU_CASES]
    results = run_ranks(parity_suite, 2, configs, backend="nccl", timeout=600)[0]
    report, failures = [], []
    for (name, _, _, tol), weights in zip(GPU_CASES, results, strict=True):
        tol = bf16_tolerance if tol is None else tol
        errors = relative_errors(weights, *references[name])
        worst = max(errors, key=errors.get)
        report.append(f"{name:14s} worst {errors[worst]:.2e} ({worst}) tol {tol:.1e}")
        if not errors[worst] <= tol:
            failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)


def test_replicate_only_parity_nccl(references):
    """2 GPUs as 2 replicas x 1 shard (DDP-style): parity, and async == sync."""
    exact = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64, device="cuda", replicate=2)
    configs = [exact, with_(exact, replicate_async=False)]
    results = run_ranks(parity_suite, 2, configs, backend="nccl", timeout=600)[0]
    errors = relative_errors(results[0], *references["z3"])
    print(f"replicate-only 2x1, NCCL: worst {max(errors.values()):.2e}")
    assert max(errors.values()) <= 1e-10
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_bytes_and_storage_nccl():
    exact = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64, device="cuda")
    configs = [with_(exact, reshard_after_forward=False), exact]
    for rank_results in run_ranks(accounting_and_storage, 2, configs, backend="nccl"):
        for factor, r in zip((2, 3), rank_results, strict=True):
            moved = r["moved"]
            total = moved["forward"] + moved.get("backward_unshard", 0.0) + moved["reduce"]
            assert total == pytest.approx(factor * 0.5 * r["P_M"], rel=1e-12)


def test_mixed_precision_nccl():
    for r in run_ranks(mixed_precision, 2, "cuda", backend="nccl"):
        assert r["compute_dtype"] == "torch.bfloat16" and r["master_dtypes"] == ["torch.float32"]
        assert r["grad_rel_error"] < 1e-6


@pytest.mark.parametrize("collectives", ["broadcast", "gather"])
def test_host_syncs_nccl(collectives):
    cfg = RunConfig(
        device="cuda", mixed_precision=True, ns_dtype=torch.bfloat16, collectives=collectives
    )
    for counts in run_ranks(count_host_syncs, 2, cfg, backend="nccl"):
        print(counts)
        assert counts["forward"] == 0
        # every owner had its own gradients: the presence flags need not be read back
        assert counts["backward"] == 0
