"""Leave a finished CPU (gloo) run without a spurious abort.

After a run that succeeded, a gloo worker thread may still be dropping a finished
collective's work object, and its tensors, while CPython finalizes: taking the GIL then ends
the thread by a forced unwind through a ``noexcept`` frame, and ``std::terminate`` aborts the
process (SIGABRT, "terminate called without an active exception"; read from a core dump of
such an exit). torchtitan's ``main`` (``python -m torchtitan.train``) destroys the process groups on its way
out of a successful run only; once it has, the process is left by ``os._exit(0)`` at
interpreter exit, after the output is flushed and before finalization. An uncaught exception
after that point still exits the usual way, with its status; other programs are untouched.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import torch.distributed as dist

_PATCHED = "_dmuon_exit_fast"


def _exit_now() -> None:
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception: its own exit
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
            atexit.register(_exit_now)

    setattr(destroy_process_group, _PATCHED, True)
    dist.destroy_process_group = destroy_process_group
