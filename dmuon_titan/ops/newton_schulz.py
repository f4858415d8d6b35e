"""Newton–Schulz orthogonalization: coefficient schedules, plain and Gram iterations.

Pure math: no process group, no hooks. Every function here follows the semantics that
``torch.optim.Muon`` documents (and implements in ``torch/optim/_muon.py``), with two
extensions: the NS compute dtype is a parameter (``torch.optim.Muon`` always uses bfloat16),
and the (a, b, c) coefficients may change per iteration (e.g. Polar Express).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .fused import divide_
from .ns_cost import DEFAULT_GRAM_RESTARTS, ns_algorithm_for
from .symmetric import runs_for as symmetric_kernel_runs_for
from .symmetric import symmetric_matmul

Coefficients = tuple[float, float, float]

JORDAN_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)


def _polar_express() -> tuple[Coefficients, ...]:
    # Degree-5 schedule from Amsel et al., "The Polar Express" (arXiv 2505.16932),
    # with the paper's 1.01 safety factor on every polynomial but the last, which is the
    # fixed point the schedule converges to (later iterations reuse it).
    raw = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    )
    safety = 1.01
    scaled = tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in raw)
    return scaled + ((1.875, -1.25, 0.375),)


#: Named coefficient schedules. A schedule shorter than ``ns_steps`` repeats its last entry.
NS_COEFFICIENT_SETS: dict[str, tuple[Coefficients, ...]] = {
    "jordan": (JORDAN_COEFFICIENTS,),
    "polar_express": _polar_express(),
}


def normalize_coefficients(
    coefficients: Coefficients | Sequence[Coefficients] | str,
) -> tuple[Coefficients, ...]:
    """Return a per-iteration schedule from a single (a, b, c), a list of them, or a name.

    Raises ``ValueError`` (naming the bad value) for anything else.
    """
    if isinstance(coefficients, str):
        if coefficients not in NS_COEFFICIENT_SETS:
            raise ValueError(
                f"unknown ns_coefficients name {coefficients!r}; "
                f"known: {sorted(NS_COEFFICIENT_SETS)}"
            )
        return NS_COEFFICIENT_SETS[coefficients]
    seq = list(coefficients)
    if len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
        return ((float(seq[0]), float(seq[1]), float(seq[2])),)
    if not seq:
        raise ValueError("ns_coefficients must not be empty")
    schedule = []
    for i, triple in enumerate(seq):
        try:
            a, b, c = triple
            schedule.append((float(a), float(b), float(c)))
        except (TypeError, ValueError):
            raise ValueError(
                f"ns_coefficients[{i}] must be an (a, b, c) triple of floats, got {triple!r}"
            ) from None
    return tuple(schedule)


#: How NS scales its input before the first iteration: ``"frobenius"`` divides it by its
#: Frobenius norm (torch.optim.Muon's); ``"aol"`` rescales its rows (:func:`aol_precondition_`).
NS_PRECONDITIONERS = ("frobenius", "aol")


def check_ns_preconditioner(preconditioner: str) -> None:
    """Raise a ValueError naming ``preconditioner`` unless it is one of
    :data:`NS_PRECONDITIONERS`."""
    if preconditioner not in NS_PRECONDITIONERS:
        raise ValueError(
            f"unknown ns_preconditioner {preconditioner!r}; known: {list(NS_PRECONDITIONERS)}"
        )


def aol_precondition_(x: Tensor, eps: float, sym: dict | None = None) -> Tensor:
    """AOL rescaling of the wide ``x`` (``[batch,] m × n``, m ≤ n) in place, returning the
    rescaled matrix's Gram matrix, which NS's first iteration takes instead of its own X·Xᵀ.

    With A = X·Xᵀ and D = diag(1/√(Σ_j |A_ij|)) (row sums clamped at ``eps``²), X ← D·X and
    the result is D·A·D (the scale in float32, or float64 for float64 ``x``). By Schur's test
    ‖D·X‖₂ ≤ 1, a start nearer the polar factor than X/‖X‖_F (Prach & Lampert, "Almost-
    orthogonal layers", arXiv 2208.03160; used so in Turbo-Muon, arXiv 2512.04632). The
    polar factor of D·X is not exactly X's (they agree when D is a multiple of I): the
    accuracy harness measures the difference on training's matrices. ``sym``: the route of
    the symmetric product (:func:`symmetric_matmul`'s ``panels`` and ``kernel``)."""
    return aol_rescale_(x, symmetric_matmul(x, x.mT, **sym) if sym else x @ x.mT, eps)


def aol_rescale_(x: Tensor, gram: Tensor, eps: float) -> Tensor:
    """:func:`aol_precondition_` with X·Xᵀ given (``gram``, of ``x``'s dtype): ``x``'s rows
    scaled in place, D·``gram``·D returned."""
    wide = torch.promote_types(x.dtype, torch.float32)
    scale = gram.abs().sum(dim=-1, dtype=wide).clamp(min=eps * eps).rsqrt()
    x.mul_(scale.unsqueeze(-1))
    return (gram * scale.unsqueeze(-1) * scale.unsqueeze(-2)).to(x.dtype)


def normalize_into(matrix: Tensor, out: Tensor, eps: float) -> Tensor:
    """``out ← matrix / ‖matrix‖_F`` per matrix (norm clamped at ``eps``), rounded once to
    ``out``'s dtype. The float16 way into NS: float16 has 5 exponent bits, so gradient-sized
    entries (≈1e-6 and below) lose their precision and large ones overflow when cast as they
    are; NS normalizes anyway, so normalizing first changes no value beyond rounding."""
    norm = torch.linalg.matrix_norm(matrix, keepdim=True).clamp(min=eps)
    return torch.div(matrix, norm, out=out)


def _wide_ns_input(
    matrix: Tensor, dtype: torch.dtype, eps: float, overwrite_input: bool
) -> tuple[Tensor, bool]:
    """(X in ``dtype``, transposed to be wide; whether ``matrix`` was tall). X is a copy
    unless ``overwrite_input`` and ``matrix`` is already of ``dtype``. A wider input to
    float16 NS is normalized before the cast (:func:`normalize_into`); otherwise
    torch.optim.Muon's order: cast here, normalize afterwards."""
    if matrix.ndim not in (2, 3):
        raise ValueError(
            f"Newton-Schulz needs a 2-D matrix or a 3-D batch, got {tuple(matrix.shape)}"
        )
    if dtype == torch.float16 and matrix.dtype != torch.float16:
        x = normalize_into(matrix, torch.empty_like(matrix, dtype=dtype), eps)
    elif overwrite_input and matrix.dtype == dtype:
        x = matrix
    else:
        x = matrix.to(dtype, copy=True)
    tall = matrix.size(-2) > matrix.size(-1)
    return (x.mT if tall else x), tall


def zeropower_via_newtonschulz(
    matrix: Tensor,
    coefficients: Sequence[Coefficients],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
    symmetric_panels: int = 1,
    overwrite_input: bool = False,
    symmetric_kernel: bool = False,
    polynomial_form: bool = False,
    fold_normalization: bool = False,
    squares: Tensor | None = None,
    preconditioner: str = "frobenius",
) -> Tensor:
    """Approximate the orthogonal polar factor of ``matrix`` (2-D, or a batch of same-shape 3-D).

    Same algorithm and operation order as ``torch.optim.Muon``: cast to ``dtype``, transpose
    when tall, divide by the Frobenius norm clamped at ``eps``, then ``ns_steps`` iterations of
    X ← aX + (bA + cA²)X with A = XXᵀ. Iteration ``i`` uses ``coefficients[min(i, len - 1)]``.
    Returns a tensor of ``dtype`` and of ``matrix``'s shape. ``symmetric_panels`` > 1 computes the two symmetric products (A and A²) by
    :func:`symmetric_matmul` (no longer bitwise ``torch.optim.Muon``'s rounding).
    ``overwrite_input``: ``matrix`` (already of ``dtype``) may be used as scratch, saving a copy
    (otherwise ``matrix`` is never modified). float16: see :func:`_wide_ns_input`.
    ``symmetric_kernel``: the same, by the Triton kernel of :mod:`.symmetric` where it runs.
    ``polynomial_form`` (with panels or the kernel only): each iteration as X ← P·X with
    P = aI + bA + cA² formed by the symmetric product, instead of aX + (bA + cA²)X: the same
    FLOPs without copying X into the last product's output (:func:`orthogonalize` takes it
    with the kernel). The kernel adds ``a`` in float32 before rounding P once; elsewhere ``a``
    is added to the rounded product, a second rounding of the diagonal.
    ``fold_normalization`` (with ``polynomial_form``): no pass dividing X by its norm; the
    first iteration takes X as it is and scales its two symmetric products instead, A by
    1/‖X‖² and P by 1/‖X‖ (:func:`inverse_norms`), so P·X is the first iteration's result
    (where it is safe, :func:`_folds`). Both flags act on the panels/kernel route only; the
    other one is always torch.optim.Muon's operations. ``squares``: see :func:`orthogonalize`.
    ``preconditioner`` (:data:`NS_PRECONDITIONERS`): ``"aol"`` starts from
    :func:`aol_precondition_` instead of the Frobenius normalization (and never folds).
    """
    if fold_normalization and not polynomial_form:
        raise ValueError("fold_normalization needs polynomial_form (X <- P X)")
    check_ns_preconditioner(preconditioner)
    aol = preconditioner == "aol" and ns_steps > 0
    x, tall = _wide_ns_input(matrix, dtype, eps, overwrite_input)
    if symmetric_panels > 1 or symmetric_kernel:
        sym = {"panels": symmetric_panels, "kernel": symmetric_kernel}
        first = aol_precondition_(x, eps, sym) if aol else None
        fold = fold_normalization and not aol and _folds(dtype, eps, ns_steps)
        inverse = None if aol else _normalize_or_fold(x, eps, fold, _usable(squares, matrix, dtype))
        x = _symmetric_iterations(x, coefficients, ns_steps, inverse, polynomial_form, sym, first)
        return x.mT if tall else x
    addmm = torch.addmm if matrix.ndim == 2 else torch.baddbmm
    if aol:
        gram = aol_precondition_(x, eps)
    elif matrix.ndim == 2:
        divide_(x, x.norm().clamp(min=eps))
    else:
        divide_(x, torch.linalg.matrix_norm(x, keepdim=True).clamp(min=eps))  # x is our copy
    for i in range(ns_steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        if i > 0 or not aol:
            gram = x @ x.mT
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def _symmetric_iterations(
    x: Tensor,
    coefficients: Sequence[Coefficients],
    ns_steps: int,
    inverse: Tensor | None,
    polynomial_form: bool,
    sym: dict,
    first_gram: Tensor | None = None,
) -> Tensor:
    """:func:`zeropower_via_newtonschulz`'s iterations with the symmetric products by
    :func:`symmetric_matmul` (``inverse``: the first iteration's folded normalization;
    ``first_gram``: the first iteration's X·Xᵀ, already computed)."""
    for i in range(ns_steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        folded = inverse is not None and i == 0
        if i == 0 and first_gram is not None:
            gram = first_gram
        else:
            gram = symmetric_matmul(x, x.mT, scale=inverse.square() if folded else None, **sym)
        # bA + cA², plus aI in the polynomial form
        diagonal = a if polynomial_form else 0.0
        poly = _polynomial(gram, (diagonal, b, c), inverse if folded else None, sym)
        if polynomial_form:
            x = poly @ x
        else:
            x = (torch.baddbmm if x.ndim == 3 else torch.addmm)(x, poly, x, beta=a)
    return x


def _polynomial(
    gram: Tensor, coefficients: Coefficients, scale: Tensor | None, sym: dict
) -> Tensor:
    """(aI + bA + cA²)·``scale`` for the symmetric A = ``gram`` and (a, b, c) =
    ``coefficients``, by one symmetric product (``sym``: its route)."""
    a, b, c = coefficients
    return symmetric_matmul(
        gram, gram, addend=gram, beta=b, alpha=c, diagonal=a, scale=scale, **sym
    )


def _usable(squares: Tensor | None, matrix: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``squares`` where they are the squares NS would sum: ``matrix``'s own entries, not
    rounded again by a cast to ``dtype``."""
    return squares if squares is not None and matrix.dtype == dtype else None


#: the smallest ``eps`` the fold takes: 1/eps² must stay within float32
FOLD_MIN_EPS = 1e-15


def _folds(dtype: torch.dtype, eps: float, ns_steps: int) -> bool:
    """Whether ``fold_normalization`` may fold: not in float16 (its inputs arrive normalized,
    :func:`_wide_ns_input`, and 1/eps times a coefficient would overflow its range, turning a
    zero matrix into NaN), not for ``eps`` below :data:`FOLD_MIN_EPS`, not without an
    iteration to fold into."""
    return dtype != torch.float16 and eps >= FOLD_MIN_EPS and ns_steps > 0


def _normalize_or_fold(
    x: Tensor, eps: float, fold: bool, squares: Tensor | None = None
) -> Tensor | None:
    """NS's normalization of ``x``: with ``fold``, :func:`inverse_norms` for the first products
    to scale by (``x`` unchanged; from ``squares`` if given); otherwise ``x`` divided by its
    norm in place, and None."""
    if fold:
        return inverse_norms(x, eps, squares)
    divide_(x, torch.linalg.matrix_norm(x, keepdim=True).clamp(min=eps))
    return None


def inverse_norms(x: Tensor, eps: float, squares: Tensor | None = None) -> Tensor:
    """1 / ‖x‖_F per matrix (the norm rounded to ``x``'s dtype and clamped at ``eps``, as the
    division NS normalizes by), in float32 (float64 for float64 ``x``), of shape
    ``x.shape[:-2]``. ``squares``: partial sums of the squares of ``x``'s entries, float32,
    one row per matrix (:func:`orthogonalize`); the norm is then their sum's root, and ``x``
    is not read."""
    if squares is None:
        norm = torch.linalg.matrix_norm(x)
    else:
        norm = squares.sum(dim=-1).sqrt().reshape(x.shape[:-2]).to(x.dtype)
    return norm.clamp(min=eps).to(torch.promote_types(x.dtype, torch.float32)).reciprocal()


#: Gram NS computes its symmetric products in this many row panels (``symmetric_matmul``)
#: when the short side is at least ``SYMMETRIC_PANELS_MIN_SIDE``: panels pay off on large
#: matrices only, smaller panels being far from the matmul rate (docs/design_notes.md#row-panels).
SYMMETRIC_PANELS = 4
SYMMETRIC_PANELS_MIN_SIDE = 4096


def gram_newton_schulz(
    matrix: Tensor,
    coefficients: Sequence[Coefficients],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
    restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
    symmetric_panels: int = 1,
    overwrite_input: bool = False,
    symmetric_kernel: bool = False,
    fold_normalization: bool = False,
    squares: Tensor | None = None,
    preconditioner: str = "frobenius",
) -> Tensor:
    """The same polynomial iteration as :func:`zeropower_via_newtonschulz`, run on the Gram
    matrix: equal in exact arithmetic, fewer FLOPs when one side is much longer.

    With X (m×n, m ≤ n) and R = XXᵀ, an iteration X ← P X with P = aI + bR + cR² changes R
    to P R P (P is a polynomial in R, so they commute), and after k iterations X_k = Q X_0
    with Q the product of the P's. Only m×m products run inside the loop; X is re-formed as
    Q X_0 at the end and at every iteration listed in ``restarts`` (where R is recomputed
    from it, which keeps half-precision rounding from compounding: without a restart bf16
    results can be off by far more than the matrix itself). Every product but Q X_0 is
    symmetric, so ``symmetric_panels`` > 1 or ``symmetric_kernel`` computes them by
    :func:`symmetric_matmul`.
    2-D or a 3-D batch; returns ``dtype`` in ``matrix``'s shape; ``matrix`` is not modified
    unless ``overwrite_input`` (then, when already of ``dtype``, it is used as scratch).
    ``fold_normalization``: no pass dividing X by its norm; the first Gram matrix is scaled
    by 1/‖X‖², and the Q that first multiplies X by 1/‖X‖ (:func:`inverse_norms`; where it
    is safe, :func:`_folds`). ``squares``: see :func:`orthogonalize`. ``preconditioner``: as
    :func:`zeropower_via_newtonschulz`'s (AOL's X·Xᵀ is the first Gram matrix).
    """
    check_ns_preconditioner(preconditioner)
    aol = preconditioner == "aol" and ns_steps > 0
    x, tall = _wide_ns_input(matrix, dtype, eps, overwrite_input)
    sym = {"panels": symmetric_panels, "kernel": symmetric_kernel}  # all products but Q·X
    if aol:
        inverse, gram = None, aol_precondition_(x, eps, sym)
    else:
        fold = fold_normalization and _folds(dtype, eps, ns_steps)
        inverse = _normalize_or_fold(x, eps, fold, _usable(squares, matrix, dtype))
        scale = None if inverse is None else inverse.square()
        gram = symmetric_matmul(x, x.mT, scale=scale, **sym)
    restart_at = {r for r in restarts if 0 < r < ns_steps}
    first_run_end = min(restart_at | {ns_steps}) - 1  # where Q first multiplies X
    q = None  # None: the identity (X is current)
    for i in range(ns_steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        scale = inverse if i == first_run_end else None
        poly = _polynomial(gram, (a, b, c), scale if q is None else None, sym)
        q = poly if q is None else symmetric_matmul(poly, q, scale=scale, **sym)
        if i == ns_steps - 1:
            break
        if i + 1 in restart_at:
            x, q = q @ x, None
            gram = symmetric_matmul(x, x.mT, **sym)
        else:
            gram = symmetric_matmul(poly, symmetric_matmul(gram, poly, **sym), **sym)
    if q is not None:
        x = q @ x
    return x.mT if tall else x


def _kernel_route(
    shape: Sequence[int], algorithm: str, dtype: torch.dtype, device: torch.device
) -> tuple[bool, bool]:
    """(whether :func:`orthogonalize` runs the symmetric kernel on matrices of ``shape``;
    whether it takes the polynomial form and the fold too)."""
    short, long = sorted(shape[-2:])
    kernel = algorithm != "plain" and symmetric_kernel_runs_for(short, long, dtype, device)
    # The polynomial form and the fold by the kernel: measured in bfloat16 only (float16
    # keeps the addend form and never folds, _folds; docs/design_notes.md#polynomial-form-and-folded-normalization).
    return kernel, kernel and dtype == torch.bfloat16


def uses_squares(
    shape: Sequence[int],
    algorithm: str,
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    preconditioner: str = "frobenius",
) -> bool:
    """Whether :func:`orthogonalize` of ``dtype`` matrices of ``shape`` would take their
    norms from ``squares`` (it folds the normalization), so that the caller computes them
    only then."""
    if preconditioner != "frobenius":
        return False
    return _kernel_route(shape, algorithm, dtype, device)[1] and _folds(dtype, eps, ns_steps)


def orthogonalize(
    matrix: Tensor,
    coefficients: Sequence[Coefficients],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
    algorithm: str = "plain",
    overwrite_input: bool = False,
    squares: Tensor | None = None,
    preconditioner: str = "frobenius",
) -> Tensor:
    """Newton–Schulz by ``algorithm`` (see :data:`NS_ALGORITHMS`; ``"auto"`` decides by the
    matrix's last two dimensions).

    ``"plain"`` is always ``torch.optim.Muon``'s exact operations. ``"gram"`` and ``"auto"``
    compute their symmetric products (X·Xᵀ, and plain NS's A² as well) by the Triton kernel
    of :mod:`.symmetric` where it runs (CUDA, half precision, sides multiples of its tile);
    elsewhere Gram NS cuts them into row panels on large matrices
    (:data:`SYMMETRIC_PANELS_MIN_SIDE`) and plain NS is torch.optim.Muon's. In bfloat16, plain
    NS by the kernel runs each iteration as X ← P·X (``polynomial_form``), and both, by the
    kernel, fold the normalization into the first products (``fold_normalization``).

    ``squares`` (float32, one row per matrix: partial sums of the squares of ``matrix``'s
    entries, as ``fused.momentum_directions_by_table`` writes them): where the normalization
    is folded and ``matrix`` is already of ``dtype``, its norm is their sum's root instead
    of a pass over the matrix; elsewhere they are not used. ``preconditioner``
    (:data:`NS_PRECONDITIONERS`): how the input is scaled first (``"aol"`` never folds)."""
    choice = ns_algorithm_for(matrix.shape[-2:], algorithm, ns_steps)
    short, long = sorted(matrix.shape[-2:])
    kernel, measured = _kernel_route(matrix.shape, algorithm, dtype, matrix.device)
    if choice == "gram":
        panels = SYMMETRIC_PANELS if short >= SYMMETRIC_PANELS_MIN_SIDE else 1
        return gram_newton_schulz(
            matrix,
            coefficients,
            ns_steps,
            eps,
            dtype,
            symmetric_panels=panels,
            overwrite_input=overwrite_input,
            symmetric_kernel=kernel,
            fold_normalization=measured,
            squares=squares,
            preconditioner=preconditioner,
        )
    # Plain NS without panels: they measured slower on its shapes (docs/design_notes.md#row-panels).
    # With the kernel as X ← P·X: no copy of X into each iteration's last product, and no
    # less accurate, since the kernel rounds P once; the fold measured so too
    # (docs/design_notes.md#polynomial-form-and-folded-normalization).
    return zeropower_via_newtonschulz(
        matrix,
        coefficients,
        ns_steps,
        eps,
        dtype,
        overwrite_input=overwrite_input,
        symmetric_kernel=kernel,
        polynomial_form=measured,
        fold_normalization=measured,
        squares=squares,
        preconditioner=preconditioner,
    )
