"""On one GPU: the captured Muon step (``Muon(cuda_graph=True)``, DMuon's direct path).

Skipped cleanly without CUDA; run on one H100 or H200 (results in docs/benchmarks.md, "GPU
tests")."""

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
    """Train each config (``train_step``: forward, backward, step, ``zero_grad``). Before
    every odd step, spacers the size of each Muon matrix are allocated and kept, taking the
    blocks the gradients just freed (the allocator would otherwise hand them back to the
    next gradients): the captured step must follow the gradients elsewhere. Records the
    gradient addresses each matrix had over the run."""
    out = []
    for cfg in configs:
        model, optimizer = build_dmuon(cfg, world_size)
        spacers, addresses = [], {}
        for step in range(cfg.steps):
            if step % 2:
                spacers += [torch.empty_like(p) for p in optimizer.param_groups[0]["params"]]
            train_step_recording(cfg, model, optimizer, step, rank, world_size, addresses)
        record = optimizer.step_graph
        out.append(
            {
                "weights": dmuon.get_model_state_dict(model),  # (FSDP2's DTensors made whole)
                "direct": model._dmuon_state.direct,
                "warmed": record.warmed,
                "captures": record.captures,
                "replays": record.replays,
                "disabled": record.disabled,
                "held": len(record.params),
                "moved": min(len(seen) for seen in addresses.values()),
            }
        )
    return out


def train_step_recording(cfg, model, optimizer, step, rank, world_size, addresses) -> None:
    """:func:`train_step`, noting each Muon matrix's gradient address before the step."""
    original = optimizer.step

    def step_noting_addresses(*args, **kwargs):
        for p in optimizer.param_groups[0]["params"]:
            if p.grad is not None:
                addresses.setdefault(id(p), set()).add(p.grad.data_ptr())
        return original(*args, **kwargs)

    with mock.patch.object(optimizer, "step", step_noting_addresses):
        train_step(cfg, model, optimizer, step, rank, world_size)


def test_float64_masters_step_eagerly_and_equal_the_reference():
    """float64 on one GPU, 5 steps, Z3 and a tall/wide/square mix (the toy): float64 is not a
    dtype of the fused momentum kernel, which the captured step needs (it reads each gradient
    through an address slot), so nothing is captured; the weights equal the single-process
    reference within 1e-10 of the weight change. float32 masters with float64 NS (the
    kernel's output dtype) are not captured either."""
    exact = RunConfig(param_dtype=torch.float64, ns_dtype=torch.float64, device="cuda")
    graph, float64_ns = run_ranks(
        graph_and_eager, 1, [exact, with_(exact, param_dtype=torch.float32)], backend="nccl"
    )[0]
    assert graph["direct"] and not graph["warmed"] and graph["captures"] == 0
    assert float64_ns["direct"] and not float64_ns["warmed"] and float64_ns["captures"] == 0
    init = initial_state(exact)
    reference = train_reference(exact)
    assert max(relative_errors(graph["weights"], reference, init).values()) <= 1e-10


def captured_with_counted_updates(rank: int, world_size: int, configs: list[RunConfig]) -> list:
    """:func:`graph_and_eager`, counting the matrices the fused update kernels update by
    whether they read their scalars from device memory (the captured step's, one matrix per
    launch or a batch by table) or take Python floats, with the eager step's small matrices
    on the same per-matrix fused passes as the graph's (not grouped into foreach passes) and
    its NS on the graph's batches (a matrix with its transposes): both then run the same
    arithmetic on the same values."""
    from dmuon_titan.ops import fused
    from dmuon_titan.optim import passes

    launches = {True: 0, False: 0, "by_table": 0}

    class Counted:
        def __init__(self, kernel, by_table: bool) -> None:
            self.kernel, self.by_table = kernel, by_table

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.by_table:  # (grid: tiles, tiles, matrices)
                    launches[True] += grid[2]
                    launches["by_table"] += 1
                else:
                    launches[kwargs["SCALARS_ON_DEVICE"]] += 1
                return self.kernel[grid](*args, **kwargs)

            return launch

    def merged_chunks(self, todo, captured):  # (the captured step's NS batches, eagerly too)
        return chunks(self, todo, True)

    chunks = passes.MatrixStep.chunks
    with (
        mock.patch.object(passes.MatrixStep, "chunks", merged_chunks),
        mock.patch.object(fused, "_update_kernel", Counted(fused._update_kernel, False)),
        mock.patch.object(fused, "_update_table_kernel", Counted(fused._update_table_kernel, True)),
        mock.patch.object(passes, "GROUPED_PASS_NUMEL", 0),
    ):
        runs = graph_and_eager(rank, world_size, configs)
    return [runs, launches]


def test_captured_step_takes_the_fused_passes_in_float32():
    """float32 masters and NS (the kernels' dtypes): captured once after the first step,
    replayed for the other four, while the gradients move between steps (read through the
    address table); every matrix is updated by a fused kernel reading lr and decay from
    device scalars (the first, eager step and the capture: twice per matrix), by batches of
    one shape (the step's tables; the toy's 4 runs of one shape, the tall and wide FFN
    matrices in one chunk). Its weights equal those of the eager step on the same
    arithmetic within 1e-6 of the weight change (a stale gradient or scalar would be off by
    far more), and the single-process float32 reference's within 1e-4."""
    cfg = RunConfig(param_dtype=torch.float32, ns_dtype=torch.float32, device="cuda")
    (graph, eager), launches = run_ranks(
        captured_with_counted_updates, 1, [cfg, with_(cfg, cuda_graph=False)], backend="nccl"
    )[0]
    assert graph["captures"] == 1 and graph["replays"] == cfg.steps - 1
    assert not graph["disabled"] and eager["replays"] == 0
    assert graph["moved"] >= 2, graph["moved"]  # (every matrix's gradient moved at least once)
    assert graph["held"] > 0 and launches[True] == 2 * graph["held"], (graph["held"], launches)
    assert launches["by_table"] == 2 * 4, launches
    init = initial_state(cfg)
    assert max(relative_errors(graph["weights"], eager["weights"], init).values()) <= 1e-6
    reference = train_reference(cfg, ns_precision="float32")
    assert max(relative_errors(graph["weights"], reference, init).values()) <= 1e-4


def test_a_clip_deferred_to_the_captured_step_changes_no_bit():
    """float32, every step's gradients clipped (``max_norm`` far below their norm): the
    captured step multiplying each gradient by the clip's factor as its momentum pass reads
    it (``clip_grad_norm_(defer_owned=True)``) gives the weights of clipping in place, bit
    for bit (the product is rounded on its own, not contracted), captured once and replayed
    for the rest while the gradients move."""
    cfg = RunConfig(param_dtype=torch.float32, ns_dtype=torch.float32, device="cuda", max_norm=1e-3)
    clipped, deferred = run_ranks(
        graph_and_eager, 1, [cfg, with_(cfg, defer_clip=True)], backend="nccl"
    )[0]
    assert deferred["captures"] == 1 and deferred["replays"] == cfg.steps - 1
    assert clipped["captures"] == 1 and deferred["moved"] >= 2
    init = initial_state(cfg)
    assert any(not torch.equal(deferred["weights"][k].cpu(), init[k].cpu()) for k in init)
    assert all(torch.equal(clipped["weights"][k], deferred["weights"][k]) for k in init)


def on_lanes(rank: int, world_size: int, configs: list[RunConfig]) -> list:
    """:func:`graph_and_eager` of ``configs[0]`` with the captured step's chunks on one
    stream, then on two (``captured.STEP_LANES``), counting per setting the chunks put on a side
    stream while the step is captured and while it is not."""
    from dmuon_titan.optim import captured

    runs, counts = [], []
    lanes = captured.CapturedStep.lane_streams

    def counted_lanes(self, ctx, chunks):
        streams = lanes(self, ctx, chunks)
        key = "captured" if torch.cuda.is_current_stream_capturing() else "eager"
        counts[-1][key] += sum(s is not None for s in streams)
        return streams

    for count in (1, 2):
        counts.append({"captured": 0, "eager": 0})
        with (
            mock.patch.object(captured, "STEP_LANES", count),
            mock.patch.object(captured.CapturedStep, "lane_streams", counted_lanes),
        ):
            runs += graph_and_eager(rank, world_size, configs[:1])
    return [runs, counts]


def test_the_captured_step_on_two_streams_changes_no_bit():
    """float32, the toy's chunks (its attention matrices, its FFN matrices with their
    transposes): on two streams (``STEP_LANES = 2``; the capture puts a chunk on the side
    stream, the eager first step none) the weights after 5 steps equal those of the
    one-stream step bit for bit, captured once and replayed for the rest while the
    gradients move."""
    cfg = RunConfig(param_dtype=torch.float32, ns_dtype=torch.float32, device="cuda")
    (one, two), counts = run_ranks(on_lanes, 1, [cfg], backend="nccl")[0]
    assert counts[0] == {"captured": 0, "eager": 0}, counts
    assert counts[1]["captured"] >= 1 and counts[1]["eager"] == 0, counts
    for run in (one, two):
        assert run["captures"] == 1 and run["replays"] == cfg.steps - 1
    init = initial_state(cfg)
    assert any(not torch.equal(two["weights"][k].cpu(), init[k].cpu()) for k in init)
    assert all(torch.equal(one["weights"][k], two["weights"][k]) for k in init)


#: GPU cycles each replay is held back by (≈ 200 ms): a read or write that does not wait for
#: the step in flight then sees the old matrices, and a gradient zeroed or overwritten after
#: the step but not queued behind it is changed before the replay reads it
DELAY_CYCLES = 400_000_000
#: after these steps, at once (each after a step that nothing else waited for; steps 2 and 8
#: have none, so that their ``zero_grad`` and scribble come right after the step): the
#: parameters read directly after ``wait_all_replicate_broadcasts`` (a loop of one's own, an
#: EMA say), a no-grad forward (an evaluation), the model's own ``state_dict()``, the
#: optimizer state dict (the state-dict function); after the last step, the weights (the
#: state-dict function)
MIRROR_STEP, LOGITS_STEP, STATE_DICT_STEP, MOMENTA_STEP = 3, 4, 5, 6
#: NaN tensors per Muon matrix written after a ``zero_grad``: enough to take every free
#: block of its size (best fit may hand out others of the same size before the one just
#: freed: one scribble per matrix went unseen on an H200)
SCRIBBLES = 32


def local(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 DTensor's local tensor (on one rank: the whole), a tensor as it is; read
    where the test takes it, and comparable after the process group is gone."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def delayed_step_work(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """Train with every graph replay held back on its stream. Even steps: forward, backward,
    step, ``zero_grad`` (in place at step 2, else dropping the gradients), then a
    scribble: NaN tensors the size of each Muon matrix (``SCRIBBLES`` each), allocated and
    written on the compute stream, as the next step's first allocations are before its
    forward waits (they must not get the dropped gradients' blocks while the replay is still
    to read them). Odd steps: forward, ``zero_grad``, backward, step. Nothing else waits in between: each loss is read
    by the next forward alone. Right after some steps one reader each (``*_STEP``)."""
    replay = torch.cuda.CUDAGraph.replay

    def delayed_replay(graph) -> None:
        torch.cuda._sleep(DELAY_CYCLES)
        replay(graph)

    # The first launch of a kernel loads its module (CUDA's lazy loading), which may
    # synchronize the whole device and so hide a missing wait (on an H200, 2026-12-02, a wait
    # taken out went unnoticed until these kernels were loaded first): the fill kernels the
    # loop's zeroing and scribbles launch are loaded here.
    for dtype in {cfg.param_dtype for cfg in configs}:
        torch.ones(1, dtype=dtype, device=configs[0].device).zero_().fill_(float("nan"))
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    out = []
    with mock.patch.object(torch.cuda.CUDAGraph, "replay", delayed_replay):
        for cfg in configs:
            model, optimizer = build_dmuon(cfg, world_size)
            matrices = optimizer.param_groups[0]["params"]
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
                    optimizer.zero_grad(set_to_none=step != 2)
                    scribbles = [
                        torch.full_like(p, float("nan")) for p in matrices for _ in range(SCRIBBLES)
                    ]
                    del scribbles
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
    """``async_step``: the captured step replayed on a side stream, each replay held back
    (≈ 200 ms) on the GPU. The next forward's losses, the parameters read after
    ``wait_all_replicate_broadcasts``, a no-grad forward right after a step, the gradients
    the replay reads after a ``zero_grad`` in place or a dropping one followed by new
    allocations, ``model.state_dict()``, the optimizer state dict and the weights read by the
    state-dict functions right after a step are bitwise those of replays on the current
    stream. (``scripts/run/check_async_step_waits.sh`` re-runs it with each wait or
    stream mark taken out: each must fail.)"""
    cfg = RunConfig(ns_dtype=torch.bfloat16, device="cuda", steps=10)
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


def forward_wait_counts(rank: int, world_size: int, configs: list[RunConfig]) -> list[list[int]]:
    """After some steps, the waits on the step's event each forward asks of the GPU
    (``wait_event``; FSDP2's own waits, several a forward, are not counted)."""
    cfg = configs[0]
    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(3):
        train_step(cfg, model, optimizer, step, rank, world_size)
    tokens = batch(cfg, 0).to(cfg.device)
    waits = []
    original = torch.cuda.Stream.wait_event

    def counted(stream, event):
        waits[-1] += event is optimizer.step_graph.done
        return original(stream, event)

    side = torch.cuda.Stream()
    with mock.patch.object(torch.cuda.Stream, "wait_event", counted), torch.no_grad():
        for stream in (None, None, side, None):
            waits.append(0)
            with (
                torch.cuda.stream(stream)
                if stream is not None
                else torch.cuda.stream(torch.cuda.current_stream())
            ):
                model(tokens)
    torch.cuda.synchronize()
    return [waits]


def test_a_forward_waits_for_the_step_in_flight_once_per_stream():
    """The root and every block of the forward ask to wait for the asynchronous step; the
    GPU is asked once per stream and replay: once after a step, not again in a second
    forward on that stream, once on another stream, once more back on the first (its
    wait was recorded for the other)."""
    cfg = RunConfig(ns_dtype=torch.bfloat16, device="cuda", steps=3)
    (counts,) = run_ranks(forward_wait_counts, 1, [cfg], backend="nccl")[0]
    assert counts == [1, 0, 1, 1]


def step_wait_hooks(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict]:
    """The boundaries' step-wait hooks (DMuon's own, per boundary) and whether they are
    armed: after a forward that found the step done, right after a step held in flight
    (``torch.cuda._sleep`` queued before it on the compute stream, which the replay's stream
    follows), after a forward while it is still in flight, and after one once it is done."""
    cfg = configs[0]
    model, optimizer = build_dmuon(cfg, world_size)
    state = model._dmuon_state

    def seen() -> tuple[list[int], bool]:
        return [len(g.hook_handles) for g in state.groups], state.step_waits_armed

    for step in range(3):
        train_step(cfg, model, optimizer, step, rank, world_size)
    tokens = batch(cfg, 0).to(cfg.device)
    torch.cuda.synchronize()
    out = {}
    with torch.no_grad():
        model(tokens)
    out["done"] = seen()
    loss_fn(model(tokens), tokens).backward()
    torch.cuda._sleep(400_000_000)  # (about 0.2 s of the GPU's clock)
    optimizer.step()
    out["in flight"] = (*seen(), optimizer.step_graph.in_flight())
    with torch.no_grad():
        model(tokens)
    out["forward in flight"] = seen()
    torch.cuda.synchronize()
    with torch.no_grad():
        model(tokens)
    out["forward after"] = seen()
    return [out]


def test_the_blocks_wait_for_the_step_only_while_it_is_in_flight():
    """One GPU, asynchronous captured step: the boundaries hold no hook of DMuon's while no
    step is in flight (their modules take nn.Module's plain call path: validation's
    forwards), one wait each from a step still running until a forward of the model finds
    it done."""
    cfg = RunConfig(ns_dtype=torch.bfloat16, device="cuda", steps=3)
    (out,) = run_ranks(step_wait_hooks, 1, [cfg], backend="nccl")[0]
    n = len(out["done"][0])
    assert n > 0
    assert out["done"] == ([0] * n, False)
    assert out["in flight"] == ([1] * n, True, True)
    assert out["forward in flight"] == ([1] * n, True)
    assert out["forward after"] == ([0] * n, False)


def dropped_optimizer(rank: int, world_size: int, configs: list[RunConfig]) -> list[tuple]:
    """An optimizer dropped right after a step held in flight (``torch.cuda._sleep`` queued
    before it on the compute stream, which the replay's stream follows), then a forward with
    nothing else in between: whether the step was in flight, and whether that forward's
    logits equal those of a forward after the GPU is done (it read the updated weights)."""
    import gc

    cfg = configs[0]
    model, optimizer = build_dmuon(cfg, world_size)
    for step in range(3):
        train_step(cfg, model, optimizer, step, rank, world_size)
    tokens = batch(cfg, 0).to(cfg.device)
    torch.cuda.synchronize()
    loss_fn(model(tokens), tokens).backward()
    torch.cuda._sleep(400_000_000)  # (about 0.2 s of the GPU's clock)
    optimizer.step()
    in_flight = optimizer.step_graph.in_flight()
    optimizer.zero_grad()
    del optimizer
    gc.collect()
    with torch.no_grad():
        racing = model(tokens).float()
        torch.cuda.synchronize()
        settled = model(tokens).float()
    return [(in_flight, torch.equal(racing, settled))]


def test_a_dropped_optimizer_leaves_its_step_in_flight_waited_for():
    """One GPU, asynchronous captured step: the optimizer dropped while its replay runs,
    the next forward still waits for the replay (the model holds the step graph until a
    forward finds it done)."""
    cfg = RunConfig(ns_dtype=torch.bfloat16, device="cuda", steps=3)
    (out,) = run_ranks(dropped_optimizer, 1, [cfg], backend="nccl")[0]
    assert out == (True, True)


def test_qk_clip_after_the_asynchronous_captured_step():
    """float32, QK-clip at a threshold every step clips, lr 0.2 (the toy's logits grow): the
    rescale is queued on the captured step's side stream (``async_step``) behind the replay
    and lands before the next forward's broadcasts. Captured once and replayed for the
    rest, the weights equal those of the same captured step replayed on the current stream
    (the clip after it there) within 1e-7 of the weight change, or twice what two eager runs
    differ by (the forward and backward kernels' own nondeterminism), the eager step's within
    1e-5 (the fused passes' rounding, carried through 5 steps at this learning rate: 3e-6
    on an H100) and the single-process float32 reference with the clip written out within
    1e-4, and differ from the run without the clip."""
    cfg = RunConfig(
        param_dtype=torch.float32, ns_dtype=torch.float32, device="cuda", lr=0.2, qk_clip=0.4
    )
    eager_cfg = with_(cfg, cuda_graph=False)
    graph, current, eager, eager_again, unclipped = run_ranks(
        graph_and_eager,
        1,
        [cfg, with_(cfg, async_step=False), eager_cfg, eager_cfg, with_(cfg, qk_clip=None)],
        backend="nccl",
    )[0]
    assert graph["captures"] == 1 and graph["replays"] == cfg.steps - 1
    assert current["captures"] == 1
    init = initial_state(cfg)
    floor = max(relative_errors(eager["weights"], eager_again["weights"], init).values())
    drift = max(relative_errors(graph["weights"], current["weights"], init).values())
    assert drift <= max(1e-7, 2 * floor), (drift, floor)
    assert max(relative_errors(graph["weights"], eager["weights"], init).values()) <= 1e-5
    assert max(relative_errors(unclipped["weights"], graph["weights"], init).values()) > 1e-3
    reference = train_reference(cfg, ns_precision="float32")
    assert max(relative_errors(graph["weights"], reference, init).values()) <= 1e-4
