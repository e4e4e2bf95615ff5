"""TRL's GRPO quickstart, as a TRL 1.x user writes it, on trl_lite: SmolLM2-135M-Instruct learns to add, offline.

The shape of TRL's documented quickstart - a dataset with a ``prompt`` column, reward functions with TRL's
signature, ``GRPOConfig``, ``GRPOTrainer(...).train()`` - with ``from trl_lite import ...`` in place of
``from trl import ...``. The task is that of `grpo_smollm2.py` (the hand-written ``step()`` loop): "What is a + b?
Reply with the number only." in the model's chat template (a conversational dataset), the reward 1 if the last
integer of the reply is a + b, a LoRA adapter on the attention and MLP projections, held-out questions (split by
unordered pair) answered greedily before, every --eval_every optimizer steps, and after.

    python examples/scripts/grpo_trainer_smollm2.py                       # docs/migrating_from_trl.md has the result
    python examples/scripts/grpo_trainer_smollm2.py --max_steps 2 --num_heldout 4   # a smoke test

Every GRPOConfig field is a flag too. Written to --output_dir: checkpoints, the final LoRA adapter and tokenizer,
and heldout.json (the held-out accuracy by optimizer step).
"""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, disable_progress_bars
from peft import LoraConfig
from transformers import AutoModelForCausalLM, HfArgumentParser, TrainerCallback
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_smollm2 import PROJECTIONS, answer_reward, greedy_replies, question, split_problems  # noqa: E402
from smollm2 import load_smollm2  # noqa: E402

from trl_lite import GRPOConfig, GRPOTrainer  # noqa: E402  (a TRL script: from trl import GRPOConfig, GRPOTrainer)


@dataclass
class ScriptArguments:
    """Flags besides GRPOConfig's."""

    lora_rank: int = field(default=16, metadata={"help": "Rank of the LoRA adapter."})
    max_operand: int = field(default=19, metadata={"help": "Questions add two integers in 1..max_operand."})
    num_heldout: int = field(default=64, metadata={"help": "Held-out questions of the greedy accuracy."})
    eval_every: int = field(default=8, metadata={"help": "Held-out accuracy every this many optimizer steps."})

    def __post_init__(self):
        for name in ("lora_rank", "num_heldout", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")


# grpo_smollm2.py's run in GRPOConfig's terms: 8 questions x 4 completions a generation, in two passes of 16 (two
# optimizer steps a generation: 12 generations are 24 steps), replies of at most 12 tokens at temperature 0.7, DAPO's
# loss with clip-higher, no KL (beta 0, no reference), learning rate 2e-4, on the transformers engine.
DEFAULTS = {
    "output_dir": "outputs/grpo_trainer_smollm2", "max_steps": 24, "num_generations": 4,
    "per_device_train_batch_size": 16, "steps_per_generation": 2, "max_completion_length": 12, "temperature": 0.7,
    "learning_rate": 2e-4, "lr_scheduler_type": "constant", "max_grad_norm": 1.0, "loss_type": "dapo",
    "epsilon_high": 0.28, "beta": 0.0, "logging_steps": 2, "save_steps": 12, "save_total_limit": 1, "seed": 0,
    "gradient_checkpointing": False, "report_to": "none",
}  # fmt: skip


def make_dataset(problems: list) -> Dataset:
    """A conversational dataset: the question as a user message, the operands as columns for the reward."""
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": question(a, b)}] for a, b in problems],
        "a": [a for a, _ in problems], "b": [b for _, b in problems],
    })  # fmt: skip


def accuracy(completions, a, b, **kwargs) -> list[float]:
    """TRL's reward signature: 1.0 where the reply's last integer is a + b (`a`, `b`: the dataset's columns)."""
    return [answer_reward(completion[0]["content"], x, y) for completion, x, y in zip(completions, a, b)]


class HeldoutAccuracy(TrainerCallback):
    """Greedy accuracy on the held-out questions every ``every`` optimizer steps (greedy: no random state used)."""

    def __init__(self, trainer: GRPOTrainer, heldout: list, every: int):
        self.trainer, self.heldout, self.every, self.results = trainer, heldout, every, {}

    def measure(self, step: int) -> float:
        rewards = greedy_replies(self.trainer.ppo, self.heldout, self.trainer.args.max_completion_length)[1]
        self.results[step] = sum(rewards) / len(rewards)
        return self.results[step]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.measure(state.global_step)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, GRPOConfig))
    parser.set_defaults(**DEFAULTS)
    script_args, training_args = parser.parse_args_into_dataclasses()
    start = time.perf_counter()
    disable_progress_bars()
    transformers_logging.set_verbosity_error()

    model, tokenizer = load_smollm2(AutoModelForCausalLM)
    train, heldout = split_problems(script_args.max_operand, script_args.num_heldout, training_args.seed)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[accuracy], args=training_args, train_dataset=make_dataset(train),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=script_args.lora_rank, lora_alpha=2 * script_args.lora_rank, target_modules=PROJECTIONS),
    )  # fmt: skip
    heldout_accuracy = HeldoutAccuracy(trainer, heldout, script_args.eval_every)
    before = heldout_accuracy.measure(0)
    trainer.add_callback(heldout_accuracy)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    after = heldout_accuracy.results[trainer.state.global_step]
    Path(training_args.output_dir, "heldout.json").write_text(json.dumps(heldout_accuracy.results))
    sampled = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print(f"{len(heldout)} held-out questions, greedy accuracy: before {before:.1%}, after {after:.1%} "
          f"({trainer.state.global_step} optimizer steps; by step: {heldout_accuracy.results})")  # fmt: skip
    print(f"sampled reward by log: {[round(r, 2) for r in sampled]}")
    print(f"wrote the adapter, checkpoints and heldout.json to {training_args.output_dir} in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
