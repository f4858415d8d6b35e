"""Moved to :mod:`dmuon_titan.ops.update`; this name stays for existing imports (the same module object)."""

import sys

from .ops import update as _moved

sys.modules[__name__] = _moved
