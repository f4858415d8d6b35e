"""Bad input: a ValueError that names the offending parameter, before any collective."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_titan as dmuon
from dmuon_titan.runtime.state import STATE_ATTR

from ..helpers.models import ToyTransformer, dedicated_predicate

COLLECTIVES = [
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_reduce",
    "reduce",
    "reduce_scatter_tensor",
    "barrier",
]


def no_collectives():
    """Patch every collective DMuon could issue so that calling one fails the test."""
    patches = [
        mock.patch.object(dist, name, side_effect=AssertionError(f"collective {name} was issued"))
        for name in COLLECTIVES
    ]
    stack = __import__("contextlib").ExitStack()
    for p in patches:
        stack.enter_context(p)
    return stack


def meta_model(**kw):
    with torch.device("meta"):
        return ToyTransformer(**kw)


def test_non_2d_selected_param(cpu_mesh):
    model = meta_model()
    with (
        no_collectives(),
        pytest.raises(ValueError, match=r"'layers\.0\.attention_norm\.weight'.*2-D"),
    ):
        dmuon.dedicate_params(model, cpu_mesh, lambda n, p: n.startswith("layers.0."))


def test_shared_param(cpu_mesh):
    model = meta_model()
    model.output.weight = model.tok_embeddings.weight  # tied embeddings
    with (
        no_collectives(),
        pytest.raises(ValueError, match=r"'tok_embeddings\.weight' is shared.*output\.weight"),
    ):
        dmuon.dedicate_params(model, cpu_mesh, lambda n, p: p.ndim == 2)


@pytest.mark.parametrize("alone", [False, True])
def test_tied_weight_selected_by_its_second_name(cpu_mesh, alone):
    """``output.weight`` tied to the embedding: the predicate picks it by its second name,
    with other matrices or alone; either way the tie is named, never a silent AdamW."""
    model = meta_model()
    model.output.weight = model.tok_embeddings.weight

    def predicate(name, p):
        return name == "output.weight" or (not alone and dedicated_predicate(name, p))

    with (
        no_collectives(),
        pytest.raises(ValueError, match=r"'output\.weight' is shared.*tied.*tok_embeddings"),
    ):
        dmuon.dedicate_params(model, cpu_mesh, predicate)


def test_optimizer_with_adamw_params_left_on_meta(cpu_mesh):
    """No fully_shard, optimizer built before to_empty: the AdamW parameters it holds were
    replaced by to_empty; step() names one instead of training nothing."""
    model = meta_model()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    model.to_empty(device="cpu")
    model.init_weights()
    with pytest.raises(RuntimeError, match=r"'tok_embeddings\.weight'.*meta device.*to_empty"):
        optimizer.step()


def test_frozen_param(cpu_mesh):
    model = meta_model()
    model.layers[1].feed_forward.w2.weight.requires_grad_(False)
    with (
        no_collectives(),
        pytest.raises(
            ValueError, match=r"'layers\.1\.feed_forward\.w2\.weight' does not require grad"
        ),
    ):
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)


def test_non_1d_mesh(single_rank_group):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with no_collectives(), pytest.raises(ValueError, match="1-D DeviceMesh"):
        dmuon.dedicate_params(meta_model(), mesh, dedicated_predicate)
    with no_collectives(), pytest.raises(ValueError, match="1-D DeviceMesh"):
        dmuon.dedicate_params(meta_model(), "not a mesh", dedicated_predicate)


def test_fully_shard_before_dedicate(cpu_mesh):
    model = meta_model()
    fully_shard(model.layers[0], mesh=cpu_mesh)
    with (
        no_collectives(),
        pytest.raises(
            ValueError, match=r"fully_shard was applied before dedicate_params.*layers\.0"
        ),
    ):
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)


def test_predicate_selecting_nothing(cpu_mesh):
    with no_collectives(), pytest.raises(ValueError, match="selected no parameters"):
        dmuon.dedicate_params(meta_model(), cpu_mesh, lambda n, p: False)


def test_dedicating_twice(cpu_mesh):
    model = meta_model()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    with no_collectives(), pytest.raises(ValueError, match="already applied"):
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)


def test_fully_shard_skips_dedicated_params_whatever_the_import_order(cpu_mesh):
    # ``fully_shard`` was imported at the top of this module, before any dedicate_params call;
    # the patch lives below it, so the name binding does not matter.
    model = meta_model()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh)
    fully_shard(model, mesh=cpu_mesh)
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) != dedicated_predicate(name, p), name


def test_meta_flow_storage_only_on_owner(cpu_mesh):
    # One rank owns everything here; the multi-rank version is in test_distributed.py.
    model = meta_model()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    fully_shard(model, mesh=cpu_mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    w = model.layers[0].attention.wq.weight
    assert w.shape == (32, 32) and not w.is_meta and w.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": -1.0, "adamw_lr": 1e-3}, "lr"),
        ({"lr": 0.02, "adamw_lr": -1e-3}, "adamw_lr"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "momentum": 1.0}, "momentum"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "ns_steps": 0}, "ns_steps"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "eps": 0.0}, "eps"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "adjust_lr_fn": "rms"}, "adjust_lr_fn"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "ns_dtype": torch.int32}, "ns_dtype"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "adamw_betas": (0.9, 1.0)}, "adamw_betas"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "ns_coefficients": "cubic"}, "ns_coefficients"),
        ({"lr": 0.02}, "adamw_lr"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "ns_algorithm": "fast"}, "ns_algorithm"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "ns_batch_numel": -1}, "ns_batch_numel"),
        ({"lr": 0.02, "adamw_lr": 1e-3, "ns_preconditioner": "spectral"}, "ns_preconditioner"),
    ],
)
def test_optimizer_hyperparameters(cpu_mesh, kwargs, name):
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    with pytest.raises(ValueError, match=name):
        dmuon.Muon(model, **kwargs)


def test_unknown_tp_ns_in_dedicate_params(cpu_mesh):
    model = ToyTransformer()
    with no_collectives(), pytest.raises(ValueError, match="tp_ns must be one of.*'row'"):
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate, tp_ns="row")


def test_unknown_ns_algorithm_in_dedicate_params(cpu_mesh):
    model = meta_model()
    with no_collectives(), pytest.raises(ValueError, match="ns_algorithm must be one of.*'fast'"):
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate, ns_algorithm="fast")
    assert not hasattr(model, STATE_ATTR)  # nothing installed: the model can be dedicated again


def test_unknown_collectives_in_dedicate_params(cpu_mesh):
    model = meta_model()
    with no_collectives(), pytest.raises(ValueError, match="collectives must be one of"):
        dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate, collectives="ring")
    assert not hasattr(model, STATE_ATTR)


def test_optimizer_takes_the_planned_algorithm_and_warns_on_another(cpu_mesh):
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate, ns_algorithm="auto")
    with pytest.warns(UserWarning, match=r"balanced for ns_algorithm='auto'"):
        dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_algorithm="plain")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dmuon.Muon(model, lr=0.02, adamw_lr=1e-3).ns_algorithm == "auto"  # the plan's
        dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_algorithm="auto")


def test_adamw_lr_defaults_to_lr_with_match_rms_adamw(cpu_mesh):
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    opt = dmuon.Muon(model, lr=3e-4, adjust_lr_fn="match_rms_adamw")
    assert [g["lr"] for g in opt.param_groups] == [3e-4, 3e-4]


def test_param_groups_cover_every_trainable_param_once(cpu_mesh):
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    muon, adamw = opt.param_groups
    assert len(muon["params"]) == 21 and len(adamw["params"]) == 3 + 3 * 2
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()
    }
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 5e-4]
    del sched


def test_no_dedicated_model_is_plain_adamw():
    model = nn.Linear(4, 4)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    assert opt.param_groups[0]["params"] == [] and len(opt.param_groups[1]["params"]) == 2


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)
        self.blob = nn.Parameter(torch.empty(2, 2, 2, 2))


@pytest.mark.parametrize(
    "name, match",
    [
        ("conv.weight", r"'conv\.weight'.*Conv1d weight, not a stack of matrices"),
        ("blob", r"'blob' has shape \(2, 2, 2, 2\).*3-D stacks"),
    ],
)
def test_parameters_that_are_not_matrices_or_expert_stacks(cpu_mesh, name, match):
    with torch.device("meta"):
        model = _Conv()
    with no_collectives(), pytest.raises(ValueError, match=match):
        dmuon.dedicate_params(model, cpu_mesh, lambda n, p: n == name)


def test_a_state_dict_saved_before_ns_preconditioner_loads_as_frobenius(cpu_mesh):
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    saved = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3).state_dict()
    assert saved["param_groups"][0].pop("ns_preconditioner") == "frobenius"
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_preconditioner="aol")
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["ns_preconditioner"] == "frobenius"
    assert "ns_preconditioner" not in optimizer.param_groups[1]
