"""One optimizer step of `loss_type="global_token_mean"` on a fixed global batch of 8 rows of unequal lengths.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 \\
        tests/distributed/global_token_mean_step.py --output_dir OUT --mini_batch_size 2 --gradient_accumulation_steps 2
    accelerate launch --config_file accelerate_configs/single_gpu.yaml \\
        tests/distributed/global_token_mean_step.py --output_dir OUT --mini_batch_size 8
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/global_token_mean_step.py --output_dir OUT --mini_batch_size 2 \\
        --gradient_accumulation_steps 2 --max_tokens_per_minibatch 16

Process r of n takes rows [r * 8/n, (r+1) * 8/n); each process's rows form one backward batch
(`batch_size = mini_batch_size * gradient_accumulation_steps`), one PPO epoch, REINFORCE++ (no
value loss, advantages whitened over all processes), an entropy bonus (aggregated the same way), SGD. The responses have different lengths,
so the processes hold different numbers of action tokens: only a loss that divides by the action
tokens of all processes (docs/algorithm.md section 13) takes the step of one process on all 8 rows.
With ``--max_tokens_per_minibatch`` each process's backward batch goes into passes of that many tokens
(docs/algorithm.md section 18); the rows are such that the processes alone would need different numbers
of passes (checked here), so the run also shows that they make the same number and their collectives line up.
`--init_kl_coef 0` makes the step on-policy (docs/algorithm.md section 3: no pass without grad); `--every_pass`
runs both passes whatever the config (today's path).
Rank 0 writes OUT/result.pt: its full weights after the step, the step's policy loss, ``ppo/minibatches`` and the
policy's calls without grad.
"""

import argparse
import os

import torch
from common import finish, full_named_parameters, gather_across_processes

from tiny_models import make_gpt2, make_tokenizer, random_batch
from trl_lite import PPOConfig, PPOTrainer, set_seed
from trl_lite.trainer.step.rollout_plan import EVERY_PASS
from trl_lite.trainer.memory.token_budget import split_by_tokens

GLOBAL_BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--mini_batch_size", type=int, required=True)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--loss_type", default="global_token_mean")
    parser.add_argument("--init_kl_coef", type=float, default=0.2)
    parser.add_argument("--every_pass", action="store_true")
    parser.add_argument("--max_tokens_per_minibatch", type=int, default=None)
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    per_process = GLOBAL_BATCH // world_size
    config = PPOConfig(
        batch_size=per_process,
        mini_batch_size=args.mini_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        ppo_epochs=1,
        learning_rate=1.0,
        advantage_estimator="reinforce_pp",
        loss_type=args.loss_type,
        entropy_coef=0.05,
        init_kl_coef=args.init_kl_coef,
        max_grad_norm=None,
        max_tokens_per_minibatch=args.max_tokens_per_minibatch,
        seed=0,
    )
    set_seed(0)
    model = make_gpt2(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    trainer_class = PPOTrainer
    if args.every_pass:
        trainer_class = type("EveryPassTrainer", (PPOTrainer,), {"plan_rollout": staticmethod(lambda config: EVERY_PASS)})
    trainer = trainer_class(config, model, tokenizer=make_tokenizer(), optimizer=optimizer)
    no_grad_calls = []  # the policy's and its reference copy's passes without grad (hooked after the copy)
    reference = trainer.accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None
    for lm in [model] + ([reference.pretrained_model] if reference is not None else []):
        lm.transformer.register_forward_pre_hook(lambda m, a: None if torch.is_grad_enabled() else no_grad_calls.append(1))
    assert trainer.accelerator.num_processes == world_size, (trainer.accelerator.num_processes, world_size)

    queries, responses, scores = random_batch(GLOBAL_BATCH, seed=3, query_len=(2, 5), response_len=(1, 9))
    rows = slice(rank * per_process, (rank + 1) * per_process)
    tokens = [sum(len(r) for r in responses[i * per_process : (i + 1) * per_process]) for i in range(world_size)]
    assert world_size == 1 or len(set(tokens)) > 1, tokens  # the processes hold different numbers of tokens
    if args.max_tokens_per_minibatch is not None and world_size > 1:
        costs = [len(q) + len(r) for q, r in zip(queries[rows], responses[rows])]
        alone = len(split_by_tokens(costs, args.max_tokens_per_minibatch))
        counts = gather_across_processes(torch.tensor(float(alone)), trainer.accelerator.device)
        assert len(set(float(c) for c in counts)) > 1, counts  # the processes alone would make unequal passes
    stats = trainer.step(queries[rows], responses[rows], scores[rows])

    named = full_named_parameters(trainer, trainer.accelerator.unwrap_model(trainer.model).pretrained_model)
    if rank == 0:
        result = {
            "named_parameters": named, "loss": stats["ppo/loss/policy"], "minibatches": stats["ppo/minibatches"],
            "no_grad_calls": len(no_grad_calls),
        }  # fmt: skip
        torch.save(result, os.path.join(args.output_dir, "result.pt"))
    finish(trainer)


if __name__ == "__main__":
    main()
