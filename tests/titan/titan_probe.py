"""Load the latest checkpoint through torchtitan's own Trainer and CheckpointManager, then
write the full DMuon model and optimizer state (rank 0). Launched with torchrun by the tests:

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
        model = trainer.model_parts[0]
        optimizer = trainer.optimizers.optimizers[0]
        state = {
            "step": trainer.step,
            "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, optimizer),
            "plan": dmuon.summarize_plan(model),
        }
        if dist.get_rank() == 0:
            torch.save(state, out)
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
