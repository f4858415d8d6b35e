"""The end of a benchmark's distributed run.

On gloo (the CPU smoke runs) a process that destroyed its process group may still abort at
exit: a gloo worker thread dropping a finished collective's work object while CPython
finalizes is ended by a forced unwind through a ``noexcept`` frame (SIGABRT, "terminate
called without an active exception"; ``dmuon_titan/toy/exit.py`` has the analysis). Measured
here: 2 of 8 CPU runs of ``bench_optimizer.py --model tiny`` aborted so, with AdamW and the
naive path alone as with DMuon, after printing their results. So a finished gloo run leaves
by ``os._exit(0)`` at interpreter exit, after flushing; NCCL runs exit as usual.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import torch.distributed as dist


def _leave() -> None:
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception: its own exit
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_distributed_run() -> None:
    """Destroy the default process group; on gloo, leave fast at interpreter exit."""
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        atexit.register(_leave)
