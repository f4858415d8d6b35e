"""Extra flavors for the repository's benchmarks, loss curves and CPU tests."""

from __future__ import annotations

import dataclasses

#: llama3 ``"170M"``: 12 blocks of width 1024 on an 8192-token BPE vocabulary, 171 M
#: parameters, for the loss-curve comparison on one GPU; ``"500M"``: 16 blocks of width 1536
#: on the same vocabulary (478 M), the same comparison one size up. ``"8B_8layers"``: the first 8 of
#: llama3-8B's 32 blocks (same shapes, vocabulary and heads), so one GPU can run and profile
#: the 8B step's per-block work without FSDP. qwen3 ``"debugmodel_moe_small"``: qwen3's MoE
#: debug model cut to 2 blocks of 8 experts (top 2), so CPU tests of the MoE path take seconds
#: a step (the 64-expert debug model takes ~15 s of CPU Newton–Schulz a step on 2 ranks);
#: qwen3 ``"moe_1B"``: 8 blocks of width 1024 with 64 experts each (1.2 B parameters, 1.2 B
#: of them in experts), a torchtitan MoE run that fits one GPU.
#: gpt_oss ``"debugmodel_small"``: its debug model on the toy 2048-token vocabulary (the
#: stock one has 201,088) with 2 blocks of narrower experts.
EXTRA_FLAVORS = {
    "llama3": {
        "170M": dict(dim=1024, n_layers=12, n_heads=16, vocab_size=8192, rope_theta=500000),
        "500M": dict(dim=1536, n_layers=16, n_heads=12, vocab_size=8192, rope_theta=500000),
        "8B_8layers": dict(base="8B", n_layers=8),
    },
    "qwen3": {
        "debugmodel_moe_small": dict(
            base="debugmodel_moe",
            n_layers=2,
            moe_inter_dim=256,
            moe_args=dict(num_experts=8, top_k=2),
        ),
        "moe_1B": dict(
            base="debugmodel_moe",
            dim=1024,
            n_heads=16,
            n_kv_heads=8,
            head_dim=64,
        ),
    },
    "gpt_oss": {
        "debugmodel_small": dict(base="debugmodel", vocab_size=2048, n_layers=2, moe_inter_dim=256),
    },
}


def _flavor_table(model: str) -> dict:
    if model == "llama3":
        from torchtitan.models.llama3 import llama3_args

        return llama3_args
    from torchtitan.protocols.train_spec import get_train_spec

    return get_train_spec(model).model_args


def add_flavors() -> None:
    """Idempotent: add :data:`EXTRA_FLAVORS` to torchtitan's flavor tables."""
    for model, flavors in EXTRA_FLAVORS.items():
        table = _flavor_table(model)
        for flavor, kwargs in flavors.items():
            if flavor in table:
                continue
            kwargs = dict(kwargs)
            base = kwargs.pop("base", None)
            if base is None:
                from torchtitan.models.llama3.model.args import TransformerModelArgs

                table[flavor] = TransformerModelArgs(**kwargs)
                continue
            args = table[base]
            if "moe_args" in kwargs:
                kwargs["moe_args"] = dataclasses.replace(args.moe_args, **kwargs["moe_args"])
            table[flavor] = dataclasses.replace(args, **kwargs)
