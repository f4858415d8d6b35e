"""The optimizer, split as ``torch.optim`` splits its own: a thin :class:`Muon` over the
step's plan (:mod:`.step_plan`), its pass variants (:mod:`.passes`), the captured step
(:mod:`.captured`) and the AdamW group's functional step (:mod:`.adamw`)."""

from .muon import Muon
from .naive import NaiveMuon

__all__ = ["Muon", "NaiveMuon"]
