#!/usr/bin/env python3
"""torchtitan's trainer with cProfile on for a range of training steps.

A drop-in for ``-m torchtitan.train`` (same arguments): the steps in ``TITAN_PROFILE_STEPS``
(``FIRST-LAST``, default ``101-300``) run ``Trainer.train_step`` under cProfile, whose
statistics go to ``TITAN_PROFILE_OUT`` (default ``host.prof``) when training ends. Only
those steps are profiled: not the set-up, the warm-up or the validations between them, so
``scripts/analysis/host_profile.py`` can compare the host time per step of two runs.

    TITAN_PROFILE_OUT=adamw.prof torchrun --standalone --nproc_per_node=1 \\
        scripts/bench/titan_host_profile.py --job.config_file configs/llm170m_adamw.toml
    HOST_PROFILE=101-300 scripts/run/small_scale.sh OUT throughput   # OUT/NAME.prof per run
"""

from __future__ import annotations

import cProfile
import os

from torchtitan.train import Trainer, main


def _steps() -> tuple[int, int]:
    first, _, last = os.environ.get("TITAN_PROFILE_STEPS", "101-300").partition("-")
    return int(first), int(last or first)


class ProfiledTrainer(Trainer):
    """torchtitan's trainer; ``train_step`` profiled in the chosen range of steps."""

    profiler = cProfile.Profile()
    steps = _steps()

    def train_step(self, data_iterator):
        if self.steps[0] <= self.step <= self.steps[1]:
            # runcall switches the profiler on and off around the call itself, so cProfile sees
            # torchtitan's train_step from its first line (enable() inside this frame did not)
            return self.profiler.runcall(super().train_step, data_iterator)
        return super().train_step(data_iterator)


if __name__ == "__main__":
    try:
        main(ProfiledTrainer)
    finally:
        ProfiledTrainer.profiler.dump_stats(os.environ.get("TITAN_PROFILE_OUT", "host.prof"))
