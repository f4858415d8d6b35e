"""Planning: pure functions of names, shapes and world size (no process group, no hooks)."""

from .boundary import default_boundary, select_boundaries
from .collectives import BOUNDARY_COLLECTIVES, choose_boundary_collectives
from .partition import TP_NS_MODES, ParamSpec, Plan, plan_partition

__all__ = [
    "BOUNDARY_COLLECTIVES",
    "TP_NS_MODES",
    "ParamSpec",
    "Plan",
    "choose_boundary_collectives",
    "default_boundary",
    "plan_partition",
    "select_boundaries",
]
