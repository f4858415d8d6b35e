"""DMuon's per-step figures in torchtitan's metrics: log line and TensorBoard/W&B."""

from __future__ import annotations

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger


class DMuonMetricsProcessor(MetricsProcessor):
    """Adds ``dmuon/optimizer_ms``, ``dmuon/ns_ms`` and ``dmuon/adamw_ms`` to every logged
    step (read from CUDA events on logging steps only) and prints them on their own line."""

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        timings = getattr(self.optimizers, "step_timings", None)
        figures = {}
        if timings is not None:
            figures = {f"dmuon/{phase}_ms": ms for phase, ms in timings().items()}
        super().log(
            step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **figures}
        )
        if figures:
            logger.info(
                f"dmuon step: {step:2}  optimizer: {figures.get('dmuon/optimizer_ms', 0):.2f}ms  "
                f"ns: {figures.get('dmuon/ns_ms', 0):.2f}ms  "
                f"adamw: {figures.get('dmuon/adamw_ms', 0):.2f}ms"
            )


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return DMuonMetricsProcessor(job_config, parallel_dims, tag)
