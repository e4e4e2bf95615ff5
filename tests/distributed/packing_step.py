"""Two PPO steps with packed or padded mini-batches on every process.

    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/packing_step.py --padding_free {0,1} --output_dir OUT

Each process takes its own 8 rows of varied lengths (left-padded tokenizer, response masks), in
mini-batches of 2 with 2-step gradient accumulation and 2 epochs. The optimizer is SGD, whose
update is linear in the gradient (Adam's first step would turn float noise in near-zero gradients
into visible weight differences). Rank 0 writes OUT/result.pt: the full weights after the steps,
the statistics of both steps and whether the trainer packed.
"""

import argparse
import os

import torch
from common import finish, full_named_parameters

from tiny_models import make_gpt2, make_tokenizer, random_batch
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--padding_free", type=int, choices=(0, 1), required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    config = PPOConfig(
        batch_size=8,
        mini_batch_size=2,
        gradient_accumulation_steps=2,
        ppo_epochs=2,
        learning_rate=0.05,
        padding_free=bool(args.padding_free),
        seed=0,
    )
    set_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer("left"), optimizer=optimizer)
    assert trainer.is_deepspeed_enabled and trainer.accelerator.num_processes == 2

    stats = []
    for step in range(2):
        queries, responses, scores = random_batch(8, seed=100 * rank + step, query_len=(1, 7), response_len=(1, 9))
        g = torch.Generator().manual_seed(100 * rank + step)
        masks = [(torch.rand(len(r), generator=g) > 0.3).long() for r in responses]
        stats.append(trainer.step(queries, responses, scores, response_masks=masks))

    named = full_named_parameters(trainer)
    if rank == 0:
        result = {
            "packed": trainer._pack,
            "named_parameters": named,
            "stats": [{k: v for k, v in s.items() if not k.startswith("time/")} for s in stats],
        }
        torch.save(result, os.path.join(args.output_dir, "result.pt"))
    finish(trainer)


if __name__ == "__main__":
    main()
