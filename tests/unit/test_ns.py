"""Newton–Schulz math against torch.optim.Muon's own implementation."""

import functools

import pytest
import torch
from torch.optim import _muon

import dmuon_titan as dmuon
from dmuon_titan import newton_schulz, symmetric, update
from dmuon_titan.plan import cost

SHAPES = [(32, 32), (48, 32), (32, 48), (7, 129)]


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_ns_is_bitwise_torch_optim_muon(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz.zeropower_via_newtonschulz(
        g, (newton_schulz.JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16
    )
    theirs = _muon._zeropower_via_newtonschulz(g, newton_schulz.JORDAN_COEFFICIENTS, 5, 1e-7)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_ns_does_not_modify_its_input():
    g = torch.randn(16, 24, dtype=torch.bfloat16)
    before = g.clone()
    newton_schulz.zeropower_via_newtonschulz(
        g, (newton_schulz.JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16
    )
    assert torch.equal(g, before)


def test_batched_equals_one_by_one():
    gs = torch.randn(4, 24, 40, dtype=torch.float64)
    coeffs = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]
    batched = newton_schulz.zeropower_via_newtonschulz(gs, coeffs, 8, 1e-7, torch.float64)
    for i in range(4):
        single = newton_schulz.zeropower_via_newtonschulz(gs[i], coeffs, 8, 1e-7, torch.float64)
        torch.testing.assert_close(batched[i], single, rtol=1e-12, atol=1e-12)


def test_schedules_orthogonalize():
    g = torch.randn(64, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    jordan = newton_schulz.zeropower_via_newtonschulz(
        g, newton_schulz.NS_COEFFICIENT_SETS["jordan"], 5, 1e-7, torch.float64
    )
    polar = newton_schulz.zeropower_via_newtonschulz(
        g, newton_schulz.NS_COEFFICIENT_SETS["polar_express"], 8, 1e-7, torch.float64
    )
    s_j = torch.linalg.svdvals(jordan)
    s_p = torch.linalg.svdvals(polar)
    # Jordan's quintic lands singular values in roughly (0.5, 1.5) (torch.optim.Muon's docs);
    # Polar Express converges much closer to 1 in the same matmul budget.
    assert 0.5 < s_j.min() and s_j.max() < 1.5
    assert (s_p - 1).abs().max() < 0.05
    assert (s_p - 1).abs().max() < (s_j - 1).abs().max()


def test_polar_express_schedule_shape():
    pe = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]
    assert len(pe) == 8 and pe[-1] == (1.875, -1.25, 0.375)
    assert pe[0][0] == pytest.approx(8.28721201814563 / 1.01)


def test_a_single_triple_and_a_list_of_one_are_the_same_schedule():
    assert newton_schulz.normalize_coefficients(
        (3.4445, -4.775, 2.0315)
    ) == newton_schulz.normalize_coefficients([(3.4445, -4.775, 2.0315)])
    assert newton_schulz.normalize_coefficients("jordan") == ((3.4445, -4.7750, 2.0315),)


@pytest.mark.parametrize("bad", ["nope", [], [(1.0, 2.0)], [(1.0, 2.0, 3.0), "x"]])
def test_bad_coefficients_are_named(bad):
    with pytest.raises(ValueError, match="ns_coefficients"):
        newton_schulz.normalize_coefficients(bad)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(32, 32), (48, 32), (32, 48)])
def test_adjusted_lr_matches_torch(fn, shape):
    assert update.adjusted_lr(0.02, fn, shape) == _muon._adjust_lr(0.02, fn, torch.Size(shape))


def test_unknown_adjust_lr_fn():
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        update.adjusted_lr(0.02, "bogus", (2, 2))


def test_ns_chunks_group_by_shape_and_bound_the_batch():
    from dmuon_titan.optim.step_plan import ns_chunks

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


def test_ns_chunks_may_batch_a_shape_with_its_transpose():
    """The captured step's chunks: 4x8 and 8x4 matrices in one batch, each shape's matrices
    consecutive (the shape seen first, first), bounded as before; chunking the chunks'
    concatenation gives the same chunks (the step's table rows follow that order)."""
    from dmuon_titan.optim.step_plan import ns_chunks

    a = [torch.empty(4, 8) for _ in range(3)]
    b = [torch.empty(8, 4) for _ in range(2)]
    c = torch.empty(4, 8, dtype=torch.float64)
    s = torch.empty(4, 4)
    params = [b[0], a[0], s, a[1], c, b[1], a[2]]
    chunks = ns_chunks(params, 10**6, merge_transposes=True)
    assert [[id(t) for t in ch] for ch in chunks] == [
        [id(b[0]), id(b[1]), id(a[0]), id(a[1]), id(a[2])],
        [id(s)],
        [id(c)],
    ]
    bounded = ns_chunks(params, max_numel=64, merge_transposes=True)  # two per batch
    assert [[id(t) for t in ch] for ch in bounded] == [
        [id(b[0]), id(b[1])],
        [id(a[0]), id(a[1])],
        [id(a[2])],
        [id(s)],
        [id(c)],
    ]
    for chunked in (chunks, bounded):
        again = ns_chunks(
            [p for ch in chunked for p in ch],
            64 if chunked is bounded else 10**6,
            merge_transposes=True,
        )
        assert [[id(t) for t in ch] for ch in again] == [[id(t) for t in ch] for ch in chunked]
    assert len(ns_chunks(params, 10**6)) == 4  # (without: 4x8, 8x4, 4x4, float64)


def test_chunk_lanes_balance_the_cost_in_order():
    from dmuon_titan.optim.step_plan import chunk_lanes

    assert chunk_lanes([1.03, 1.18], 2) == [0, 1]  # (the 170M step's two NS batches)
    assert chunk_lanes([5, 1, 1, 1, 1, 3], 2) == [0, 1, 1, 1, 1, 1]
    assert chunk_lanes([2, 2, 2, 2], 3) == [0, 1, 2, 0]
    assert chunk_lanes([3, 1, 1], 1) == [0, 0, 0]
    assert chunk_lanes([], 2) == []


# ------------------------------------------------------------------ Gram Newton–Schulz
GRAM_SHAPES = [(24, 80), (80, 24), (40, 40), (3, 24, 60), (2, 60, 24)]


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("restarts", [(), (2,), (1, 3)])
@pytest.mark.parametrize("panels", [1, 2, 4, 5])
def test_gram_ns_is_plain_ns_in_float64(shape, restarts, panels):
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    coeffs = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]  # per-iteration coefficients
    plain = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 6, 1e-7, torch.float64)
    gram = newton_schulz.gram_newton_schulz(g, coeffs, 6, 1e-7, torch.float64, restarts, panels)
    assert gram.shape == g.shape and gram.dtype == torch.float64
    torch.testing.assert_close(gram, plain, rtol=0, atol=1e-12)


def test_gram_ns_does_not_modify_its_input():
    g = torch.randn(16, 40, dtype=torch.bfloat16)
    before = g.clone()
    newton_schulz.gram_newton_schulz(
        g, (newton_schulz.JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16
    )
    assert torch.equal(g, before)


@pytest.mark.parametrize("shape", [(40, 40), (3, 40, 40), (24, 80), (80, 24)])
@pytest.mark.parametrize("panels", [2, 4, 5])
def test_plain_ns_with_symmetric_panels_is_plain_ns_in_float64(shape, panels):
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    coeffs = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]
    plain = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 6, 1e-7, torch.float64)
    paneled = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 6, 1e-7, torch.float64, panels)
    torch.testing.assert_close(paneled, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(40, 40), (3, 40, 40), (24, 80), (80, 24)])
@pytest.mark.parametrize("route", [{"symmetric_panels": 2}, {"symmetric_kernel": True}])
def test_polynomial_form_is_plain_ns_in_float64(shape, route):
    """X ← (aI + bA + cA²)·X is the same iteration (off CUDA the kernel route falls back to
    the torch products; its bf16 rounding is measured on the GPU, check_ns_accuracy.py)."""
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    coeffs = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]
    plain = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 6, 1e-7, torch.float64)
    p_form = newton_schulz.zeropower_via_newtonschulz(
        g, coeffs, 6, 1e-7, torch.float64, polynomial_form=True, **route
    )
    torch.testing.assert_close(p_form, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(40, 40), (3, 40, 40), (24, 80), (80, 24)])
@pytest.mark.parametrize("route", [{"symmetric_panels": 2}, {"symmetric_kernel": True}])
@pytest.mark.parametrize("scale", [1.0, 1e-5, 3e4])
def test_folded_normalization_is_plain_ns_in_float64(shape, route, scale):
    """The division by the norm folded into the first iteration's products (A by 1/‖X‖²,
    P by 1/‖X‖) is the same iteration, whatever X's scale; it needs the polynomial form."""
    g = scale * torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    coeffs = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]
    plain = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 6, 1e-7, torch.float64)
    folded = newton_schulz.zeropower_via_newtonschulz(
        g, coeffs, 6, 1e-7, torch.float64, polynomial_form=True, fold_normalization=True, **route
    )
    torch.testing.assert_close(folded, plain, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="fold_normalization needs polynomial_form"):
        newton_schulz.zeropower_via_newtonschulz(
            g, coeffs, 6, 1e-7, torch.float64, fold_normalization=True, **route
        )


@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (2, 16, 48)])
@pytest.mark.parametrize("restarts", [(), (1,), (2,), (1, 3), (4,)])
@pytest.mark.parametrize("ns_steps", [1, 2, 5])
def test_folded_normalization_is_gram_ns_in_float64(shape, restarts, ns_steps):
    """Gram NS with the first Gram matrix scaled by 1/‖X‖² and the Q that first multiplies
    X by 1/‖X‖: the same result for every run layout (a first run of one iteration, where
    Q is P itself, or longer; restarts or none)."""
    g = 1e-4 * torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    coeffs = newton_schulz.NS_COEFFICIENT_SETS["polar_express"]
    args = (g, coeffs, ns_steps, 1e-7, torch.float64, restarts)
    plain = newton_schulz.gram_newton_schulz(*args)
    folded = newton_schulz.gram_newton_schulz(*args, fold_normalization=True)
    torch.testing.assert_close(folded, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ["plain", "gram"])
def test_folded_normalization_of_zero_and_tiny_matrices(dtype, algorithm):
    """A zero matrix (an expert that got no tokens) and tiny ones stay finite with the fold,
    and where the fold is not safe (float16, whose range 1/eps times a coefficient exceeds;
    eps below FOLD_MIN_EPS; no iteration) it is not taken: bitwise the unfolded result."""
    g = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    g[0] = 0.0
    g[1] *= 1e-6
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    route = {"symmetric_panels": 2}
    if algorithm == "plain":

        def ns(x, eps=1e-7, steps=5, fold=True):
            return newton_schulz.zeropower_via_newtonschulz(
                x, coeffs, steps, eps, dtype, polynomial_form=True, fold_normalization=fold, **route
            )
    else:

        def ns(x, eps=1e-7, steps=5, fold=True):
            return newton_schulz.gram_newton_schulz(
                x, coeffs, steps, eps, dtype, fold_normalization=fold, **route
            )

    folded, unfolded = ns(g), ns(g, fold=False)
    assert torch.isfinite(folded).all()
    assert not folded[0].any() and not unfolded[0].any()
    if dtype == torch.float16:
        assert torch.equal(folded, unfolded)
    else:
        error = (folded[1:].float() - unfolded[1:].float()).norm() / unfolded[1:].float().norm()
        assert error < 0.05, error
    # (float16 rounds eps = 1e-20 to 0: a zero matrix is NaN there, folded or not)
    torch.testing.assert_close(
        ns(g, eps=1e-20), ns(g, eps=1e-20, fold=False), rtol=0, atol=0, equal_nan=True
    )
    assert torch.equal(ns(g, steps=0), ns(g, steps=0, fold=False))


def test_inverse_norms_clamp_at_eps():
    x = torch.zeros(3, 4, 5, dtype=torch.bfloat16)
    x[1] = 2.0
    inverse = newton_schulz.inverse_norms(x, 1e-3)
    assert inverse.dtype == torch.float32 and inverse.shape == (3,)
    norm = torch.tensor(2 * 20**0.5, dtype=torch.bfloat16).item()  # (rounded as x is)
    eps = torch.tensor(1e-3, dtype=torch.bfloat16).item()
    assert inverse.tolist() == pytest.approx([1 / eps, 1 / norm, 1 / eps], rel=1e-6)
    assert newton_schulz.inverse_norms(x.double(), 1e-3).dtype == torch.float64


@pytest.mark.parametrize("shape", [(12, 30), (2, 12, 30), (10, 10)])
@pytest.mark.parametrize("panels", [1, 2, 3, 4, 7])
def test_symmetric_matmul_is_the_product(shape, panels):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    sym = x @ x.mT
    torch.testing.assert_close(symmetric.symmetric_matmul(x, x.mT, panels), sym, rtol=0, atol=1e-12)
    expected = -0.5 * sym + 2.0 * (sym @ sym)
    got = symmetric.symmetric_matmul(sym, sym, panels, addend=sym, beta=-0.5, alpha=2.0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        symmetric.symmetric_matmul(sym, sym, panels, alpha=3.0), 3 * sym @ sym
    )


@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (40, 40), (8, 64)])
@pytest.mark.parametrize("restarts", [(), (2,), (1, 3), (4, 9)])
def test_flop_formulas_count_the_matmuls_that_run(shape, restarts):
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.randn(shape, dtype=torch.float64)
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    with FlopCounterMode(display=False) as plain:
        newton_schulz.zeropower_via_newtonschulz(g, coeffs, 5, 1e-7, torch.float64)
    with FlopCounterMode(display=False) as gram:
        newton_schulz.gram_newton_schulz(g, coeffs, 5, 1e-7, torch.float64, restarts)
    assert plain.get_total_flops() == cost.ns_flops(shape, 5)
    assert gram.get_total_flops() == cost.gram_ns_flops(shape, 5, restarts)


def test_auto_picks_the_cheaper_algorithm_per_shape():
    assert cost.ns_algorithm_for((4096, 4096), "auto") == "plain"
    assert cost.ns_algorithm_for((14336, 4096), "auto") == "gram"
    assert cost.ns_algorithm_for((4096, 14336), "auto") == "gram"
    assert cost.ns_algorithm_for((1024, 4096), "auto") == "gram"
    assert cost.ns_algorithm_for((4096, 4096), "gram") == "gram"
    # FLOPs per shape: 14336x4096 is 80 vs 56 units of 4096^3 (Gram with one restart).
    assert cost.gram_ns_flops((14336, 4096)) * 80 == cost.ns_flops((14336, 4096)) * 56
    with pytest.raises(ValueError, match="ns_algorithm"):
        cost.ns_algorithm_for((8, 8), "fast")


def _spectrum_matrix(rows, cols, singular_values, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    left, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=gen))
    right, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=gen))
    return (left * singular_values) @ right.T


@pytest.mark.parametrize("shape", [(64, 224), (224, 64)])
def test_gram_ns_half_precision_accuracy(shape):
    """In bf16 Gram NS stays within a small factor of torch.optim.Muon's own bf16 error, in
    fp16 it is more accurate than that; without its restart bf16 Gram NS is far off (rounding
    of the recursive Gram update compounds), which is why the restart is the default."""
    k = min(shape)
    g = _spectrum_matrix(*shape, 1.0 / torch.arange(1, k + 1, dtype=torch.float64))
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    exact = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 5, 1e-7, torch.float64)

    def error(out):
        return ((out.double() - exact).norm() / exact.norm()).item()

    muon_bf16 = error(
        _muon._zeropower_via_newtonschulz(g, newton_schulz.JORDAN_COEFFICIENTS, 5, 1e-7)
    )
    gram_bf16 = error(newton_schulz.gram_newton_schulz(g, coeffs, 5, 1e-7, torch.bfloat16))
    gram_fp16 = error(newton_schulz.gram_newton_schulz(g, coeffs, 5, 1e-7, torch.float16))
    no_restart = error(
        newton_schulz.gram_newton_schulz(g, coeffs, 5, 1e-7, torch.bfloat16, restarts=())
    )
    assert 1e-3 < muon_bf16 < 0.1
    assert gram_bf16 < 3 * muon_bf16
    assert gram_fp16 < muon_bf16 / 2
    assert no_restart > 10 * muon_bf16


@pytest.mark.parametrize("algorithm", ["gram", "auto"])
def test_orthogonalize_dispatches(algorithm):
    g = torch.randn(3, 16, 48, dtype=torch.float64)
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    out = newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, torch.float64, algorithm)
    torch.testing.assert_close(
        out, newton_schulz.zeropower_via_newtonschulz(g, coeffs, 5, 1e-7, torch.float64)
    )
    bf = newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, torch.bfloat16, algorithm)
    assert torch.equal(bf, newton_schulz.gram_newton_schulz(g, coeffs, 5, 1e-7, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 16), (16, 48)])
def test_orthogonalize_takes_the_measured_forms_by_the_kernel(dtype, shape, monkeypatch):
    """Where the kernel runs (stood in for: CPU), ``"auto"`` passes plain NS the polynomial
    form and the fold, and Gram NS the fold, in bfloat16 only (what was measured on a GPU);
    ``"plain"`` never."""
    calls = []

    def noting(name):
        def record(*args, **kwargs):
            calls.append((name, kwargs))
            return args[0]

        return record

    monkeypatch.setattr(newton_schulz, "symmetric_kernel_runs_for", lambda *a: True)
    monkeypatch.setattr(newton_schulz, "zeropower_via_newtonschulz", noting("plain"))
    monkeypatch.setattr(newton_schulz, "gram_newton_schulz", noting("gram"))
    g = torch.zeros(shape, dtype=dtype)
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, dtype, "auto")
    newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, dtype, "plain")
    (name, auto), (_, plain) = calls
    bf16 = dtype == torch.bfloat16
    assert name == cost.ns_algorithm_for(shape, "auto") and auto["symmetric_kernel"]
    assert auto["fold_normalization"] == bf16
    assert auto.get("polynomial_form", bf16) == bf16  # (Gram NS has no such flag)
    assert not plain["symmetric_kernel"] and not plain["polynomial_form"]
    assert not plain["fold_normalization"]


def test_plain_ns_of_large_matrices_is_not_batched(cpu_mesh):
    from dmuon_titan.optim.step_plan import PLAIN_NS_UNBATCHED_NUMEL, ns_chunks

    square = [torch.empty(4096, 4096, device="meta") for _ in range(3)]
    ffn = [torch.empty(14336, 4096, device="meta") for _ in range(3)]
    small = [torch.empty(1024, 4096, device="meta") for _ in range(3)]
    assert 4096 * 4096 >= PLAIN_NS_UNBATCHED_NUMEL
    assert [len(c) for c in ns_chunks(square, 2**27, PLAIN_NS_UNBATCHED_NUMEL)] == [1, 1, 1]
    assert [len(c) for c in ns_chunks(ffn, 2**27, PLAIN_NS_UNBATCHED_NUMEL)] == [1, 1, 1]
    assert [len(c) for c in ns_chunks(small, 2**27, PLAIN_NS_UNBATCHED_NUMEL)] == [3]
    assert [len(c) for c in ns_chunks(square, 2**27)] == [3]
    assert [len(c) for c in ns_chunks(ffn, 2**27)] == [2, 1]
    # The optimizer's rule per algorithm.
    from ..helpers.models import ToyTransformer, dedicated_predicate

    thresholds = {}
    for algorithm in cost.NS_ALGORITHMS:
        model = ToyTransformer()
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate, ns_algorithm=algorithm)
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_algorithm=algorithm)
        thresholds[algorithm] = opt.ns_unbatched_numel
    assert thresholds == {"plain": PLAIN_NS_UNBATCHED_NUMEL, "gram": None, "auto": None}


def test_large_gram_ns_uses_symmetric_panels(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.randn(32, 96, dtype=torch.float64)
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    with FlopCounterMode(display=False) as below:
        out_below = newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, torch.float64, "gram")
    monkeypatch.setattr(newton_schulz, "SYMMETRIC_PANELS_MIN_SIDE", 32)
    with FlopCounterMode(display=False) as above:
        out_above = newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, torch.float64, "gram")
    assert below.get_total_flops() == cost.gram_ns_flops(g.shape)
    # 4 panels: the m×m products cost 5/8, the Gram matrices XXᵀ too; only Q·X stays whole.
    m, n = 32, 96
    whole_qx = 2 * 2 * m * m * n
    assert above.get_total_flops() == (below.get_total_flops() - whole_qx) * 5 // 8 + whole_qx
    torch.testing.assert_close(out_above, out_below, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-7, 1e5])
@pytest.mark.parametrize("algorithm", ["plain", "gram"])
def test_float16_ns_is_normalized_before_the_cast(scale, algorithm):
    """float16 cannot hold gradient-sized (≈1e-7) or large entries as they are; NS in float16
    normalizes its wider input first and stays more accurate than torch.optim.Muon's bf16."""
    g = torch.randn(64, 224, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    g = g * scale
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    exact = newton_schulz.zeropower_via_newtonschulz(g, coeffs, 5, 1e-7, torch.float64)
    fp16 = newton_schulz.orthogonalize(g, coeffs, 5, 1e-7, torch.float16, algorithm).double()
    bf16 = _muon._zeropower_via_newtonschulz(
        g.float(), newton_schulz.JORDAN_COEFFICIENTS, 5, 1e-7
    ).double()
    assert torch.isfinite(fp16).all()
    assert (fp16 - exact).norm() < (bf16 - exact).norm() / 2


def test_muon_float16_step_on_gradient_sized_directions(cpu_mesh):
    from ..helpers.models import ToyTransformer, dedicated_predicate

    def step(ns_dtype):
        torch.manual_seed(0)
        model = ToyTransformer()
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, weight_decay=0.0, ns_dtype=ns_dtype)
        params = opt.param_groups[0]["params"]
        gen = torch.Generator().manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-7  # clipped 8B-model scale
        before = [p.detach().clone() for p in params]
        opt.step()
        return [p.detach().double() - b.double() for p, b in zip(params, before, strict=True)]

    exact, half, brain = step(torch.float64), step(torch.float16), step(torch.bfloat16)
    for e, h, b in zip(exact, half, brain, strict=True):
        assert torch.isfinite(h).all() and e.norm() > 0
        assert (h - e).norm() < (b - e).norm() / 2


def _squares_of(x: torch.Tensor, parts: int = 7) -> torch.Tensor:
    """Partial sums of squares per matrix, as the momentum pass writes them (float32; float64
    for float64 ``x``)."""
    flat = (
        x.to(torch.promote_types(x.dtype, torch.float32))
        .reshape(-1, x.shape[-2] * x.shape[-1])
        .square()
    )
    return torch.stack([c.sum(1) for c in flat.chunk(parts, dim=1)], dim=1)


@pytest.mark.parametrize("shape", [(40, 40), (3, 24, 80), (2, 80, 24)])
def test_inverse_norms_from_squares(shape):
    """The norm from partial sums of squares: the matrix norm's, rounded to the matrix's
    dtype, clamped at eps; a zero matrix's is 1/eps."""
    torch.manual_seed(0)
    x = torch.randn(shape).to(torch.bfloat16)
    from_squares = newton_schulz.inverse_norms(x, 1e-7, _squares_of(x))
    assert from_squares.shape == x.shape[:-2] and from_squares.dtype == torch.float32
    torch.testing.assert_close(from_squares, newton_schulz.inverse_norms(x, 1e-7), rtol=0, atol=0)
    zero = torch.zeros(shape, dtype=torch.bfloat16)
    got = newton_schulz.inverse_norms(zero, 1e-3, _squares_of(zero))
    torch.testing.assert_close(got, torch.full(x.shape[:-2], 1e3), rtol=1e-2, atol=0)


@pytest.mark.parametrize("algorithm", ["plain", "gram"])
def test_folded_ns_takes_its_norm_from_squares(algorithm):
    """With the fold, NS's norm comes from ``squares`` when given (wrong ones change the
    result), and only for a matrix already of NS's dtype (a cast would round it again)."""
    g = torch.randn(2, 24, 80, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    coeffs = (newton_schulz.JORDAN_COEFFICIENTS,)
    if algorithm == "plain":
        ns = functools.partial(
            newton_schulz.zeropower_via_newtonschulz, symmetric_panels=2, polynomial_form=True
        )
    else:
        ns = functools.partial(newton_schulz.gram_newton_schulz, restarts=(2,))
    args = (coeffs, 5, 1e-7, torch.float64)
    exact = ns(g, *args, fold_normalization=True)
    squares = _squares_of(g)
    torch.testing.assert_close(
        ns(g, *args, fold_normalization=True, squares=squares), exact, rtol=0, atol=1e-12
    )
    wrong = ns(g, *args, fold_normalization=True, squares=4 * squares)
    assert (wrong - exact).abs().max() > 1e-3
    as_float32 = ns(g.float(), *args, fold_normalization=True, squares=4 * squares)
    torch.testing.assert_close(as_float32, exact, rtol=0, atol=1e-5)  # (ignored: a cast)


def test_squares_are_asked_for_only_where_ns_folds():
    cpu = torch.device("cpu")
    assert not newton_schulz.uses_squares((1024, 1024), "auto", 5, 1e-7, torch.bfloat16, cpu)
    if torch.cuda.is_available() and newton_schulz.symmetric_kernel_runs_for(
        1024, 1024, torch.bfloat16, torch.device("cuda")
    ):
        cuda = torch.device("cuda")
        assert newton_schulz.uses_squares((1024, 2816), "auto", 5, 1e-7, torch.bfloat16, cuda)
        assert not newton_schulz.uses_squares((1024, 1024), "plain", 5, 1e-7, torch.bfloat16, cuda)
        assert not newton_schulz.uses_squares((1024, 1024), "auto", 5, 1e-7, torch.float16, cuda)
        assert not newton_schulz.uses_squares((1000, 1024), "auto", 5, 1e-7, torch.bfloat16, cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4, 1024, 1024), (3, 512, 1536), (1024, 1024)])
def test_ns_on_the_kernel_route_with_squares_is_ns_without(shape):
    """On the GPU route that folds (bf16, the symmetric kernel), NS given the squares of
    its input equals NS computing the norm itself (the same bf16 norm, up to fp32 order)."""
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    args = ((newton_schulz.JORDAN_COEFFICIENTS,), 5, 1e-7, torch.bfloat16, "auto")
    assert newton_schulz.uses_squares(x.shape, "auto", 5, 1e-7, torch.bfloat16, x.device)
    with_squares = newton_schulz.orthogonalize(x, *args, squares=_squares_of(x))
    without = newton_schulz.orthogonalize(x, *args)
    torch.testing.assert_close(with_squares.float(), without.float(), rtol=0, atol=2e-2)
    assert (with_squares != without).float().mean() < 0.01
