"""dmuon_titan: Muon with dedicated matrix ownership on FSDP2, and a torchtitan plugin.

Importing it changes nothing in torch: :func:`dedicate_params` makes FSDP2's ``fully_shard``
and composable ``replicate`` (DDP) skip dedicated parameters when it is called.
"""

# The modules' former paths, attributes of the package as before (aliases of the moved ones).
from . import fused, muon, newton_schulz, step_graph, symmetric, update  # noqa: F401
from .api import (
    check_pipeline_schedule,
    dedicate_params,
    move_hooks_outside_compile,
    no_sync,
    prepare_pipeline_stage,
    set_gradient_divide_factor,
    summarize_plan,
    wait_all_replicate_broadcasts,
)
from .clip import clip_grad_norm_
from .ops.newton_schulz import NS_COEFFICIENT_SETS
from .optim.muon import Muon
from .qk_clip import QKClip
from .runtime.init_rng import independent_init
from .state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "NS_COEFFICIENT_SETS",
    "Muon",
    "QKClip",
    "check_pipeline_schedule",
    "clip_grad_norm_",
    "dedicate_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "independent_init",
    "move_hooks_outside_compile",
    "no_sync",
    "prepare_pipeline_stage",
    "set_model_state_dict",
    "set_gradient_divide_factor",
    "set_optimizer_state_dict",
    "summarize_plan",
    "wait_all_replicate_broadcasts",
]
