"""Module hooks that drive one boundary through forward and backward.

The forward pre-hook makes the boundary's dedicated weights current (waiting for the prefetched
broadcast when there is one) and swaps the full-size parameters into their modules; the
post-hook swaps them back, registers the pre-backward hook on the outputs and, under Z3, frees
the storage. Backward is driven by tensor hooks (pre-backward re-broadcast) and per-parameter
post-accumulate-grad hooks (reduce once all of a boundary's gradients are final); see
``state.py``.
"""

from __future__ import annotations

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
