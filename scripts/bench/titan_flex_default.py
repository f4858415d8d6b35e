#!/usr/bin/env python3
"""torchtitan's trainer with FlexAttention compiled in Inductor's default mode.

A drop-in for ``-m torchtitan.train`` (same arguments). torchtitan 0.2.2 compiles
``flex_attention`` with ``max_autotune``, whose kernel benchmarking outlasts a 10-minute device
call for gpt_oss (docs/benchmarks.md, "Mixture-of-experts on one GPU"); the default mode
compiles in about a minute. The kernels differ, the model and the optimizers do not: this is for checking that a
FlexAttention model trains, not for timing it.

    torchrun --standalone --nproc_per_node=1 scripts/bench/titan_flex_default.py \\
        --job.config_file configs/toy_dmuon.toml --model.name gpt_oss
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import flex_attention
from torchtitan.models.attention import FlexAttentionWrapper
from torchtitan.train import Trainer, main

if __name__ == "__main__":
    # a class attribute: every FlexAttentionWrapper calls this one compiled function
    # (torchtitan's options less max_autotune and coordinate_descent_tuning)
    FlexAttentionWrapper._compiled_flex_attn = torch.compile(
        flex_attention,
        options={"wrap_inductor_compiled_regions": True, "triton.cudagraphs": False},
    )
    main(Trainer)
