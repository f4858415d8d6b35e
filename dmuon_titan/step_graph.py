"""Moved to :mod:`dmuon_titan.optim.captured`; this name stays for existing imports (the
same module object)."""

import sys

from .optim import captured as _moved

sys.modules[__name__] = _moved
