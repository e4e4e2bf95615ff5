"""A GRPO rollout loop on a plain causal LM (generate k per query -> score -> step), with a checkpoint
and an exact resume, run by every process.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/grpo_rollout_loop.py --base_model DIR --output_dir OUT

with the DeepSpeed ZeRO-2 or ZeRO-3 config or the DDP one (multi_gpu). Each process draws its own queries and generates 4 responses per query with
``generate(num_return_sequences=4)``; the groups stay in their process. After step 2 the trainer
saves a checkpoint and takes step 3; a second trainer, built afresh in the same processes, loads
the checkpoint and takes step 3 again. Rank 0 writes to OUT/report.pt every process's weights
(gathered with ``torch.distributed``), both step-3 results and the statistics; the policy is saved
to OUT/model with ``PPOTrainer.save_pretrained`` (a plain transformers model).
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import finish, flat, full_named_parameters, gather_across_processes
from transformers import AutoModelForCausalLM

from tiny_models import VOCAB_SIZE, make_tokenizer
from trl_lite import PPOConfig, PPOTrainer

SAMPLES = 4
QUERIES = 2
STEPS = 3


def build_trainer(base_model: str) -> PPOTrainer:
    config = PPOConfig(
        batch_size=QUERIES * SAMPLES,
        mini_batch_size=2,
        ppo_epochs=2,
        learning_rate=1e-2,
        advantage_estimator="grpo",
        num_samples_per_query=SAMPLES,
        init_kl_coef=0.2,
        target=0.1,
        horizon=100,
        seed=0,
    )
    # The reference is loaded, not copied: under ZeRO-3 a loaded model is already partitioned.
    policy, reference = (AutoModelForCausalLM.from_pretrained(base_model) for _ in range(2))
    return PPOTrainer(config, policy, ref_model=reference, tokenizer=make_tokenizer())


def score(response: torch.Tensor) -> torch.Tensor:
    """The share of even token ids in a response."""
    return (response % 2 == 0).float().mean()


def one_step(trainer: PPOTrainer, step: int) -> dict:
    rank = trainer.accelerator.process_index
    g = torch.Generator().manual_seed(1000 * step + rank)
    queries = [torch.randint(3, VOCAB_SIZE, (int(n),), generator=g) for n in torch.randint(2, 6, (QUERIES,), generator=g)]
    # Rank r asks for a different length: the processes run different numbers of forward passes.
    new_tokens = 3 + 2 * rank
    responses = trainer.generate(
        queries, return_prompt=False, batch_size=QUERIES, num_return_sequences=SAMPLES, do_sample=True, top_k=0,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
    )  # fmt: skip
    rows = [q for q in queries for _ in range(SAMPLES)]
    stats = trainer.step(rows, responses, [score(r) for r in responses])
    return {k: v for k, v in stats.items() if isinstance(v, float) and not k.startswith("time/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    checkpoint = os.path.join(args.output_dir, "checkpoint")

    trainer = build_trainer(args.base_model)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    head_before = unwrapped.v_head.summary.weight.detach().clone()
    history = [one_step(trainer, step) for step in (1, 2)]
    trainer.save_checkpoint(checkpoint)
    history.append(one_step(trainer, STEPS))
    straight = full_named_parameters(trainer)
    # The internal value head of the plain policy neither trains nor needs gradients.
    head_trained = any(p.requires_grad for p in unwrapped.v_head.parameters()) or not torch.equal(
        unwrapped.v_head.summary.weight.detach(), head_before
    )
    device = trainer.accelerator.device
    weights = gather_across_processes(flat(straight), device)
    kl_coefs = gather_across_processes(torch.tensor([trainer.kl_ctl.value]), device)
    trainer.save_pretrained(os.path.join(args.output_dir, "model"))

    resumed_trainer = build_trainer(args.base_model)
    resumed_trainer.load_checkpoint(checkpoint)
    resumed_stats = one_step(resumed_trainer, STEPS)
    resumed = full_named_parameters(resumed_trainer)
    if dist.get_rank() == 0:
        torch.save(
            {
                "world_size": dist.get_world_size(),
                "model_class": type(trainer.model).__name__,
                "weights_per_rank": weights,
                "kl_coef_per_rank": kl_coefs,
                "history": history,
                "straight": straight,
                "resumed": resumed,
                "resumed_stats": resumed_stats,
                "resumed_step": resumed_trainer.current_step,
                "head_trained": head_trained,
            },
            os.path.join(args.output_dir, "report.pt"),
        )
    finish(resumed_trainer)


if __name__ == "__main__":
    main()
