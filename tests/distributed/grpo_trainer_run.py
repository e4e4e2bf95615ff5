"""GRPOTrainer.train() (or RLOOTrainer's, with --trainer rloo) under `accelerate launch`: one generation (2 prompts x 4
completions, one prompt's group on each process), SGD so that the update is linear in the gradient. Writes, from the
main process, every process's rollout (queries, responses, scores as `step()` got them), the prompts each process's
reward function saw, the final weights of every process (gathered whole under ZeRO-3), the log history, the engine's
class and how many parameters it partitions to --output.

    accelerate launch --config_file accelerate_configs/{multi_gpu,deepspeed_zero2,deepspeed_zero3}.yaml \
        --num_processes 2 grpo_trainer_run.py --base_model DIR --output FILE [--agents tools|environment]

``--agents``: TRL's ``tools`` (test_agents' ``add``) or ``environment_factory`` (test_grpo_trainer_tools' ``Counter``,
its ``get_reward`` a reward source) on chat prompts; DIR then holds a sampling successor model of test_agents that
calls the tool in some completions (the trainer gives each process a sampling seed of its own, so the processes'
episodes differ), and each step() call's response masks and group ids are written too. Every run also writes each
process's sampling seed.
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
    """Records each prompt (as text) and, for chat completions, its number of tool messages; rewards nothing."""
    for prompt, completion in zip(prompts, completions):
        tool_messages = sum(m["role"] == "tool" for m in completion) if isinstance(completion, list) else 0
        SEEN.append((str(prompt), tool_messages))
    return [0.0] * len(prompts)


def build(base_model: str, output_dir: str, per_device_train_batch_size: int, trainer: str = "grpo",
          agents: str | None = None) -> GRPOTrainer:  # fmt: skip
    """The run's trainer, ``GRPOTrainer`` or ``RLOOTrainer`` (also the 1-process replay's in the test); ``agents``:
    None, ``"tools"`` or ``"environment"`` (see the module docstring)."""
    model = AutoModelForCausalLM.from_pretrained(base_model)
    if agents is not None:
        return _agents_trainer(model, output_dir, per_device_train_batch_size, agents)
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


def _agents_trainer(model, output_dir: str, per_device_train_batch_size: int, agents: str) -> GRPOTrainer:
    """GRPO with test_agents' ``add`` tool or test_grpo_trainer_tools' ``Counter`` environments, one tool round."""
    from test_agents import add, make_chat_tokenizer
    from test_grpo_trainer_tools import Counter
    from test_grpo_trainer_tools import config as agents_config
    from test_grpo_trainer_tools import dataset as agents_dataset

    args = agents_config(output_dir, per_device_train_batch_size=per_device_train_batch_size, max_steps=1, beta=0.1,
                         max_completion_length=40, gradient_checkpointing=False)  # fmt: skip
    tools = {"tools": [add]} if agents == "tools" else {"environment_factory": Counter}
    return GRPOTrainer(model, [length_reward, seen_prompts], args=args, train_dataset=agents_dataset(start=[3, 1]),
                       processing_class=make_chat_tokenizer(),
                       optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None), **tools)  # fmt: skip


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    parser.add_argument("--agents", choices=["tools", "environment"], default=None)
    args = parser.parse_args()
    trainer = build(args.base_model, os.path.dirname(args.output), per_device_train_batch_size=4, trainer=args.trainer,
                    agents=args.agents)  # fmt: skip
    step = trainer.ppo.step

    def recording_step(queries, responses, scores, **kwargs):
        rollout = ([q.tolist() for q in queries], [r.tolist() for r in responses], [float(s) for s in scores])
        if args.agents is not None:
            rollout += ([m.tolist() for m in kwargs["response_masks"]], list(kwargs["group_ids"]))
        ROLLOUTS.append(rollout)
        return step(queries, responses, scores, **kwargs)

    trainer.ppo.step = recording_step
    sampling_seed = torch.initial_seed()  # the trainer's seed per process (args.seed + the process's index)
    trainer.train()
    weights = full_named_parameters(trainer.ppo, trainer.model)
    rollouts, seen, all_weights, seeds = gather(ROLLOUTS), gather(SEEN), gather(weights), gather(sampling_seed)
    partitioned = sum(p.numel() == 0 for p in trainer.model.parameters())  # ZeRO-3 shards outside a gather
    if trainer.accelerator.is_main_process:
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        torch.save({"rollouts": rollouts, "seen": seen, "weights": all_weights, "log_history": trainer.state.log_history,
                    "num_processes": trainer.accelerator.num_processes, "partitioned_parameters": partitioned,
                    "model_class": type(trainer.ppo.model).__name__, "sampling_seeds": seeds}, args.output)  # fmt: skip
    finish(trainer)


if __name__ == "__main__":
    main()
