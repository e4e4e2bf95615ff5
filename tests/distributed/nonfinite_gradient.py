"""A gradient that turns NaN on one process, with a finite loss: every process skips the update.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/nonfinite_gradient.py --base_model DIR --output_dir OUT

Step 1 poisons the value head's weight gradient on rank 1 only; gradient averaging (DDP) or
DeepSpeed's reduction spreads it, so both processes must skip, count and warn, and keep their
weights. Step 2, without the poison, must update them again. Rank 0 writes what every process saw
(gathered with `torch.distributed`) to OUT/report.json.
"""

import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist
from common import finish, flat, full_named_parameters, gather_across_processes

from tiny_models import VOCAB_SIZE, make_tokenizer
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer


def step_and_observe(trainer: PPOTrainer, batch: tuple) -> list:
    """[skipped mini-batches, skip warnings, changed parameters, non-finite parameters] of one step."""
    before = full_named_parameters(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = trainer.step(*batch)
    after = full_named_parameters(trainer)
    warned = sum("Skipping a PPO mini-batch" in str(w.message) for w in caught)
    changed = sum(not torch.equal(before[name], after[name]) for name in before)
    nonfinite = int((~torch.isfinite(flat(after))).sum())
    return [stats["ppo/skipped_minibatches"], warned, changed, nonfinite]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    config = PPOConfig(batch_size=4, mini_batch_size=4, ppo_epochs=1, learning_rate=1e-2, seed=0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    rank = trainer.accelerator.process_index
    g = torch.Generator().manual_seed(rank)
    batch = (
        [torch.randint(3, VOCAB_SIZE, (3,), generator=g) for _ in range(4)],
        [torch.randint(3, VOCAB_SIZE, (4,), generator=g) for _ in range(4)],
        [torch.tensor(1.0)] * 4,
    )
    head = trainer.accelerator.unwrap_model(trainer.model).v_head.summary.weight
    poison = head.register_hook(lambda grad: grad * float("nan")) if rank == 1 else None
    first = step_and_observe(trainer, batch)
    if poison is not None:
        poison.remove()
    second = step_and_observe(trainer, batch)
    seen = gather_across_processes(torch.tensor(first + second), trainer.accelerator.device)
    if dist.get_rank() == 0:
        with open(os.path.join(args.output_dir, "report.json"), "w") as f:
            json.dump([row.tolist() for row in seen], f)
    finish(trainer)


if __name__ == "__main__":
    main()
