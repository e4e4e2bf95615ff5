"""A short PPO rollout loop (generate -> score -> step, then save) run by every process.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/rollout_loop.py --base_model DIR --output_dir OUT [--peft] [--num_shared_layers N]

Each process draws its own queries, generates a different number of new tokens and splits its
queries into a different number of `generate` chunks (2 on rank 0, 1 on rank 1), so under ZeRO-3
the processes run different numbers of forward passes and of `model.generate` calls. After the loop,
the weights, the KL coefficient and the score moments of every process are collected with
`torch.distributed.all_gather` and rank 0 writes them to OUT/report.pt, with its own full weights;
the policy is saved to OUT/model with `PPOTrainer.save_pretrained`.
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import finish, flat, full_named_parameters, gather_across_processes

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from tiny_models import VOCAB_SIZE, make_tokenizer


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True, help="directory of a saved transformers causal LM")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter; the reference is the base model")
    parser.add_argument("--num_shared_layers", type=int, default=None)
    return parser.parse_args()


def build_trainer(args) -> PPOTrainer:
    config = PPOConfig(
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=2,
        learning_rate=1e-2,
        init_kl_coef=0.2,
        target=0.1,
        horizon=100,
        max_grad_norm=1.0,
        use_score_scaling=True,
        use_score_norm=True,
        seed=0,
    )
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model, peft_config=peft_config)
    return PPOTrainer(config, model, tokenizer=make_tokenizer(), num_shared_layers=args.num_shared_layers)


def score(response: torch.Tensor) -> torch.Tensor:
    """The share of even token ids in a response: a reward the tiny policy can learn."""
    return (response % 2 == 0).float().mean()


def rollout(trainer: PPOTrainer, steps: int) -> dict:
    """`steps` rounds of generate -> score -> step on this process's own queries.

    Returns, per step, the scores of every process (gathered with `torch.distributed`) and this
    process's `objective/kl` and `objective/kl_coef` statistics.
    """
    rank = trainer.accelerator.process_index
    history = {"scores": [], "kl": [], "kl_coef": []}
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        lengths = torch.randint(2, 6, (trainer.config.batch_size,), generator=g)
        queries = [torch.randint(3, VOCAB_SIZE, (int(n),), generator=g) for n in lengths]
        # Rank r asks for 3 + 4r + step new tokens: the processes generate different lengths.
        new_tokens = 3 + 4 * rank + step
        responses = trainer.generate(
            queries,
            return_prompt=False,
            batch_size=2 + 2 * rank,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            top_k=0,
            pad_token_id=0,
        )
        assert all(len(r) == new_tokens for r in responses), [len(r) for r in responses]
        scores = [score(r) for r in responses]
        stats = trainer.step(queries, responses, scores)
        assert all(torch.isfinite(torch.tensor(v)) for k, v in stats.items() if isinstance(v, float)), stats
        history["scores"].append(torch.cat(gather_across_processes(torch.stack(scores), trainer.accelerator.device)))
        history["kl"].append(stats["objective/kl"])
        history["kl_coef"].append(stats["objective/kl_coef"])
    return history


def report(trainer: PPOTrainer, history: dict, output_dir: str) -> None:
    """Collect every process's state with `torch.distributed` and write it from rank 0."""
    device = trainer.accelerator.device
    # Under ZeRO-3 a partitioned parameter holds an empty tensor outside a gather; count them to show
    # that the run really sharded weights (parameters below DeepSpeed's persistence threshold are not).
    model = trainer.accelerator.unwrap_model(trainer.model)
    partitioned = sum(p.numel() == 0 for p in model.parameters())
    named = full_named_parameters(trainer)
    weights = gather_across_processes(flat(named), device)
    running = trainer.running
    scalars = [trainer.kl_ctl.value, running.mean, running.std, running.count, *history["kl"], *history["kl_coef"]]
    scalars = gather_across_processes(torch.tensor(scalars, dtype=torch.float64), device)
    if dist.get_rank() == 0:
        torch.save(
            {
                "world_size": dist.get_world_size(),
                "num_processes": trainer.accelerator.num_processes,
                "model_class": type(trainer.model).__name__,
                "partitioned_parameters": partitioned,
                "ref_class": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
                "weights_per_rank": weights,
                # kl_ctl.value, running mean, std, count, then objective/kl and objective/kl_coef of each step
                "scalars_per_rank": scalars,
                "scores_per_step": history["scores"],
                "kl_per_step": history["kl"],
                "kl_coef_per_step": history["kl_coef"],
                "named_parameters": named,
            },
            os.path.join(output_dir, "report.pt"),
        )


def main() -> None:
    args = parse_args()
    trainer = build_trainer(args)
    history = rollout(trainer, args.steps)
    report(trainer, history, args.output_dir)
    trainer.save_pretrained(os.path.join(args.output_dir, "model"))
    finish(trainer)


if __name__ == "__main__":
    main()
