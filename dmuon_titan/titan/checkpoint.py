"""torchtitan checkpoints with dedicated matrices: owner-only entries, drained before saving.

Two class-level hooks (the trainer may run as ``__main__``, so module-level rebinding of
``Trainer`` would not reach it, but the checkpoint module's globals and classes are shared):

- ``ModelWrapper`` (looked up when the CheckpointManager is built) is replaced by one whose
  state dict is DMuon's owner-only DCP form for models with dedicated matrices, and torch's
  for any other model, exactly as before.
- ``CheckpointManager.dcp_save``, the one place every save passes through (interval, last
  step, model-only, seed, async), first drains pending replica broadcasts.
- ``CheckpointManager.dcp_load`` first compares what the job needs with what the checkpoint
  holds (its metadata). Matrices that moved between Muon and AdamW since the save (``[dmuon]
  params`` changed, or an AdamW run resumed with DMuon) load their weights, and their
  optimizer state starts fresh, said in one line; missing optimizer hyper-parameters come
  from this job's config; anything else missing ends the run with one line naming the keys,
  instead of DCP's traceback on every rank; so does a step folder whose files are missing
  or truncated.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components import checkpoint as titan_checkpoint
from torchtitan.tools.logging import logger

from ..api import clean_fqn, wait_all_replicate_broadcasts
from ..runtime.state import STATE_ATTR
from ..state_dict import get_model_state_dict, set_model_state_dict
from .errors import ConfigError

#: optimizer state that says which update rule a parameter was under when saved
_MUON_STATE, _ADAMW_STATE = "momentum_buffer", "exp_avg"

_StockModelWrapper = titan_checkpoint.ModelWrapper


def _has_dmuon(model) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


class DMuonModelWrapper(_StockModelWrapper):
    def __init__(self, model) -> None:
        parts = [model] if not isinstance(model, list) else model
        self._dmuon = any(_has_dmuon(m) for m in parts)
        super().__init__(model)

    def _get_state_dict(self) -> dict[str, Any]:
        if not self._dmuon:
            return super()._get_state_dict()
        out: dict[str, Any] = {}
        for part in self.model:
            out.update(get_model_state_dict(part, full=False))
        return out

    def state_dict(self) -> dict[str, Any]:
        if not self._dmuon:
            return super().state_dict()
        return self._get_state_dict()  # live tensors; recomputed so it follows the owners

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._dmuon:
            return super().load_state_dict(state_dict)
        for part in self.model:
            mine = get_model_state_dict(part, full=False)
            set_model_state_dict(
                part, {k: v for k, v in state_dict.items() if k in mine}, strict=False, full=False
            )


def _draining(dcp_save):
    @functools.wraps(dcp_save)
    def wrapper(self, *args, **kwargs):
        model = self.states.get("model")
        for part in getattr(model, "model", []):
            if _has_dmuon(part):
                wait_all_replicate_broadcasts(part)
                if getattr(part, STATE_ATTR).device.type == "cuda":
                    # DCP may stage on a stream of its own: have it all done (saves are rare)
                    torch.cuda.current_stream().synchronize()
        return dcp_save(self, *args, **kwargs)

    wrapper._dmuon_draining = True
    return wrapper


def _parameter_of(key: str, fqns: list[str]) -> str | None:
    """The parameter an ``optimizer.state.<fqn>.<k>`` / ``optimizer.param_groups.<fqn>.<k>``
    key belongs to (the longest FQN it starts with), else ``None``."""
    for prefix in ("optimizer.state.", "optimizer.param_groups."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            hits = [f for f in fqns if rest.startswith(f + ".")]
            return max(hits, key=len) if hits else None
    return None


def moved_since_save(saved: set[str], fqns: list[str], dedicated: set[str]) -> tuple[list, list]:
    """(to Muon, to AdamW): the parameters whose update rule changed since the checkpoint was
    saved, from its keys (``saved``) and the matrices dedicated now; the same on every rank."""
    to_muon = [f for f in fqns if f in dedicated and f"optimizer.state.{f}.{_ADAMW_STATE}" in saved]
    to_adamw = [
        f for f in fqns if f not in dedicated and f"optimizer.state.{f}.{_MUON_STATE}" in saved
    ]
    return to_muon, to_adamw


def _saved_by_dmuon(saved: set[str]) -> bool:
    """Whether the optimizer state in ``saved`` is DMuon's (its param groups say which
    parameters were on Muon)."""
    return any(k.startswith("optimizer.param_groups.") and k.endswith(".use_muon") for k in saved)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (the decision to load must be the same everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def checkpoint_file_problem(checkpoint_id: str) -> str | None:
    """What keeps the DCP checkpoint folder ``checkpoint_id`` from being read, in words (a
    missing or unreadable ``.metadata``, a file it names missing or shorter than the data it
    holds there), or None."""
    folder = Path(checkpoint_id)
    if not (folder / ".metadata").is_file():
        return "its .metadata file is missing"
    try:
        metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    except Exception as err:  # (any reason: it is named in the line)
        return f"its .metadata file cannot be read ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            return f"its file {name} is missing"
        if path.stat().st_size < size:
            return f"its file {name} is truncated ({path.stat().st_size} of {size} bytes)"
    return None


def _check_files(checkpoint_id: str) -> None:
    """One line, before DCP reads anything, if some rank finds the folder unreadable."""
    problem = checkpoint_file_problem(checkpoint_id)
    if _any_rank(problem is not None):
        raise ConfigError(
            f"checkpoint {checkpoint_id} cannot be read: {problem or 'on another rank'}. Resume "
            "from an earlier step ([checkpoint] load_step) or delete that step folder"
        )


def _checking_load(dcp_load):
    @functools.wraps(dcp_load)
    def wrapper(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if not from_hf:
            _check_files(checkpoint_id)
        parts = getattr(self.states.get("model"), "model", [])
        if from_hf or not any(_has_dmuon(p) for p in parts):
            return dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        saved = set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
        optimizer_saved = any(k.startswith("optimizer.") for k in saved)
        if "optimizer" in state_dict and optimizer_saved and not _saved_by_dmuon(saved):
            raise ConfigError(
                f"checkpoint {checkpoint_id} was saved with another [optimizer] name (its "
                "optimizer state is not DMuon's): to continue from its weights with DMuon, "
                "start a new [checkpoint] folder with initial_load_path = that checkpoint and "
                "initial_load_model_only = true"
            )
        fqns = [clean_fqn(n) for part in parts for n, _ in part.named_parameters()]
        dedicated = {
            p.fqn for part in parts if _has_dmuon(part) for p in getattr(part, STATE_ATTR).params
        }
        to_muon, to_adamw = moved_since_save(saved, fqns, dedicated)
        moved = set(to_muon) | set(to_adamw)
        # What DCP will ask the checkpoint for: the Stateful entries' state dicts, flattened.
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        missing = set(flatten_state_dict(plain)[0]) - saved
        # Missing hyper-parameter entries are taken from this job's config (the LR schedule's
        # state is the lr_scheduler's): another optimizer's checkpoint names other ones.
        unexplained = sorted(
            k
            for k in missing
            if not k.startswith("optimizer.param_groups.") and _parameter_of(k, fqns) not in moved
        )
        if _any_rank(bool(unexplained)):
            shown = ", ".join(unexplained[:3]) or "(on another rank)"
            raise ConfigError(
                f"checkpoint {checkpoint_id} does not match this job: it lacks keys the job "
                f"needs, e.g. {shown}. A different model or parallelism than the one saved? "
                "To start over, use another [checkpoint] folder"
            )
        if not moved:
            return dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        logger.warning(
            f"DMuon: checkpoint {checkpoint_id} was saved with other [dmuon] params: "
            f"{_named(to_muon)} moved to Muon (momentum starts at zero), {_named(to_adamw)} "
            "moved to AdamW (moments start at zero); weights and everything else load as saved"
        )
        dcp.load(
            state_dict,
            checkpoint_id=checkpoint_id,
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
        if "model" in self.states:
            self.states["model"].load_state_dict(state_dict)

    wrapper._dmuon_checking = True
    return wrapper


def _named(fqns: list[str]) -> str:
    if not fqns:
        return "no matrix"
    head = ", ".join(fqns[:3])
    return f"{len(fqns)} matrices ({head}{', ...' if len(fqns) > 3 else ''})"


def install_checkpoint_hooks() -> None:
    titan_checkpoint.ModelWrapper = DMuonModelWrapper
    manager = titan_checkpoint.CheckpointManager
    if not getattr(manager.dcp_save, "_dmuon_draining", False):
        manager.dcp_save = _draining(manager.dcp_save)
    if not getattr(manager.dcp_load, "_dmuon_checking", False):
        manager.dcp_load = _checking_load(manager.dcp_load)
