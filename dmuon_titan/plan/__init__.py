"""Planning: pure functions of names, shapes and world size (no process group, no hooks)."""

from .boundary import default_boundary, select_boundaries
from .partition import ParamSpec, Plan, plan_partition

__all__ = ["ParamSpec", "Plan", "default_boundary", "plan_partition", "select_boundaries"]
