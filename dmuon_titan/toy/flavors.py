"""Extra llama3 flavors for the repository's benchmarks and loss curves."""

from __future__ import annotations

import dataclasses

#: ``"170M"``: 12 blocks of width 1024 on an 8192-token BPE vocabulary, 171 M parameters, for
#: the loss-curve comparison on one GPU. ``"8B_8layers"``: the first 8 of llama3-8B's 32
#: blocks (same shapes, vocabulary and heads), so one GPU can run and profile the 8B step's
#: per-block work without FSDP.
EXTRA_LLAMA3_FLAVORS = {
    "170M": dict(dim=1024, n_layers=12, n_heads=16, vocab_size=8192, rope_theta=500000),
    "8B_8layers": dict(base="8B", n_layers=8),
}


def add_llama3_flavors() -> None:
    """Idempotent: add :data:`EXTRA_LLAMA3_FLAVORS` to torchtitan's llama3 flavors."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    for flavor, kwargs in EXTRA_LLAMA3_FLAVORS.items():
        kwargs = dict(kwargs)
        base = kwargs.pop("base", None)
        args = (
            dataclasses.replace(llama3_args[base], **kwargs)
            if base
            else TransformerModelArgs(**kwargs)
        )
        llama3_args.setdefault(flavor, args)
