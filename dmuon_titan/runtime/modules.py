"""Stateless helpers over modules and tensors: wrapper segments in names, the modules inside
wrappers, ``torch.compile`` wrappers, and a callback at the start of a backward."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

#: Wrappers that insert a path segment without changing what the module or parameter is
#: (activation checkpoint, ``torch.compile``, FSDP1).
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module inside compile / activation-checkpoint / FSDP1 wrappers."""
    for attr in WRAPPER_SEGMENTS:
        inner = module._modules.get(attr)
        if inner is not None:
            return unwrap_module(inner)
    return module


def compile_wrappers(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """The ``torch.compile`` wrappers under ``root``, by the module each one wraps (through
    other wrappers)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # (never imported: nothing was compiled, and no import for it)
        return {}
    wrapper = eval_frame.OptimizedModule  # (fully_shard subclasses it)
    return {unwrap_module(m): m for m in root.modules() if isinstance(m, wrapper)}


def clean_fqn(fqn: str) -> str:
    """Drop activation-checkpoint / torch.compile / FSDP1 wrapper segments from a name."""
    return ".".join(s for s in fqn.split(".") if s not in WRAPPER_SEGMENTS)


def register_pre_backward(output, callback: Callable[[], None]):
    """Call ``callback()`` when the gradient of any of ``output``'s tensors arrives."""
    tensors = [
        t
        for t in torch.utils._pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]

    def hook(grad: torch.Tensor) -> None:
        callback()

    for t in tensors:
        t.register_hook(hook)
    return output
