"""Moved to :mod:`dmuon_titan.optim.muon`; this name stays for existing imports (the same
module object)."""

import sys

from .optim import muon as _moved

sys.modules[__name__] = _moved
