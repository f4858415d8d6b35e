"""Hook boundaries: the four worked examples of the seed document, strict mode, warnings.

Models are built on the meta device (the seed's sizes cost no memory) and dedicated on a
one-rank gloo mesh; the hook sites are read back from the plan summary.
"""

import json
import warnings

import pytest
import torch
from torch import nn

import dmuon_titan as dmuon
from dmuon_titan.plan import default_boundary, select_boundaries


def hook_sites(model, mesh, predicate, **kwargs):
    summary = dmuon.dedicate_params(model, mesh, predicate, **kwargs)
    json.dumps(summary)  # the plan summary is JSON-friendly
    assert summary == dmuon.summarize_plan(model)
    return summary["boundaries"], {p["fqn"]: p["boundary"] for p in summary["params"]}


# ---------------------------------------------------------------- example 1: ToyVLA
class VitBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)


class VisionTower(nn.Module):
    def __init__(self, d=1024, n=24):
        super().__init__()
        self.blocks = nn.ModuleList([VitBlock(d) for _ in range(n)])


class DecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, 4 * d, bias=False)
        self.down_proj = nn.Linear(4 * d, d, bias=False)


class ActionHead(nn.Module):
    def __init__(self, d, n_actions=7):
        super().__init__()
        self.fc1 = nn.Linear(d, d, bias=False)
        self.fc2 = nn.Linear(d, n_actions, bias=False)


class ToyVLA(nn.Module):
    def __init__(self, d=1024, n_vit=24, n_dec=28):
        super().__init__()
        self.visual = VisionTower(d, n_vit)
        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n_dec)])
        self.action_head = ActionHead(d)


def vla_boundary(m):
    return isinstance(m, (VisionTower, DecoderLayer, ActionHead))


def test_vla_collapses_vit_blocks_onto_visual_and_keeps_one_site_per_decoder_layer(cpu_mesh):
    with torch.device("meta"):
        model = ToyVLA()
    boundaries, of = hook_sites(
        model, cpu_mesh, lambda n, p: p.ndim == 2, hook_boundary_predicate=vla_boundary
    )
    paths = [b["path"] for b in boundaries]
    assert paths == ["visual"] + [f"layers.{i}" for i in range(28)] + ["action_head"]
    assert boundaries[0]["params"] == 48  # 24 ViT blocks x (qkv, proj)
    assert of["visual.blocks.17.qkv.weight"] == "visual"
    assert of["action_head.fc2.weight"] == "action_head"


def test_vla_default_heuristic_gives_per_block_sites_instead(cpu_mesh):
    # What the seed warns about: without the predicate each ViT block is its own site and the
    # action head falls back to one site per Linear.
    with torch.device("meta"):
        model = ToyVLA(d=64, n_vit=3, n_dec=2)
    boundaries, of = hook_sites(model, cpu_mesh, lambda n, p: p.ndim == 2)
    assert of["visual.blocks.1.qkv.weight"] == "visual.blocks.1"
    assert of["layers.1.gate_proj.weight"] == "layers.1"
    assert of["action_head.fc1.weight"] == "action_head.fc1"


def test_strict_mode_names_every_uncovered_parameter(cpu_mesh):
    with torch.device("meta"):
        model = ToyVLA(d=64, n_vit=2, n_dec=2)
    with pytest.raises(ValueError) as err:
        dmuon.dedicate_params(
            model,
            cpu_mesh,
            lambda n, p: p.ndim == 2,
            hook_boundary_predicate=lambda m: isinstance(m, DecoderLayer),
        )
    msg = str(err.value)
    for name in (
        "visual.blocks.0.qkv.weight",
        "visual.blocks.1.proj.weight",
        "action_head.fc1.weight",
        "action_head.fc2.weight",
    ):
        assert name in msg
    assert "layers.0.q_proj.weight" not in msg


def test_lenient_mode_falls_back_to_the_parent_module(cpu_mesh):
    with torch.device("meta"):
        model = ToyVLA(d=64, n_vit=2, n_dec=2)
    _, of = hook_sites(
        model,
        cpu_mesh,
        lambda n, p: p.ndim == 2,
        hook_boundary_predicate=lambda m: isinstance(m, DecoderLayer),
        hook_boundary_strict=False,
    )
    assert of["layers.1.o_proj.weight"] == "layers.1"
    assert of["visual.blocks.1.proj.weight"] == "visual.blocks.1.proj"


# ---------------------------------------------------------------- example 2: MoE
class Expert(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)


class MoELayer(nn.Module):
    def __init__(self, d, d_ff, n_experts=8):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, d_ff) for _ in range(n_experts)])
        self.o_proj = nn.Linear(d, d, bias=False)


class MoEModel(nn.Module):
    def __init__(self, d=256, d_ff=512, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList([MoELayer(d, d_ff) for _ in range(n_layers)])


def test_moe_one_site_per_expert_router_excluded(cpu_mesh):
    with torch.device("meta"):
        model = MoEModel()
    boundaries, of = hook_sites(
        model,
        cpu_mesh,
        lambda n, p: p.ndim == 2 and "router" not in n,
        hook_boundary_predicate=lambda m: isinstance(m, (Expert, MoELayer)),
    )
    assert "layers.0.router.weight" not in of
    assert of["layers.1.experts.5.down_proj.weight"] == "layers.1.experts.5"
    assert of["layers.1.o_proj.weight"] == "layers.1"
    expected = []
    for i in range(2):
        expected += [f"layers.{i}.experts.{k}" for k in range(8)] + [f"layers.{i}"]
    assert sorted(b["path"] for b in boundaries) == sorted(expected)


# ---------------------------------------------------------------- example 3: nested Qwen-VL
class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(d, 3 * d, bias=True)
        self.attn.proj = nn.Linear(d, d, bias=True)


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, name, nn.Linear(d, d, bias=False))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, 2 * d, bias=False)
        self.mlp.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.mlp.down_proj = nn.Linear(2 * d, d, bias=False)


class Qwen2VLForConditionalGeneration(nn.Module):
    def __init__(self, d=128, n_layers=3, n_blocks=2):
        super().__init__()
        self.visual = nn.Module()
        self.visual.blocks = nn.ModuleList([Qwen2VLVisionBlock(d) for _ in range(n_blocks)])
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Qwen2VLDecoderLayer(d) for _ in range(n_layers)])


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_qwen_vl_sites_are_the_decoder_layers(cpu_mesh):
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration()
    boundaries, of = hook_sites(
        model,
        cpu_mesh,
        lambda n, p: p.ndim == 2 and any(k in n for k in PROJ),
        hook_boundary_predicate=lambda m: isinstance(m, (Qwen2VLDecoderLayer, Qwen2VLVisionBlock)),
    )
    assert [b["path"] for b in boundaries] == [f"model.layers.{i}" for i in range(3)]
    assert all(b["params"] == 7 for b in boundaries)
    assert of["model.layers.2.mlp.up_proj.weight"] == "model.layers.2"


def test_default_heuristic_on_nested_names():
    assert (
        default_boundary("model.vlm.llm.model.layers.3.mlp.gate_proj.weight")
        == "model.vlm.llm.model.layers.3"
    )
    assert default_boundary("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert default_boundary("layers.2.mlp.experts.5.w1.weight") == "layers.2"  # left-most wins
    assert default_boundary("encoder.blocks.11.attn.qkv.weight") == "encoder.blocks.11"
    assert default_boundary("sublayers.4.proj.weight") == "sublayers.4.proj"  # not "layers.N"
    assert default_boundary("head.weight") == "head"
    assert default_boundary("weight") == ""


# ---------------------------------------------------------------- example 4: nn.Sequential
def test_sequential_gets_per_linear_sites_by_default(cpu_mesh):
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(1024, 4096, bias=False), nn.GELU(), nn.Linear(4096, 1024, bias=False)
        )
    boundaries, _ = hook_sites(model, cpu_mesh, lambda n, p: p.ndim == 2)
    assert [b["path"] for b in boundaries] == ["0", "2"]


def test_a_predicate_matching_the_root_warns(cpu_mesh):
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(64, 64, bias=False), nn.GELU(), nn.Linear(64, 64, bias=False)
        )
    with pytest.warns(UserWarning, match="root module"):
        boundaries, _ = hook_sites(
            model,
            cpu_mesh,
            lambda n, p: p.ndim == 2,
            hook_boundary_predicate=lambda m: isinstance(m, nn.Sequential),
        )
    assert [b["path"] for b in boundaries] == ["<root>"]


def test_a_predicate_that_misses_the_root_does_not_warn():
    with torch.device("meta"):
        model = ToyVLA(d=16, n_vit=1, n_dec=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_boundaries(["layers.0.q_proj.weight"], dict(model.named_modules()), vla_boundary)
