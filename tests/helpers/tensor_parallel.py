"""Workers of the tensor-parallel tests: DMuon on a (replicate, shard, tp) grid of gloo ranks,
the blocks under torch's ColwiseParallel/RowwiseParallel plan (``training.apply_tp``)."""

from __future__ import annotations

from unittest import mock

import torch.distributed as dist

import dmuon_titan as dmuon
from dmuon_titan.muon import Muon

from .training import RunConfig, build_dmuon, train_step

_orthogonalize = Muon._orthogonalize


def train_tp_counted(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """Per config: the full weights after ``cfg.steps`` steps; which matrices this rank ran
    Newton–Schulz on, per step; what the collectives moved per step after the first (which
    records the forward order), by phase; and ``summarize_plan``."""
    out = []
    for cfg in configs:
        model, optimizer = build_dmuon(cfg, world_size)
        state = model._dmuon_state
        names = {id(p.owned): p.fqn for p in state.params}
        steps: list[list[str]] = []

        def orthogonalize(self, chunk, *args, steps=steps, names=names, **kwargs):
            steps[-1].extend(names[id(p)] for p in chunk)
            return _orthogonalize(self, chunk, *args, **kwargs)

        with mock.patch.object(Muon, "_orthogonalize", orthogonalize):
            for step in range(cfg.steps):
                if step == 1:
                    state.comm.stats.reset()
                steps.append([])
                train_step(cfg, model, optimizer, step, rank, world_size)
        stats = state.comm.stats
        timed = cfg.steps - 1
        out.append(
            {
                "orthogonalized": steps,
                "moved": {k: v / timed for k, v in stats.moved_bytes.items()},
                "ops": {k: v / timed for k, v in stats.ops.items()},
                "summary": dmuon.summarize_plan(model),
                "tp_placements": {p.fqn: p.tp_dim for p in state.params},
                "weights": dmuon.get_model_state_dict(model),
            }
        )
        dist.barrier()
    return out
