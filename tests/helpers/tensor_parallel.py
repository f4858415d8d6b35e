"""Workers of the tensor-parallel tests: DMuon on a (replicate, shard, tp) grid of gloo ranks,
the blocks under torch's ColwiseParallel/RowwiseParallel plan (``training.apply_tp``)."""

from __future__ import annotations

from unittest import mock

import torch.distributed as dist

import dmuon_titan as dmuon
from dmuon_titan.optim import passes
from dmuon_titan.runtime.shared_ns import SharedNewtonSchulz

from .training import RunConfig, build_dmuon, train_step

_pass_for = passes.pass_for
_orthogonalize_shared = SharedNewtonSchulz.orthogonalize


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

        def pass_for(ctx, chunk, scalars, steps=steps, names=names):
            steps[-1].extend(names[id(p)] for p in chunk)
            return _pass_for(ctx, chunk, scalars)

        def orthogonalize_shared(self, *args, steps=steps, **kwargs):
            steps[-1].extend(p.fqn for p in self.row)  # this rank's share of each
            return _orthogonalize_shared(self, *args, **kwargs)

        with (
            mock.patch.object(passes, "pass_for", pass_for),
            mock.patch.object(SharedNewtonSchulz, "orthogonalize", orthogonalize_shared),
        ):
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
                "summary": dmuon.summarize_plan(
                    model, ns_dtype=cfg.ns_dtype, ns_preconditioner=cfg.ns_preconditioner
                ),
                "tp_placements": {p.fqn: p.tp_dim for p in state.params},
                "weights": dmuon.get_model_state_dict(model),
            }
        )
        dist.barrier()
    return out


def tp_refusals(rank: int, world_size: int) -> dict[str, str]:
    """Each mistake of a tensor-parallel setup on dp 1 x tp ``world_size``: the message of
    the ``ValueError`` it raised (every rank raises it, before any DMuon collective)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from .models import ToyTransformer, dedicated_predicate, loss_fn
    from .training import apply_tp

    world = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    messages: dict[str, str] = {}

    def attempt(name, fn):
        try:
            fn()
        except ValueError as err:
            messages[name] = str(err)

    def model():
        with torch.device("meta"):
            return ToyTransformer()

    def dedicated(m, tp=True):
        dmuon.dedicate_params(
            m, world["dp"], dedicated_predicate, tp_mesh=world["tp"] if tp else None
        )
        return m

    attempt("no tp_mesh", lambda: apply_tp(dedicated(model(), tp=False), world["tp"]))
    attempt(
        "replicated",
        lambda: parallelize_module(
            dedicated(model()).layers[0].attention.wq, world["tp"], SequenceParallel()
        ),
    )

    def untouched():
        m = dedicated(model())
        for i, layer in enumerate(m.layers):
            if i:
                apply_tp_layer(layer)
        m.to_empty(device="cpu")
        m.init_weights()
        tokens = torch.zeros(2, 4, dtype=torch.long)
        loss_fn(m(tokens), tokens).backward()

    def apply_tp_layer(layer):
        from torch.distributed.tensor.parallel import RowwiseParallel

        from .training import TP_PLAN

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(layer, world["tp"], {n: styles[s]() for n, s in TP_PLAN.items()})

    attempt("not in the plan", untouched)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(32, 33 * 2 - 1, bias=False)])

    def odd():
        with torch.device("meta"):
            m = Odd()
        dmuon.dedicate_params(m, world["dp"], lambda n, p: True, tp_mesh=world["tp"])
        parallelize_module(m.layers[0], world["tp"], ColwiseParallel())

    attempt("indivisible", odd)
    return messages
