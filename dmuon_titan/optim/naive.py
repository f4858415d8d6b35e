"""The naive baseline: Muon on plain FSDP2, every rank gathering every matrix.

Every parameter stays on FSDP2. For each Muon matrix, every rank all-gathers the momentum
direction, runs Newton–Schulz on the whole matrix (redundantly, N times over the world) and
keeps its own shard of the result (:class:`~dmuon_titan.optim.layout.GatheredLayout`). Same
update rule as :class:`dmuon_titan.Muon`, so it is the reference DMuon is checked against
inside torchtitan, and the slow baseline it is timed against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..runtime.modules import clean_fqn
from .layout import GatheredLayout
from .muon import Muon


class NaiveMuon(Muon):
    """``Muon`` with the Muon group chosen by ``predicate(fqn, param)`` among FSDP2 params.

    Takes the same arguments as :class:`~dmuon_titan.Muon` after ``predicate``.
    """

    def __init__(
        self, model: nn.Module, predicate: Callable[[str, torch.Tensor], bool], *args, **kwargs
    ) -> None:
        super().__init__(model, *args, layout=GatheredLayout(predicate, clean_fqn), **kwargs)
