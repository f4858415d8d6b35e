"""Wrap a model's ``parallelize_fn`` with what DMuon and CPU runs need after FSDP is applied.

- gloo (CPU) lacks ``PREMUL_SUM``, which torchtitan's FSDP settings select: force plain sums.
- torchtitan normalizes the loss by the global token count and sets FSDP's gradient divide
  factor to 1 (sum); its DDP averages. Dedicated gradients are scaled the same way.
- ``torch.compile`` of a block with ``fullgraph=True`` would trace DMuon's hooks: move them to
  the compiled wrapper, outside the compiled region (FSDP2's hooks live outside it too).
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..api import move_hooks_outside_compile, set_gradient_divide_factor
from ..runtime.state import STATE_ATTR


def wrap_parallelize(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config):
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
        return model

    return parallelize
