"""Moved to :mod:`dmuon_titan.ops.ns_cost`; this name stays for existing imports (the same module object)."""

import sys

from ..ops import ns_cost as _moved

sys.modules[__name__] = _moved
