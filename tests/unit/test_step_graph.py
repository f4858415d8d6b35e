"""The captured Muon step (``Muon(cuda_graph=True)``, one rank on a GPU).

On CPU the graph mechanics are stood in for (a "graph" whose replay re-runs the recorded
step, after checking that the gradient table holds the current gradients' addresses), so
what is tested here is everything else: the step the graph records (every matrix by its own
passes, lr-dependent factors from device scalars) equals the eager step, an LR schedule
reaches it through the scalars, new gradients every step are followed through the table
without a recapture, and moved matrices trigger one. The real capture runs in the GPU test
(tests/distributed/test_gpu_one.py)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

import dmuon_titan as dmuon
from dmuon_titan import fused, step_graph
from dmuon_titan.optim.captured import CapturedStep
from dmuon_titan.optim.muon import Muon
from tests.helpers.models import ToyTransformer, dedicated_predicate, loss_fn


class _ReplayedBody:
    """A stand-in for ``torch.cuda.CUDAGraph``: replay runs the recorded body again (whose
    eager passes read ``p.grad``, where the kernels read the table: so the table is checked
    to point at those same gradients, and the tables of matrices and momentum buffers at
    those of ``optimizer``)."""

    def __init__(self, body, owner, optimizer) -> None:
        self.body, self.owner, self.optimizer = body, owner, optimizer

    def replay(self) -> None:
        scalars = self.owner.scalars
        assert scalars.gradients.tolist() == [p.grad.data_ptr() for p in self.owner.params]
        assert scalars.params.tolist() == [p.data_ptr() for p in self.owner.params]
        buffers = [self.optimizer.state[p]["momentum_buffer"] for p in self.owner.params]
        assert scalars.buffers.tolist() == [b.data_ptr() for b in buffers]
        assert all(scalars.gradient_slot(p).item() == p.grad.data_ptr() for p in self.owner.params)
        self.body(scalars)


@contextlib.contextmanager
def _stand_in_graph(graph: bool, optimizer: Muon):
    """``optimizer``'s step captured by the stand-in graph (``graph``: on CPU, every step
    eligible), or eager."""
    eligible = mock.patch.object(CapturedStep, "eligible", lambda self, ctx, todo: bool(todo))
    capture = mock.patch.object(
        step_graph.MuonStepGraph,
        "_capture",
        lambda self, body: _ReplayedBody(body, self, optimizer),
    )
    # (the usual step's short checks ask for the Triton kernels, which CPU tensors never run)
    kernels = mock.patch.object(fused, "enabled", lambda: True)
    with (
        eligible if graph else contextlib.nullcontext(),
        kernels if graph else contextlib.nullcontext(),
        capture,
    ):
        yield


def _train(
    cpu_mesh,
    graph: bool,
    steps: int = 4,
    keep_grads: bool = True,
    freeze_at=None,
    dtype=torch.float64,
    adjust_lr_fn="match_rms_adamw",
    misalign_at=None,
):
    torch.manual_seed(0)
    model = ToyTransformer().to(dtype)
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=dtype, adjust_lr_fn=adjust_lr_fn)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    with _stand_in_graph(graph, optimizer):
        for step in range(steps):
            if step == freeze_at:  # one dedicated matrix stops training
                model.layers[0].attention.wq.weight.requires_grad_(False)
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            loss_fn(model(tokens), tokens).backward()
            if step == misalign_at:  # one gradient moved off 16-byte alignment, same values
                w2 = model.layers[1].feed_forward.w2.weight
                storage = torch.empty(w2.numel() + 1, dtype=dtype)
                w2.grad = storage[1:].view_as(w2).copy_(w2.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_grads)
            schedule.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, optimizer.step_graph


def test_captured_step_equals_the_eager_step_and_follows_the_lr_schedule(cpu_mesh):
    eager, _ = _train(cpu_mesh, graph=False)
    graphed, record = _train(cpu_mesh, graph=True)
    # first step eager (warm-up), then one capture, replayed for the rest
    assert record.warmed and record.captures == 1 and record.replays == 3
    worst = max((eager[k] - graphed[k]).abs().max().item() for k in eager)
    assert worst <= 1e-14, worst  # (multiply-then-add vs the fused update: last-bit rounding)


_TABLE_PASSES_INTERPRETED = """
import os, tempfile
from unittest import mock
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from dmuon_titan import fused
from tests.unit.test_step_graph import _train

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
batched = []
original = fused.momentum_directions_by_table

def counted(grads, buffers, out, *args, **kwargs):
    batched.append(tuple(out.shape))
    return original(grads, buffers, out, *args, **kwargs)

on_cpu = lambda device, *dtypes: all(d == torch.float32 for d in dtypes)
cases = [("original", {}), ("match_rms_adamw", {}), ("original", {"freeze_at": 2, "keep_grads": False}),
         ("original", {"misalign_at": 2})]
for adjust, kind in cases:
    runs = {}
    for tables in (False, True):
        batched.clear()
        with (
            mock.patch.object(fused, "table_passes_run", on_cpu if tables else lambda *a: False),
            mock.patch.object(fused, "momentum_directions_by_table", counted),
        ):
            runs[tables] = _train(mesh, True, dtype=torch.float32, adjust_lr_fn=adjust, **kind)
    (per_matrix, _), (by_table, record) = runs[False], runs[True]
    worst = max((per_matrix[k] - by_table[k]).abs().max().item() for k in per_matrix)
    assert worst <= 1e-6, (adjust, kind, worst)
    eager, _ = _train(mesh, graph=False, dtype=torch.float32, adjust_lr_fn=adjust, **kind)
    assert max((eager[k] - by_table[k]).abs().max().item() for k in eager) <= 1e-6, kind
    # per step: the toy's 3x (wq, wo) 32x32, 3x (wk, wv) 16x32, then 3x (w1, w3) 48x32 and
    # 3x w2 32x48 in one chunk, two runs; 4 steps (the first eager, 3 replays)
    every_step = [(6, 32, 32), (6, 16, 32), (6, 48, 32), (3, 32, 48)]
    if not kind:
        assert record.captures == 1 and record.replays == 3, kind
        assert batched == every_step * 4, batched
    elif "freeze_at" in kind:  # layer 0's wq stops: recaptured with new tables (and layer
        # 0's wk now comes first)
        assert record.captures == 2 and record.replays == 3, kind
        frozen = [(6, 16, 32), (5, 32, 32), *every_step[2:]]
        assert batched == every_step * 2 + frozen * 2, batched
    else:  # a gradient of the FFN chunk misaligned from step 2 on: that chunk per matrix
        assert record.captures == 2 and record.replays == 3, kind
        assert batched == every_step * 2 + every_step[:2] * 2, batched
    if adjust == "original" and not kind:
        plain_tables = by_table
# The partial sums of squares for NS's norm (asked for where NS folds, which on CPU it does
# not: asked for here by a stand-in), one row per matrix across the chunk's runs: each row
# sums to the squares of that matrix's direction as NS receives it; NS ignores them here.
from dmuon_titan import newton_schulz
checked = []
orthogonalize = newton_schulz.orthogonalize

def checking(batch, *args, squares=None, **kwargs):
    if squares is not None:
        want = batch.double().square().sum((-2, -1)).reshape(-1)
        checked.append(torch.allclose(squares.double().sum(1), want, rtol=1e-6, atol=0))
    return orthogonalize(batch, *args, squares=squares, **kwargs)

with (
    mock.patch.object(fused, "table_passes_run", on_cpu),
    mock.patch.object(newton_schulz, "uses_squares", lambda *a: True),
    mock.patch.object(newton_schulz, "orthogonalize", checking),
):
    with_squares, _ = _train(mesh, True, dtype=torch.float32, adjust_lr_fn="original")
assert len(checked) == 12 and all(checked), checked  # 3 chunks a step (one of two runs), 4 steps
assert all(torch.equal(with_squares[k], plain_tables[k]) for k in plain_tables)
print("tables ok")
"""


@pytest.mark.skipif(fused.triton is None, reason="needs Triton")
def test_captured_step_by_table_passes_in_the_triton_interpreter():
    """The captured step's batched passes (one launch per run of one shape, the matrices,
    buffers and gradients read through the step's tables), run by Triton's interpreter on
    CPU through the stand-in graph: the toy's tall and wide FFN matrices in one chunk (two
    runs, the tall one written transposed), lr adjusted per shape both ways; a recapture
    (new tables); a gradient off 16-byte alignment (recaptured, its chunk by per-matrix
    passes from then on). The weights those of the per-matrix passes and of the eager step
    within 1e-6 (float32; the kernel rounds the update once)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _TABLE_PASSES_INTERPRETED],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tables ok" in result.stdout, result.stdout


def test_moved_gradients_recapture_then_give_up(cpu_mesh):
    """Fresh gradient tensors every step (the CPU allocator does not hand the same blocks
    back): a capture per step up to the limit, then the eager path for good, same result."""
    seen = set()
    original = step_graph.MuonStepGraph._key

    def moving_key(group, params, buffers):
        seen.add(len(seen))
        return (*original(group, params, buffers), len(seen))  # never the same twice

    with mock.patch.object(step_graph.MuonStepGraph, "_key", staticmethod(moving_key)):
        graphed, record = _train(cpu_mesh, graph=True, steps=8)
    assert record.captures == step_graph.MAX_RECAPTURES + 1 and record.disabled
    eager, _ = _train(cpu_mesh, graph=False, steps=8)
    assert max((eager[k] - graphed[k]).abs().max().item() for k in eager) <= 1e-14


def test_a_cpu_model_is_not_eligible(cpu_mesh):
    """The real eligibility check (no stand-in): a CPU model steps eagerly."""
    _, record = _train(cpu_mesh, graph=False, steps=2)
    assert not record.warmed and record.replays == 0


def test_new_gradients_every_step_are_read_through_the_table_without_a_recapture(cpu_mesh):
    """``zero_grad()`` (set_to_none, as torchtitan calls it) drops every gradient, so each
    backward makes new ones (the CPU allocator hands out new blocks): one capture, replayed
    every step, its table pointed at each step's gradients (checked in each replay); the
    weights equal the eager step's, and nothing keeps the gradients after ``zero_grad``."""
    graphed, record = _train(cpu_mesh, graph=True, steps=8, keep_grads=False)
    assert record.captures == 1 and record.replays == 7 and not record.disabled
    assert record.params and all(p.grad is None for p in record.params)
    eager, _ = _train(cpu_mesh, graph=False, steps=8, keep_grads=False)
    assert max((eager[k] - graphed[k]).abs().max().item() for k in eager) <= 1e-14


def test_the_usual_step_replays_after_the_short_checks_and_steps_alike(cpu_mesh):
    """From the first replay on, a step of the same matrices with new gradients takes
    ``CapturedStep.steady_paths`` (one pass over the matrices instead of the full eligibility checks,
    the chunking and the key): the same replays, the same weights as the eager step; a
    matrix left without a gradient sends the step back to the full checks."""
    taken = []
    original = CapturedStep.steady_paths

    def spy(self, ctx, state):
        out = original(self, ctx, state)
        taken.append(out is not None)
        return out

    with mock.patch.object(CapturedStep, "steady_paths", spy):
        graphed, record = _train(cpu_mesh, graph=True, steps=8, keep_grads=False)
    assert taken == [False, False] + [True] * 6  # (the eager first step, the capture)
    assert record.captures == 1 and record.replays == 7
    eager, _ = _train(cpu_mesh, graph=False, steps=8, keep_grads=False)
    assert max((eager[k] - graphed[k]).abs().max().item() for k in eager) <= 1e-14
    taken.clear()
    with mock.patch.object(CapturedStep, "steady_paths", spy):
        _, record = _train(cpu_mesh, graph=True, steps=6, keep_grads=False, freeze_at=4)
    assert taken == [False, False, True, True, False, False] and record.captures == 2


def test_a_matrix_without_a_gradient_is_skipped_as_torch_optim_skips_it(cpu_mesh):
    """A captured matrix frozen after the capture gets no gradient (``None`` after
    ``zero_grad``): it is left out of the step, as torch.optim skips it (stepping zeros would
    decay its momentum and weight), the others are captured again; the weights equal the
    eager run's, the frozen matrix unchanged from the freeze on."""
    graphed, record = _train(cpu_mesh, graph=True, steps=6, keep_grads=False, freeze_at=3)
    eager, _ = _train(cpu_mesh, graph=False, steps=6, keep_grads=False, freeze_at=3)
    assert record.captures == 2 and not record.disabled
    assert max((eager[k] - graphed[k]).abs().max().item() for k in eager) <= 1e-14
    frozen_at_3, _ = _train(cpu_mesh, graph=True, steps=3, keep_grads=False)
    key = "layers.0.attention.wq.weight"
    assert torch.equal(graphed[key], frozen_at_3[key])


class _CountingWait:
    """Stands in for a captured step in flight: counts the waits asked of it."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def test_zero_grad_in_place_waits_for_the_step_in_flight(cpu_mesh):
    """``async_step``: the step in flight reads the gradients, so zeroing them in place
    (``set_to_none=False``) first waits for it; dropping them does not need to (each replay
    marks its gradients as used by its stream)."""
    model = ToyTransformer().double()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    counter = _CountingWait()
    optimizer.step_graph.wait = counter.wait
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()  # (the forward waits too)
    before = counter.waits
    optimizer.zero_grad(set_to_none=False)
    assert counter.waits == before + 1
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.zero_grad()
    assert counter.waits == before + 1 and all(p.grad is None for p in model.parameters())


def test_the_blocks_wait_for_a_step_only_while_one_may_be_in_flight(cpu_mesh):
    """One rank (the direct path): the blocks hold no forward hook (nothing to bring in, and
    a hooked module takes nn.Module's slower call path) until a step is in flight; then each
    block waits for it before its forward, also run alone, until a forward of the model finds
    the step done; the model's forward always waits. The weights equal a run without the
    step in flight stood in for."""
    torch.manual_seed(0)
    model = ToyTransformer().double()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    state = model._dmuon_state
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    blocks = list(model.layers)

    def hooks() -> list[int]:
        return [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in blocks]

    assert hooks() == [2] * len(blocks)  # (before the first forward: not known to be direct)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()
    assert state.direct and hooks() == [0] * len(blocks)
    in_flight = _CountingWait()
    in_flight.in_flight = lambda: in_flight.running
    in_flight.running = False
    state.step_graphs.add(in_flight)
    optimizer.step()  # (nothing in flight after it: nothing armed)
    assert hooks() == [0] * len(blocks) and in_flight.waits == 0
    optimizer.zero_grad()
    loss_fn(model(tokens), tokens).backward()
    assert in_flight.waits == 1  # (the model's forward)
    in_flight.running = True  # (as an asynchronous replay just launched)
    optimizer.step()
    assert state.step_waits_armed and hooks() == [1] * len(blocks)

    def waits(run) -> int:
        before = in_flight.waits
        run()
        return in_flight.waits - before

    with torch.no_grad():
        hidden = model.tok_embeddings(tokens)
        assert waits(lambda: blocks[1](hidden)) == 1
        # (the root and every block; still in flight: still armed)
        assert waits(lambda: model(tokens)) == 1 + len(blocks)
        assert hooks() == [1] * len(blocks)
        in_flight.running = False
        assert waits(lambda: model(tokens)) == 1  # (the root finds it done: the blocks' go)
        assert hooks() == [0] * len(blocks) and not state.step_waits_armed
        assert waits(lambda: blocks[1](hidden)) == 0
        assert waits(lambda: model(tokens)) == 1

    torch.manual_seed(0)
    reference = ToyTransformer().double()
    dmuon.dedicate_params(reference, cpu_mesh, dedicated_predicate)
    reference_optimizer = dmuon.Muon(reference, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    for _ in range(2):
        loss_fn(reference(tokens), tokens).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    )


def test_a_compiled_block_waits_through_its_wrapper_before_other_hooks(cpu_mesh):
    """One rank, a block compiled without ``move_hooks_outside_compile``: its wait for a
    step in flight is armed on the ``torch.compile`` wrapper (a hook added inside the
    compiled region later would never run: torch.compile does not guard on hooks), ahead of
    a pre-hook registered on it before, and it waits when the block runs alone."""
    torch.manual_seed(0)
    model = ToyTransformer().double()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    state = model._dmuon_state
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    inner = model.layers[1]
    model.layers[1] = wrapper = torch.compile(inner, backend="eager")
    order = []
    wrapper.register_forward_pre_hook(lambda _m, _a: order.append("user"))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()
    in_flight = _CountingWait()
    in_flight.wait = lambda: (order.append("wait"), _CountingWait.wait(in_flight))
    state.step_graphs.add(in_flight)  # (no in_flight method: counts as in flight)
    optimizer.step()
    assert state.step_waits_armed
    assert len(inner._forward_pre_hooks) == 0 and len(wrapper._forward_pre_hooks) == 2
    order.clear()
    with torch.no_grad():
        wrapper(model.tok_embeddings(tokens))
    assert order == ["wait", "user"] and in_flight.waits == 1


def test_the_model_state_dict_waits_and_a_dropped_optimizer_lets_go_of_its_step(cpu_mesh):
    """``model.state_dict()`` and ``load_state_dict()`` wait for every step in flight; the
    model's record of the optimizers' steps is weak, so an optimizer dropped (rebuilt, say)
    is freed with its graph."""
    import gc

    model = ToyTransformer().double()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    state = model._dmuon_state
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    assert len(state.step_graphs) == 1
    in_flight = _CountingWait()
    state.step_graphs.add(in_flight)
    model.load_state_dict(model.state_dict())
    assert in_flight.waits == 2
    del optimizer
    gc.collect()
    assert list(state.step_graphs) == [in_flight]


def test_a_dropped_optimizer_leaves_its_step_in_flight_waited_for(cpu_mesh):
    """An optimizer dropped while its asynchronous step may still run (rebuilt between a
    step and the next forward, say): the model keeps its step graph, and its forwards keep
    waiting for it, until one finds it done (its record of the optimizers is weak: without
    that the forward would race the replay, and the gradients the replay reads would be
    freed). Then the graph goes with the optimizer."""
    import gc
    import weakref

    model = ToyTransformer().double()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()
    graph, running, waits = optimizer.step_graph, [True], [0]
    graph.in_flight = lambda: running[0]  # (as an asynchronous replay just launched)
    graph.wait = lambda: waits.__setitem__(0, waits[0] + 1)
    optimizer.step()
    waits[0] = 0  # (the step's own wait for the one before)
    held = weakref.ref(graph)
    del graph, optimizer
    gc.collect()
    assert held() is not None
    with torch.no_grad():
        model(tokens)
    assert waits[0] == 1 + len(model.layers)  # (the root and every block)
    running[0] = False
    with torch.no_grad():
        model(tokens)  # (finds it done: lets go of it)
    gc.collect()
    assert held() is None and waits[0] == 2 + len(model.layers)
    assert not model._dmuon_state.step_waits_armed


def _clipped_run(
    cpu_mesh,
    graph: bool,
    defer: bool,
    steps: int = 4,
    dtype=torch.float32,
    clips: int = 1,
    zero_grad: bool = True,
):
    """Train with every step's gradients clipped (``clips`` times) by a norm they exceed (so
    each clip scales), ``zero_grad`` after each step or not (gradients accumulate across
    steps); returns the weights, the clip norms and, per step, whether the owned gradients
    read the same after the clips as before them."""
    torch.manual_seed(0)
    model = ToyTransformer().to(dtype)
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(
        model, lr=0.02, adamw_lr=1e-3, ns_dtype=dtype, adjust_lr_fn="match_rms_adamw"
    )
    norms, untouched = [], []
    with _stand_in_graph(graph, optimizer):
        for step in range(steps):
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            loss_fn(model(tokens), tokens).backward()
            owned = [p for p in optimizer.param_groups[0]["params"] if p.grad is not None]
            before = [p.grad.clone() for p in owned]
            for _ in range(clips):
                norms.append(dmuon.clip_grad_norm_(model, 0.05, defer_owned=defer))
            untouched.append(
                all(torch.equal(b, p.grad) for b, p in zip(before, owned, strict=True))
            )
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, torch.stack(norms), untouched, optimizer.step_graph


def test_a_clip_deferred_to_the_step_gives_the_same_weights_bit_for_bit(cpu_mesh):
    """``clip_grad_norm_(defer_owned=True)`` on one rank: the owned gradients are left as they
    are, and the step multiplies them (the captured step as its momentum pass reads each one,
    the eager step first): the same norms and the same weights, bit for bit, as clipping them
    in place; the clip did scale (every norm above max_norm)."""
    for graph in (False, True):
        clipped, norms, untouched, _ = _clipped_run(cpu_mesh, graph, defer=False)
        deferred, deferred_norms, deferred_untouched, record = _clipped_run(
            cpu_mesh, graph, defer=True
        )
        assert bool((norms > 0.05).all()) and torch.equal(norms, deferred_norms)
        assert not any(untouched) and all(deferred_untouched)
        assert all(torch.equal(clipped[k], deferred[k]) for k in clipped), graph
        assert record.replays == (3 if graph else 0)


def test_a_deferred_clip_reaches_the_gradients_by_the_next_forward(cpu_mesh):
    """No step after the clip: the next forward multiplies the gradients (before any new one
    accumulates); ``zero_grad`` forgets the factor; where it cannot be deferred (float64
    gradients) the clip multiplies at once."""
    torch.manual_seed(0)
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32)
    state = model._dmuon_state
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()
    owned = optimizer.param_groups[0]["params"]
    before = [p.grad.clone() for p in owned]
    norm = dmuon.clip_grad_norm_(model, 0.05, defer_owned=True)
    factor = (0.05 / (norm + 1e-6)).clamp(max=1.0)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, owned, strict=True))
    with torch.no_grad():
        model(tokens)
    assert all(torch.equal(b * factor, p.grad) for b, p in zip(before, owned, strict=True))
    assert state.take_grad_scale() is None
    dmuon.clip_grad_norm_(model, 0.05, defer_owned=True)
    assert state.take_grad_scale() is not None  # (taken: pending no more)
    dmuon.clip_grad_norm_(model, 0.05, defer_owned=True)
    optimizer.zero_grad()
    assert state.take_grad_scale() is None
    double = ToyTransformer().double()
    dmuon.dedicate_params(double, cpu_mesh, dedicated_predicate)
    dmuon.Muon(double, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    loss_fn(double(tokens), tokens).backward()
    grads = [p.grad.clone() for p in double.parameters()]
    dmuon.clip_grad_norm_(double, 0.05, defer_owned=True)
    assert not any(torch.equal(g, p.grad) for g, p in zip(grads, double.parameters(), strict=True))
    assert double._dmuon_state.take_grad_scale() is None


def test_an_owed_clip_factor_is_settled_by_a_second_clip_and_by_the_next_forward(cpu_mesh):
    """The captured step leaves the factor owed: two clips before the step (the second's norm
    is of clipped gradients), and gradients kept across steps (the next forward multiplies
    them before backward accumulates into them), give the norms and weights of clipping in
    place, bit for bit, eager and captured."""
    for graph in (False, True):
        for kind in ({"clips": 2}, {"zero_grad": False}):
            clipped, norms, _, _ = _clipped_run(cpu_mesh, graph, defer=False, **kind)
            deferred, deferred_norms, _, _ = _clipped_run(cpu_mesh, graph, defer=True, **kind)
            assert torch.equal(norms, deferred_norms), (graph, kind)
            assert all(torch.equal(clipped[k], deferred[k]) for k in clipped), (graph, kind)


def test_an_owed_clip_factor_refuses_gradients_changed_meanwhile(cpu_mesh):
    """A gradient replaced, or changed in place, while it owes a clip factor cannot be
    multiplied as the clip would have: an error at the step or the next forward, naming it,
    never a silent difference; gradients dropped meanwhile owe nothing."""
    torch.manual_seed(0)
    model = ToyTransformer()
    dmuon.dedicate_params(model, cpu_mesh, dedicated_predicate)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    owned = optimizer.param_groups[0]["params"]
    loss_fn(model(tokens), tokens).backward()
    dmuon.clip_grad_norm_(model, 0.05, defer_owned=True)
    owned[0].grad = owned[0].grad.clone()
    with pytest.raises(RuntimeError, match="replaced or changed in place"):
        optimizer.step()
    optimizer.zero_grad()
    loss_fn(model(tokens), tokens).backward()
    dmuon.clip_grad_norm_(model, 0.05, defer_owned=True)
    model.zero_grad(set_to_none=False)  # (not the optimizer's: the factor stays owed)
    with pytest.raises(RuntimeError, match="defer_owned=True"):
        model(tokens)
    loss_fn(model(tokens), tokens).backward()
    dmuon.clip_grad_norm_(model, 0.05, defer_owned=True)
    model.zero_grad()  # dropped: nothing owes the factor
    model(tokens)
    assert all(p.grad is None for p in owned)
