"""Where the tests' rank processes come from: forks of one server that imported torch and
torchtitan once.

A fresh interpreter spends seconds importing torch and several more importing
``torchtitan.train``, and a 4-rank launch pays that four times over on two cores: most of a
short toy run's wall time. Every rank here is still its own process with its own gloo
process group, forked from a ``multiprocessing`` fork server whose only work was those
imports (no process group, no CUDA, no torch threads; pyarrow's jemalloc starts a background
thread, which jemalloc's own fork handlers cover).

What forking gives up: the ranks share one string-hash seed, where fresh interpreters each
draw their own. ``DMUON_TESTS_FRESH_PROCESSES=1`` launches every rank as a fresh interpreter
instead (torchtitan jobs under torchrun, harness ranks spawned), as a check that nothing
depends on the shared seed; so does a machine with CUDA (see ``_fresh``). Some tests always
use torchrun: the bad-config ones, for its launcher, and one training that must end well.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _fresh() -> bool:
    if os.environ.get("DMUON_TESTS_FRESH_PROCESSES", "0") not in ("", "0"):
        return True
    import torch

    # A child forked after CUDA's driver was initialized cannot use CUDA, and importing
    # torchtitan initializes it (its device probe, ``torchtitan.tools.utils``).
    return torch.cuda.is_available()


#: whether every rank is a fresh interpreter (asked for, or CUDA present)
FRESH = _fresh()

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torchtitan.train",
    "dmuon_titan.titan",
    "dmuon_titan.toy",
]
_CONTEXT: mp.context.BaseContext | None = None
#: seconds the other ranks of a launch get to end on their own once one has failed
FAILURE_GRACE_S = 10.0


def context() -> mp.context.BaseContext:
    """The process context of every test rank: spawn when fresh processes are asked for,
    else the fork server (started on first use, with the heavy imports preloaded)."""
    global _CONTEXT
    if _CONTEXT is None:
        if FRESH:
            _CONTEXT = mp.get_context("spawn")
        else:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(err: SystemExit) -> int:
    """The status CPython gives ``SystemExit(code)`` (a message is printed, status 1)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def _run_rank(target: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """One rank: its output to ``log``, torchrun's environment, then ``target``
    (``"torchtitan.train"`` or a script's path) as ``__main__``, with the exit status Python
    would give."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    os.chdir(cwd)
    import torch
    from torchtitan.config import ConfigManager

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [target, *argv]
    # torchtitan binds ``sys.argv[1:]`` as parse_args's default when it is imported: in the
    # server, that was the server's command line.
    ConfigManager.parse_args.__defaults__ = (list(argv),)
    code = 0
    try:
        if target == "torchtitan.train":  # its ``__main__`` block, on the preloaded module
            import torchtitan.train

            torchtitan.train.main(torchtitan.train.Trainer)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave before interpreter finalization (gloo's teardown abort, see dmuon_titan.toy.exit).
    os._exit(code)


def wait_or_stop(procs: list, timeout: float, grace: float | None = None) -> list[int]:
    """Wait for ``procs`` to end; those still running ``timeout`` seconds from now (with
    ``grace``: or ``grace`` seconds after the first one failed) are killed. The indices of the
    killed ones."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if grace is not None and any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
            grace = None
        time.sleep(0.05)
    killed = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return killed


def launch(
    nproc: int,
    target: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str | Path,
    timeout: float = 600.0,
) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node=nproc`` of ``target`` (``"torchtitan.train"``
    or a script's path) with ``argv``, on forked ranks: (exit status, every rank's output, rank 0
    first). As under torchrun, once a rank fails the others are stopped (after
    ``FAILURE_GRACE_S``); a run past ``timeout`` is killed and reported with status 124."""
    ctx = context()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(nproc)]
        procs = []
        for rank in range(nproc):
            rank_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            p = ctx.Process(target=_run_rank, args=(target, argv, rank_env, str(cwd), logs[rank]))
            p.start()
            procs.append(p)
        # Once a rank fails, the others get a moment to end on their own (a mistake in the config fails every
        # rank, and rank 0 may be the last to print it); one blocked in a collective with the
        # failed rank is stopped after that.
        killed = wait_or_stop(procs, timeout, grace=FAILURE_GRACE_S)
        failed = [p.exitcode for r, p in enumerate(procs) if r not in killed and p.exitcode != 0]
        status = failed[0] if failed else (124 if killed else 0)
        if status < 0:  # killed by a signal: as a shell reports it
            status = 128 - status
        out = "".join(Path(log).read_text(errors="replace") for log in logs if os.path.exists(log))
        if status == 124:
            out += f"\n[processes.launch] killed after {timeout} s\n"
    return status, out
