"""AOL preconditioning of Newton–Schulz (``ns_preconditioner="aol"``): the rescaled start,
its iteration against the SVD polar factor in float64, and every route that runs it (plain,
Gram, panels, the symmetric-kernel route's fallback, a batch, the shared column blocks)."""

from __future__ import annotations

import pytest
import torch

from dmuon_titan.ops import newton_schulz as ns

from .test_shared_newton_schulz import shared_orthogonalize

JORDAN = (ns.JORDAN_COEFFICIENTS,)
#: a schedule that converges: Polar Express's, whose last polynomial repeats
CONVERGENT = ns.normalize_coefficients("polar_express")
SHAPES = [(24, 40), (40, 24), (32, 32), (3, 16, 48)]


def _matrix(shape, seed=0, rows_spread=1.0):
    """float64, i.i.d. normal, rows scaled over ``rows_spread`` decades (AOL's D then differs
    from a multiple of I, so its polar factor differs from the input's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    scales = torch.logspace(0, rows_spread, shape[-2], dtype=torch.float64)
    return x * scales[:, None]


def _wide(x):
    return x.mT if x.size(-2) > x.size(-1) else x


def _polar(x):
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def _rescaled(x, eps=1e-7):
    """D·X of the wide orientation, written out: D = diag(1/√(Σ_j |(X·Xᵀ)_ij|))."""
    w = _wide(x)
    d = (w @ w.mT).abs().sum(-1).clamp(min=eps * eps).rsqrt()
    return d[..., :, None] * w


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_rescaled_start_has_spectral_norm_at_most_one_and_its_gram(shape):
    x = _wide(_matrix(shape)).clone()
    gram = ns.aol_precondition_(x, 1e-7)
    assert torch.linalg.matrix_norm(x, ord=2).max().item() <= 1 + 1e-12
    assert torch.allclose(x, _rescaled(_matrix(shape)), rtol=1e-14, atol=0)
    assert torch.allclose(gram, x @ x.mT, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("algorithm", ["plain", "gram"])
def test_aol_ns_converges_to_the_polar_factor_of_the_rescaled_matrix(shape, algorithm):
    """In float64 a convergent schedule from AOL's start reaches the SVD polar factor of
    D·X, which is not X's (rows spread over two decades): AOL changes the target, and this
    test shows by how much on such a matrix."""
    x = _matrix(shape, rows_spread=2.0)
    run = ns.zeropower_via_newtonschulz if algorithm == "plain" else ns.gram_newton_schulz
    out = run(x, CONVERGENT, 14, 1e-7, torch.float64, preconditioner="aol")
    target = _polar(_rescaled(x))
    target = target.mT if shape[-2] > shape[-1] else target
    assert (out - target).norm() / target.norm() < 1e-8
    assert (out - _polar(x)).norm() / target.norm() > 1e-2


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_aol_ns_is_the_iteration_on_the_rescaled_matrix(shape):
    """Jordan's five steps (not convergent) from D·X, written out: the first iteration's
    X·Xᵀ taken from the rescaling changes nothing."""
    x = _matrix(shape, seed=3)
    y = _rescaled(x)
    a, b, c = ns.JORDAN_COEFFICIENTS
    for _ in range(5):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    y = y.mT if shape[-2] > shape[-1] else y
    out = ns.zeropower_via_newtonschulz(x, JORDAN, 5, 1e-7, torch.float64, preconditioner="aol")
    assert (out - y).abs().max().item() <= 1e-12


ROUTES = [
    {},
    {"symmetric_panels": 2},
    {"symmetric_panels": 2, "polynomial_form": True},
    {"symmetric_kernel": True, "polynomial_form": True, "fold_normalization": True},
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("route", ROUTES, ids=str)
def test_every_plain_route_is_the_same_aol_iteration(shape, route):
    x = _matrix(shape, seed=4)
    reference = ns.zeropower_via_newtonschulz(
        x, JORDAN, 5, 1e-7, torch.float64, preconditioner="aol"
    )
    out = ns.zeropower_via_newtonschulz(
        x, JORDAN, 5, 1e-7, torch.float64, preconditioner="aol", **route
    )
    assert (out - reference).abs().max().item() <= 1e-12


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("restarts", [(), (2,), (1, 3)])
@pytest.mark.parametrize("panels", [1, 2])
def test_gram_aol_is_plain_aol_in_float64(shape, restarts, panels):
    x = _matrix(shape, seed=5)
    plain = ns.zeropower_via_newtonschulz(
        x, CONVERGENT, 5, 1e-7, torch.float64, preconditioner="aol"
    )
    gram = ns.gram_newton_schulz(
        x, CONVERGENT, 5, 1e-7, torch.float64, restarts, panels, preconditioner="aol"
    )
    assert (gram - plain).abs().max().item() <= 1e-11


@pytest.mark.parametrize("algorithm", ["plain", "gram", "auto"])
def test_orthogonalize_passes_the_preconditioner_and_batches_equal_one_by_one(algorithm):
    x = _matrix((3, 16, 48), seed=6)
    batched = ns.orthogonalize(x, JORDAN, 5, 1e-7, torch.float64, algorithm, preconditioner="aol")
    for i in range(3):
        one = ns.zeropower_via_newtonschulz(
            x[i], JORDAN, 5, 1e-7, torch.float64, preconditioner="aol"
        )
        assert (batched[i] - one).abs().max().item() <= 1e-12
    frobenius = ns.orthogonalize(x, JORDAN, 5, 1e-7, torch.float64, algorithm)
    assert (batched - frobenius).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("algorithm", ["plain", "gram"])
def test_aol_of_a_zero_matrix_is_zero(dtype, algorithm):
    run = ns.zeropower_via_newtonschulz if algorithm == "plain" else ns.gram_newton_schulz
    out = run(torch.zeros(2, 16, 32), JORDAN, 5, 1e-7, dtype, preconditioner="aol")
    assert out.dtype == dtype and torch.count_nonzero(out) == 0


def test_aol_in_bfloat16_is_near_its_float64_iteration():
    """Rounding only: bf16 AOL NS is as close to its own float64 iteration as bf16
    Frobenius NS is to its own, within a factor of 2."""
    x = _matrix((64, 160), seed=7, rows_spread=1.0)
    errors = {}
    for pre in ("frobenius", "aol"):
        exact = ns.zeropower_via_newtonschulz(x, JORDAN, 5, 1e-7, torch.float64, preconditioner=pre)
        half = ns.zeropower_via_newtonschulz(
            x.float(), JORDAN, 5, 1e-7, torch.bfloat16, preconditioner=pre
        )
        errors[pre] = ((half.double() - exact).norm() / exact.norm()).item()
    assert errors["aol"] <= 2 * errors["frobenius"], errors


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (17, 53), (3, 24, 40)], ids=str)
@pytest.mark.parametrize("size", [1, 3])
def test_shared_ns_with_aol_equals_the_whole_matrix_in_float64(shape, size):
    """The column blocks take AOL's scales from the first iteration's summed X·Xᵀ: the same
    collectives as per iteration (no norm all-reduce), the whole matrix's result."""
    x = _matrix(shape, seed=8)
    whole = ns.zeropower_via_newtonschulz(x, JORDAN, 5, 1e-7, torch.float64, preconditioner="aol")
    shared, group = shared_orthogonalize(x, size, torch.float64, preconditioner="aol")
    assert (shared - whole).abs().max().item() <= 1e-12 * whole.abs().max().item()
    assert group.calls == {"all_reduce": 5, "all_gather": 5}


def test_an_unknown_preconditioner_is_named():
    with pytest.raises(ValueError, match="ns_preconditioner 'spectral'"):
        ns.zeropower_via_newtonschulz(torch.ones(4, 4), JORDAN, 5, 1e-7, preconditioner="spectral")
