"""Load the latest checkpoint through torchtitan's own Trainer and CheckpointManager, then
write the full DMuon model and optimizer state (rank 0; every model part of every pipeline
stage merged). Launched with torchrun by the tests:

    torchrun --nproc_per_node N tests/titan/titan_probe.py OUT.pt --job.config_file ... [overrides]
"""

import sys

import torch
import torch.distributed as dist
from torchtitan.config import ConfigManager
from torchtitan.train import Trainer

import dmuon_titan as dmuon


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    config = ConfigManager().parse_args(args)
    trainer = Trainer(config)
    try:
        trainer.checkpointer.load(step=config.checkpoint.load_step)
        weights, optim = {}, {}
        for part, opt in zip(trainer.model_parts, trainer.optimizers.optimizers, strict=True):
            weights.update(dmuon.get_model_state_dict(part))
            optim.update(dmuon.get_optimizer_state_dict(part, opt)["state"])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (weights, optim))  # the other pipeline stages
        for theirs_weights, theirs_optim in everyone:
            weights.update(theirs_weights)
            optim.update(theirs_optim)
        first = trainer.model_parts[0]
        state = {
            "step": trainer.step,
            "model": weights,
            "optim": {"state": optim},
            "plan": dmuon.summarize_plan(first) if hasattr(first, "_dmuon_state") else None,
        }
        if dist.get_rank() == 0:
            torch.save(state, out)
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
