"""The grouped (foreach) momentum and update passes of small same-shape matrices: the same
numbers whatever the slicing, and the per-matrix path's within float64 rounding."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

import dmuon_titan as dmuon
from dmuon_titan.optim import passes as muon_module
from tests.helpers.models import ToyTransformer, dedicated_predicate, loss_fn


def _train(cpu_mesh, steps: int = 3, **patches) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyTransformer().double()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    with mock.patch.multiple(muon_module, **patches) if patches else contextlib.nullcontext():
        for step in range(steps):
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            loss_fn(model(tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_grouped_passes_do_not_depend_on_slicing_and_match_the_per_matrix_path(cpu_mesh):
    default = _train(cpu_mesh)
    # one matrix per foreach group: every slice boundary exercised
    sliced = _train(cpu_mesh, GROUPED_PASS_SLICE_NUMEL=1)
    assert all(torch.equal(default[k], sliced[k]) for k in default)
    per_matrix = _train(cpu_mesh, GROUPED_PASS_NUMEL=0)  # no matrix is small enough to group
    worst = max((default[k] - per_matrix[k]).abs().max().item() for k in default)
    assert worst <= 1e-14, worst
    # and the model moved (the comparison is not of untouched weights)
    torch.manual_seed(0)
    init = ToyTransformer().double().state_dict()
    assert max((default[k] - init[k]).abs().max().item() for k in default) > 1e-3
