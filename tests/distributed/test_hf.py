"""The Hugging Face Trainer on a DMuon model (``dmuon_titan.hf``): the seed's recipe (a
Transformers Llama, ``dedicate_params`` on q_proj … down_proj, manual ``fully_shard``,
``dmuon.Muon``) trained by ``DMuonTrainer`` on 2 gloo ranks, against ``torch.optim.Muon`` +
``torch.optim.AdamW`` on one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dmuon_titan as dmuon  # noqa: E402

from ..helpers.harness import run_ranks  # noqa: E402
from ..helpers.hf import seed_muon, shard_like_the_seed, tiny_causal_lm, train_reference  # noqa: E402

STEPS, PER_RANK, SEQ, MAX_NORM = 4, 4, 16, 0.05


def _model():
    return tiny_causal_lm(vocab=128, seq=SEQ)


def _dataset():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 128, (32, SEQ), generator=gen)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _distributed_env(rank: int, world_size: int, port: int) -> None:
    """What torchrun would set: accelerate reads the launch from the environment."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _distributed_model(world_size: int):
    """The seed's recipe on 2 ranks' mesh, and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    model = shard_like_the_seed(_model(), init_device_mesh("cpu", (world_size,)))
    return model, seed_muon(model)


def _args(out: str, **changes):
    options = dict(
        output_dir=out,
        per_device_train_batch_size=PER_RANK,
        max_steps=STEPS,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return transformers.TrainingArguments(**{**options, **changes})


def _train(rank: int, world_size: int, port: int, out: str) -> dict:
    from dmuon_titan.hf import DMuonTrainer

    _distributed_env(rank, world_size, port)
    model, optimizer = _distributed_model(world_size)
    seen = []

    class Recording(DMuonTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch)

    args = _args(out, per_device_train_batch_size=PER_RANK // 2, gradient_accumulation_steps=2)
    trainer = Recording(
        model=model, args=args, train_dataset=_dataset(), optimizers=(optimizer, None)
    )
    deferred, no_sync = [], model.no_sync

    def counted():
        deferred.append(len(seen))
        return no_sync()

    model.no_sync = counted
    trainer.train()
    return {
        "inputs": seen,
        "weights": dmuon.get_model_state_dict(model),
        "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
        "unwrapped": trainer.model_wrapped is model and trainer.model is model,
        "deferred": deferred,
    }


def _resume(rank: int, world_size: int, port: int, out: str) -> dict:
    """Uninterrupted 4 steps; 2 steps (checkpoint-2) then resumed to 4 by a fresh model,
    optimizer and trainer; the whole model saved by save_model."""
    from transformers import TrainerCallback

    from dmuon_titan.hf import DMuonTrainer

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    _distributed_env(rank, world_size, port)
    finals = {}
    for name, stop, resume in (("whole", [], None), ("stopped", [StopAt()], None)) + (
        ("resumed", [], True),
    ):
        model, optimizer = _distributed_model(world_size)
        folder = os.path.join(out, "stopped" if name == "resumed" else name)
        args = _args(folder, save_strategy="steps", save_steps=2)
        trainer = DMuonTrainer(
            model=model,
            args=args,
            train_dataset=_dataset(),
            optimizers=(optimizer, None),
            callbacks=stop,
        )
        trainer.train(resume_from_checkpoint=resume)
        finals[name] = {
            "step": trainer.state.global_step,
            "model": dmuon.get_model_state_dict(model),
            "optimizer": dmuon.get_optimizer_state_dict(model, optimizer),
        }
    trainer.save_model(os.path.join(out, "final"))
    return finals


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trainer_equals_torch_muon_and_adamw(tmp_path):
    """4 steps of 2 accumulated micro-batches, clipping active: no DDP around the model, the logged grad_norm is the global
    one (equal on both ranks and to the reference's), and the weights equal the reference's
    (relative to how far they moved) within the float32 bound, 1e-5 (2e-14 measured here:
    float64, NS too, but the model's RMSNorm and softmax round to float32)."""
    runs = run_ranks(_train, 2, _free_port(), str(tmp_path), timeout=300)
    assert all(r["unwrapped"] for r in runs)  # (no DDP, no other wrapper)
    assert all(len(r["inputs"]) == 2 * STEPS for r in runs)  # (two micro-batches a step)
    # the first micro-batch of each step under dmuon.no_sync (its reduce deferred)
    assert all(r["deferred"] == list(range(0, 2 * STEPS, 2)) for r in runs), runs[0]["deferred"]
    batches = [
        torch.cat([r["inputs"][i] for r in runs for i in (2 * s, 2 * s + 1)]) for s in range(STEPS)
    ]
    reference, norms = train_reference(_model(), batches, MAX_NORM)
    assert runs[0]["grad_norms"] == runs[1]["grad_norms"]
    assert min(norms) > MAX_NORM  # (the clip acts at every step)
    for got, want in zip(runs[0]["grad_norms"], norms, strict=True):
        assert abs(got - want) <= 1e-6 * want, (got, want)  # (rank-local: 2.5e-3 off)
    init = _model().state_dict()
    weights = runs[0]["weights"]
    assert sorted(weights) == sorted(reference)
    for k, want in reference.items():
        moved = (want - init[k]).norm()
        error = (weights[k].to(want.dtype) - want).norm() / moved
        assert error <= 1e-5, (k, error.item())


def test_checkpoints_resume_bit_exactly_and_save_model_writes_the_whole_model(tmp_path):
    """Stopped after the step-2 checkpoint and resumed by a fresh model, optimizer and
    trainer: after step 4 every weight and every optimizer tensor equals the uninterrupted
    run's, bit for bit, on both ranks; save_model's folder loads with from_pretrained."""
    runs = run_ranks(_resume, 2, _free_port(), str(tmp_path), timeout=300)
    for rank, finals in enumerate(runs):
        assert finals["stopped"]["step"] == 2 and finals["resumed"]["step"] == STEPS, rank
        whole, resumed = finals["whole"], finals["resumed"]
        for k, v in whole["model"].items():
            assert torch.equal(v, resumed["model"][k]), (rank, k)
        assert whole["optimizer"]["param_groups"] == resumed["optimizer"]["param_groups"]
        for fqn, entries in whole["optimizer"]["state"].items():
            for name, v in entries.items():
                got = resumed["optimizer"]["state"][fqn][name]
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(got)), (rank, fqn, name)
        assert any(k.endswith("q_proj.weight") for k in whole["optimizer"]["state"])
    assert (tmp_path / "stopped" / "checkpoint-2" / "dmuon_optimizer" / ".metadata").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    for k, v in runs[0]["resumed"]["model"].items():
        assert torch.equal(loaded[k], v), k
