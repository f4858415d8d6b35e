"""Leave a finished CPU (gloo) run without a spurious abort.

After a run that succeeded, a gloo worker thread may still be dropping a finished
collective's work object, and its tensors, while CPython finalizes: taking the GIL then ends
the thread by a forced unwind through a ``noexcept`` frame, and ``std::terminate`` aborts the
process (SIGABRT, "terminate called without an active exception"; read from a core dump of
such an exit). It happens with or without DMuon: 4 of 16 CPU runs of
``scripts/bench/bench_optimizer.py --model tiny`` aborted so, AdamW and the naive path alone
among them. Once the default gloo process group is destroyed, such a process is left by
``os._exit(0)`` at interpreter exit, after the output is flushed and before finalization; an
uncaught exception still exits the usual way, with its status. :mod:`dmuon_titan.toy`
installs this for torchtitan's ``main``; the benchmarks call :func:`end_distributed_run`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import torch.distributed as dist


def exit_now() -> None:
    """Flush and leave with status 0, unless an uncaught exception is on its way out."""
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception: its own exit
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_distributed_run() -> None:
    """Destroy the default process group of a program whose work is done; on gloo, leave
    by :func:`exit_now` at interpreter exit."""
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        atexit.register(exit_now)
