"""Newton–Schulz math against torch.optim.Muon's own implementation."""

import pytest
import torch
from torch.optim import _muon

from dmuon_titan import ns

SHAPES = [(32, 32), (48, 32), (32, 48), (7, 129)]


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_ns_is_bitwise_torch_optim_muon(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = ns.zeropower_via_newtonschulz(g, (ns.JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16)
    theirs = _muon._zeropower_via_newtonschulz(g, ns.JORDAN_COEFFICIENTS, 5, 1e-7)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_ns_does_not_modify_its_input():
    g = torch.randn(16, 24, dtype=torch.bfloat16)
    before = g.clone()
    ns.zeropower_via_newtonschulz(g, (ns.JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16)
    assert torch.equal(g, before)


def test_batched_equals_one_by_one():
    gs = torch.randn(4, 24, 40, dtype=torch.float64)
    coeffs = ns.NS_COEFFICIENT_SETS["polar_express"]
    batched = ns.zeropower_via_newtonschulz(gs, coeffs, 8, 1e-7, torch.float64)
    for i in range(4):
        single = ns.zeropower_via_newtonschulz(gs[i], coeffs, 8, 1e-7, torch.float64)
        torch.testing.assert_close(batched[i], single, rtol=1e-12, atol=1e-12)


def test_schedules_orthogonalize():
    g = torch.randn(64, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    jordan = ns.zeropower_via_newtonschulz(
        g, ns.NS_COEFFICIENT_SETS["jordan"], 5, 1e-7, torch.float64
    )
    polar = ns.zeropower_via_newtonschulz(
        g, ns.NS_COEFFICIENT_SETS["polar_express"], 8, 1e-7, torch.float64
    )
    s_j = torch.linalg.svdvals(jordan)
    s_p = torch.linalg.svdvals(polar)
    # Jordan's quintic lands singular values in roughly (0.5, 1.5) (torch.optim.Muon's docs);
    # Polar Express converges much closer to 1 in the same matmul budget.
    assert 0.5 < s_j.min() and s_j.max() < 1.5
    assert (s_p - 1).abs().max() < 0.05
    assert (s_p - 1).abs().max() < (s_j - 1).abs().max()


def test_polar_express_schedule_shape():
    pe = ns.NS_COEFFICIENT_SETS["polar_express"]
    assert len(pe) == 8 and pe[-1] == (1.875, -1.25, 0.375)
    assert pe[0][0] == pytest.approx(8.28721201814563 / 1.01)


def test_a_single_triple_and_a_list_of_one_are_the_same_schedule():
    assert ns.normalize_coefficients((3.4445, -4.775, 2.0315)) == ns.normalize_coefficients(
        [(3.4445, -4.775, 2.0315)]
    )
    assert ns.normalize_coefficients("jordan") == ((3.4445, -4.7750, 2.0315),)


@pytest.mark.parametrize("bad", ["nope", [], [(1.0, 2.0)], [(1.0, 2.0, 3.0), "x"]])
def test_bad_coefficients_are_named(bad):
    with pytest.raises(ValueError, match="ns_coefficients"):
        ns.normalize_coefficients(bad)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(32, 32), (48, 32), (32, 48)])
def test_adjusted_lr_matches_torch(fn, shape):
    assert ns.adjusted_lr(0.02, fn, shape) == _muon._adjust_lr(0.02, fn, torch.Size(shape))


def test_unknown_adjust_lr_fn():
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        ns.adjusted_lr(0.02, "bogus", (2, 2))


def test_ns_chunks_group_by_shape_and_bound_the_batch():
    from dmuon_titan.muon import ns_chunks

    a = [torch.empty(4, 8) for _ in range(5)]
    b = [torch.empty(8, 4) for _ in range(2)]
    c = torch.empty(4, 8, dtype=torch.float64)
    params = [a[0], b[0], a[1], c, a[2], b[1], a[3], a[4]]
    chunks = ns_chunks(params, max_numel=64)  # two 4x8 matrices per batch
    assert [[id(t) for t in ch] for ch in chunks] == [
        [id(a[0]), id(a[1])],
        [id(a[2]), id(a[3])],
        [id(a[4])],
        [id(b[0]), id(b[1])],
        [id(c)],
    ]
    assert [len(ch) for ch in ns_chunks(params, 0)] == [1] * 8
    assert [len(ch) for ch in ns_chunks(params, 10)] == [1] * 8  # smaller than one matrix
    assert sorted(map(len, ns_chunks(params, 10**6))) == [1, 2, 5]
