"""The rank-consistent schedule (pure functions: no process group)."""

import pytest

from dmuon_titan.runtime.schedule import Schedule, merge_sequences, plan_order_schedule


def test_plan_order_guess_lists_every_boundary_once():
    s = plan_order_schedule(4)
    assert s.forward == (0, 1, 2, 3) and not s.recorded
    assert s.backward_unshard == s.reduce == (3, 2, 1, 0)


def test_backward_orders_of_a_reused_boundary():
    # layers.0 runs twice: backward meets its second use first (re-broadcast), its gradients
    # are final only after its first use's backward (reduce).
    s = Schedule((0, 1, 0, 2), recorded=True)
    assert s.backward_unshard == (2, 0, 1)
    assert s.reduce == (2, 1, 0)
    assert s.next_entry(0, 1) == 2 and s.next_entry(1, 2) is None


def test_experts_skipped_on_different_ranks_merge_into_the_natural_order():
    # boundaries: 0-3 experts of layer 0, 4 the layer; rank 0 ran experts 0 and 2, rank 1
    # ran 1 and 2; nobody ran 3.
    merged = merge_sequences([[4, 0, 2], [4, 1, 2]], 5)
    assert merged.recorded
    assert merged.forward == (3, 4, 0, 1, 2)  # 3 is unconstrained: placed by its index
    for sequence in ([4, 0, 2], [4, 1, 2]):
        positions = [merged.forward.index(b) for b in sequence]
        assert positions == sorted(positions)  # each rank's order is a subsequence


def test_repeats_and_order_are_kept():
    merged = merge_sequences([[0, 1, 0, 2], [0, 1, 0, 2]], 3)
    assert merged.forward == (0, 1, 0, 2)
    # a rank that ran the reused boundary once more than another: the union of entries
    assert merge_sequences([[0, 1, 0, 2], [0, 1, 2]], 3).forward == (0, 1, 0, 2)


def test_contradicting_orders_are_broken_the_same_way_everywhere():
    a = merge_sequences([[0, 1], [1, 0]], 2)
    b = merge_sequences([[0, 1], [1, 0]], 2)
    assert a == b and sorted(a.forward) == [0, 1]


def test_the_merge_is_a_function_of_the_gathered_sequences_only():
    sequences = [[5, 6, 0, 1, 7, 2, 3], [5, 6, 1, 7, 3], [5, 0, 7, 2]]
    first = merge_sequences(sequences, 8)
    assert merge_sequences([list(s) for s in sequences], 8) == first
    assert sorted(first.forward) == list(range(8))  # every boundary, 4 (never run) too


def test_out_of_range_boundary_is_rejected():
    with pytest.raises(ValueError, match="out of range"):
        merge_sequences([[0, 5]], 2)
