"""The Newton–Schulz cost model: FLOPs per shape and algorithm, and the algorithm choice.

Pure arithmetic on shapes (no tensors): the owner partition balances these costs, and the
optimizer asks :func:`ns_algorithm_for` which iteration to run on a shape.
"""

from __future__ import annotations

from collections.abc import Sequence


def ns_flops(shape: Sequence[int], ns_steps: int = 5) -> int:
    """FLOPs of ``ns_steps`` quintic NS iterations on a matrix of ``shape`` (2 FLOPs per FMA;
    the last two dimensions: one matrix of a stack, see :func:`orthogonalize_flops`).

    Per iteration on the wide orientation X (m×n, m ≤ n): A = X Xᵀ (2m²n), B = bA + cA² (2m³),
    X ← aX + BX (2m²n).
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    m, n = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * m * m * n + 2 * m * m * m)


#: Orthogonalization algorithms: ``"plain"`` is torch.optim.Muon's iteration; ``"gram"``
#: iterates on the m×m Gram matrix instead (same polynomial, fewer FLOPs for wide matrices);
#: ``"auto"`` picks, per shape, whichever needs fewer FLOPs.
NS_ALGORITHMS = ("plain", "gram", "auto")

#: Iterations after which Gram NS re-forms X and its Gram matrix from scratch: rounding
#: errors of the recursive Gram update grow with every iteration (by up to a² ≈ 12 on the
#: small eigenvalues), a restart caps that growth.
DEFAULT_GRAM_RESTARTS: tuple[int, ...] = (2,)


def gram_ns_flops(
    shape: Sequence[int], ns_steps: int = 5, restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS
) -> int:
    """FLOPs of :func:`gram_newton_schulz` on a matrix of ``shape`` (2 FLOPs per FMA).

    m×m products (m = the short side): R² every iteration, the R update P·R·P (two) on every
    iteration but the last and those before a restart, Q ← P·Q on all but the first of each
    run; m×n products: one Gram matrix per run, one Q·X per run.
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    m, n = min(rows, cols), max(rows, cols)
    boundaries = sorted({r for r in restarts if 0 < r < ns_steps})
    runs, start = [], 0
    for r in [*boundaries, ns_steps]:
        runs.append(r - start)
        start = r
    square = 0
    for length in runs:
        square += length  # R²
        square += 2 * (length - 1)  # R ← P R P, not after the run's last iteration
        square += length - 1  # Q ← P Q, not on the first (Q starts as P)
    return 2 * m * m * m * square + len(runs) * 4 * m * m * n


def check_ns_algorithm(algorithm: str) -> None:
    """Raise a ValueError naming ``algorithm`` unless it is one of :data:`NS_ALGORITHMS`."""
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"unknown ns_algorithm {algorithm!r}; known: {list(NS_ALGORITHMS)}")


def ns_algorithm_for(shape: Sequence[int], algorithm: str, ns_steps: int = 5) -> str:
    """``"plain"`` or ``"gram"``: ``algorithm`` itself, or for ``"auto"`` the cheaper one."""
    check_ns_algorithm(algorithm)
    if algorithm != "auto":
        return algorithm
    return "gram" if gram_ns_flops(shape, ns_steps) < ns_flops(shape, ns_steps) else "plain"


def orthogonalize_flops(shape: Sequence[int], algorithm: str = "plain", ns_steps: int = 5) -> int:
    """FLOPs of :func:`orthogonalize` by ``algorithm`` on a matrix of ``shape``, counting every
    product in full: the owner partition's cost model, which should follow the time of the
    algorithm that runs (docs/design_notes.md#partition-cost).

    A 3-D ``shape`` is a stack of ``shape[0]`` matrices (experts), each orthogonalized on its
    own: the stack costs that many matrices."""
    matrix = tuple(shape[-2:])
    count = 1
    for d in shape[:-2]:
        count *= int(d)
    if ns_algorithm_for(matrix, algorithm, ns_steps) == "gram":
        return count * gram_ns_flops(matrix, ns_steps)
    return count * ns_flops(matrix, ns_steps)


def column_block_width(shape: Sequence[int], size: int) -> int:
    """Columns of each rank's block of the wide orientation of a ``shape`` matrix (X, m×n
    with m ≤ n) when ``size`` ranks share its NS: ⌈n / size⌉ (the last blocks padded with
    zero columns, which stay zero and do not touch the others)."""
    return -(-max(int(shape[-2]), int(shape[-1])) // size)


def shared_ns_moved_bytes(
    shape: Sequence[int],
    tp_size: int,
    ns_size: int = 2,
    sum_size: int = 4,
    ns_steps: int = 5,
    norm: bool = True,
) -> int:
    """Bytes a row of ``tp_size`` ranks moves in all, in ``CommStats``' convention, to share
    the NS of a ``shape`` matrix (``ns_size``: the NS dtype's bytes; ``sum_size``: its sums',
    4, or 8 for float64 NS): with m its short side, w :func:`column_block_width`, p = ⌈m / T⌉,
    (T − 1) · (2·m·w·ns_size + sum_size + ns_steps · (m²·sum_size + T·p·m·ns_size)) — the
    blocks out and back, the norm (not under AOL, ``norm=False``: its scales come from the
    first Gram all-reduce), and per iteration the Gram all-reduce and the update all-gather."""
    t = tp_size
    m = min(int(shape[-2]), int(shape[-1]))
    width, per = column_block_width(shape, t), -(-m // t)
    iteration = m * m * sum_size + t * per * m * ns_size
    norms = sum_size if norm else 0
    return (t - 1) * (2 * m * width * ns_size + norms + ns_steps * iteration)
