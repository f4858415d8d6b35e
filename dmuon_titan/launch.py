"""``python -m dmuon_titan.launch``: torchrun, with failed ranks reported in one line.

Takes torchrun's arguments and runs torchrun's own launcher (``torch.distributed.run``).
When ranks fail, torchrun raises ``ChildFailedError`` out of its ``main`` and Python prints
the launcher's traceback and a report block after whatever the ranks said. A DMuon
configuration mistake is already one line from rank 0; here the launcher adds one more line
naming the rank that failed first, then the others, with their exit codes, and exits with the
first failure's code
(128 + the signal for a rank killed by one).

    python -m dmuon_titan.launch --standalone --nproc_per_node=2 -m torchtitan.train \\
        --job.config_file your.toml
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as err:
        first_rank, first = _first_failure(err.failures)
        others = sorted((r, f) for r, f in err.failures.items() if r != first_rank)
        also = "".join(f", then rank {rank} (exit code {f.exitcode})" for rank, f in others)
        print(
            f"dmuon_titan launch: {err.name} failed: rank {first_rank} first (exit code "
            f"{first.exitcode}){also}; its own output above says why",
            file=sys.stderr,
        )
        code = first.exitcode
        # A rank killed by a signal (negative code, e.g. -9 for an OOM kill): 128 + signal,
        # as a shell reports it.
        return code if code > 0 else (128 - code if code < 0 else 1)
    return 0


def _first_failure(failures: dict):
    """(rank, failure) of the rank that failed first: torchrun stops the others with SIGTERM
    once one fails, and its timestamps are whole seconds, so a rank ended by SIGTERM comes
    after every rank that ended otherwise; then by time, then by rank."""
    sigterm = -signal.SIGTERM

    def order(item):
        rank, failure = item
        return (failure.exitcode == sigterm, failure.timestamp, rank)

    return min(failures.items(), key=order)


if __name__ == "__main__":
    sys.exit(main())
