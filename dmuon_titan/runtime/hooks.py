"""Every hook DMuon installs, registered here; each calls into the root state (``state.py``).

- the root module's forward pre/post hooks open and close one forward pass over the schedule
  (what this rank did not run still joins its collectives at the close);
- each boundary's forward pre/post hooks bring its weights in and out (on one rank, DMuon's
  direct path, there is nothing to bring: a pre-forward hook that waits for an optimizer step
  in flight, there only while one may be, :meth:`DMuonState.arm_step_waits`);
- a post-forward hook on every module with boundaries inside closes their scope (entries of
  boundaries that did not run there are issued at once);
- tensor hooks on forward outputs begin a boundary's backward (Z3 re-broadcast) and make the
  end-of-backward callback be queued even where no boundary ran;
- post-accumulate-grad hooks on the full-size parameters mark gradients final;
- the root's state-dict pre-hooks wait for an optimizer step still in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .modules import WRAPPER_SEGMENTS, compile_wrappers, register_pre_backward, unwrap_module

__all__ = [
    "WRAPPER_SEGMENTS",
    "compile_wrappers",
    "register_pre_backward",
    "unwrap_module",
]

if TYPE_CHECKING:
    from .group import BoundaryGroup
    from .state import DMuonState


def register_boundary_hooks(
    state: DMuonState, group: BoundaryGroup, module: nn.Module | None = None
) -> list[RemovableHandle]:
    """Hook ``group`` onto ``module`` (default: its boundary module), replacing earlier hooks.

    A wrapper such as ``torch.compile``'s may take the hooks instead of the module it wraps,
    so that they run outside the compiled region.
    """

    def pre_forward(_module, _args):
        state.pre_forward(group)

    def post_forward(_module, _args, output):
        return state.post_forward(group, output)

    for handle in group.hook_handles:
        handle.remove()
    module = group.module if module is None else module
    group.hook_module = module
    if state.direct:  # (after lazy init, on one rank: the wait alone, while it is armed)
        group.hook_handles = register_step_wait_hook(state, group) if state.step_waits_armed else []
        return group.hook_handles
    group.hook_handles = [
        module.register_forward_pre_hook(pre_forward),
        module.register_forward_hook(post_forward),
    ]
    return group.hook_handles


def register_step_wait_hook(state: DMuonState, group: BoundaryGroup) -> list[RemovableHandle]:
    """DMuon's direct path: a pre-forward hook on ``group``'s hooked module that makes the
    current stream wait for an optimizer step in flight (:meth:`DMuonState.pre_forward`)."""

    def pre_forward(_module, _args):
        state.pre_forward(group)

    # (first: before any other pre-hook registered since, FSDP2's or a user's, reads them)
    return [group.hook_module.register_forward_pre_hook(pre_forward, prepend=True)]


def register_root_hooks(state: DMuonState, root: nn.Module) -> list[RemovableHandle]:
    """Hook the model's own forward: before every boundary's hooks, and after them."""

    def pre_forward(_module, _args):
        state.root_pre_forward()

    def post_forward(_module, _args, output):
        return state.root_post_forward(output)

    return [
        root.register_forward_pre_hook(pre_forward, prepend=True),
        root.register_forward_hook(post_forward),
        *register_state_dict_waits(state, root),
    ]


def register_scope_hooks(
    state: DMuonState, modules: dict[str, nn.Module], boundary_paths: list[str]
) -> list[RemovableHandle]:
    """On every module (but the root) with boundaries strictly inside its subtree, a
    post-forward hook that closes their scope (:meth:`DMuonState.close_scope`)."""
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
            state.close_scope(frozen)

        handles.append(modules[path].register_forward_hook(post_forward))
    return handles


def register_grad_hooks(state: DMuonState, group: BoundaryGroup) -> None:
    """On each trainable full-size parameter of ``group``: its gradient is final."""
    for p in group.params:
        if p.unsharded.requires_grad:

            def hook(_tensor: torch.Tensor, p=p) -> None:
                state.grad_accumulated(group, p)

            p.unsharded.register_post_accumulate_grad_hook(hook)


def register_state_dict_waits(state: DMuonState, root: nn.Module) -> list[RemovableHandle]:
    """``root.state_dict()`` and ``root.load_state_dict()`` first make the current stream
    wait for an optimizer step still in flight on its own stream (``Muon(async_step=True)``):
    the tensors they return or fill are read or written after the hook."""

    def before_state_dict(_module, _prefix, _keep_vars) -> None:
        state.wait_for_step()

    def before_load(_module, *_args) -> None:
        state.wait_for_step()

    return [
        root.register_state_dict_pre_hook(before_state_dict),
        root.register_load_state_dict_pre_hook(before_load),
    ]
