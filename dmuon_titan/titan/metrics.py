"""DMuon in torchtitan's metrics: honest model size and FLOPs, per-step figures, progress.

- torchtitan counts parameters (and derives FLOPs per token, TFLOPS and MFU) after the
  converters ran, when a rank holds only the matrices it owns: the count is taken with
  full-size stand-ins in the dedicated slots, so it is the model's, equal on every rank and
  equal to an AdamW run's.
- ``dmuon/optimizer_ms``, ``dmuon/ns_ms`` and ``dmuon/adamw_ms`` join every logged step
  (read from CUDA events on logging steps only) with a line of their own; with QK-clip,
  ``dmuon/max_attention_logit`` (before the clip) and ``dmuon/clipped_heads`` too.
- A progress line (``step N/M``, elapsed, ETA) on every logged step, and a summary at the last.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch import nn
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from ..runtime.state import STATE_ATTR

_PATCHED = "_dmuon_full_size_count"


@contextlib.contextmanager
def full_size_stand_ins(model: nn.Module):
    """For the duration, every dedicated slot of ``model`` holds a full-size meta tensor (a
    stand-in for counting; nothing is allocated), then its own parameter again."""
    state = getattr(model, STATE_ATTR, None)
    saved = []
    try:
        for p in state.params if state is not None else ():
            current = p.module._parameters[p.attr]
            saved.append((p, current))
            p.module._parameters[p.attr] = nn.Parameter(
                torch.empty(p.shape, dtype=p.orig_dtype, device="meta"),
                requires_grad=current.requires_grad,
            )
        yield
    finally:
        for p, current in saved:
            p.module._parameters[p.attr] = current


def count_full_sizes(model_args_cls: type) -> None:
    """Idempotent: ``model_args_cls.get_nparams_and_flops`` counts dedicated matrices whole."""
    original = model_args_cls.get_nparams_and_flops
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def get_nparams_and_flops(self, model: nn.Module, seq_len: int):
        with full_size_stand_ins(model):
            return original(self, model, seq_len)

    setattr(get_nparams_and_flops, _PATCHED, True)
    model_args_cls.get_nparams_and_flops = get_nparams_and_flops


class DMuonMetricsProcessor(MetricsProcessor):
    """torchtitan's metrics, plus DMuon's optimizer timings, progress and an end summary."""

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        timings = getattr(self.optimizers, "step_timings", None)
        figures = {}
        if timings is not None:
            figures = {f"dmuon/{phase}_ms": ms for phase, ms in timings().items()}
        clip = getattr(self.optimizers, "clip_figures", lambda: {})()
        figures.update({f"dmuon/{name}": value for name, value in clip.items()})
        super().log(
            step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **figures}
        )
        if figures:
            logger.info(
                f"dmuon step: {step:2}  optimizer: {figures.get('dmuon/optimizer_ms', 0):.2f}ms  "
                f"ns: {figures.get('dmuon/ns_ms', 0):.2f}ms  "
                f"adamw: {figures.get('dmuon/adamw_ms', 0):.2f}ms"
                + (
                    f"  max attention logit: {clip['max_attention_logit']:.2f}  "
                    f"clipped heads: {clip['clipped_heads']:.0f}"
                    if clip
                    else ""
                )
            )
        self._progress(step, float(global_avg_loss))

    def log_validation(self, loss, step, extra_metrics=None):
        super().log_validation(loss, step, extra_metrics)
        self._last_validation = (step, float(loss))
        if step == self.job_config.training.steps and hasattr(self, "_last_loss"):
            self._summary()

    def _validates_at(self, step: int) -> bool:
        validation = self.job_config.validation
        return validation.enable and step % validation.freq == 0

    def _progress(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        if not hasattr(self, "_started"):
            self._started, self._first_step, self._first_loss = now, step, loss
        total = self.job_config.training.steps
        elapsed = now - self._started
        done = step - self._first_step
        rate = elapsed / done if done > 0 else None
        eta = f", ETA {rate * (total - step):.0f} s" if rate is not None and step < total else ""
        logger.info(
            f"progress: step {step}/{total} ({100 * step / total:.0f} %), {elapsed:.0f} s{eta}"
        )
        self._last_loss, self._elapsed = (step, loss), elapsed
        if step == total and not self._validates_at(step):
            self._summary()

    def _summary(self) -> None:
        step, loss = self._last_loss
        validation = getattr(self, "_last_validation", None)
        valid = (
            f", validation loss {validation[1]:.4f} at step {validation[0]}" if validation else ""
        )
        logger.info(
            f"summary: steps {self._first_step}-{step} in {self._elapsed:.0f} s; training loss "
            f"{self._first_loss:.4f} -> {loss:.4f}{valid}"
        )


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return DMuonMetricsProcessor(job_config, parallel_dims, tag)
