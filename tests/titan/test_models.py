"""Every language model torchtitan 0.2.2 ships, with DMuon from the same four TOML lines:
what goes to Muon by default (from what the parameters are), and CPU training runs (gloo,
2 ranks) of their debug flavors, mixture-of-experts ones included."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .test_compose import TP2
from .test_titan import (
    REPO,
    TOY,
    checkpointed_args,
    checkpointed_from,
    from_seed,
    launch,
    model_size,
    optimizer_tensors,
    read_checkpoint,
    run_ok,
    run_probe,
    seed_checkpoint,
    tb_losses,
    tb_scalars,
    toy_args,
)

# (model, flavor, what the default rule puts on Muon: name patterns with layers.N folded)
SELECTIONS = {
    ("llama3", "debugmodel"): 42,
    ("llama4", "debugmodel"): 51,
    ("qwen3", "debugmodel"): 56,
    ("qwen3", "debugmodel_moe"): 56,
    ("deepseek_v3", "debugmodel"): 57,
    ("gpt_oss", "debugmodel"): 24,
}


def _meta_model(name: str, flavor: str, with_args: bool = False):
    from torchtitan.protocols.train_spec import get_train_spec

    import dmuon_titan.toy  # noqa: F401  (the repository's flavors)

    spec = get_train_spec(name)
    args = spec.model_args[flavor]
    if not hasattr(args, "moe_impl"):  # set from the job config by torchtitan's trainer
        args.moe_impl = "standard"
    with torch.device("meta"):
        model = spec.model_cls(args)
    return (model, args) if with_args else model


@pytest.mark.parametrize("name, flavor", list(SELECTIONS))
def test_default_selection_is_what_the_parameters_are(name, flavor):
    from dmuon_titan.titan.selection import muon_predicate

    model = _meta_model(name, flavor)
    predicate = muon_predicate([], model)
    muon = {n: p for n, p in model.named_parameters() if predicate(n, p)}
    assert len(muon) == SELECTIONS[(name, flavor)]
    for n, p in model.named_parameters():
        leaf = n.rsplit(".", 1)[-1]
        if n in muon:  # inside a block: a Linear weight or an expert stack
            assert n.startswith("layers.") and p.ndim in (2, 3), n
            assert ".router." not in n and leaf not in ("bias", "sinks"), n
        else:  # embeddings, head, norms, biases, sinks, routers
            assert (
                p.ndim == 1
                or not n.startswith("layers.")
                or ".router." in n
                or leaf.endswith("bias")
            ), n
    stacks = [n for n, p in muon.items() if p.ndim == 3]
    has_experts = any(hasattr(m, "num_experts") for m in model.modules())
    assert bool(stacks) == has_experts


def test_a_3d_pattern_that_is_not_an_expert_stack_is_refused():
    from dmuon_titan.titan.config import ConfigError
    from dmuon_titan.titan.selection import muon_predicate

    model = _meta_model("deepseek_v3", "debugmodel")
    model.layers["1"].register_parameter("bogus", torch.nn.Parameter(torch.empty(2, 3, 4)))
    with pytest.raises(
        ConfigError, match=r"'layers\.1\.bogus' of shape \(2, 3, 4\).*not an expert"
    ):
        muon_predicate([r"layers\.1\.bogus"], model)


# (model, flavor): trained TRAIN_STEPS steps on 2 CPU ranks. gpt_oss is not here: its attention is
# FlexAttention, which has no backward on CPU (torch's); qwen3's 64-expert debug model runs in
# a slow test (15 s of CPU Newton-Schulz a step), its 8-expert cut here.
MODELS = [
    ("llama4", "debugmodel"),
    ("qwen3", "debugmodel"),  # tied embedding and head: on AdamW, one FSDP2 group
    ("qwen3", "debugmodel_moe_small"),
    ("deepseek_v3", "debugmodel"),
]


def model_args(name: str, flavor: str, steps: int) -> list[str]:
    return [
        "--model.name",
        name,
        "--model.flavor",
        flavor,
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--lr_scheduler.warmup_steps",
        "2",
        "--validation.no-enable",  # not every train spec has a validator
    ]


def _trains(tokenizer_dir, tmp_path, name, flavor, steps=10, *extra):
    dump = tmp_path / f"{name}-{flavor}"
    out = run_ok(2, *toy_args(tokenizer_dir, dump, *model_args(name, flavor, steps), *extra))
    assert "DMuon params: Muon" in out
    # The size torchtitan logs (and derives FLOPs and MFU from) is the whole model's: what
    # its own count gives on the undistributed model, as under AdamW.
    model, args = _meta_model(name, flavor, with_args=True)
    assert model_size(out) == args.get_nparams_and_flops(model, 64)[0]
    losses = tb_losses(dump)
    assert sorted(losses) == list(range(1, steps + 1))
    first, last = (losses[1] + losses[2]) / 2, (losses[steps - 1] + losses[steps]) / 2
    assert last < first - 0.1, (name, flavor, losses)
    return out


#: train specs whose optimizer builder adds MoE load balancing (the expert-bias update)
LOAD_BALANCED = ("llama4", "deepseek_v3")


#: steps of the plain training tests (a CPU step of an MoE debug model is mostly its experts'
#: Newton–Schulz)
TRAIN_STEPS = 6
#: validation on, at the first and last steps (2 batches), on every model: torchtitan 0.2.2's validator
#: hands SDPA models masks llama4 refuses, and deepseek_v3's train spec has none
VALIDATED = [
    "--validation.enable",
    "--validation.freq",
    str(TRAIN_STEPS),
    "--validation.steps",
    "2",
]
VALIDATED += ["--validation.seq_len", "64"]


@pytest.mark.parametrize("name, flavor", MODELS)
def test_model_trains_with_dmuon(tokenizer_dir, tmp_path, name, flavor):
    """``TRAIN_STEPS`` steps with falling loss, validated at the first and last with finite
    losses."""
    last = str(TRAIN_STEPS)
    save = ["--checkpoint.enable", "--checkpoint.interval", last] if name in LOAD_BALANCED else []
    out = _trains(tokenizer_dir, tmp_path, name, flavor, TRAIN_STEPS, *save, *VALIDATED)
    validation = tb_scalars(tmp_path / f"{name}-{flavor}", "validation_metrics/loss")
    assert sorted(validation) == [1, TRAIN_STEPS], validation
    assert all(math.isfinite(v) and v > 0 for v in validation.values()), validation
    if flavor.startswith("debugmodel_moe") or name in LOAD_BALANCED:
        assert "expert stacks:" in out
    if name in LOAD_BALANCED:  # the spec's expert-bias update runs with DMuon's optimizer
        saved = read_checkpoint(
            tmp_path / f"{name}-{flavor}" / "checkpoint" / f"step-{last}", tmp_path
        )
        biases = [v for k, v in saved.items() if k.endswith("moe.expert_bias")]
        assert biases and all(b.abs().sum() > 0 for b in biases), name


EP2 = ["--parallelism.expert_parallel_degree", "2"]


@pytest.mark.parametrize(
    "name, flavor", [("qwen3", "debugmodel_moe_small"), ("deepseek_v3", "debugmodel")]
)
def test_moe_model_trains_with_expert_parallelism(tokenizer_dir, tmp_path, name, flavor):
    out = _trains(tokenizer_dir, tmp_path, name, flavor, TRAIN_STEPS, *EP2)
    assert "experts cut by expert parallelism 2" in out


@pytest.mark.parametrize(
    "params, muon_stacks",
    [
        (r"layers\.\d+\.attention\.wq\.weight", False),
        pytest.param(  # (the same path as wq alone: every stack on AdamW)
            r"layers\.\d+\.moe\.router\.gate\.weight", False, marks=pytest.mark.slow
        ),
        (r"layers\.\d+\.(attention\.wq\.weight|moe\.experts\.w[13])", True),  # w2 on AdamW
    ],
)
def test_expert_stacks_left_on_adamw_under_expert_parallelism(
    tokenizer_dir, tmp_path, params, muon_stacks
):
    """deepseek_v3 at ep 2 on 2 ranks with ``[dmuon] params`` leaving expert stacks on AdamW
    (they stay EP DTensors on the expert meshes, the rest on FSDP's), all of them or w2 alone
    beside w1 and w3 on Muon: 6 steps, clipping on, the loss falls, and the first step's
    gradient norm (taken over both meshes and the owners) equals stock torchtitan's AdamW
    within 1e-6, from one seed checkpoint."""
    seed = _model_seed(tokenizer_dir, tmp_path, "deepseek_v3", "debugmodel")
    common = [*model_args("deepseek_v3", "debugmodel", 6), *from_seed(seed, 6), *EP2]
    norms, losses, outs = {}, {}, {}
    for opt, config in (("dmuon", TOY), ("adamw", REPO / "configs" / "toy_adamw.toml")):
        dump = tmp_path / opt
        extra = ["--dmuon.params", params] if opt == "dmuon" else []
        outs[opt] = run_ok(2, *toy_args(tokenizer_dir, dump, *common, *extra, config=config))
        norms[opt], losses[opt] = tb_scalars(dump, "grad_norm"), tb_losses(dump)
    assert ("expert stacks:" in outs["dmuon"]) == muon_stacks, outs["dmuon"][-3000:]
    assert abs(norms["dmuon"][1] - norms["adamw"][1]) <= 1e-6 * norms["adamw"][1]
    assert sorted(losses["dmuon"]) == list(range(1, 7))
    assert losses["dmuon"][6] < losses["dmuon"][1], losses


def test_moe_resumes_bit_exactly_and_loads_at_another_expert_degree(tokenizer_dir, tmp_path):
    """deepseek_v3 with expert parallelism 2 on 2 ranks: 6 steps; stopped at 3 and resumed,
    steps 4-6 are bit-identical, and so are the step-6 checkpoints; the step-3 checkpoint
    loads without expert parallelism (another cut of every stack) with identical weights and
    momentum."""
    common = [
        *model_args("deepseek_v3", "debugmodel", 6),
        *checkpointed_args(total_steps=6, interval=3, validation_freq=100),
        "--validation.no-enable",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    out = run_ok(2, *toy_args(tokenizer_dir, a, *common, *EP2))
    assert "experts cut by expert parallelism 2" in out
    run_ok(2, *toy_args(tokenizer_dir, b, *common, *EP2, "--training.steps", "3"))
    out = run_ok(2, *toy_args(tokenizer_dir, b, *common, *EP2))
    assert "Training starts at step 4" in out
    la, lb = tb_losses(a), tb_losses(b)
    assert [la[s] for s in (4, 5, 6)] == [lb[s] for s in (4, 5, 6)]
    assert la[6] < la[1]
    ca = read_checkpoint(a / "checkpoint" / "step-6", tmp_path)
    cb = read_checkpoint(b / "checkpoint" / "step-6", tmp_path)
    stacks = [k for k in ca if k.endswith("moe.experts.w1")]
    assert stacks and ca[stacks[0]].shape[0] == 8  # whole stacks in the checkpoint
    for k, v in ca.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, cb[k]), k
    for k, v in ca["optimizer"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, cb["optimizer"][k]), k

    saved = read_checkpoint(b / "checkpoint" / "step-3", tmp_path)
    probe = run_probe(
        2,
        tmp_path / "probe.pt",
        *toy_args(tokenizer_dir, b, *common, "--checkpoint.load_step", "3"),
    )
    assert probe["step"] == 3
    for k, v in probe["model"].items():
        assert torch.equal(v, saved[k]), k
    moments = 0
    for fqn, key, value in optimizer_tensors(probe):
        assert torch.equal(value, saved["optimizer"][f"state.{fqn}.{key}"]), (fqn, key)
        moments += key == "momentum_buffer" and ".experts." in fqn
    assert moments == 15  # 5 MoE blocks x 3 stacks


def _relative_gaps(a: dict, b: dict, keys) -> dict[str, float]:
    """Per key, the largest difference of ``a[key]`` and ``b[key]`` over ``b[key]``'s largest
    entry."""
    return {k: ((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in keys}


def test_tensor_parallel_with_expert_parallelism(tokenizer_dir, tmp_path):
    """llama4 (MoE every other block) at dp 2 x tp 2 x ep 2 (4 CPU ranks: torchtitan's ep mesh
    spans the tp ranks, so EP cuts the stacks across them) from one seed checkpoint, against
    dp 2 x ep 2 (2 ranks, the same batches), fp32 NS, clipping on:
    - the first step's gradient norm (DMuon's clip over owners, tp rows and expert pieces)
      equals stock torchtitan's (AdamW, FSDP2 x TP x EP) within 1e-6;
    - after step 1 every Muon matrix's and expert stack's momentum is as close to the
      dp 2 x ep 2 run's as AdamW's first moments are between the same two layouts (TP alone
      moves the gradients by up to ~3e-3 of their largest entry), and the experts moved;
    - later losses stay as close to the dp 2 x ep 2 run's as AdamW's do, and fall;
    - the step-2 checkpoint loads at both layouts with identical weights and momentum."""
    seed = _model_seed(tokenizer_dir, tmp_path, "llama4", "debugmodel")
    common = [
        *model_args("llama4", "debugmodel", 4),
        *checkpointed_from(seed, 4, 1),
        "--training.max_norm",
        "0.5",
    ]
    layouts = {"tpep": (4, [*TP2, *EP2]), "ep": (2, EP2)}
    adamw = REPO / "configs" / "toy_adamw.toml"
    ckpt, losses, norms = {}, {}, {}
    for opt, config in (("dmuon", TOY), ("adamw", adamw)):
        for layout, (n, extra) in layouts.items():
            dump = tmp_path / f"{opt}_{layout}"
            out = run_ok(n, *toy_args(tokenizer_dir, dump, *common, *extra, config=config))
            if opt == "dmuon" and layout == "tpep":
                assert "x 2 tensor-parallel, experts cut by expert parallelism 2" in out
            ckpt[opt, layout] = read_checkpoint(
                dump / "checkpoint" / "step-1", tmp_path / dump.name
            )
            losses[opt, layout] = tb_losses(dump)
            norms[opt, layout] = tb_scalars(dump, "grad_norm")[1]
    assert abs(norms["dmuon", "tpep"] - norms["adamw", "tpep"]) <= 1e-6 * norms["adamw", "tpep"]

    momentum = [k for k in ckpt["dmuon", "ep"]["optimizer"] if k.endswith(".momentum_buffer")]
    assert len(momentum) == 51 and sum(".experts." in k for k in momentum) == 9
    matrices = [k[len("state.") : -len(".momentum_buffer")] for k in momentum]
    opt_of = {layout: ckpt["dmuon", layout]["optimizer"] for layout in layouts}
    mine = _relative_gaps(opt_of["tpep"], opt_of["ep"], momentum)
    adam = {layout: ckpt["adamw", layout]["optimizer"] for layout in layouts}
    theirs = _relative_gaps(adam["tpep"], adam["ep"], [f"state.{m}.exp_avg" for m in matrices])
    assert max(theirs.values()) > 1e-4  # (TP moves the gradients: the yardstick is not zero)
    assert max(mine.values()) <= 2 * max(theirs.values()), (mine, theirs)
    seed_weights = read_checkpoint(Path(seed), tmp_path)
    for m in matrices:
        if ".experts." in m:
            moved = (ckpt["dmuon", "tpep"][m] - seed_weights[m]).abs().amax(dim=(1, 2))
            assert bool((moved > 0).all()), (m, moved)

    mine_loss, adam_loss = losses["dmuon", "tpep"], losses["adamw", "tpep"]
    assert sorted(mine_loss) == [1, 2, 3, 4] and mine_loss[4] < mine_loss[1]
    for step in (2, 3, 4):
        gap = abs(mine_loss[step] - losses["dmuon", "ep"][step])
        assert gap <= max(abs(adam_loss[step] - losses["adamw", "ep"][step]), 1e-4), step

    # Its checkpoint loads at this layout and at dp 2 x ep 2 with identical weights and
    # momentum. (Resuming is not bit-exact here: stock torchtitan with AdamW does not resume
    # bit-exactly at dp 2 x tp 2 x ep 2 either, 2e-3 in the loss one step after.)
    dump = tmp_path / "dmuon_tpep"
    saved = read_checkpoint(dump / "checkpoint" / "step-2", dump)
    reshard = ["--checkpoint.load_step", "2", "--checkpoint.exclude_from_loading", "dataloader"]
    for name, (n, extra) in layouts.items():
        probe = run_probe(
            n,
            tmp_path / f"probe_{name}.pt",
            *toy_args(tokenizer_dir, dump, *common, *extra, *reshard),
        )
        assert probe["step"] == 2
        for k, v in probe["model"].items():
            assert torch.equal(v, saved[k]), (name, k)
        loaded = optimizer_tensors(probe)
        assert sum(key == "momentum_buffer" for _, key, _ in loaded) == 51
        for fqn, key, value in loaded:
            assert torch.equal(value, saved["optimizer"][f"state.{fqn}.{key}"]), (name, fqn, key)


def _model_seed(tokenizer_dir, tmp_path, name: str, flavor: str) -> str:
    """A one-rank AdamW seed checkpoint of torchtitan's ``name`` ``flavor`` at the sequence
    length of :func:`model_args`: its path."""
    model = ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", "64"]
    seed, _ = seed_checkpoint(tokenizer_dir, tmp_path / "seed", *model, "--validation.no-enable")
    return seed


def _first_step_states(tokenizer_dir, tmp_path, nproc: int, overrides, steps: int = 1):
    """``steps`` steps (clipping off, a checkpoint after each) of DMuon and of stock
    torchtitan's AdamW, each on ``nproc`` ranks with ``overrides``, into ``tmp_path/dmuon1``
    and ``tmp_path/adamw1``: (DMuon's optimizer state after step 1, AdamW's, DMuon's
    output)."""
    first = ["--checkpoint.interval", "1", "--training.max_norm", "1000"]
    first += ["--training.steps", str(steps)]
    states, outputs = [], []
    for name, config in (("dmuon1", TOY), ("adamw1", REPO / "configs" / "toy_adamw.toml")):
        dump = tmp_path / name
        outputs.append(
            run_ok(nproc, *toy_args(tokenizer_dir, dump, *overrides, *first, config=config))
        )
        states.append(read_checkpoint(dump / "checkpoint" / "step-1", dump)["optimizer"])
    return states[0], states[1], outputs[0]


def _first_gradients_equal(mine: dict, stock: dict, count: int) -> None:
    """Every parameter's first-step gradient, read from the optimizer states after step 1
    (clipping off; Muon's momentum holds 0.05 g, AdamW's first moment 0.1 g), equal in the
    DMuon run ``mine`` and the stock AdamW run ``stock`` within 1e-6 of its largest entry."""
    firsts = {k: v for k, v in stock.items() if k.endswith(".exp_avg")}
    assert len(firsts) == count
    for key, theirs in firsts.items():
        base = key[: -len(".exp_avg")]
        muon = f"{base}.momentum_buffer"
        ours = mine[muon] / 0.05 if muon in mine else mine[key] / 0.1
        gap = (ours - theirs / 0.1).abs().max()
        assert gap <= 1e-6 * (theirs / 0.1).abs().max(), (key, gap)


def test_qwen3_with_tensor_parallelism(tokenizer_dir, tmp_path):
    """qwen3 (its plan hands DTensors to SDPA: the toy harness gives the CPU attention kernel
    torch's heads-sharded strategy) at tp 2 on 2 CPU ranks from one seed checkpoint: the
    first step's gradients equal stock torchtitan's (AdamW, FSDP2 x TP) within 1e-6, and
    over 4 steps (fp32 NS, clipping on) the losses equal the naive path's within 1e-5 and
    fall."""
    seed = _model_seed(tokenizer_dir, tmp_path, "qwen3", "debugmodel")
    common = [*model_args("qwen3", "debugmodel", 4), *from_seed(seed, 4), *TP2]
    mine, stock, _ = _first_step_states(tokenizer_dir, tmp_path, 2, common)
    _first_gradients_equal(mine, stock, 90)
    assert sum(k.endswith(".momentum_buffer") for k in mine) == 56

    clipped = ["--training.max_norm", "0.5"]
    out = run_ok(2, *toy_args(tokenizer_dir, tmp_path / "dmuon", *common, *clipped))
    assert "x 2 tensor-parallel" in out
    run_ok(
        2, *toy_args(tokenizer_dir, tmp_path / "naive", *common, *clipped, "--dmuon.mode", "naive")
    )
    mine_loss, naive = tb_losses(tmp_path / "dmuon"), tb_losses(tmp_path / "naive")
    assert sorted(mine_loss) == [1, 2, 3, 4] and mine_loss[4] < mine_loss[1]
    for step in range(1, 5):
        assert abs(mine_loss[step] - naive[step]) <= 1e-5, (step, mine_loss[step], naive[step])


def test_deepseek_v3_with_tensor_and_expert_parallelism(tokenizer_dir, tmp_path):
    """deepseek_v3 at dp 2 x tp 2 x ep 2 (4 CPU ranks) from one seed checkpoint: torchtitan's
    plan keeps attention.wkv_a whole on every tp rank (NoParallel), so the default selection
    leaves it on AdamW (logged). The first step's gradients (clipping off) equal stock
    torchtitan's (AdamW, FSDP2 x TP x EP) within 1e-6 of each tensor's largest entry, read
    from the first moments (Muon's momentum 0.05 g, AdamW's 0.1 g), and the loss falls.
    Selecting wkv_a explicitly is refused in one line naming it."""
    seed = _model_seed(tokenizer_dir, tmp_path, "deepseek_v3", "debugmodel")
    common = [*model_args("deepseek_v3", "debugmodel", 3), *from_seed(seed, 3), *TP2, *EP2]
    mine, stock, out = _first_step_states(tokenizer_dir, tmp_path, 4, common, steps=3)
    assert "keeps attention.wkv_a, attention.wq_a whole on every tp rank" in out
    assert "layers.N.attention.wkv_a.weight x6" in out.split("; AdamW")[1].split("\n")[0]
    _first_gradients_equal(mine, stock, 83)
    assert sum(k.endswith(".momentum_buffer") for k in mine) == 51
    losses = tb_losses(tmp_path / "dmuon1")
    assert losses[3] < losses[1]

    rc, out = launch(
        4,
        *toy_args(
            tokenizer_dir,
            tmp_path / "explicit",
            *common,
            "--dmuon.params",
            r"layers\.\d+\.attention\.wkv_.\.weight",
        ),
    )
    assert rc != 0
    errors = [line for line in out.splitlines() if "dmuon_titan config error" in line]
    assert errors and "'layers.0.attention.wkv_a.weight' whole on every tp rank" in errors[0]
    assert "Traceback" not in out


def test_qwen3_moe_with_tensor_and_expert_parallelism(tokenizer_dir, tmp_path):
    """qwen3's MoE (every block; SDPA on DTensors, as above) at dp 2 x tp 2 x ep 2 (4 CPU
    ranks) from one seed checkpoint: the first step's gradients (clipping off) equal stock
    torchtitan's (AdamW, FSDP2 x TP x EP) within 1e-6 of each tensor's largest entry, the
    expert stacks among them, and the loss falls."""
    seed = _model_seed(tokenizer_dir, tmp_path, "qwen3", "debugmodel_moe_small")
    common = [
        *model_args("qwen3", "debugmodel_moe_small", 3),
        *from_seed(seed, 3),
        *TP2,
        *EP2,
    ]
    mine, stock, out = _first_step_states(tokenizer_dir, tmp_path, 4, common, steps=3)
    assert "x 2 tensor-parallel, experts cut by expert parallelism 2" in out
    _first_gradients_equal(mine, stock, 27)
    momentum = [k for k in mine if k.endswith(".momentum_buffer")]
    assert len(momentum) == 14 and sum(".experts." in k for k in momentum) == 6
    losses = tb_losses(tmp_path / "dmuon1")
    assert losses[3] < losses[1]


@pytest.mark.slow
def test_qwen3_moe_debugmodel_trains_with_dmuon(tokenizer_dir, tmp_path):
    _trains(tokenizer_dir, tmp_path, "qwen3", "debugmodel_moe")


def _job(mode="dedicated", initial_load_in_hf=False):
    from types import SimpleNamespace

    return SimpleNamespace(
        dmuon=SimpleNamespace(mode=mode),
        checkpoint=SimpleNamespace(initial_load_in_hf=initial_load_in_hf, last_save_in_hf=False),
    )


@pytest.mark.parametrize(
    "name, job, ep, key",
    [
        ("deepseek_v3", _job(mode="naive"), 1, '[dmuon] mode = "naive"'),
        ("deepseek_v3", _job(initial_load_in_hf=True), 1, "checkpoint.initial_load_in_hf"),
    ],
)
def test_what_expert_stacks_do_not_serve_yet_is_one_line(name, job, ep, key):
    """Refused at conversion (before any collective), naming the key: the naive baseline
    (2-D only) and Hugging Face checkpoint conversion. (Expert parameters left on AdamW under
    expert parallelism, gpt_oss's biases among them, are served since the clip takes one norm
    per mesh: test_expert_stacks_left_on_adamw_under_expert_parallelism.)"""
    from types import SimpleNamespace

    from dmuon_titan.titan.config import ConfigError
    from dmuon_titan.titan.converter import check_stacks
    from dmuon_titan.titan.selection import muon_predicate

    model = _meta_model(name, "debugmodel")
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        check_stacks(job, SimpleNamespace(ep=ep, tp=1), model, muon_predicate([], model))
    check_stacks(_job(), SimpleNamespace(ep=1, tp=1), model, muon_predicate([], model))  # served


def test_expert_stacks_with_tensor_parallelism_are_one_line():
    """Expert stacks in [dmuon] params with tensor parallelism: refused at conversion,
    naming the key."""
    from types import SimpleNamespace

    from dmuon_titan.titan.config import ConfigError
    from dmuon_titan.titan.converter import check_stacks
    from dmuon_titan.titan.selection import muon_predicate

    model = _meta_model("deepseek_v3", "debugmodel")
    with pytest.raises(ConfigError, match="parallelism.tensor_parallel_degree = 2"):
        check_stacks(_job(), SimpleNamespace(ep=1, tp=2), model, muon_predicate([], model))
