"""``python -m dmuon_titan.launch``: torchrun, with failed ranks reported in one line.

Takes torchrun's arguments and runs torchrun's own launcher (``torch.distributed.run``).
When ranks fail, torchrun raises ``ChildFailedError`` out of its ``main`` and Python prints
the launcher's traceback and a report block after whatever the ranks said. A DMuon
configuration mistake is already one line from rank 0; here the launcher adds one more line
naming the failed ranks and their exit codes, and exits with the first failure's code
(128 + the signal for a rank killed by one).

    python -m dmuon_titan.launch --standalone --nproc_per_node=2 -m torchtitan.train \\
        --job.config_file your.toml
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as err:
        failures = sorted(err.failures.items())
        codes = ", ".join(f"rank {rank} exit code {f.exitcode}" for rank, f in failures)
        print(f"dmuon_titan launch: {err.name} failed ({codes})", file=sys.stderr)
        _, first = err.get_first_failure()
        code = first.exitcode
        # A rank killed by a signal (negative code, e.g. -9 for an OOM kill): 128 + signal,
        # as a shell reports it.
        return code if code > 0 else (128 - code if code < 0 else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
