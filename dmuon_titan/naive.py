"""Moved to :mod:`dmuon_titan.optim.naive`; this name stays for existing imports (the same
module object)."""

import sys

from .optim import naive as _moved

sys.modules[__name__] = _moved
