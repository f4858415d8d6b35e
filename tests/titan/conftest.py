"""Fixtures of the torchtitan tests."""

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The toy tokenizer, trained once per session on the standard library's source."""
    from dmuon_titan.toy.data import ensure_tokenizer

    return ensure_tokenizer(tmp_path_factory.mktemp("assets") / "tokenizer")
