"""The fused momentum and update passes: eager path bitwise equal to the unfused formulas;
Triton kernels (CUDA only, skipped without) equal to the eager path up to fp32 rounding."""

import functools

import pytest
import torch

from dmuon_titan import fused

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused.enabled()), reason="needs CUDA and Triton"
)


def _tensors(shape, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    grad = torch.randn(shape, generator=gen, device=device)
    buffer = torch.randn(shape, generator=gen, device=device)
    return grad, buffer


def _direction_out(layout: str) -> torch.Tensor:
    """An empty 1031×517 bf16 NS input: contiguous, or a wide buffer seen tall."""
    return (
        torch.empty(517, 1031, dtype=torch.bfloat16, device="cuda").mT
        if layout == "transposed_out"
        else torch.empty(1031, 517, dtype=torch.bfloat16, device="cuda")
    )


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_momentum_is_the_unfused_formula(nesterov, dtype):
    grad, buffer = _tensors((37, 53), "cpu")
    ref_buffer = buffer.clone()
    ref_buffer.lerp_(grad, 1 - 0.95)  # torch.optim.Muon's momentum step, by hand
    expected = (grad.lerp(ref_buffer, 0.95) if nesterov else ref_buffer).to(dtype)
    out = torch.empty(grad.shape, dtype=dtype)
    fused.momentum_direction_into(grad, buffer, out, 0.95, nesterov)
    assert torch.equal(buffer, ref_buffer)
    assert torch.equal(out, expected)


def test_eager_update_is_mul_then_add():
    param, _ = _tensors((37, 53), "cpu")
    update = torch.randn(53, 37).to(torch.bfloat16).mT  # a transposed view, as NS returns
    expected = param.clone().mul_(0.999).add_(update, alpha=-0.02)
    fused.decay_and_update_(param, update, 0.999, 0.02)
    assert torch.equal(param, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_update_by_device_scalars(dtype):
    """The captured step's form (decay and step as 0-d tensors, read at run time): multiply,
    then subtract the step's own product, in the parameter's dtype (a bf16 update is not
    rounded to bf16 with the step); within one rounding of the Python-float path, whose
    ``add_`` may fuse the product."""
    param, _ = _tensors((37, 53), "cpu")
    update = torch.randn(53, 37).to(dtype).mT
    expected = param.clone().mul_(0.999).sub_(update.float() * 0.0213)
    by_floats = param.clone()
    fused.decay_and_update_(by_floats, update, 0.999, 0.0213)
    fused.decay_and_update_(param, update, torch.tensor(0.999), torch.tensor(0.0213))
    assert torch.equal(param, expected)
    torch.testing.assert_close(param, by_floats, rtol=2e-7, atol=1e-8)


@cuda
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("momentum", [0.95, 0.0, 0.3])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_momentum_kernel_matches_eager(nesterov, dtype, momentum, param_dtype):
    grad, buffer = _tensors((1023, 4099), "cuda")  # not a multiple of the block
    grad, buffer = grad.to(param_dtype), buffer.to(param_dtype)
    ref_buffer = buffer.clone()
    ref_out = torch.empty(grad.shape, dtype=dtype, device="cuda")
    out = torch.empty_like(ref_out)
    fused.momentum_direction_into(grad, buffer, out, momentum, nesterov)
    # the eager path, by hand (fused.momentum_direction_into would take the kernel)
    ref_buffer.lerp_(grad, 1 - momentum)
    ref_out.copy_(grad.lerp(ref_buffer, momentum) if nesterov else ref_buffer)
    if param_dtype == torch.float32:
        torch.testing.assert_close(buffer, ref_buffer, rtol=2e-7, atol=1e-7)
        mismatched = (out != ref_out).float().mean().item()
        assert mismatched < 1e-3  # only where fp32 rounding crosses a rounding boundary
    else:  # bf16 state: both round the buffer to bf16; eager also rounds the direction to it
        mismatched = (buffer != ref_buffer).float().mean().item()
        assert mismatched < 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-6)


@cuda
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_momentum_kernel_into_a_transposed_view_is_the_contiguous_one(nesterov, param_dtype):
    """The tiled pass for a strided output (a tall matrix's NS input laid out wide) writes
    what the contiguous pass writes, bit for bit, and updates the buffer alike."""
    grad, buffer = _tensors((1031, 517), "cuda")  # tall, not tile multiples
    grad, buffer = grad.to(param_dtype), buffer.to(param_dtype)
    ref_buffer = buffer.clone()
    expected = torch.empty(grad.shape, dtype=torch.bfloat16, device="cuda")
    fused.momentum_direction_into(grad, ref_buffer, expected, 0.95, nesterov)
    wide = torch.empty(517, 1031, dtype=torch.bfloat16, device="cuda")
    fused.momentum_direction_into(grad, buffer, wide.mT, 0.95, nesterov)
    assert torch.equal(buffer, ref_buffer)
    assert torch.equal(wide.mT, expected)


@cuda
@pytest.mark.parametrize("layout", ["contiguous", "transposed_out"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_momentum_kernel_reads_the_gradient_through_its_address(layout, param_dtype):
    """``grad_address`` (a captured step's gradient table): the kernel reads the gradient at
    the address in the slot, not the tensor passed as ``grad`` (here a decoy of the same
    shape), and writes bit for bit what it writes given the gradient itself."""
    grad, buffer = (t.to(param_dtype) for t in _tensors((1031, 517), "cuda"))
    decoy = torch.full_like(grad, float("nan"))

    out = functools.partial(_direction_out, layout)

    expected, expected_buffer = out(), buffer.clone()
    fused.momentum_direction_into(grad, expected_buffer, expected, 0.95, True)
    got, got_buffer = out(), buffer.clone()
    slot = torch.tensor(grad.data_ptr(), dtype=torch.int64, device="cuda")
    fused.momentum_direction_into(decoy, got_buffer, got, 0.95, True, grad_address=slot)
    assert torch.equal(got_buffer, expected_buffer) and torch.equal(got, expected)


@cuda
@pytest.mark.parametrize("layout", ["contiguous", "transposed_out"])
@pytest.mark.parametrize("by_address", [False, True])
def test_momentum_kernel_scales_the_gradient_as_a_multiply_of_its_own(layout, by_address):
    """``grad_scale`` (a clip's factor deferred to the step): the kernel writes bit for bit
    what it writes given the gradient multiplied beforehand (``grad * scale``, as the clip's
    multiply rounds it): the product is not contracted into the lerp's arithmetic."""
    grad, buffer = _tensors((1031, 517), "cuda")
    scale = torch.tensor(0.3137, device="cuda")

    out = functools.partial(_direction_out, layout)

    expected, expected_buffer = out(), buffer.clone()
    fused.momentum_direction_into(grad * scale, expected_buffer, expected, 0.95, True)
    got, got_buffer = out(), buffer.clone()
    slot = torch.tensor(grad.data_ptr(), dtype=torch.int64, device="cuda") if by_address else None
    fused.momentum_direction_into(
        grad, got_buffer, got, 0.95, True, grad_address=slot, grad_scale=scale
    )
    assert torch.equal(got_buffer, expected_buffer) and torch.equal(got, expected)
    assert not torch.equal(got_buffer, buffer.clone().lerp_(grad, 0.05))  # (it did scale)


def test_momentum_scale_needs_a_float32_gradient():
    grad, buffer = _tensors((3, 4), "cpu")
    with pytest.raises(ValueError, match="float32 gradient"):
        fused.momentum_direction_into(
            grad.bfloat16(), buffer, torch.empty(3, 4), 0.95, True, grad_scale=torch.tensor(0.5)
        )


def test_eager_momentum_scales_the_gradient_first():
    grad, buffer = _tensors((37, 53), "cpu")
    scale = torch.tensor(0.3137)
    expected, expected_buffer = torch.empty(37, 53), buffer.clone()
    fused.momentum_direction_into(grad * scale, expected_buffer, expected, 0.95, True)
    got, got_buffer = torch.empty(37, 53), buffer.clone()
    fused.momentum_direction_into(grad, got_buffer, got, 0.95, True, grad_scale=scale)
    assert torch.equal(got_buffer, expected_buffer) and torch.equal(got, expected)


@cuda
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_update_kernel_matches_eager(transposed, dtype, param_dtype):
    param, _ = _tensors((1000, 3001), "cuda")
    param = param.to(param_dtype)
    start = param.clone()
    raw = (
        torch.randn(3001, 1000, device="cuda")
        if transposed
        else torch.randn(1000, 3001, device="cuda")
    )
    update = (raw.mT if transposed else raw).to(dtype)
    expected = param.clone().mul_(0.998).add_(update, alpha=-0.03)
    by_device_scalars = param.clone()
    fused.decay_and_update_(param, update, 0.998, 0.03)
    scalars = [torch.tensor(v, device="cuda", dtype=param_dtype) for v in (0.998, 0.03)]
    fused.decay_and_update_(by_device_scalars, update, *scalars)
    if param_dtype == torch.float32:  # the same kernel, its scalars read from memory
        assert torch.equal(by_device_scalars, param)
    if param_dtype == torch.float32:
        torch.testing.assert_close(param, expected, rtol=2e-7, atol=2e-7)
    else:  # one rounding (fused) vs two (mul_ then add_): the fused result is the nearer
        exact = start.float() * 0.998 - 0.03 * update.float()
        fused_error = (param.float() - exact).abs()
        assert (fused_error <= (expected.float() - exact).abs() + 1e-6).all()
        assert (fused_error <= exact.abs() * 2**-8 + 1e-6).all()  # half a bf16 step


@cuda
def test_kernels_can_be_turned_off(monkeypatch):
    class NoKernel:
        def __getitem__(self, grid):
            raise AssertionError("a kernel ran although DMUON_FUSED=0")

    monkeypatch.setenv("DMUON_FUSED", "0")
    monkeypatch.setattr(fused, "_momentum_kernel", NoKernel())
    monkeypatch.setattr(fused, "_update_kernel", NoKernel())
    assert not fused.enabled()
    grad, buffer = _tensors((64, 96), "cuda")
    out = torch.empty(64, 96, dtype=torch.bfloat16, device="cuda")
    fused.momentum_direction_into(grad, buffer, out, 0.95, True)
    fused.decay_and_update_(grad, out, 0.99, 0.1)


def test_reading_by_address_without_a_kernel_under_capture_raises(monkeypatch):
    """``grad_address`` where no kernel runs (here: CPU tensors, a float64 output) while a
    CUDA graph is being captured (stood in for) raises instead of baking the capture's
    gradient address into the graph; outside a capture the eager path reads ``grad``."""
    monkeypatch.setattr(fused, "_capturing", lambda: True)
    grad, buffer = _tensors((8, 8), "cpu")
    out = torch.empty(8, 8, dtype=torch.float64)
    slot = torch.tensor(grad.data_ptr(), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="grad_address.*output torch.float64"):
        fused.momentum_direction_into(grad, buffer.clone(), out, 0.95, True, grad_address=slot)
    monkeypatch.setattr(fused, "_capturing", lambda: False)
    expected = torch.empty_like(out)
    fused.momentum_direction_into(grad, buffer.clone(), expected, 0.95, True)
    fused.momentum_direction_into(grad, buffer.clone(), out, 0.95, True, grad_address=slot)
    assert torch.equal(out, expected)


_INTERPRETED = """
import torch, triton
from dmuon_titan import fused

for nesterov in (True, False):
    grad, buf = torch.randn(37, 53), torch.randn(37, 53)
    out = torch.empty(37, 53, dtype=torch.bfloat16)
    ref_buf = buf.clone().lerp_(grad, 1 - 0.95)
    ref_out = (grad.lerp(ref_buf, 0.95) if nesterov else ref_buf).bfloat16()
    grid = (triton.cdiv(grad.numel(), fused._BLOCK),)
    fused._momentum_kernel[grid](
        grad, buf, out, buf, grad.numel(), 1 - 0.95, 0.95, NESTEROV=nesterov, BY_ADDRESS=False,
        GRAD_TYPE=None, SCALED=False,
        BLOCK=fused._BLOCK,
    )
    torch.testing.assert_close(buf, ref_buf, rtol=2e-7, atol=1e-7)
    # within one bf16 step: the interpreter rounds bf16 stores toward zero (the GPU rounds
    # to nearest; test_momentum_kernel_matches_eager checks that on CUDA)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-6)

for nesterov in (True, False):  # the tiled pass, into a transposed view
    grad, buf = torch.randn(70, 130), torch.randn(70, 130)
    ref_buf = buf.clone().lerp_(grad, 1 - 0.95)
    ref_out = (grad.lerp(ref_buf, 0.95) if nesterov else ref_buf).bfloat16()
    wide = torch.empty(130, 70, dtype=torch.bfloat16)
    fused._momentum_kernel_2d[(triton.cdiv(70, fused._TILE), triton.cdiv(130, fused._TILE))](
        grad, buf, wide.mT, buf, 70, 130, 1, 70, 1 - 0.95, 0.95, NESTEROV=nesterov,
        BY_ADDRESS=False, GRAD_TYPE=None, SCALED=False,
        TILE=fused._TILE,
    )
    torch.testing.assert_close(buf, ref_buf, rtol=2e-7, atol=1e-7)
    torch.testing.assert_close(wide.mT.float(), ref_out.float(), rtol=1e-2, atol=1e-6)

# The gradient read through an int64 slot holding its address (a captured step's): both
# kernels write what they write given the gradient itself, bit for bit.
grad, buf = torch.randn(70, 130), torch.randn(70, 130)
slot = torch.tensor(grad.data_ptr(), dtype=torch.int64)
f32 = fused._TL_DTYPES[torch.float32]
runs = []
for by_address in (False, True):
    b, out = buf.clone(), torch.empty(70, 130, dtype=torch.bfloat16)
    fused._momentum_kernel[(triton.cdiv(grad.numel(), fused._BLOCK),)](
        slot if by_address else grad, b, out, b, grad.numel(), 1 - 0.95, 0.95, NESTEROV=True,
        BY_ADDRESS=by_address, GRAD_TYPE=f32 if by_address else None, SCALED=False,
        BLOCK=fused._BLOCK,
    )
    b2, wide = buf.clone(), torch.empty(130, 70, dtype=torch.bfloat16)
    fused._momentum_kernel_2d[(triton.cdiv(70, fused._TILE), triton.cdiv(130, fused._TILE))](
        slot if by_address else grad, b2, wide.mT, b2, 70, 130, 1, 70, 1 - 0.95, 0.95,
        NESTEROV=True, BY_ADDRESS=by_address, GRAD_TYPE=f32 if by_address else None,
        SCALED=False, TILE=fused._TILE,
    )
    runs.append((b, out, b2, wide))
assert all(torch.equal(x, y) for x, y in zip(*runs))
assert not torch.equal(runs[1][0], buf)  # (it did read a gradient)

# A gradient factor read from device memory (a clip deferred to the step): both kernels
# write what they write given the gradient multiplied beforehand, bit for bit.
scale = torch.tensor(0.3137, dtype=torch.float32)
runs = []
for scaled in (False, True):
    g = grad if scaled else grad * scale
    b, out = buf.clone(), torch.empty(70, 130, dtype=torch.bfloat16)
    fused._momentum_kernel[(triton.cdiv(grad.numel(), fused._BLOCK),)](
        g, b, out, scale if scaled else b, grad.numel(), 1 - 0.95, 0.95, NESTEROV=True,
        BY_ADDRESS=False, GRAD_TYPE=None, SCALED=scaled, BLOCK=fused._BLOCK,
    )
    b2, wide = buf.clone(), torch.empty(130, 70, dtype=torch.bfloat16)
    fused._momentum_kernel_2d[(triton.cdiv(70, fused._TILE), triton.cdiv(130, fused._TILE))](
        g, b2, wide.mT, scale if scaled else b2, 70, 130, 1, 70, 1 - 0.95, 0.95,
        NESTEROV=True, BY_ADDRESS=False, GRAD_TYPE=None, SCALED=scaled, TILE=fused._TILE,
    )
    runs.append((b, out, b2, wide))
assert all(torch.equal(x, y) for x, y in zip(*runs))

for transposed in (False, True):
    param = torch.randn(70, 130)
    update = (torch.randn(130, 70).mT if transposed else torch.randn(70, 130)).bfloat16()
    expected = param.clone().mul_(0.99).add_(update, alpha=-0.1)
    grid = (triton.cdiv(70, fused._TILE), triton.cdiv(130, fused._TILE))
    fused._update_kernel[grid](
        param, update, 70, 130, update.stride(0), update.stride(1), 0.99, 0.1,
        SCALARS_ON_DEVICE=False, TILE=fused._TILE,
    )
    torch.testing.assert_close(param, expected, rtol=2e-7, atol=2e-7)
    by_device_scalars = expected.clone()
    fused._update_kernel[grid](
        by_device_scalars, update, 70, 130, update.stride(0), update.stride(1),
        torch.tensor(0.99), torch.tensor(0.1), SCALARS_ON_DEVICE=True, TILE=fused._TILE,
    )
    param_again = expected.clone()
    fused._update_kernel[grid](
        param_again, update, 70, 130, update.stride(0), update.stride(1), 0.99, 0.1,
        SCALARS_ON_DEVICE=False, TILE=fused._TILE,
    )
    assert torch.equal(by_device_scalars, param_again)
# A batch by tables of addresses (the captured step's passes): each matrix's buffer,
# direction and update bit for bit those of its own launch, wide or written transposed.
grads = [torch.randn(70, 130) for _ in range(3)]
bufs = [torch.randn(70, 130) for _ in range(3)]
grad_table = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
for transposed, scale, grid_limit in [
    (t, s, limit) for t in (False, True) for s in (None, torch.tensor(0.3137)) for limit in (65535, 2)
]:
        fused._MAX_GRID_MATRICES = grid_limit  # (2: launched in slices of 2 matrices)
        own, batched = [b.clone() for b in bufs], [b.clone() for b in bufs]
        wide = [torch.empty(3, 130, 70, dtype=torch.bfloat16) for _ in range(2)]
        outs = [w.mT for w in wide] if transposed else [w.view(3, 70, 130) for w in wide]
        for i in range(3):
            fused._momentum_kernel_2d[(triton.cdiv(70, fused._TILE), triton.cdiv(130, fused._TILE))](
                grads[i], own[i], outs[0][i], own[i] if scale is None else scale, 70, 130,
                outs[0].stride(1), outs[0].stride(2), 1 - 0.95, 0.95, NESTEROV=True,
                BY_ADDRESS=False, GRAD_TYPE=None, SCALED=scale is not None, TILE=fused._TILE,
            )
        buf_table = torch.tensor([b.data_ptr() for b in batched], dtype=torch.int64)
        squares = torch.zeros(3, fused.square_parts(70, 130) + 1)  # (more than needed: zeros)
        fused.momentum_directions_by_table(
            grad_table, buf_table, outs[1], torch.float32, torch.float32, 0.95, True, scale,
            squares,
        )
        assert all(torch.equal(x, y) for x, y in zip(own, batched)), (transposed, scale, grid_limit)
        assert torch.equal(outs[0], outs[1]) and not torch.equal(own[0], bufs[0])
        # the partial sums of squares: of the directions as stored (bf16), every matrix's
        torch.testing.assert_close(
            squares.sum(1), outs[1].float().square().sum((1, 2)), rtol=1e-6, atol=0
        )
        assert (squares[:, : fused.square_parts(70, 130) - 1] > 0).all() and (squares[:, -1] == 0).all()
        params = [torch.randn(70, 130) for _ in range(3)]
        expected = [p.clone() for p in params]
        decay, step = torch.tensor(0.99), torch.tensor(0.1)
        for i in range(3):
            fused._update_kernel[(triton.cdiv(70, fused._TILE), triton.cdiv(130, fused._TILE))](
                expected[i], outs[0][i], 70, 130, outs[0].stride(1), outs[0].stride(2), decay,
                step, SCALARS_ON_DEVICE=True, TILE=fused._TILE,
            )
        table = torch.tensor([p.data_ptr() for p in params], dtype=torch.int64)
        fused.decay_and_update_by_table(table, torch.float32, outs[1], decay, step)
        assert all(torch.equal(x, y) for x, y in zip(expected, params))

x = torch.randn(3, 40, 70)
norms = torch.linalg.matrix_norm(x, keepdim=True)
expected = x / norms
fused._divide_kernel[(triton.cdiv(40 * 70, 1024), 3)](x, norms.reshape(3), 40 * 70, BLOCK=1024)
torch.testing.assert_close(x, expected, rtol=2e-7, atol=0)
print("kernels ok")
"""


@pytest.mark.skipif(fused.triton is None, reason="needs Triton")
def test_kernels_in_the_triton_interpreter():
    """The kernels' math on CPU tensors (Triton's interpreter), so CPU-only CI covers them."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels ok" in result.stdout


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["one", "batch", "tall_view"])
def test_divide_kernel_is_bitwise_div(dtype, layout):
    """fused.divide_ rounds exactly as Tensor.div_ (so NS's normalization is unchanged)."""
    torch.manual_seed(0)
    shape = {"one": (300, 1001), "batch": (3, 300, 1001), "tall_view": (3, 300, 1001)}[layout]
    x = torch.randn(shape, device="cuda").to(dtype)
    if layout == "tall_view":
        x = x.mT  # contiguous storage, transposed view
    if layout == "one":
        norms = x.norm()
    else:
        norms = torch.linalg.matrix_norm(x, keepdim=True)
    expected = x.clone().div_(norms)
    got = fused.divide_(x, norms)
    assert got is x
    assert torch.equal(x, expected)
