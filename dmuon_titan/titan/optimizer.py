"""``[optimizer] name = "DMuon"``: a torchtitan OptimizersContainer around dmuon's optimizer.

Muon's hyper-parameters come from ``[dmuon]`` (defaults derived from ``[optimizer]``), the
AdamW part from ``[optimizer]``; torchtitan's LR scheduler scales both parameter groups.
Checkpoints use the owner-only form (see ``dmuon_titan.state_dict``).
"""

from __future__ import annotations

import contextlib
from typing import Any

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

    def __init__(self, model_parts, optimizer_config, dmuon_config, predicate) -> None:
        kwargs = options_kwargs(dmuon_config.muon_options(optimizer_config))
        self.model_parts = model_parts
        if dmuon_config.mode == "naive":
            self.optimizers = [NaiveMuon(m, predicate, **kwargs) for m in model_parts]
        else:
            self.optimizers = [Muon(m, **kwargs) for m in model_parts]
        self._validate_length(len(model_parts))
        tau = dmuon_config.qk_clip_threshold
        #: one QK-clip per model part (none when [dmuon] qk_clip_threshold = 0)
        self.qk_clips = (
            [QKClip(m, o, tau) for m, o in zip(model_parts, self.optimizers, strict=True)]
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
        if not figures:
            return {}
        return {
            "max_attention_logit": max(f[0] for f in figures),
            "clipped_heads": float(sum(f[1] for f in figures)),
        }

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
    return DMuonOptimizersContainer(model_parts, optimizer_config, job.config, job.predicate)


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
