"""Wrap a model's ``parallelize_fn`` with what DMuon and CPU runs need after FSDP is applied.

- gloo (CPU) lacks ``PREMUL_SUM``, which torchtitan's FSDP settings select: force plain sums.
- torchtitan normalizes the loss by the global token count and sets FSDP's gradient divide
  factor to 1 (sum); its DDP averages. Dedicated gradients are scaled the same way.
- ``torch.compile`` of a block with ``fullgraph=True`` would trace DMuon's hooks: move them to
  the compiled wrapper, outside the compiled region (FSDP2's hooks live outside it too).
- Expert parallelism: torchtitan's ``ExpertParallel`` distributes the experts' parameters
  over the expert mesh; dedicated stacks are cut by that mesh already (``dedicate_params``'s
  ``expert_mesh``), so it leaves them as they are and only dispatches tokens.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..api import move_hooks_outside_compile, prepare_pipeline_stage, set_gradient_divide_factor
from ..runtime.init_rng import wrap_init_weights
from ..runtime.owned_param import dedicated_of, is_dedicated
from ..runtime.state import STATE_ATTR
from .converter import JOB_ATTR, dedicate
from .errors import ConfigError


def install_expert_parallel_patch() -> None:
    """Idempotent: torchtitan's ``ExpertParallel`` leaves dedicated parameters alone (its
    ``distribute_module`` would cut them, then make whatever it did not cut a replicated
    DTensor): they are out of their modules while it runs."""
    from torchtitan.distributed.expert_parallel import ExpertParallel

    original = ExpertParallel._apply
    if getattr(original, "_dmuon", False):
        return

    @functools.wraps(original)
    def apply(self, module, device_mesh):
        held = []
        for m in module.modules():
            order = list(m._parameters)
            mine = {k: v for k, v in m._parameters.items() if v is not None and is_dedicated(v)}
            for key in mine:
                del m._parameters[key]
            held.append((m, order, mine))
        try:
            return original(self, module, device_mesh)
        finally:  # back in their places, in the modules' order
            for m, order, mine in held:
                current = dict(m._parameters)
                m._parameters.clear()
                m._parameters.update({k: mine.get(k, current.get(k)) for k in order})

    apply._dmuon = True
    ExpertParallel._apply = apply


def install_no_parallel_patch() -> None:
    """Idempotent: torchtitan's ``NoParallel`` (a module kept whole on every tensor-parallel
    rank, as a replicated DTensor) refuses a dedicated parameter in one line: DMuon serves a
    tensor-parallel matrix as colwise or rowwise shards only. (The default selection leaves
    the modules torchtitan's plans keep whole on AdamW: ``selection.TP_KEPT_WHOLE``.)"""
    from torchtitan.distributed import NoParallel

    original = NoParallel._apply
    if getattr(original, "_dmuon", False):
        return

    @functools.wraps(original)
    def apply(self, module, device_mesh):
        for p in module.parameters():
            dedicated = dedicated_of(p)
            if dedicated is not None:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree = {device_mesh.size()}: torchtitan's "
                    f"tensor-parallel plan keeps {dedicated.fqn!r} whole on every tp rank "
                    "(NoParallel), and DMuon serves tensor-parallel matrices as colwise or "
                    "rowwise shards only: leave it out of [dmuon] params"
                )
        return original(self, module, device_mesh)

    apply._dmuon = True
    NoParallel._apply = apply


def _stage_name(model) -> str:
    """How logs name a pipeline stage's part: by its first and last children kept."""
    kept = [
        f"layers.{k}" if name == "layers" else name
        for name, child in model.named_children()
        if child is not None
        for k in (list(child.keys()) if name == "layers" else [None])
    ]
    return f"pipeline stage [{kept[0]} .. {kept[-1]}]" if kept else "pipeline stage (empty)"


def wrap_parallelize(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config):
        job = getattr(model, JOB_ATTR, None)
        if job is not None and job.per_stage:
            dedicate(model, job_config, parallel_dims, job.predicate, stage=_stage_name(model))
        model = parallelize_fn(model, parallel_dims, job_config)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        if getattr(model, STATE_ATTR, None) is not None:
            # Match the other parameters: FSDP/HSDP sum (torchtitan sets divide factor 1, its
            # loss is normalized by the global token count); DDP averages over replicas.
            replicas = parallel_dims.dp_replicate if not parallel_dims.fsdp_enabled else 1
            set_gradient_divide_factor(model, float(replicas))
            move_hooks_outside_compile(model)
            # torchtitan seeds every rank alike: each dedicated matrix is initialized from
            # its name and the seed, not from its owner's stream (runtime/init_rng.py)
            wrap_init_weights(model)
        return model

    return parallelize


def wrap_pipelining(pipelining_fn):
    """A spec's ``pipelining_fn`` whose stages with dedicated matrices DMuon serves
    (:func:`dmuon_titan.prepare_pipeline_stage`: weights kept for the step's microbatches,
    gradients reduced once per step)."""
    if pipelining_fn is None:
        return None

    @functools.wraps(pipelining_fn)
    def pipeline(*args, **kwargs):
        schedule, parts, has_first, has_last = pipelining_fn(*args, **kwargs)
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            prepare_pipeline_stage(stage)
        return schedule, parts, has_first, has_last

    return pipeline
