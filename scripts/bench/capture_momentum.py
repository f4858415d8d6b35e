#!/usr/bin/env python3
"""Momentum matrices of a training run, from its torchtitan checkpoints, for the NS accuracy
harness (``check_ns_accuracy.py --fixtures``): Newton–Schulz's speed and error depend on
the spectrum, which random matrices do not have.

Reads the ``momentum_buffer`` of the matrices whose names match ``--match`` from each DCP
checkpoint folder given (no process group needed) and saves them, by name and step, in one
file, in ``--dtype`` (bfloat16 halves the size; NS casts to bf16 anyway).

    scripts/train.sh configs/llm170m_dmuon.toml --checkpoint.enable --checkpoint.interval 100 \\
        --checkpoint.folder ckpt --job.dump_folder outputs/capture
    python3 scripts/bench/capture_momentum.py outputs/capture/ckpt/step-100 \\
        outputs/capture/ckpt/step-1000 --match 'layers\\.(0|11)\\.' --out momentum_170m.pt
"""

from __future__ import annotations

import argparse
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

PREFIX, SUFFIX = "optimizer.state.", ".momentum_buffer"


def momentum_of(folder: str, pattern: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{parameter name: momentum}`` of the checkpoint in ``folder``, for names matching
    ``pattern`` (a regular expression searched in the parameter's name)."""
    reader = FileSystemReader(folder)
    metadata = reader.read_metadata().state_dict_metadata
    wanted = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(PREFIX)
        and key.endswith(SUFFIX)
        and re.search(pattern, key[len(PREFIX) : -len(SUFFIX)])
        and len(meta.size) == 2
    }
    if not wanted:
        raise SystemExit(f"{folder}: no 2-D momentum buffer matches {pattern!r}")
    with warnings.catch_warnings():  # (no process group: dcp says it loads without one)
        warnings.simplefilter("ignore")
        dcp.load(wanted, storage_reader=reader)
    return {key[len(PREFIX) : -len(SUFFIX)]: t.to(dtype) for key, t in wanted.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="checkpoint folders, e.g. ckpt/step-100")
    parser.add_argument("--match", default=r"layers\.0\.", help="regex on parameter names")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    fixtures = {}
    for folder in args.folders:
        step = re.search(r"step-(\d+)", folder)
        label = f"step{step.group(1)}" if step else folder
        for name, matrix in momentum_of(folder, args.match, dtype).items():
            fixtures[f"{label}/{name}"] = matrix
            print(f"{label}/{name}: {tuple(matrix.shape)}")
    torch.save(fixtures, args.out)
    size = sum(t.numel() * t.element_size() for t in fixtures.values())
    print(f"{len(fixtures)} matrices, {size / 2**20:.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
