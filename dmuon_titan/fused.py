"""Moved to :mod:`dmuon_titan.ops.fused`; this name stays for existing imports (the same module object)."""

import sys

from .ops import fused as _moved

sys.modules[__name__] = _moved
