"""``[optimizer] name = "DMuon"``: a torchtitan OptimizersContainer around dmuon's optimizer.

Muon's hyper-parameters come from ``[dmuon]`` (defaults derived from ``[optimizer]``), the
AdamW part from ``[optimizer]``; torchtitan's LR scheduler scales both parameter groups.
Checkpoints use the owner-only form (see ``dmuon_titan.state_dict``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components import optimizer as titan_optimizer
from torchtitan.components.optimizer import OptimizersContainer

from ..optim.muon import Muon
from ..optim.naive import NaiveMuon
from ..options import options_kwargs
from ..qk_clip import QKClip
from ..state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from .converter import job_of
from .errors import ConfigError

_stock_build_optimizers = titan_optimizer.build_optimizers


class DMuonOptimizersContainer(OptimizersContainer):
    """One :class:`dmuon_titan.Muon` (or the naive baseline) per model part."""

    def __init__(
        self, model_parts, optimizer_config, dmuon_config, predicate, parallel_dims=None
    ) -> None:
        kwargs = options_kwargs(dmuon_config.muon_options(optimizer_config))
        self.model_parts = model_parts
        if dmuon_config.mode == "naive":
            self.optimizers = [NaiveMuon(m, predicate, **kwargs) for m in model_parts]
        else:
            self.optimizers = [Muon(m, **kwargs) for m in model_parts]
        self._validate_length(len(model_parts))
        tau = dmuon_config.qk_clip_threshold
        pipelined = parallel_dims is not None and parallel_dims.pp_enabled
        #: under pipeline parallelism: the pp mesh (the figures of every stage are combined
        #: for the log) and this stage's ranks (its maxima are combined)
        self._pp_mesh = parallel_dims.get_mesh("pp") if pipelined and tau > 0 else None
        stage = stage_group(parallel_dims) if self._pp_mesh is not None else None
        #: one QK-clip per model part (none when [dmuon] qk_clip_threshold = 0)
        self.qk_clips = (
            [
                QKClip(m, o, tau, process_group=stage, allow_empty=pipelined)
                for m, o in zip(model_parts, self.optimizers, strict=True)
            ]
            if tau > 0
            else []
        )
        all_params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        self._post_init(all_params, {"lr": kwargs["lr"]})

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model, opt in zip(self.model_parts, self.optimizers, strict=True):
            out.update(get_optimizer_state_dict(model, opt, full=False))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, opt in zip(self.model_parts, self.optimizers, strict=True):
            # (one flat dict for all parts: each takes its own keys, pipeline stages' FQNs
            # being disjoint)
            mine = get_optimizer_state_dict(model, opt, full=False)
            part = {k: v for k, v in state_dict.items() if k in mine}
            set_optimizer_state_dict(model, opt, part, full=False)

    def clip_figures(self) -> dict[str, float]:
        """The last step's QK-clip figures (syncs on CUDA): the largest attention logit before
        the clip and the number of heads rescaled; empty without the clip or before a step."""
        figures = [f for f in (c.figures() for c in self.qk_clips) if f is not None]
        logit = max((f[0] for f in figures), default=-math.inf)
        heads = float(sum(f[1] for f in figures))
        if self._pp_mesh is not None:  # (every rank logs at the same steps: the same calls)
            logit, heads = _over_stages(self._pp_mesh, logit, heads)
        if logit == -math.inf:
            return {}
        return {"max_attention_logit": logit, "clipped_heads": heads}

    def step_timings(self) -> dict[str, float]:
        """Milliseconds per phase of the last step, summed over model parts (syncs on CUDA)."""
        total: dict[str, float] = {}
        for opt in self.optimizers:
            for phase, ms in opt.step_timings().items():
                total[phase] = total.get(phase, 0.0) + ms
        return total


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """torchtitan's ``build_optimizers``: DMuon for ``name = "DMuon"``, stock otherwise."""
    if optimizer_config.name != "DMuon":
        return _stock_build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    job = job_of(model_parts)
    if job is None:
        raise ConfigError(
            '[optimizer] name = "DMuon" needs [model] converters = ["dmuon"] (the converter '
            "dedicates the Muon matrices before parallelization)"
        )
    return DMuonOptimizersContainer(
        model_parts, optimizer_config, job.config, job.predicate, parallel_dims
    )


def stage_group(parallel_dims) -> dist.ProcessGroup:
    """The ranks of this rank's pipeline stage (every data, context and tensor rank of it:
    torchtitan's meshes put pp outermost), as a process group; every rank calls it."""
    pp, world = parallel_dims.pp, parallel_dims.world_size
    per_stage = world // pp
    stages = [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)]
    rank = dist.get_rank()
    pp_ranks = parallel_dims.get_mesh("pp").mesh.flatten().tolist()
    if pp_ranks != [rank % per_stage + s * per_stage for s in range(pp)]:
        raise RuntimeError(f"DMuon QK-clip: the pp mesh {pp_ranks} is not outermost")
    return dist.new_subgroups_by_enumeration(stages)[0]


def _over_stages(pp_mesh, logit: float, heads: float) -> tuple[float, float]:
    """(the largest logit, the clipped heads summed) over the pipeline stages."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if pp_mesh.device_type == "cuda" else None
    )
    group = pp_mesh.get_group()
    largest = torch.tensor([logit], dtype=torch.float64, device=device)
    total = torch.tensor([heads], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(total, group=group)
    return float(largest), float(total)


@contextlib.contextmanager
def _dmuon_builder():
    """torchtitan's MoE builder (``build_optimizers_with_moe_load_balancing``) calls the
    module's ``build_optimizers`` and registers its expert-bias update on the result: for the
    duration, that call builds DMuon's container."""
    stock = titan_optimizer.build_optimizers
    titan_optimizer.build_optimizers = build_optimizers
    try:
        yield
    finally:
        titan_optimizer.build_optimizers = stock


def builder_for(spec_fn):
    """A train spec's ``build_optimizers_fn`` that also serves ``name = "DMuon"``, keeping
    what the spec's own builder adds (MoE load balancing: the expert-bias update hook)."""

    def build(model_parts, optimizer_config, parallel_dims, ft_manager=None):
        if optimizer_config.name != "DMuon":
            return spec_fn(model_parts, optimizer_config, parallel_dims, ft_manager)
        if spec_fn is _stock_build_optimizers:
            return build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        with _dmuon_builder():
            return spec_fn(model_parts, optimizer_config, parallel_dims, ft_manager)

    return build
