"""Module hooks that drive the boundaries through forward and backward.

The root's hooks open and close one forward pass over the schedule (what this rank did not
run still joins its collectives at the close) and make backward begin even where no boundary
ran. A boundary's forward pre-hook makes its dedicated weights current (waiting for the
scheduled broadcast) and swaps the full-size parameters into their modules; the post-hook
swaps them back, registers the pre-backward hook on the outputs and, under Z3, frees the
storage. Backward is driven by tensor hooks (pre-backward re-broadcast) and per-parameter
post-accumulate-grad hooks (a boundary's gradients are final); see ``state.py``.
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from .group import BoundaryGroup
from .state import DMuonState


def register_boundary_hooks(
    state: DMuonState, group: BoundaryGroup, module=None
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
    group.hook_handles = [
        module.register_forward_pre_hook(pre_forward),
        module.register_forward_hook(post_forward),
    ]
    return group.hook_handles


def register_root_hooks(state: DMuonState, root: nn.Module) -> list[RemovableHandle]:
    """Hook the model's own forward: before every boundary's hooks, and after them."""

    def pre_forward(_module, _args):
        state.root_pre_forward()

    def post_forward(_module, _args, output):
        return state.root_post_forward(output)

    return [
        root.register_forward_pre_hook(pre_forward, prepend=True),
        root.register_forward_hook(post_forward),
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
