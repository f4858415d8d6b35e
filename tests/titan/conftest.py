"""Fixtures of the torchtitan tests."""

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The toy tokenizer, trained once per test run on the standard library's source."""
    from dmuon_titan.toy.data import ensure_tokenizer

    return ensure_tokenizer(tmp_path_factory.mktemp("assets") / "tokenizer")


@pytest.fixture(scope="session")
def toy_seed(tokenizer_dir, tmp_path_factory) -> str:
    """The toy's one-rank AdamW seed checkpoint (torchtitan's defaults otherwise), made once per
    test run: runs started from it share their weights. Read only (``initial_load_path``)."""
    from .test_titan import seed_checkpoint

    seed, _ = seed_checkpoint(tokenizer_dir, tmp_path_factory.mktemp("toy_seed"))
    return seed
