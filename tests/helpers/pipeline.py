"""DMuon under torch.distributed.pipelining: the toy transformer cut into pipeline stages
(as torchtitan's ``pipeline_module_split`` cuts its models), each stage's part dedicated over
its data-parallel mesh, run by torch's schedules with microbatches."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

import dmuon_titan as dmuon

from .models import ToyTransformer, dedicated_predicate, loss_fn
from .training import batch, build_optimizer


class StagedTransformer(ToyTransformer):
    """ToyTransformer whose blocks live in a ModuleDict (names ``layers.<i>`` survive the
    cut) and whose forward skips what a stage does not hold."""

    def __init__(self, vocab: int, n_layers: int) -> None:
        super().__init__(vocab=vocab, n_layers=n_layers)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(self.layers)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def cut(model: StagedTransformer, keep: list[str]) -> StagedTransformer:
    """A deep copy holding only ``keep`` (top-level names and ``layers.<i>``)."""
    part = copy.deepcopy(model)
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(part, name, None)
    for key in list(part.layers.keys()):
        if f"layers.{key}" not in keep:
            del part.layers[key]
    return part


@dataclass(frozen=True)
class PipelineConfig:
    pp: int = 2
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    n_layers: int = 4  # the RunConfig's model must have as many ("toy2", "toy", "toy4")
    #: the modules of each stage (None: embedding + even layer split + norm/head)
    stage_modules: tuple[tuple[str, ...], ...] | None = None
    micro_batches: int = 4  # per data-parallel rank and step
    steps: int = 5
    max_norm: float | None = None


def stage_modules(pcfg: PipelineConfig) -> list[list[str]]:
    if pcfg.stage_modules is not None:
        return [list(m) for m in pcfg.stage_modules]
    n = pcfg.pp * pcfg.stages_per_rank
    per = pcfg.n_layers // n
    stages = [[f"layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(n)]
    stages[0].insert(0, "tok_embeddings")
    stages[-1] += ["norm", "output"]
    return stages


def train_pipelined(rank: int, world_size: int, cfg, pcfg: PipelineConfig) -> dict:
    """Train ``steps`` steps on (pp, dp) ranks; returns this rank's full weights of its
    stages (from dp rank 0), every DMuon collective it issued and its buckets, per stage, and
    whether each stage ran direct (one data-parallel rank: nothing to move)."""
    dp = world_size // pcfg.pp
    mesh = init_device_mesh("cpu", (pcfg.pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    with torch.device("meta"):
        whole = StagedTransformer(cfg.vocab, pcfg.n_layers).to(cfg.param_dtype)
    modules = stage_modules(pcfg)
    n_stages = len(modules)
    if pcfg.stages_per_rank == 1:
        mine = [pp_rank]
    else:  # looped: stage s runs on pp rank s % pp
        mine = [pp_rank + k * pcfg.pp for k in range(pcfg.stages_per_rank)]
    parts, stages = [], []
    for index in mine:
        part = cut(whole, modules[index])
        # every part, with Muon matrices or not (a no-Muon part only joins group creation)
        dmuon.dedicate_params(
            part, mesh["dp"], dedicated_predicate, small_param_numel=0, allow_empty=True
        )
        for layer in part.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        part.to_empty(device="cpu")
        part.init_weights()
        stage = PipelineStage(
            part, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()
        )
        served = dmuon.prepare_pipeline_stage(stage)
        state = getattr(part, "_dmuon_state", None)
        assert served == (state is not None)
        if state is not None:
            state.comm.log = []
        parts.append(part)
        stages.append(stage)
    schedule_class = get_schedule_class(pcfg.schedule)
    dmuon.check_pipeline_schedule(schedule_class)
    single = issubclass(schedule_class, PipelineScheduleSingle)
    schedule = schedule_class(
        stages[0] if single else stages,
        n_microbatches=pcfg.micro_batches,
        loss_fn=loss_fn,  # mean per microbatch; the schedule divides by their count
    )
    # (QK-clip: each stage's maxima combined over its data-parallel ranks alone)
    optimizers = [build_optimizer(cfg, part, mesh["dp"].get_group()) for part in parts]
    per_rank = cfg.batch // dp
    norms = []
    for step in range(cfg.steps):
        tokens = batch(cfg, step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        # (the toy loss is next-token on the input itself: the target is the input)
        args = (tokens,) if has_first else ()
        schedule.step(*args, target=tokens if has_last else None)
        if pcfg.max_norm is not None:
            norms.append(float(dmuon.clip_grad_norm_(parts, pcfg.max_norm, pp_mesh=mesh["pp"])))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    weights = {}
    for part in parts:  # (with DMuon state or without: FSDP2's DTensors gathered alike)
        weights.update(dmuon.get_model_state_dict(part))
    logs, buckets = {}, {}
    for index, part in zip(mine, parts, strict=True):
        state = getattr(part, "_dmuon_state", None)
        if state is not None:
            logs[index] = list(state.comm.log)
            buckets[index] = sum(len(group.buckets) for group in state.groups)
    return {
        "weights": weights if dp_rank == 0 else None,
        "logs": logs,
        "buckets": buckets,
        "direct": [bool(getattr(p, "_dmuon_state", None) and p._dmuon_state.direct) for p in parts],
        "norms": norms,
    }
