"""The Hugging Face tests' models, the seed's recipe and their single-process reference
(imported by tests that have checked transformers is installed)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from unittest import mock

import torch
import transformers
from torch import nn

import dmuon_titan as dmuon

from .training import ns_in

#: the seed's Muon matrices: the attention and MLP projections
PROJECTIONS = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
LR, ADAMW_LR, DECAY = 0.02, 3e-3, 0.1


def projection(name: str, _param=None) -> bool:
    return bool(PROJECTIONS.search(name))


def tiny_causal_lm(
    family: str = "llama",
    *,
    vocab: int,
    seq: int,
    tied: bool = False,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: torch.dtype = torch.float64,
) -> nn.Module:
    """A Llama or Qwen3 built from a config (seeded: the same weights every call), eager
    attention, in ``dtype``."""
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(head_dim=hidden // heads, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(config).to(dtype)


def shard_like_the_seed(model: nn.Module, mesh, root: bool = True) -> nn.Module:
    """``dedicate_params`` on the projections, then ``fully_shard`` on each of
    ``model.model.layers`` and (``root``) the model."""
    from torch.distributed.fsdp import fully_shard

    dmuon.dedicate_params(model, mesh, projection)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def seed_muon(model: nn.Module) -> dmuon.Muon:
    """DMuon with the reference's hyper-parameters (NS in float64)."""
    return dmuon.Muon(
        model,
        lr=LR,
        weight_decay=DECAY,
        ns_dtype=torch.float64,
        adamw_lr=ADAMW_LR,
        adamw_betas=(0.9, 0.95),
        adamw_weight_decay=DECAY,
    )


def train_reference(
    model: nn.Module, batches: Iterable[torch.Tensor], max_norm: float
) -> tuple[dict, list[float]]:
    """One process, each step's whole batch: torch.optim.Muon (NS in float64) on the
    projections, AdamW on the rest, clipped by torch's clip_grad_norm_; (the final state,
    each step's norm before the clip)."""
    muon_params = [p for n, p in model.named_parameters() if projection(n)]
    rest = [p for n, p in model.named_parameters() if not projection(n)]
    muon = torch.optim.Muon(muon_params, lr=LR, weight_decay=DECAY)
    adamw = torch.optim.AdamW(rest, lr=ADAMW_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=DECAY)
    norms = []
    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", ns_in(torch.float64)):
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms
