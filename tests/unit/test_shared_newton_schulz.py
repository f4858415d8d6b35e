"""Newton–Schulz shared by a group of ranks (column blocks, ``orthogonalize_column_blocks``):
the pure math, with the group's collectives stood in for by threads of one process."""

from __future__ import annotations

import threading

import pytest
import torch

from dmuon_titan.ops import newton_schulz as ns
from dmuon_titan.runtime import column_blocks


class ThreadGroup:
    """``size`` threads acting as ranks: blocking sums and gathers through a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size
        self.calls = {"all_reduce": 0, "all_gather": 0}

    def member(self, rank: int):
        group = self

        class Member:
            size, rank = group.size, None

            def all_reduce_(self, tensor):
                group.slots[rank] = tensor.clone()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())
                group.barrier.wait()
                if rank == 0:
                    group.calls["all_reduce"] += 1
                tensor.copy_(total)

            def all_gather(self, tensor):
                group.slots[rank] = tensor.clone()
                group.barrier.wait()
                out = torch.stack(group.slots)
                group.barrier.wait()
                if rank == 0:
                    group.calls["all_gather"] += 1
                return out

        m = Member()
        m.rank = rank
        return m


def shared_orthogonalize(
    matrix, size, dtype, coefficients=(ns.JORDAN_COEFFICIENTS,), steps=5, preconditioner="frobenius"
):
    """Every rank's block through ``orthogonalize_column_blocks`` on its thread; the whole
    result, and the group (for its call counts)."""
    group = ThreadGroup(size)
    out: list = [None] * size
    errors: list = []

    def run(rank):
        try:
            block = column_blocks.wide_column_block(matrix.to(dtype), rank, size)
            out[rank] = column_blocks.orthogonalize_column_blocks(
                block, coefficients, steps, 1e-7, group.member(rank), preconditioner
            )
        except Exception as err:  # pragma: no cover - surfaced below
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return column_blocks.from_wide_column_blocks(out, matrix.shape), group


SHAPES = [(24, 40), (40, 24), (32, 32), (17, 53), (3, 24, 40)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shared_ns_equals_the_whole_matrix_ns_in_float64(shape, size):
    """Tall, wide, square, sides no group size divides, a batch: the column blocks' result
    equals torch.optim.Muon's iteration on the whole matrix (ours, which the parity tests tie
    to torch.optim.Muon) up to the order of summation."""
    matrix = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = ns.zeropower_via_newtonschulz(
        matrix, (ns.JORDAN_COEFFICIENTS,), 5, 1e-7, dtype=torch.float64
    )
    shared, group = shared_orthogonalize(matrix, size, torch.float64)
    assert shared.shape == matrix.shape
    assert (shared - whole).abs().max().item() <= 1e-12 * whole.abs().max().item()
    # one norm, then per iteration one m×m sum and one gather
    assert group.calls == {"all_reduce": 1 + 5, "all_gather": 5}


def test_shared_ns_follows_a_per_iteration_schedule():
    matrix = torch.randn(20, 36, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    schedule = ns.normalize_coefficients("polar_express")
    whole = ns.zeropower_via_newtonschulz(matrix, schedule, 6, 1e-7, dtype=torch.float64)
    shared, _ = shared_orthogonalize(matrix, 3, torch.float64, schedule, steps=6)
    assert (shared - whole).abs().max().item() <= 1e-12


def test_shared_ns_in_bfloat16_is_as_close_to_float64_as_the_whole_matrix_ns():
    """bf16: partial products rounded before their float32 sum, so not bitwise; its distance
    from the float64 result is the whole-matrix bf16 NS's within 25 %."""
    matrix = torch.randn(64, 160, generator=torch.Generator().manual_seed(3))
    exact = ns.zeropower_via_newtonschulz(
        matrix.double(), (ns.JORDAN_COEFFICIENTS,), 5, 1e-7, dtype=torch.float64
    )
    whole = ns.zeropower_via_newtonschulz(matrix, (ns.JORDAN_COEFFICIENTS,), 5, 1e-7)
    shared, _ = shared_orthogonalize(matrix, 4, torch.bfloat16)
    assert shared.dtype == torch.bfloat16
    whole_error = (whole.double() - exact).norm() / exact.norm()
    shared_error = (shared.double() - exact).norm() / exact.norm()
    assert shared_error <= 1.25 * whole_error, (shared_error, whole_error)


def test_column_blocks_round_trip_and_pad_with_zeros():
    matrix = torch.arange(5 * 7, dtype=torch.float32).view(7, 5)  # tall: blocks of its transpose
    blocks = [column_blocks.wide_column_block(matrix, r, 3) for r in range(3)]
    assert [tuple(b.shape) for b in blocks] == [(5, 3)] * 3
    assert blocks[2][:, 1:].abs().sum() == 0  # 7 columns in blocks of 3: two padding columns
    assert torch.equal(column_blocks.from_wide_column_blocks(blocks, matrix.shape), matrix)
