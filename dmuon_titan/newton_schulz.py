"""Moved to :mod:`dmuon_titan.ops.newton_schulz`; this name stays for existing imports (the same module object)."""

import sys

from .ops import newton_schulz as _moved

sys.modules[__name__] = _moved
