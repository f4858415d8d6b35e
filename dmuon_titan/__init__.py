"""dmuon_titan: Muon with dedicated matrix ownership on FSDP2, and a torchtitan plugin.

Importing this package makes FSDP2's ``fully_shard`` and composable ``replicate`` (DDP) skip
dedicated parameters.
"""

from .runtime.fsdp import install_fully_shard_patch, install_replicate_patch

install_fully_shard_patch()
install_replicate_patch()

from .api import (  # noqa: E402
    dedicate_params,
    move_hooks_outside_compile,
    no_sync,
    set_gradient_divide_factor,
    summarize_plan,
    wait_all_replicate_broadcasts,
)
from .clip import clip_grad_norm_  # noqa: E402
from .muon import Muon  # noqa: E402
from .newton_schulz import NS_COEFFICIENT_SETS  # noqa: E402
from .state_dict import (  # noqa: E402
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "NS_COEFFICIENT_SETS",
    "Muon",
    "clip_grad_norm_",
    "dedicate_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "move_hooks_outside_compile",
    "no_sync",
    "set_model_state_dict",
    "set_gradient_divide_factor",
    "set_optimizer_state_dict",
    "summarize_plan",
    "wait_all_replicate_broadcasts",
]
