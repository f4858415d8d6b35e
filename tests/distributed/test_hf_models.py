"""The seed's plain-loop recipe on Transformers models built from configs: ``dedicate_params``
on q_proj … down_proj, ``fully_shard`` on ``model.model.layers`` and the root, ``dmuon.Muon``;
against ``torch.optim.Muon`` + ``torch.optim.AdamW`` on one process, in float64.

The models are not wholly float64: their RMSNorm and eager softmax round to float32, where a
batch split across ranks flips roundings, so they are held to the float32 bound (1e-5; about
8e-7 measured)."""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dmuon_titan as dmuon  # noqa: E402

from ..helpers import relative_errors  # noqa: E402
from ..helpers.harness import run_ranks  # noqa: E402
from ..helpers.hf import seed_muon, shard_like_the_seed, tiny_causal_lm, train_reference  # noqa: E402

STEPS, BATCH, SEQ, MAX_NORM = 5, 12, 16, 0.5
#: (name, model family, tied embeddings, micro-batches, gradient checkpointing)
CASES = [
    ("llama", "llama", False, 1, False),
    ("llama-tied", "llama", True, 1, False),
    ("qwen3", "qwen3", False, 1, False),
    ("llama-no_sync-checkpointing", "llama", False, 2, True),
]


def _model(family: str, tied: bool):
    return tiny_causal_lm(family, vocab=96, seq=SEQ, tied=tied)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 96, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _dmuon_runs(rank: int, world_size: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for _, family, tied, micro, checkpointing in CASES:
        model = _model(family, tied)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        shard_like_the_seed(model, mesh)
        optimizer = seed_muon(model)
        model.train()
        per_rank = BATCH // world_size
        for tokens in _batches():
            mine = tokens[rank * per_rank : (rank + 1) * per_rank]
            chunks = mine.chunk(micro)
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                with dmuon.no_sync(model) if not last else contextlib.nullcontext():
                    (model(input_ids=chunk, labels=chunk).loss / micro).backward()
            dmuon.clip_grad_norm_(model, MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        results.append(dmuon.get_model_state_dict(model))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_transformers_models_equal_torch_muon_and_adamw(world_size):
    """5 steps, clipping on: Llama, Llama with tied embeddings, Qwen3, and Llama with 2
    accumulated micro-batches (the first under ``dmuon.no_sync``) and HF's gradient
    checkpointing; every weight within 1e-5 of the reference's (relative to how far it
    moved)."""
    runs = run_ranks(_dmuon_runs, world_size, timeout=300)
    failures = []
    for (name, family, tied, _, _), weights in zip(CASES, runs[0], strict=True):
        init = _model(family, tied).state_dict()
        reference, _ = train_reference(_model(family, tied), _batches(), MAX_NORM)
        assert set(weights) == set(reference), name
        errors = relative_errors(weights, reference, init)
        worst = max(errors, key=errors.get)
        if not errors[worst] <= 1e-5:
            failures.append(f"{name}: {worst} off by {errors[worst]:.2e}")
    assert not failures, "\n".join(failures)
