"""Run a function on N local processes (gloo on CPU, or NCCL on GPUs) and collect results.

Each rank's return value is saved with ``torch.save``; an exception on any rank fails the
caller with that rank's traceback; a rank still running after ``timeout`` means a hang and
fails too (all ranks are killed). Ranks are forked from the tests' fork server (see
``processes.py``), or spawned where ``processes.FRESH`` says so.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import processes


def _entry(rank: int, world_size: int, backend: str, tmp: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
            # No rank leaves before every rank is done: one that exits while a peer is still
            # in the handshake of a group both just created (dedicate_params makes groups, and
            # a refusal test may end right after) closes the connection under that peer
            # (gloo "connectFullMesh ... Connection closed by peer", seen once in CI).
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(tmp, f"result_{rank}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    # Done: leave without interpreter finalization, during which a gloo worker thread that
    # still drops a finished collective's work (and its tensors) aborts the process
    # (std::terminate from a thread taking the GIL while Python finalizes; seen in a core).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, one process each."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = processes.context()
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, backend, tmp, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        # A rank that failed leaves the others blocked in a collective (the final barrier at
        # least): they are stopped FAILURE_GRACE_S later instead of at the timeout.
        hung = processes.wait_or_stop(procs, timeout, grace=processes.FAILURE_GRACE_S)
        errors = []
        for r in range(world_size):
            path = os.path.join(tmp, f"error_{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- rank {r} ---\n{f.read()}")
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout}s (hang)")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        finished = [r for r in bad if os.path.exists(os.path.join(tmp, f"result_{r}.pt"))]
        if finished:
            # torch's gloo backend sometimes aborts in interpreter teardown, after the rank
            # destroyed its process groups and saved its result ("terminate called without
            # an active exception", seen with and without DMuon's own groups). Reported, not
            # hidden: the results asserted on are complete.
            warnings.warn(
                f"ranks {finished} exited with codes {[procs[r].exitcode for r in finished]} "
                "after finishing (process teardown)",
                stacklevel=2,
            )
        bad = [r for r in bad if r not in finished]
        if bad:
            raise AssertionError(
                f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}"
            )
        return [
            torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
