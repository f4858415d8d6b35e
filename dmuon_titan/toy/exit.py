"""A clean exit of finished CPU (gloo) torchtitan runs: after ``python -m torchtitan.train``
destroys its gloo process group on its way out of a successful run, the process is left by
:func:`dmuon_titan.exit.exit_now` at interpreter exit (that module has the abort it avoids).
Other programs are untouched.
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist

from ..exit import exit_now

_PATCHED = "_dmuon_exit_fast"


def _running_torchtitan_train() -> bool:
    """Whether this process is ``python -m torchtitan.train`` (torchrun's workers)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "torchtitan.train"


def install_fast_exit() -> None:
    """Idempotent: after the default process group of a gloo run is destroyed, exit fast."""
    original = dist.destroy_process_group
    if getattr(original, _PATCHED, False):
        return

    def destroy_process_group(group=None):
        gloo = group is None and dist.is_initialized() and dist.get_backend() == "gloo"
        original(group)
        if gloo and _running_torchtitan_train():
            atexit.register(exit_now)

    setattr(destroy_process_group, _PATCHED, True)
    dist.destroy_process_group = destroy_process_group
