"""The toy corpus: sorted or shuffled training order, the same texts either way."""

from dmuon_titan.toy.data import read_texts


def test_shuffled_training_order_is_seeded_and_keeps_the_texts():
    sorted_texts = read_texts("train")
    one, again, two = (read_texts("train", shuffle_seed=s) for s in (1, 1, 2))
    assert len(sorted_texts) > 100
    assert one == again  # the same order for the same seed, every time
    assert one != sorted_texts and one != two
    assert sorted(one) == sorted(sorted_texts) == sorted(two)
