"""The parity cases: DMuon configurations and the reference each is held to (see
``tests/distributed/test_parity.py``)."""

import torch

from .training import RunConfig, with_

EXACT = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64)

#: (name, config, reference precision, tolerance)
CASES = [
    ("z3", EXACT, "float64", 1e-10),
    ("z2", with_(EXACT, reshard_after_forward=False), "float64", 1e-10),
    ("z3+ac", with_(EXACT, activation_checkpointing=True), "float64", 1e-10),
    (
        "z2+ac",
        with_(EXACT, reshard_after_forward=False, activation_checkpointing=True),
        "float64",
        1e-10,
    ),
    ("z3+no_sync", with_(EXACT, micro_batches=2), "float64", 1e-10),
    (
        "z2+ac+no_sync",
        with_(EXACT, reshard_after_forward=False, activation_checkpointing=True, micro_batches=2),
        "float64",
        1e-10,
    ),
    ("z3+packed", with_(EXACT, small_param_numel=1 << 16), "float64", 1e-10),
    # Stage 1 by one all-gather / reduce-scatter per boundary instead of per-owner broadcasts
    # and reduces; "auto" picks it per boundary (here: on 2 and 3 ranks, not on 4).
    ("z3+gather", with_(EXACT, collectives="gather"), "float64", 1e-10),
    (
        "z2+ac+no_sync+gather",
        with_(
            EXACT,
            reshard_after_forward=False,
            activation_checkpointing=True,
            micro_batches=2,
            collectives="gather",
        ),
        "float64",
        1e-10,
    ),
    ("z3+auto_collectives", with_(EXACT, collectives="auto"), "float64", 1e-10),
    ("z3+clip", with_(EXACT, max_norm=0.5), "float64", 1e-10),
    # (torch's checkpoint stops a recompute early: the modules must get their masters back)
    (
        "z3+ac+clip",
        with_(EXACT, activation_checkpointing=True, max_norm=0.5),
        "float64",
        1e-10,
    ),
    (
        "z3+ac+compile",
        with_(EXACT, activation_checkpointing=True, compile_backend="aot_eager"),
        "float64",
        1e-10,
    ),
    # Gram NS is the same polynomial: exact against torch.optim.Muon's plain NS in float64.
    ("gram", with_(EXACT, ns_algorithm="gram"), "float64", 1e-10),
    # AOL's row scaling instead of the Frobenius norm: the reference's NS written out with it
    ("aol", with_(EXACT, ns_preconditioner="aol"), "float64", 1e-10),
    ("aol+gram", with_(EXACT, ns_preconditioner="aol", ns_algorithm="gram"), "float64", 1e-10),
    ("ns_float32", with_(EXACT, ns_dtype=torch.float32), "float64", 1e-5),
    ("fp32", RunConfig(ns_dtype=torch.float32), "float32", 1e-5),
    ("bf16_default", RunConfig(ns_dtype=torch.bfloat16), "torch", None),  # measured below
]
