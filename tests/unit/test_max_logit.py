"""The one-pass maximum-logit kernel (dmuon_titan.ops.max_logit): in Triton's interpreter on
CPU, and compiled on a GPU, against the chunked float32 path of ``ops.qk_clip.max_logits``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dmuon_titan.ops import fused, max_logit
from dmuon_titan.ops import qk_clip as ops

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused.enabled()), reason="needs CUDA and Triton"
)

_INTERPRETED = r"""
import math
import torch
from dmuon_titan.ops import max_logit
from dmuon_titan.ops import qk_clip as ops
torch.manual_seed(0)
# (batch, heads, kv heads, queries, keys, head dim, causal): partial blocks, GQA, more keys
# than queries (a cache's bottom-right alignment), fewer (rows that see no key), no mask
for b, h, kv, n_q, n_k, d, causal in [
    (2, 4, 2, 100, 100, 16, True), (1, 4, 4, 130, 150, 32, True), (1, 2, 1, 140, 20, 16, True),
    (2, 6, 3, 70, 70, 64, False), (1, 2, 1, 200, 200, 128, True), (1, 2, 2, 330, 330, 32, True),
    (1, 2, 1, 300, 290, 16, False),
]:
    q = torch.randn(b, n_q, h, d).transpose(1, 2).half()  # strided, as torchtitan passes it
    k = torch.randn(b, kv, n_k, d)
    for ramp in (False, True):  # queries shrinking, keys growing: a key seen past its mask wins
        if ramp:
            q = (q.float().abs() * torch.linspace(4, 1, n_q)[:, None]).half()
            k = k.abs() * torch.linspace(1, 4, n_k)[:, None]
        kh = k.half()
        expected = ops.max_logits(q.float(), kh.float(), causal=causal, scale=0.7 / math.sqrt(d))
        got = max_logit.max_logits(q, kh, causal=causal, scale=0.7 / math.sqrt(d))
        assert got.dtype == torch.float32 and got.shape == (h,)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # folded into a running maximum: a slot above this batch's keeps its value
        held = expected.clone()
        held[::2] += 1.0
        slots = torch.full((h + 2,), -math.inf)
        slots[1 : h + 1] = held
        view = slots[1 : h + 1]
        assert max_logit.max_logits(q, kh, causal=causal, scale=0.7 / math.sqrt(d), out=view) is view
        torch.testing.assert_close(view, torch.maximum(held, expected), rtol=1e-5, atol=1e-5)
        assert slots[0] == slots[-1] == -math.inf
# a spike just past the diagonal of each row block's first row (offsets that end a key
# block there), and logits all negative (padded query rows' zeros must not count)
for n_q, n_k, sign in [(130, 192, 1), (200, 326, 1), (100, 100, 1), (140, 150, -1)]:
    q = torch.randn(1, 2, n_q, 32).abs() * 0.01
    k = torch.randn(1, 1, n_k, 32).abs() * 0.01 * sign
    for block, r in enumerate(range(0, n_q, 128)):  # (each pair in a dimension of its own)
        if r + n_k - n_q + 1 < n_k and sign > 0:
            q[0, :, r, block], k[0, 0, r + n_k - n_q + 1, block] = 10.0, 10.0
    q, k = q.half(), k.half()
    expected = ops.max_logits(q.float(), k.float(), causal=True)
    torch.testing.assert_close(max_logit.max_logits(q, k, causal=True, scale=32**-0.5), expected)
print("max logit ok")
"""


@pytest.mark.skipif(max_logit.triton is None, reason="needs Triton")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="for CPU-only machines: GPUs run the compiled kernel"
)
def test_kernel_in_the_triton_interpreter():
    """Block walk, causal bound, GQA head mapping, strides and masks, checked in float16
    against the float32 chunked path (so CPU-only CI covers them; the older Triton of the
    GPU machines cannot interpret a loop bound computed in the kernel)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")  # (CPU tensors)
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max logit ok" in result.stdout


def test_cpu_takes_the_chunked_path():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert not max_logit.runs_for(q, q)


@cuda
@pytest.mark.parametrize("d, kv_heads", [(64, 12), (128, 8)])
def test_kernel_on_the_gpu(d, kv_heads):
    """bf16 q and k shaped as torchtitan's 170M (64-dim heads, MHA) and llama3-8B (128, GQA 4)
    pass them, sequence 2048: equal to the float32 logits written out in chunks within fp32
    summation order."""
    q = torch.randn(2, 2048, 32 if d == 128 else 12, d, device="cuda").transpose(1, 2)
    q = (q * 3).bfloat16()
    k = (torch.randn(2, kv_heads, 2048, d, device="cuda") * 3).bfloat16()
    assert max_logit.runs_for(q, k)
    for causal in (True, False):
        got = ops.max_logits(q, k, causal=causal)
        expected = ops.max_logits(q.float(), k.float(), causal=causal)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
