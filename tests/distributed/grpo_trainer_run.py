"""GRPOTrainer.train() (or RLOOTrainer's, with --trainer rloo) under `accelerate launch`: one generation (2 prompts x 4
completions, one prompt's group on each process), SGD so that the update is linear in the gradient. Writes, from the
main process, every process's rollout (queries, responses, scores as `step()` got them), the prompts each process's
reward function saw, the final weights of every process (gathered whole under ZeRO-3), the log history, the engine's
class and how many parameters it partitions to --output.

    accelerate launch --config_file accelerate_configs/{multi_gpu,deepspeed_zero2,deepspeed_zero3}.yaml \
        --num_processes 2 grpo_trainer_run.py --base_model DIR --output FILE
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import finish, full_named_parameters  # noqa: E402
from grpo_helpers import config, dataset, length_reward, tokenizer  # noqa: E402

from trl_lite import GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

SEEN, ROLLOUTS = [], []


def seen_prompts(prompts, completions, completion_ids, **kwargs):
    SEEN.extend(prompts)
    return [0.0] * len(prompts)


def build(base_model: str, output_dir: str, per_device_train_batch_size: int, trainer: str = "grpo") -> GRPOTrainer:
    """The run's trainer, ``GRPOTrainer`` or ``RLOOTrainer`` (also the 1-process replay's in the test)."""
    model = AutoModelForCausalLM.from_pretrained(base_model)
    args = config(output_dir, per_device_train_batch_size=per_device_train_batch_size, max_steps=1, beta=0.1,
                  max_completion_length=5, gradient_checkpointing=False)  # fmt: skip
    trainer_class = GRPOTrainer
    if trainer == "rloo":  # the same values as TRL's RLOO fields
        args = RLOOConfig(**{f: getattr(args, f) for f in ("output_dir", "per_device_train_batch_size", "num_generations",
                          "max_completion_length", "max_steps", "learning_rate", "logging_steps", "save_strategy",
                          "report_to", "disable_tqdm", "seed", "beta", "gradient_checkpointing")})  # fmt: skip
        trainer_class = RLOOTrainer
    return trainer_class(model, [length_reward, seen_prompts], args=args, train_dataset=dataset(),
                         processing_class=tokenizer(), optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None))  # fmt: skip


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    args = parser.parse_args()
    trainer = build(args.base_model, os.path.dirname(args.output), per_device_train_batch_size=4, trainer=args.trainer)
    step = trainer.ppo.step

    def recording_step(queries, responses, scores, **kwargs):
        ROLLOUTS.append(([q.tolist() for q in queries], [r.tolist() for r in responses], [float(s) for s in scores]))
        return step(queries, responses, scores, **kwargs)

    trainer.ppo.step = recording_step
    trainer.train()
    weights = full_named_parameters(trainer.ppo, trainer.model)
    rollouts, seen, all_weights = gather(ROLLOUTS), gather(SEEN), gather(weights)
    partitioned = sum(p.numel() == 0 for p in trainer.model.parameters())  # ZeRO-3 shards outside a gather
    if trainer.accelerator.is_main_process:
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        torch.save({"rollouts": rollouts, "seen": seen, "weights": all_weights, "log_history": trainer.state.log_history,
                    "num_processes": trainer.accelerator.num_processes, "partitioned_parameters": partitioned,
                    "model_class": type(trainer.ppo.model).__name__}, args.output)  # fmt: skip
    finish(trainer)


if __name__ == "__main__":
    main()
