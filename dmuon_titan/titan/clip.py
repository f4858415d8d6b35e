"""torchtitan's ``clip_grad_norm_`` (looked up through ``torchtitan.distributed.utils`` at
call time), extended to models with dedicated matrices: the logged norm is the true global
norm and clipping reaches the owned gradients (on one GPU through the optimizer's captured
step: ``defer_owned`` of :func:`dmuon_titan.clip.clip_grads_`)."""

from __future__ import annotations

import functools

import torchtitan.distributed.utils as dist_utils

from ..clip import clip_grads_
from ..runtime.owned_param import dedicated_of

_stock = dist_utils.clip_grad_norm_


def _dmuon_states_of(parameters) -> list:
    """The DMuon states (one per model part) whose dedicated matrices are among
    ``parameters``, in order."""
    states: dict[int, object] = {}
    refs = {id(d.state_ref): d.state_ref for p in parameters if (d := dedicated_of(p))}
    for ref in refs.values():
        state = ref() if ref else None
        if state is not None:
            states.setdefault(id(state), state)
    return list(states.values())


@functools.wraps(_stock)
def clip_grad_norm_(
    parameters,
    max_norm,
    norm_type=2.0,
    error_if_nonfinite=False,
    foreach=None,
    pp_mesh=None,
    ep_enabled=False,
):
    parameters = list(parameters)
    states = _dmuon_states_of(parameters)
    if not states:
        return _stock(
            parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled
        )
    # torchtitan steps right after clipping: the owned gradients' factor may go to the step
    return clip_grads_(
        parameters, states, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, True
    )


def install_clip() -> None:
    dist_utils.clip_grad_norm_ = clip_grad_norm_
