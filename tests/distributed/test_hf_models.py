"""The seed's plain-loop recipe on Transformers models built from configs: ``dedicate_params``
on q_proj … down_proj, ``fully_shard`` on ``model.model.layers`` and the root, ``dmuon.Muon``;
against ``torch.optim.Muon`` + ``torch.optim.AdamW`` on one process, in float64.

The models are not wholly float64: their RMSNorm and eager softmax round to float32, where a
batch split across ranks flips roundings, so they are held to the float32 bound (1e-5; about
8e-7 measured)."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dmuon_titan as dmuon  # noqa: E402

from ..helpers import relative_errors  # noqa: E402
from ..helpers.harness import run_ranks  # noqa: E402
from ..helpers.training import ns_in  # noqa: E402

PROJECTIONS = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
STEPS, BATCH, SEQ, MAX_NORM = 5, 12, 16, 0.5
LR, ADAMW_LR, DECAY = 0.02, 3e-3, 0.1
#: (name, model family, tied embeddings, micro-batches, gradient checkpointing)
CASES = [
    ("llama", "llama", False, 1, False),
    ("llama-tied", "llama", True, 1, False),
    ("qwen3", "qwen3", False, 1, False),
    ("llama-no_sync-checkpointing", "llama", False, 2, True),
]


def _model(family: str, tied: bool):
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(head_dim=8, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(config).double()


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 96, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _dmuon_runs(rank: int, world_size: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for _, family, tied, micro, checkpointing in CASES:
        model = _model(family, tied)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        dmuon.dedicate_params(model, mesh, lambda n, p: bool(PROJECTIONS.search(n)))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(
            model,
            lr=LR,
            weight_decay=DECAY,
            ns_dtype=torch.float64,
            adamw_lr=ADAMW_LR,
            adamw_betas=(0.9, 0.95),
            adamw_weight_decay=DECAY,
        )
        model.train()
        per_rank = BATCH // world_size
        for tokens in _batches():
            mine = tokens[rank * per_rank : (rank + 1) * per_rank]
            chunks = mine.chunk(micro)
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                with dmuon.no_sync(model) if not last else _nothing():
                    (model(input_ids=chunk, labels=chunk).loss / micro).backward()
            dmuon.clip_grad_norm_(model, MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        results.append(dmuon.get_model_state_dict(model))
    return results


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _reference(family: str, tied: bool) -> tuple[dict, dict]:
    from unittest import mock

    model = _model(family, tied)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    muon_params = [p for n, p in model.named_parameters() if PROJECTIONS.search(n)]
    rest = [p for n, p in model.named_parameters() if not PROJECTIONS.search(n)]
    muon = torch.optim.Muon(muon_params, lr=LR, weight_decay=DECAY)
    adamw = torch.optim.AdamW(rest, lr=ADAMW_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=DECAY)
    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", ns_in(torch.float64)):
        for tokens in _batches():
            model(input_ids=tokens, labels=tokens).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, init


@pytest.mark.parametrize("world_size", [2, 3])
def test_transformers_models_equal_torch_muon_and_adamw(world_size):
    """5 steps, clipping on: Llama, Llama with tied embeddings, Qwen3, and Llama with 2
    accumulated micro-batches (the first under ``dmuon.no_sync``) and HF's gradient
    checkpointing; every weight within 1e-5 of the reference's (relative to how far it
    moved)."""
    runs = run_ranks(_dmuon_runs, world_size, timeout=300)
    failures = []
    for (name, family, tied, _, _), weights in zip(CASES, runs[0], strict=True):
        reference, init = _reference(family, tied)
        assert set(weights) == set(reference), name
        errors = relative_errors(weights, reference, init)
        worst = max(errors, key=errors.get)
        if not errors[worst] <= 1e-5:
            failures.append(f"{name}: {worst} off by {errors[worst]:.2e}")
    assert not failures, "\n".join(failures)
