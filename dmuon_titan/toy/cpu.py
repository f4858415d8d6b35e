"""Let torchtitan 0.2.2 train on CPU with gloo when no accelerator is present.

torchtitan picks ``device_type = <accelerator> or "cuda"`` once, at import, and copies the
pair (type, module) into four other modules. Without CUDA we rebind all of them to "cpu" and a
small device-module shim (``torch.cpu`` lacks the memory-statistics calls the metrics use),
before the trainer reads them. FSDP2 on gloo also needs sum-only reductions (the plugin's
``titan/parallelize.py`` sets them).
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from types import SimpleNamespace

import torch


class CpuDeviceModule:
    """``torch.cpu`` plus the device-module calls torchtitan makes (memory stats, names)."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0  # an index: torchtitan passes it to barrier(device_ids=[...])

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return platform.processor() or platform.machine() or "CPU"

    def get_device_properties(self, device=None):
        return SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    def memory_stats(self, device=None) -> dict[str, int]:
        # Peak resident memory of this process (Linux reports KiB, macOS bytes).
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


def install_cpu_device() -> bool:
    """Rebind torchtitan's device globals to CPU when CUDA is absent; True if it did."""
    if torch.cuda.is_available():
        return False
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.profiling as profiling
    import torchtitan.tools.utils as tools_utils

    module = CpuDeviceModule()
    for mod in (tools_utils, dist_utils, metrics):
        mod.device_type = "cpu"
        mod.device_module = module
    parallel_dims.device_type = "cpu"
    profiling.device_module = module
    return True


_histc = torch.histc


def _histc_any_dtype(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 (torch's names)
    """``torch.histc`` that also counts integer tensors on CPU (``histogram_cpu`` has no
    kernel for them; torchtitan's MoE routers count expert indices with it): counted in
    float32, returned in the input's dtype as the CUDA kernel does."""
    if input.is_floating_point() or input.device.type != "cpu" or out is not None:
        return _histc(input, bins=bins, min=min, max=max, out=out)
    return _histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)


def install_moe_cpu_shims() -> None:
    """What torchtitan's mixture-of-experts layers need on CPU (idempotent): integer
    ``histc``, and the token permutation of the grouped-mm path (expert parallelism
    included) by its CPU implementation instead of the Triton kernel."""
    if torch.histc is not _histc_any_dtype:
        torch.histc = _histc_any_dtype
    import torchtitan.models.moe.utils as moe_utils

    original = moe_utils.generate_permute_indices
    if getattr(original, "_dmuon_cpu", False):
        return

    def generate_permute_indices(tokens_per_expert_group, *args, use_cpu=False, **kwargs):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return original(tokens_per_expert_group, *args, use_cpu=use_cpu, **kwargs)

    generate_permute_indices._dmuon_cpu = True
    moe_utils.generate_permute_indices = generate_permute_indices


def _cpu_ring_attention(op_call, args, kwargs):
    """DTensor handler for CPU flash attention under context parallelism: torch's own ring
    attention (``_templated_ring_attention`` and its backward) on the local shards, outputs
    sharded like the query (the sequence dimension, as torch's CUDA handlers do)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    first = next(a for a in args if isinstance(a, DTensor))
    mesh, placements = first.device_mesh, first.placements
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    group, seq_dim = mesh.get_group(), 2
    forward = op_call is aten._scaled_dot_product_flash_attention_for_cpu.default
    tensors = 3 if forward else 6  # (q, k, v) or (grad_out, q, k, v, out, logsumexp)
    options = dict(zip(("dropout_p", "is_causal"), local[tensors:], strict=False))
    options.update(kwargs)
    is_causal = options.pop("is_causal", False)
    if forward:
        query, key, value = local[:tensors]
        results = cp._templated_ring_attention(
            group,
            seq_dim,
            op_call,
            query=query,
            key=key,
            value=value,
            is_causal=is_causal,
            **options,
        )
    else:
        grad_out, query, key, value, out, logsumexp = local[:tensors]
        results = cp._templated_ring_attention_backward(
            group,
            seq_dim,
            op_call,
            grad_out=grad_out,
            grad_out_name="grad_out",
            query=query,
            key=key,
            value=value,
            out=out,
            logsumexp=logsumexp,
            is_causal=is_causal,
            **options,
        )
    return tuple(
        DTensor.from_local(t, mesh, placements, run_check=False)
        if isinstance(t, torch.Tensor)
        else t
        for t in results
    )


def install_cp_cpu_shim() -> None:
    """Context parallelism on CPU (idempotent): torch's CP dispatcher has handlers for the
    CUDA attention kernels only; register the CPU flash-attention op and its backward."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    for op in (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ):
        cp.custom_ops.setdefault(op, _cpu_ring_attention)


def _heads_or_replicated(outputs: int):
    """A DTensor sharding strategy for an attention op with ``outputs`` tensor outputs whose
    tensor inputs and outputs are all [batch, heads, ...]: all replicated, or all sharded on
    the heads (tensor parallelism's layout, as torch's strategies for the CUDA kernels)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    def strategy(op_schema):
        tensors = sum(isinstance(a, OpStrategy) for a in op_schema.args_schema)
        width = outputs + tensors
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(),
            op_schema,
            [[Replicate()] * width, [Shard(1)] * width],
            input_index=outputs,
        )

    return strategy


def install_tp_attention_cpu_shim() -> None:
    """Tensor parallelism of attention that hands DTensors to SDPA (qwen3's plan) on CPU
    (idempotent): torch's DTensor has sharding strategies for the CUDA attention kernels
    only; give the CPU flash-attention op and its backward the same heads-sharded one."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy

    aten = torch.ops.aten
    known = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    # (op, tensor outputs, index of its first non-tensor argument: dropout_p)
    for op, outputs, static in (
        (aten._scaled_dot_product_flash_attention_for_cpu.default, 2, 3),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 3, 6),
    ):
        if op not in known:
            strategy = _heads_or_replicated(outputs)
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(static))(strategy)
