"""torchtitan checkpoints with dedicated matrices: owner-only entries, drained before saving.

Two class-level hooks (the trainer may run as ``__main__``, so module-level rebinding of
``Trainer`` would not reach it, but the checkpoint module's globals and classes are shared):

- ``ModelWrapper`` (looked up when the CheckpointManager is built) is replaced by one whose
  state dict is DMuon's owner-only DCP form for models with dedicated matrices, and torch's
  for any other model, exactly as before.
- ``CheckpointManager.dcp_save``, the one place every save passes through (interval, last
  step, model-only, seed, async), first drains pending replica broadcasts.
"""

from __future__ import annotations

import functools
from typing import Any

from torchtitan.components import checkpoint as titan_checkpoint

from ..api import wait_all_replicate_broadcasts
from ..runtime.state import STATE_ATTR
from ..state_dict import get_model_state_dict, set_model_state_dict

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
        return dcp_save(self, *args, **kwargs)

    wrapper._dmuon_draining = True
    return wrapper


def install_checkpoint_hooks() -> None:
    titan_checkpoint.ModelWrapper = DMuonModelWrapper
    manager = titan_checkpoint.CheckpointManager
    if not getattr(manager.dcp_save, "_dmuon_draining", False):
        manager.dcp_save = _draining(manager.dcp_save)
