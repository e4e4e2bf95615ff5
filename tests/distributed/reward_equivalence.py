"""RewardTrainer on a fixed global batch of 8 pairs per optimizer step, split evenly over the processes.

    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/reward_equivalence.py --base_model DIR --output_dir OUT
    accelerate launch --config_file accelerate_configs/single_gpu.yaml \\
        tests/distributed/reward_equivalence.py --base_model DIR --output_dir OUT

Each process takes ``4 / n`` pairs per forward pass and accumulates 2 passes per optimizer step, so
every step of either run sees the same 8 pairs: accelerate shards the batches of one seeded
shuffle, process r of n taking batches r, r + n, ... Five steps over 24 pairs cross an epoch
boundary (a new shuffle). The loss is a mean over pairs, and every process holds the same number of
pairs, so gradients averaged over processes are those of the global mean. The optimizer is SGD
(see equivalence_step.py for why not Adam), with gradient clipping and a warm-up schedule on.

Rank 0 writes OUT/result.pt: full weights after training, the log history and the metrics on 11
held-out pairs (an odd count, so accelerate pads the last evaluation batch and must drop the
repeats). Every process checks with torch.distributed that all hold the same weights, then all
save the model to OUT/model.
"""

import argparse
import os

import torch
from common import finish, flat, full_named_parameters, gather_across_processes
from transformers import AutoModelForSequenceClassification

from preference_pairs import planted_pairs
from tiny_models import make_tokenizer
from trl_lite import RewardConfig, RewardTrainer

GLOBAL_FORWARD_BATCH = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = RewardConfig(
        output_dir=os.path.join(args.output_dir, "model"),
        per_device_train_batch_size=GLOBAL_FORWARD_BATCH // world_size,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=5,
        learning_rate=0.5,
        warmup_steps=2,
        max_grad_norm=0.3,
        logging_steps=2,
        disable_tqdm=True,
        seed=0,
    )
    model = AutoModelForSequenceClassification.from_pretrained(args.base_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    trainer = RewardTrainer(
        model,
        config,
        train_dataset=planted_pairs(24, seed=21),
        eval_dataset=planted_pairs(11, seed=22),
        tokenizer=make_tokenizer(),
        optimizers=(optimizer, None),
    )
    assert trainer.accelerator.num_processes == world_size, (trainer.accelerator.num_processes, world_size)
    if world_size > 1:
        assert trainer.is_deepspeed_enabled, "the 2-process run must be a DeepSpeed run"
    trainer.train()
    metrics = trainer.evaluate()

    weights = full_named_parameters(trainer)
    if world_size > 1:
        copies = gather_across_processes(flat(weights), trainer.accelerator.device)
        for rank, copy in enumerate(copies):
            assert torch.equal(copy, copies[0]), f"process {rank} holds different weights from process 0"
    trainer.save_model()
    if trainer.accelerator.is_main_process:
        result = {"weights": weights, "log_history": trainer.log_history, "eval": metrics}
        torch.save(result, os.path.join(args.output_dir, "result.pt"))
    finish(trainer)


if __name__ == "__main__":
    main()
