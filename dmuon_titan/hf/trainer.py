"""The Hugging Face ``Trainer`` on a model that ``dedicate_params`` and ``fully_shard`` have
already distributed: trained as it is, clipped by the true global norm, checkpointed whole.

The stock Trainer gets three things wrong on such a model. Accelerate wraps it in DDP (on
gloo; on NCCL it refuses DTensor parameters), which fails at the first step. Its clip and
its logged ``grad_norm`` are rank-local for the owners' gradients, so every rank would scale
by another factor. Its checkpoints hold rank 0's shards and rank 0's optimizer state only.
:class:`DMuonTrainerMixin` overrides just those paths and leaves the rest (data, schedules,
logging, evaluation, callbacks, checkpoint rotation) to the Trainer.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Trainer

from ..api import no_sync
from ..clip import clip_grad_norm_, global_grad_norm
from ..optim.muon import Muon
from ..runtime.owned_param import is_dedicated
from ..runtime.state import STATE_ATTR
from ..state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

#: the folders of a checkpoint's DMuon state (every rank writes its own part: DCP)
MODEL_FOLDER, OPTIMIZER_FOLDER = "dmuon_model", "dmuon_optimizer"
SCHEDULER_FILE = "scheduler.pt"  # (the Trainer's own name for it)


def _refusal(what: str, fix: str) -> ValueError:
    return ValueError(f"DMuonTrainer: {what}; {fix}")


def _check_model(model: nn.Module) -> None:
    """The model must be DMuon's and wholly distributed: every trainable parameter dedicated
    or an FSDP2 DTensor (a plain one would train unsynchronized on every rank)."""
    if getattr(model, STATE_ATTR, None) is None:
        raise _refusal(
            "the model has no dedicated matrices",
            "call dmuon_titan.dedicate_params(model, ...) and fully_shard before the Trainer",
        )
    for name, p in model.named_parameters():
        if p.requires_grad and not (is_dedicated(p) or isinstance(p, DTensor)):
            raise _refusal(
                f"parameter {name!r} is neither dedicated nor sharded by FSDP2",
                "call fully_shard(model) on the root as well (after its layers)",
            )


def _check_args(args) -> None:
    """What the Trainer would do to the model that breaks ownership, refused in one line."""
    refused = {
        "fsdp": bool(args.fsdp),
        "deepspeed": bool(args.deepspeed),
        "fp16": bool(args.fp16),
        "fp16_full_eval": bool(args.fp16_full_eval),
        "bf16_full_eval": bool(args.bf16_full_eval),
        "torch_compile": bool(args.torch_compile),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "auto_find_batch_size": bool(args.auto_find_batch_size),
    }
    for key, on in refused.items():
        if on:
            raise _refusal(
                f"TrainingArguments({key}=...) is not supported",
                "leave it unset (the model is already distributed by dedicate_params and "
                "fully_shard)",
            )
    if dist.is_initialized() and dist.get_world_size() > 1 and args.world_size == 1:
        raise _refusal(
            f"{dist.get_world_size()} processes, but TrainingArguments sees one",
            "launch with torchrun (RANK, WORLD_SIZE, LOCAL_RANK set), and use_cpu=True on CPU",
        )


def _muon_of(optimizer) -> Muon | None:
    """The :class:`~dmuon_titan.Muon` behind the Trainer's optimizer (Accelerate wraps it)."""
    while optimizer is not None and not isinstance(optimizer, Muon):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class DMuonTrainerMixin:
    """Put before a ``transformers.Trainer`` (sub)class: ``class MyTrainer(DMuonTrainerMixin,
    SFTTrainer)``. Takes the Trainer's arguments; ``optimizers=(dmuon.Muon(model, ...),
    None)`` as the seed recipe passes it.

    Checkpoints (``save_steps``, ``resume_from_checkpoint``) hold the model's and the
    optimizer's DMuon state by DCP in ``checkpoint-N/dmuon_model`` and ``dmuon_optimizer``
    (each rank its own part; loadable at another world size), beside the Trainer's own files.
    ``save_model()`` (outside a checkpoint) writes the whole model as ``save_pretrained``
    does. Both are collective: call them on every rank."""

    def __init__(self, model: nn.Module, args, *rest, **kwargs) -> None:
        _check_model(model)
        _check_args(args)
        optimizers = kwargs.get("optimizers", (None, None))
        muon = _muon_of(optimizers[0])
        if muon is None or muon._dmuon is not getattr(model, STATE_ATTR):
            raise _refusal(
                "optimizers[0] must be the dmuon_titan.Muon built for this model",
                "pass optimizers=(dmuon_titan.Muon(model, lr=..., adamw_lr=...), None)",
            )
        # Accelerate's own mark of a model it prepared: it then neither wraps it in DDP nor
        # moves, casts or compiles it.
        model._is_accelerate_prepared = True
        # Accumulation through accelerate.no_sync(model), which takes the model's own.
        model.no_sync = functools.partial(no_sync, model)
        # Schedules reading defaults["lr"] (polynomial, min_lr): the Muon group's.
        muon.defaults.setdefault("lr", muon.param_groups[0]["lr"])
        super().__init__(model, args, *rest, **kwargs)

    # ------------------------------------------------------------------ training
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The model is where ``fully_shard`` put it; ``.to()`` on FSDP2 parameters fails."""

    def _clip_grad_norm(self, model: nn.Module):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        return global_grad_norm(self.model) if grad_norm is None else grad_norm

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        if _internal_call:  # a checkpoint: every rank's part
            state = get_model_state_dict(self.model, full=False)
            dcp.save(state, checkpoint_id=os.path.join(output_dir, MODEL_FOLDER))
            if self.is_world_process_zero():
                self.model.config.save_pretrained(output_dir)
            return
        full = get_model_state_dict(self.model)  # (collective: every rank)
        if self.is_world_process_zero():
            self.model.save_pretrained(output_dir, state_dict=full)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        muon = _muon_of(self.optimizer)
        state = get_optimizer_state_dict(self.model, muon, full=False)
        dcp.save(state, checkpoint_id=os.path.join(output_dir, OPTIMIZER_FOLDER))
        if self.is_world_process_zero() and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        folder = os.path.join(resume_from_checkpoint, MODEL_FOLDER)
        if not os.path.isdir(folder):
            raise _refusal(
                f"{resume_from_checkpoint} holds no {MODEL_FOLDER}/ (not a DMuonTrainer "
                "checkpoint)",
                "resume from a checkpoint this trainer wrote",
            )
        state = get_model_state_dict(self.model, full=False)
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(self.model, state, full=False)

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        muon = _muon_of(self.optimizer)
        state = get_optimizer_state_dict(self.model, muon, full=False)
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, OPTIMIZER_FOLDER))
        set_optimizer_state_dict(self.model, muon, state, full=False)
        path = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


class DMuonTrainer(DMuonTrainerMixin, Trainer):
    """``transformers.Trainer`` for a model distributed by DMuon (:class:`DMuonTrainerMixin`)."""
