"""Experiment (fifteenth session): the captured step's momentum and update passes per matrix
against one launch per run of one shape (``fused.*_by_table``), and Gram NS of the 170M FFN
matrices as two batches (24 tall, 12 wide) against one of 36; all timed as CUDA graphs.
Prints one line per measurement. One H200; shapes of llama3 170M."""

from __future__ import annotations

import argparse

import torch

from dmuon_titan import fused, newton_schulz
from dmuon_titan.timing import graph_median_milliseconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    runs = {"square": (48, (1024, 1024)), "tall": (24, (2816, 1024)), "wide": (12, (1024, 2816))}
    mats = {k: [torch.randn(s, device=dev) for _ in range(n)] for k, (n, s) in runs.items()}
    grads = {k: [torch.randn_like(p) * 1e-3 for p in v] for k, v in mats.items()}
    bufs = {k: [torch.zeros_like(p) for p in v] for k, v in mats.items()}
    table = {
        kind: {
            name: torch.tensor([t.data_ptr() for t in ts[kind]], dtype=torch.int64, device=dev)
            for name, ts in (("grads", grads), ("bufs", bufs), ("params", mats))
        }
        for kind in runs
    }
    slots = {k: table[k]["grads"].unbind(0) for k in runs}
    square = torch.empty(48, 1024, 1024, dtype=torch.bfloat16, device=dev)
    ffn = torch.empty(36, 1024, 2816, dtype=torch.bfloat16, device=dev)
    outs = {"square": square, "tall": ffn[:24].mT, "wide": ffn[24:]}
    scale = torch.tensor(0.5, device=dev)
    decay = torch.tensor(1 - 0.02 * 0.1, device=dev)
    steps = {k: torch.tensor(0.02, device=dev) for k in runs}

    def momentum_per_matrix():
        for k in runs:
            for i, (g, b) in enumerate(zip(grads[k], bufs[k], strict=True)):
                fused.momentum_direction_into(
                    g, b, outs[k][i], 0.95, True, grad_address=slots[k][i], grad_scale=scale
                )

    def momentum_by_table():
        for k in runs:
            fused.momentum_directions_by_table(
                table[k]["grads"],
                table[k]["bufs"],
                outs[k],
                torch.float32,
                torch.float32,
                0.95,
                True,
                scale,
            )

    def update_per_matrix():
        for k in runs:
            for i, p in enumerate(mats[k]):
                fused.decay_and_update_(p, outs[k][i], decay, steps[k])

    def update_by_table():
        for k in runs:
            fused.decay_and_update_by_table(
                table[k]["params"], torch.float32, outs[k], decay, steps[k]
            )

    momentum_by_table()  # (directions with values in them for NS)
    coeffs = newton_schulz.normalize_coefficients("jordan")

    def ns_two_batches():
        newton_schulz.orthogonalize(ffn[:24], coeffs, 5, 1e-7, torch.bfloat16, "auto")
        newton_schulz.orthogonalize(ffn[24:], coeffs, 5, 1e-7, torch.bfloat16, "auto")

    def ns_one_batch():
        newton_schulz.orthogonalize(ffn, coeffs, 5, 1e-7, torch.bfloat16, "auto")

    def ns_square():
        newton_schulz.orthogonalize(square, coeffs, 5, 1e-7, torch.bfloat16, "auto")

    def norms():
        newton_schulz.inverse_norms(square, 1e-7)
        newton_schulz.inverse_norms(ffn, 1e-7)

    numel = sum(n * s[0] * s[1] for n, s in runs.values())
    cases = [
        ("momentum per matrix", momentum_per_matrix, 14),
        ("momentum by table", momentum_by_table, 14),
        ("update per matrix", update_per_matrix, 10),
        ("update by table", update_by_table, 10),
        ("NS ffn 24 + 12", ns_two_batches, 0),
        ("NS ffn 36", ns_one_batch, 0),
        ("NS square 48", ns_square, 0),
        ("norms (square + ffn batches)", norms, 2),
    ]
    for r in range(args.rounds):
        for name, fn, bytes_per in cases:
            calls = 2 if name.startswith("NS") else 5
            ms = graph_median_milliseconds(fn, dev, 3, args.reps, calls=calls)
            rate = f"  {numel * bytes_per / ms / 1e9:.2f} TB/s" if bytes_per else ""
            print(f"round {r} {name:32s} {ms:.3f} ms{rate}", flush=True)


if __name__ == "__main__":
    main()
