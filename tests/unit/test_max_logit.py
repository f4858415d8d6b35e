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
    (2, 6, 3, 70, 70, 64, False), (1, 2, 1, 200, 200, 128, True),
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
print("max logit ok")
"""


@pytest.mark.skipif(max_logit.triton is None, reason="needs Triton")
def test_kernel_in_the_triton_interpreter():
    """Block walk, causal bound, GQA head mapping, strides and masks, checked in float16
    against the float32 chunked path (so CPU-only CI covers them)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
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
