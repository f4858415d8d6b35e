"""DMuon's ``clip_grad_norm_`` on one rank against ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import math

import pytest
import torch

import dmuon_titan as dmuon
from dmuon_titan.titan.clip import clip_grad_norm_ as titan_clip
from tests.helpers.models import ToyTransformer, dedicated_predicate, loss_fn


def _gradients(dtype: torch.dtype, dedicated_mesh=None, freeze: str | None = None):
    torch.manual_seed(0)
    model = ToyTransformer().to(dtype)
    if freeze is not None:
        model.get_parameter(freeze).requires_grad_(False)
    if dedicated_mesh is not None:
        dmuon.dedicate_params(model, dedicated_mesh, dedicated_predicate)
        dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=dtype)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("freeze", [None, "layers.0.attention_norm.weight"])
def test_one_rank_clips_as_torch_does_bit_for_bit(cpu_mesh, dtype, norm_type, freeze):
    """Plain and owned gradients of one process are one norm, taken as torch takes it: the
    same norm and the same clipped gradients, bit for bit, through the public function and
    through torchtitan's (its parameter list), with a frozen parameter among them; the clip
    did scale (the norm is far above max_norm)."""
    reference = _gradients(dtype, freeze=freeze)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
    assert expected.item() > 0.05
    for clip in ("public", "titan"):
        model = _gradients(dtype, cpu_mesh, freeze)
        assert len(model._dmuon_state.params) > 0
        if clip == "public":
            norm = dmuon.clip_grad_norm_(model, 0.01, norm_type)
        else:
            norm = titan_clip(list(model.parameters()), 0.01, norm_type)
            model._dmuon_state.apply_deferred_grad_scale()  # (a factor the step would apply)
        assert norm.dtype == torch.promote_types(dtype, torch.float32)
        assert torch.equal(norm, expected.to(norm.dtype)), (clip, norm, expected)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), (clip, name)
