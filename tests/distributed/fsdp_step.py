"""PPO steps under FSDP2 (`accelerate_configs/fsdp2.yaml`) on a fixed global batch of 8 rows, split over the processes.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 \\
        tests/distributed/fsdp_step.py --output_dir OUT
    accelerate launch --config_file accelerate_configs/single_gpu.yaml tests/distributed/fsdp_step.py --output_dir OUT

Every case takes exactly one optimizer step (SGD: the update is linear in the gradient) on the same 8 rows with
equal response lengths, so 2 processes x 4 rows and 1 process x 8 rows must give the same update (see
equivalence_step.py). Rank 0 writes OUT/<case>.pt: the full weights before and after, the step's scalar statistics
and how far the processes' weights were apart. Cases:

- ``gae``: GPT-2 with a value head and a created reference; greedy generation before and after the step
  (transformers engine, the first call before any forward), ``save_pretrained`` into OUT/gae_saved;
- ``qwen``: a rotary GQA Qwen2 with a value head, packed passes, gradient checkpointing, a token budget,
  a chunked LM head and gradient accumulation (2 mini-batches per process);
- ``grpo_lora``: a plain Qwen2 LM with a LoRA adapter (PEFT), GRPO, the reference its adapter-less self;
- ``critic``: GPT-2 policy with a separate critic (GPT-2 classifier);
- ``resume``: two steps straight against one step, ``save_checkpoint``, a new trainer, ``load_checkpoint``
  and the second step (Adam, an LR scheduler): the weights must be bit-identical.
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import finish, full_named_parameters

from tiny_models import make_gpt2, make_gpt2_critic, make_qwen2, make_tokenizer, random_batch
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed

GLOBAL_BATCH = 8
CASES = ("gae", "qwen", "grpo_lora", "critic", "resume")


def build(case: str, per_process: int, world_size: int) -> PPOTrainer:
    common = dict(batch_size=per_process, mini_batch_size=per_process, ppo_epochs=1, learning_rate=0.1,
                  init_kl_coef=0.2, target=0.1, horizon=100, max_grad_norm=None, seed=0)  # fmt: skip
    tokenizer = make_tokenizer()
    set_seed(0)
    if case == "gae":
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
        return PPOTrainer(PPOConfig(**common), model, tokenizer=tokenizer,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    if case == "qwen":
        config = PPOConfig(**{**common, "mini_batch_size": per_process // 2, "gradient_accumulation_steps": 2},
                           padding_free=True, gradient_checkpointing=True, max_tokens_per_minibatch=24,
                           lm_head_chunk_size=5)  # fmt: skip
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_qwen2(seed=0))
        return PPOTrainer(config, model, tokenizer=tokenizer, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    if case == "grpo_lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
        model = get_peft_model(make_qwen2(seed=0), lora)
        config = PPOConfig(**common, advantage_estimator="grpo", num_samples_per_query=4)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return PPOTrainer(config, model, tokenizer=tokenizer, optimizer=optimizer)
    if case == "critic":
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
        critic = make_gpt2_critic(seed=1)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return PPOTrainer(PPOConfig(**common), model, tokenizer=tokenizer, value_model=critic,
                          optimizer=torch.optim.SGD(trainable, lr=0.1),
                          critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.1))  # fmt: skip
    # resume: Adam and a scheduler, whose states must come back
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = PPOConfig(**{**common, "learning_rate": 1e-2, "max_grad_norm": 1.0})
    return PPOTrainer(config, model, tokenizer=tokenizer, optimizer=optimizer, lr_scheduler=scheduler)


def batch(case: str, rank: int, per_process: int, seed: int = 7):
    queries, responses, scores = random_batch(GLOBAL_BATCH, seed=seed, query_len=(2, 6), response_len=(5, 5))
    if case == "grpo_lora":  # groups of 4 answers to one query
        queries = [queries[i - i % 4] for i in range(GLOBAL_BATCH)]
    rows = slice(rank * per_process, (rank + 1) * per_process)
    return queries[rows], responses[rows], scores[rows]


def spread(trainer, named: dict) -> float:
    """The largest difference between the processes' full weights (0.0 on one process)."""
    if not dist.is_initialized():
        return 0.0
    flat = torch.cat([named[k].flatten() for k in sorted(named)])
    out = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return max((o - out[0]).abs().max().item() for o in out)


def full_weights(trainer) -> dict:
    named = full_named_parameters(trainer)
    if trainer.critic is not None:
        critic = full_named_parameters(trainer, trainer.critic)
        named.update({f"critic.{k}": v for k, v in critic.items()})
    return named


def run_case(case: str, rank: int, world_size: int, output_dir: str) -> None:
    per_process = GLOBAL_BATCH // world_size
    trainer = build(case, per_process, world_size)
    result = {"world_size": world_size, "sharded": _sharded(trainer)}
    tokenizer = make_tokenizer()
    prompts = [torch.tensor(tokenizer.encode(t)) for t in ("the movie was", "i loved this film and")]
    greedy = dict(do_sample=False, max_new_tokens=4, batch_size=2)
    if case == "gae":
        result["generated_before"] = [r.tolist() for r in trainer.generate(prompts, **greedy)]
    before = full_weights(trainer)
    stats = trainer.step(*batch(case, rank, per_process))
    if case == "resume":
        path = os.path.join(output_dir, "resume_checkpoint")
        trainer.save_checkpoint(path)
        stats = trainer.step(*batch(case, rank, per_process, seed=8))
        straight = full_weights(trainer)
        trainer = build(case, per_process, world_size)
        trainer.load_checkpoint(path)
        trainer.step(*batch(case, rank, per_process, seed=8))
        result["straight"] = straight
    after = full_weights(trainer)
    if case == "gae":
        result["generated_after"] = [r.tolist() for r in trainer.generate(prompts, **greedy)]
        trainer.save_pretrained(os.path.join(output_dir, "gae_saved"))
        result["pushed"] = pushed_weights(trainer)
    result.update(before=before, after=after, spread=spread(trainer, after), kl_coef=trainer.kl_ctl.value,
                  stats={k: v for k, v in stats.items() if isinstance(v, float) and not k.startswith("time/")})  # fmt: skip
    if rank == 0:
        torch.save(result, os.path.join(output_dir, f"{case}.pt"))
    trainer.accelerator.wait_for_everyone()


def pushed_weights(trainer) -> dict:
    """What a weight push to vLLM sends (the trainer's generation part, with its FSDP2 gathering around the push, and
    ``named_policy_weights`` as for vLLM), captured instead of sent; float64 CPU copies by name."""
    from trl_lite.engines.weight_sync import WeightVersion, named_policy_weights

    generation, pushed = trainer.generation, {}
    lm = trainer.accelerator.unwrap_model(trainer.model).pretrained_model
    generation.policy_weights = lambda: named_policy_weights(lm)
    generation.version = WeightVersion(trainer.optimizer)
    generation.push = lambda weights: pushed.update({n: t.to("cpu", torch.float64).clone() for n, t in weights})
    generation._push()
    return pushed


def _sharded(trainer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in trainer.model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for case in args.cases.split(","):
        run_case(case, rank, world_size, args.output_dir)
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
