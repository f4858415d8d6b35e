"""``DMuonTrainer``'s refusals: one ValueError naming what is wrong and the fix, raised
before the Trainer is built (one process: nothing here is collective)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dmuon_titan as dmuon  # noqa: E402

from ..helpers.hf import shard_like_the_seed, tiny_causal_lm  # noqa: E402


def _llama():
    return tiny_causal_lm(vocab=64, seq=8, layers=1, hidden=16, heads=2, kv_heads=1)


def _args(tmp_path, **changes):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **changes
    )


def _dedicated(mesh, root=True):
    return shard_like_the_seed(_llama(), mesh, root)


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
