"""On one GPU: the captured Muon step (``Muon(cuda_graph=True)``, DMuon's direct path).

Skipped cleanly without CUDA; run on one H200 (result in docs/benchmarks.md)."""

from unittest import mock

import pytest
import torch
from torch.distributed.tensor import DTensor

import dmuon_titan as dmuon

from ..helpers import relative_errors
from ..helpers.harness import run_ranks
from ..helpers.models import loss_fn
from ..helpers.training import (
    RunConfig,
    batch,
    build_dmuon,
    initial_state,
    train_reference,
    train_step,
    with_,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def graph_and_eager(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    out = []
    for cfg in configs:
        model, optimizer = build_dmuon(cfg, world_size)
        for step in range(cfg.steps):
            train_step(cfg, model, optimizer, step, rank, world_size)
        record = optimizer.step_graph
        out.append(
            {
                "weights": dmuon.get_model_state_dict(model),  # (FSDP2's DTensors made whole)
                "direct": model._dmuon_state.direct,
                "captures": record.captures,
                "replays": record.replays,
                "disabled": record.disabled,
                "held": len(record.params),
            }
        )
    return out


def test_captured_step_equals_the_reference_and_the_eager_step():
    """float64 on one GPU, 5 steps, Z3 and a tall/wide/square mix (the toy): with the graph
    (captured once after the first step, replayed for the other four) the weights equal the
    single-process reference within 1e-10 of the weight change, and the eager step's within
    1e-12."""
    exact = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64, device="cuda")
    graph, eager = run_ranks(
        graph_and_eager, 1, [exact, with_(exact, cuda_graph=False)], backend="nccl"
    )[0]
    assert graph["direct"] and graph["captures"] == 1 and graph["replays"] == 4
    assert not graph["disabled"] and eager["replays"] == 0
    init = initial_state(exact)
    reference = train_reference(exact)
    assert max(relative_errors(graph["weights"], reference, init).values()) <= 1e-10
    assert max(relative_errors(graph["weights"], eager["weights"], init).values()) <= 1e-12


def captured_with_counted_updates(rank: int, world_size: int, configs: list[RunConfig]) -> list:
    """:func:`graph_and_eager`, counting the fused update kernel's launches by whether they
    read their scalars from device memory (the captured step's) or take Python floats."""
    from dmuon_titan import fused

    kernel, launches = fused._update_kernel, {True: 0, False: 0}

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[kwargs["SCALARS_ON_DEVICE"]] += 1
                return kernel[grid](*args, **kwargs)

            return launch

    with mock.patch.object(fused, "_update_kernel", Counted()):
        runs = graph_and_eager(rank, world_size, configs)
    return [runs, launches]


def test_captured_step_takes_the_fused_passes_in_float32():
    """float32 masters and NS (the kernels' dtypes; float64 above runs eagerly): the captured
    step updates every matrix by the fused kernel reading lr and decay from device scalars
    (the first, eager step and the capture: two launches per matrix), and its weights equal
    the eager step's within float32 rounding (the eager step's foreach passes round the
    update in two steps, the kernel in one)."""
    cfg = RunConfig(param_dtype=torch.float32, ns_dtype=torch.float32, device="cuda")
    (graph, eager), launches = run_ranks(
        captured_with_counted_updates, 1, [cfg, with_(cfg, cuda_graph=False)], backend="nccl"
    )[0]
    assert graph["captures"] == 1 and graph["replays"] == cfg.steps - 1
    assert graph["held"] > 0 and launches[True] == 2 * graph["held"], (graph["held"], launches)
    init = initial_state(cfg)
    assert max(relative_errors(graph["weights"], eager["weights"], init).values()) <= 1e-4


#: GPU cycles each gradient zeroing is held back by (≈ 100 ms), and each replay by twice that:
#: a read or write that does not wait for the step in flight then sees the old matrices or
#: gradients yet to be zeroed, and a zeroing issued after the step but not queued behind it
#: runs before the replay reads the gradients
DELAY_CYCLES = 200_000_000
#: after these steps, at once (each after a step that nothing else waited for): the
#: parameters read directly after ``wait_all_replicate_broadcasts`` (a loop of one's own, an
#: EMA say), a no-grad forward (an evaluation), the model's own ``state_dict()``, the
#: optimizer state dict (the state-dict function); after the last step, the weights (the
#: state-dict function)
MIRROR_STEP, LOGITS_STEP, STATE_DICT_STEP, MOMENTA_STEP = 3, 4, 5, 6


def local(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 DTensor's local tensor (on one rank: the whole), a tensor as it is; read
    where the test takes it, and comparable after the process group is gone."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def delayed_step_work(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """Train with every graph replay and every in-place gradient zeroing held back on its
    stream. Even steps: forward, backward, step, ``zero_grad``; odd steps: forward,
    ``zero_grad``, backward, step. Nothing else waits in between: each loss is read by the
    next forward alone. Right after some steps one reader each (``*_STEP``)."""
    replay, zero = torch.cuda.CUDAGraph.replay, torch._foreach_zero_

    def delayed_replay(graph) -> None:
        torch.cuda._sleep(2 * DELAY_CYCLES)
        replay(graph)

    def delayed_zero(tensors) -> None:
        torch.cuda._sleep(DELAY_CYCLES)
        zero(tensors)

    # The first launch of a kernel loads its module (CUDA's lazy loading), which may
    # synchronize the whole device: without this, the first zeroing of the held gradients
    # (step 2) waited on the host for the replay, and a zeroing queued on the compute stream
    # went unseen on an H200 (seen since; docs/benchmarks.md, seventh session). Loaded
    # here, no launch in the loop below synchronizes.
    for dtype in {cfg.param_dtype for cfg in configs}:
        zero([torch.ones(1, dtype=dtype, device=configs[0].device)])
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    out = []
    with (
        mock.patch.object(torch.cuda.CUDAGraph, "replay", delayed_replay),
        mock.patch.object(torch, "_foreach_zero_", delayed_zero),
    ):
        for cfg in configs:
            model, optimizer = build_dmuon(cfg, world_size)
            probe = batch(cfg, 99).to(cfg.device)
            losses, record = [], {}
            for step in range(cfg.steps):
                tokens = batch(cfg, step).to(cfg.device)
                loss = loss_fn(model(tokens), tokens)
                losses.append(loss.detach().clone())
                if step % 2:
                    optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step == MIRROR_STEP:
                    dmuon.wait_all_replicate_broadcasts(model)
                    record["mirror"] = {
                        name: local(p).detach().clone() for name, p in model.named_parameters()
                    }
                elif step == LOGITS_STEP:
                    with torch.no_grad():
                        record["logits"] = model(probe).clone()
                elif step == STATE_DICT_STEP:
                    record["state_dict"] = {
                        k: local(v).clone() for k, v in model.state_dict().items()
                    }
                elif step == MOMENTA_STEP:
                    momenta = dmuon.get_optimizer_state_dict(model, optimizer)["state"]
                    record["momenta"] = {
                        k: local(v["momentum_buffer"]).clone()
                        for k, v in momenta.items()
                        if "momentum_buffer" in v
                    }
                if not step % 2:
                    optimizer.zero_grad()
            record["weights"] = dmuon.get_model_state_dict(model)
            record = {  # (to the host only now: a copy back waits for the whole GPU)
                k: v.cpu() if isinstance(v, torch.Tensor) else {n: t.cpu() for n, t in v.items()}
                for k, v in record.items()
            }
            graph = optimizer.step_graph
            out.append(
                {
                    "losses": torch.stack(losses).cpu(),
                    **record,
                    "side": graph.stream is not None,
                    "replays": graph.replays,
                }
            )
    return out


def test_the_asynchronous_step_is_waited_for_by_everything_that_reads_it():
    """``async_step``: the captured step replayed on a side stream, each replay (≈ 200 ms) and
    each zeroing of the held gradients (≈ 100 ms) held back on the GPU. The next forward's
    losses, the parameters read after ``wait_all_replicate_broadcasts``, a no-grad forward
    right after a step, the backward after a ``zero_grad`` issued between forward and
    backward, ``model.state_dict()``, the optimizer state dict and the weights read by the
    state-dict functions right after a step are bitwise those of replays on the current
    stream. (``scripts/run/check_async_step_waits.sh`` re-runs it with each
    wait taken out: each must fail.)"""
    cfg = RunConfig(ns_dtype=torch.bfloat16, device="cuda", steps=8)
    overlapped, inline = run_ranks(
        delayed_step_work, 1, [cfg, with_(cfg, async_step=False)], backend="nccl"
    )[0]
    assert overlapped["side"] and not inline["side"]
    assert overlapped["replays"] == inline["replays"] == cfg.steps - 1
    assert torch.equal(overlapped["losses"], inline["losses"])
    assert torch.equal(overlapped["logits"], inline["logits"])
    assert len(inline["momenta"]) == 21
    for kind in ("mirror", "state_dict", "momenta", "weights"):
        assert overlapped[kind].keys() == inline[kind].keys()
        for key, value in inline[kind].items():
            assert torch.equal(overlapped[kind][key], value), (kind, key)


def test_shared_newton_schulz_in_bfloat16_on_the_gpu():
    """The math of a tensor-parallel row's shared Newton–Schulz (``tp_ns="shared"``; four
    ranks stood in for by threads) on CUDA in bf16, llama-like wide and tall shapes: its
    distance from float64 NS is within 1.25× the whole-matrix bf16 NS's (cuBLAS's rounding,
    which the CPU unit test does not see)."""
    from dmuon_titan import newton_schulz as ns

    from ..unit.test_shared_newton_schulz import shared_orthogonalize

    generator = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((1024, 4096), (2816, 1024)):
        matrix = torch.randn(shape, device="cuda", generator=generator)
        exact = ns.zeropower_via_newtonschulz(
            matrix.double(), (ns.JORDAN_COEFFICIENTS,), 5, 1e-7, dtype=torch.float64
        )
        whole = ns.zeropower_via_newtonschulz(matrix, (ns.JORDAN_COEFFICIENTS,), 5, 1e-7)
        shared, _ = shared_orthogonalize(matrix, 4, torch.bfloat16)
        whole_error = ((whole.double() - exact).norm() / exact.norm()).item()
        shared_error = ((shared.double() - exact).norm() / exact.norm()).item()
        assert shared_error <= 1.25 * whole_error, (shape, shared_error, whole_error)
