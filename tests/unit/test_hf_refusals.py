"""``DMuonTrainer``'s refusals: one ValueError naming what is wrong and the fix, raised
before the Trainer is built (one process: nothing here is collective)."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dmuon_titan as dmuon  # noqa: E402

PROJECTIONS = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _args(tmp_path, **changes):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **changes
    )


def _dedicated(mesh, root=True):
    from torch.distributed.fsdp import fully_shard

    model = _llama()
    dmuon.dedicate_params(model, mesh, lambda n, p: bool(PROJECTIONS.search(n)))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def test_a_model_without_dedicated_matrices(tmp_path):
    from dmuon_titan.hf import DMuonTrainer

    model = _llama()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="no dedicated matrices; call dmuon_titan.dedicate_params"):
        DMuonTrainer(model=model, args=_args(tmp_path), optimizers=(optimizer, None))


def test_a_parameter_fully_shard_did_not_take(cpu_mesh, tmp_path):
    from dmuon_titan.hf import DMuonTrainer

    model = _dedicated(cpu_mesh, root=False)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is neither dedicated nor"):
        DMuonTrainer(model=model, args=_args(tmp_path), optimizers=(optimizer, None))


def test_another_optimizer(cpu_mesh, tmp_path):
    from dmuon_titan.hf import DMuonTrainer

    model = _dedicated(cpu_mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"optimizers\[0\] must be the dmuon_titan.Muon"):
        DMuonTrainer(model=model, args=_args(tmp_path), optimizers=(optimizer, None))


@pytest.mark.parametrize(
    "changes, key",
    [({"torch_compile": True}, "torch_compile"), ({"gradient_checkpointing": True}, "gradient")],
)
def test_trainer_options_that_would_change_the_model(cpu_mesh, tmp_path, changes, key):
    from dmuon_titan.hf import DMuonTrainer

    model = _dedicated(cpu_mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    with pytest.raises(ValueError, match=f"TrainingArguments\\({key}"):
        DMuonTrainer(model=model, args=_args(tmp_path, **changes), optimizers=(optimizer, None))
