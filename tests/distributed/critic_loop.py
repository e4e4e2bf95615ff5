"""A PPO rollout loop with a separate critic, PTX and an EMA of the policy, run by every process.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/critic_loop.py --base_model DIR --critic_model DIR --output_dir OUT

Each process generates responses of its own length to its own queries, scores them and steps with
its own PTX rows. Afterwards the full weights of the policy, the critic and the policy's EMA of
every process are collected with `torch.distributed.all_gather`; rank 0 writes them to
OUT/report.pt. The policy and critic are saved to OUT/model (critic in OUT/model/value_model) and
the EMA to OUT/ema with `PPOTrainer.save_pretrained`.
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import finish, flat, full_named_parameters, gather_across_processes
from transformers import GPT2ForSequenceClassification

from tiny_models import VOCAB_SIZE, make_tokenizer
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True, help="directory of a saved transformers causal LM")
    parser.add_argument("--critic_model", required=True, help="directory of a saved one-label classifier")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=2)
    return parser.parse_args()


def build_trainer(args) -> PPOTrainer:
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-2, critic_learning_rate=5e-3,
        init_kl_coef=0.2, max_grad_norm=1.0, ptx_coef=0.5, ema_decay=0.5, seed=0,
    )  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model)
    critic = GPT2ForSequenceClassification.from_pretrained(args.critic_model)
    return PPOTrainer(config, model, tokenizer=make_tokenizer(), value_model=critic)


def main() -> None:
    args = parse_args()
    trainer = build_trainer(args)
    rank = trainer.accelerator.process_index
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        lengths = torch.randint(2, 6, (trainer.config.batch_size,), generator=g)
        queries = [torch.randint(3, VOCAB_SIZE, (int(n),), generator=g) for n in lengths]
        new_tokens = 3 + 2 * rank + step
        responses = trainer.generate(
            queries, return_prompt=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=True, top_k=0, pad_token_id=0,
        )  # fmt: skip
        scores = [(r % 2 == 0).float().mean() for r in responses]
        ptx = [torch.randint(3, VOCAB_SIZE, (int(n) + 2,), generator=g) for n in lengths]
        stats = trainer.step(queries, responses, scores, ptx_inputs=ptx)
        assert all(torch.isfinite(torch.tensor(v)) for v in stats.values() if isinstance(v, float)), stats

    device = trainer.accelerator.device
    policy = full_named_parameters(trainer)
    critic = full_named_parameters(trainer, trainer.accelerator.unwrap_model(trainer.critic).pretrained_model)
    ema = {name: t.to("cpu", torch.float64) for name, t in trainer._ema.full_parameters().items()}
    per_rank = {key: gather_across_processes(flat(named), device) for key, named in
                (("policy", policy), ("critic", critic), ("ema", ema))}  # fmt: skip
    partitioned = sum(p.numel() == 0 for p in trainer.accelerator.unwrap_model(trainer.critic).parameters())
    if dist.get_rank() == 0:
        torch.save(
            {
                "world_size": dist.get_world_size(),
                "critic_class": type(trainer.critic).__name__,
                "critic_partitioned_parameters": partitioned,
                "per_rank": per_rank,
                "policy": policy,
                "critic": critic,
                "ema": ema,
            },
            os.path.join(args.output_dir, "report.pt"),
        )
    trainer.save_pretrained(os.path.join(args.output_dir, "model"), save_value_model=True)
    trainer.save_pretrained(os.path.join(args.output_dir, "ema"), ema=True)
    finish(trainer)


if __name__ == "__main__":
    main()
