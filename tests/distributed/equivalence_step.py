"""One PPO step on a fixed global batch of 8 rows, split evenly over the processes.

    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/equivalence_step.py --output_dir OUT
    accelerate launch --config_file accelerate_configs/single_gpu.yaml \\
        tests/distributed/equivalence_step.py --output_dir OUT

Process r of n takes rows [r * 8/n, (r+1) * 8/n) with `batch_size = mini_batch_size = 8/n` and one
PPO epoch, so each run takes exactly one optimizer step on the same 8 rows. With gradients averaged
over processes, that step follows the gradient of the mean loss over the global mini-batch when
  - every process holds the same number of action tokens (the losses are masked means), which the
    data below guarantees by giving every response the same length, and
  - the advantages are whitened with the mean and variance of the whole global batch (whitening
    each process's rows alone, as classic TRL does, makes the two runs differ by about 3e-3 here).
The optimizer is SGD, whose update is linear in the gradient, so the weight difference measures the
gradient difference; Adam's first step divides by |gradient| and turns float noise in near-zero
gradients into differences of up to 0.2 * learning rate. Rank 0 writes OUT/result.pt: its full
weights after the step, the KL coefficient and the step's scalar statistics.

``--head_chunk_tokens C``: the default head rule (``lm_head_chunk_size=None``) takes chunks of C tokens of the
tiny vocabulary, as it does for a real one: its CPU one-buffer limit is set to 0 and its chunk bytes to C rows.
"""

import argparse
import os

import torch
from common import finish, full_named_parameters

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed
from trl_lite.core import lm_head
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer, random_batch

GLOBAL_BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--head_chunk_tokens", type=int, default=None)
    args = parser.parse_args()
    if args.head_chunk_tokens is not None:
        lm_head._ONE_BUFFER_BYTES["cpu"] = 0
        lm_head._CHUNK_BYTES["cpu"] = args.head_chunk_tokens * 4 * VOCAB_SIZE  # float32 rows of the vocabulary

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    per_process = GLOBAL_BATCH // world_size
    config = PPOConfig(
        batch_size=per_process,
        mini_batch_size=per_process,
        ppo_epochs=1,
        learning_rate=0.1,
        init_kl_coef=0.2,
        target=0.1,
        horizon=100,
        max_grad_norm=None,
        seed=0,
    )
    set_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer(), optimizer=optimizer)
    assert trainer.accelerator.num_processes == world_size, (trainer.accelerator.num_processes, world_size)

    # Equal response lengths: every process holds the same number of action tokens.
    queries, responses, scores = random_batch(GLOBAL_BATCH, seed=7, query_len=(2, 6), response_len=(5, 5))
    rows = slice(rank * per_process, (rank + 1) * per_process)
    stats = trainer.step(queries[rows], responses[rows], scores[rows])

    head_numel = trainer.accelerator.unwrap_model(trainer.model).transformers_model.get_output_embeddings().weight.numel()
    named = full_named_parameters(trainer)
    if rank == 0:
        torch.save(
            {
                "named_parameters": named,
                "kl_coef": trainer.kl_ctl.value,
                "stats": {k: v for k, v in stats.items() if isinstance(v, float) and not k.startswith("time/")},
                "lm_head_chunk_size": stats["memory/lm_head_chunk_size"],
                "head_partitioned": head_numel == 0,  # ZeRO-3 outside the head's forward: an empty shard
            },
            os.path.join(args.output_dir, "result.pt"),
        )
    finish(trainer)


if __name__ == "__main__":
    main()
