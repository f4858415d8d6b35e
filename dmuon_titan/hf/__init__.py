"""Hugging Face integration: the ``Trainer`` on a DMuon model (needs the ``hf`` extra:
transformers and accelerate; ``import dmuon_titan`` itself does not)."""

from .trainer import DMuonTrainer, DMuonTrainerMixin

__all__ = ["DMuonTrainer", "DMuonTrainerMixin"]
