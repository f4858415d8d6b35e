"""Moved to :mod:`dmuon_titan.ops.symmetric`; this name stays for existing imports (the same module object)."""

import sys

from .ops import symmetric as _moved

sys.modules[__name__] = _moved
