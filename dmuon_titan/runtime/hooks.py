"""Hook registration helpers, stateless: each registers callbacks it is handed.

:class:`~dmuon_titan.runtime.state.DMuonState` registers its own hooks through them
(:meth:`~dmuon_titan.runtime.state.DMuonState.install_hooks`):

- the root module's forward pre/post hooks open and close one forward pass over the schedule
  (what this rank did not run still joins its collectives at the close);
- each boundary's forward pre/post hooks bring its weights in and out (on one rank, DMuon's
  direct path, there is nothing to bring: a pre-forward hook that waits for an optimizer step
  in flight, there only while one may be);
- a post-forward hook on every module with boundaries inside closes their scope (entries of
  boundaries that did not run there are issued at once);
- tensor hooks on forward outputs begin a boundary's backward (Z3 re-broadcast) and make the
  end-of-backward callback be queued even where no boundary ran;
- post-accumulate-grad hooks on the full-size parameters mark gradients final;
- the root's state-dict pre-hooks wait for an optimizer step still in flight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .modules import WRAPPER_SEGMENTS, compile_wrappers, register_pre_backward, unwrap_module

__all__ = [
    "WRAPPER_SEGMENTS",
    "compile_wrappers",
    "register_pre_backward",
    "unwrap_module",
    "register_forward_pair",
    "register_first_pre_hook",
    "register_scope_hooks",
    "register_grad_hooks",
    "register_state_dict_waits",
]


def register_forward_pair(
    module: nn.Module,
    before: Callable[[], None],
    after: Callable[[object], object],
    first: bool = False,
) -> list[RemovableHandle]:
    """``before()`` ahead of ``module``'s forward (``first``: ahead of every other
    pre-hook), ``after(output)`` after it (its value replaces the output)."""

    def pre_forward(_module, _args):
        before()

    def post_forward(_module, _args, output):
        return after(output)

    return [
        module.register_forward_pre_hook(pre_forward, prepend=first),
        module.register_forward_hook(post_forward),
    ]


def register_first_pre_hook(module: nn.Module, before: Callable[[], None]) -> RemovableHandle:
    """``before()`` ahead of ``module``'s forward, before any other pre-hook registered since
    (FSDP2's or a user's) runs."""

    def pre_forward(_module, _args):
        before()

    return module.register_forward_pre_hook(pre_forward, prepend=True)


def register_scope_hooks(
    modules: dict[str, nn.Module],
    boundary_paths: list[str],
    close: Callable[[frozenset[int]], None],
) -> list[RemovableHandle]:
    """On every module (but the root) with boundaries strictly inside its subtree, a
    post-forward hook that calls ``close(indices of those boundaries)``."""
    inside: dict[str, set[int]] = {}
    for index, path in enumerate(boundary_paths):
        ancestor = path
        while ancestor:
            ancestor = ancestor.rpartition(".")[0]
            if ancestor:
                inside.setdefault(ancestor, set()).add(index)
    handles = []
    for path, indices in inside.items():
        frozen = frozenset(indices)

        def post_forward(_module, _args, _output, frozen=frozen):
            close(frozen)

        handles.append(modules[path].register_forward_hook(post_forward))
    return handles


def register_grad_hooks(params, accumulated: Callable[[object], None]) -> None:
    """On each trainable full-size parameter of ``params`` (dedicated ones):
    ``accumulated(param)`` once its gradient is final."""
    for p in params:
        if p.unsharded.requires_grad:

            def hook(_tensor: torch.Tensor, p=p) -> None:
                accumulated(p)

            p.unsharded.register_post_accumulate_grad_hook(hook)


def register_state_dict_waits(root: nn.Module, wait: Callable[[], None]) -> list[RemovableHandle]:
    """``root.state_dict()`` and ``root.load_state_dict()`` first call ``wait()``: the tensors
    they return or fill are read or written after the hook."""

    def before_state_dict(_module, _prefix, _keep_vars) -> None:
        wait()

    def before_load(_module, *_args) -> None:
        wait()

    return [
        root.register_state_dict_pre_hook(before_state_dict),
        root.register_load_state_dict_pre_hook(before_load),
    ]
