"""Sentiment tuning with GRPO: the offline sentiment task of ppo_sentiment.py without a critic.

Each step takes batch_size / num_samples_per_query prompts, lets the policy (a plain causal LM, no
value head) continue each of them num_samples_per_query times with
`trainer.generate(..., num_return_sequences=k)`, scores every continuation with the sentiment
classifier and hands the rows to `trainer.step`, which baselines each reward against the other
continuations of its prompt (PPOConfig advantage_estimator="grpo", docs/algorithm.md section 12).

    # offline default: the tiny SFT policy and classifier of tiny_sentiment.py, 4 samples per prompt
    python examples/scripts/grpo_sentiment.py
    # compare with a PPO run of the same batch size (the same budget of generated tokens per step)
    python examples/scripts/ppo_sentiment.py --output_dir outputs/ppo_sentiment
    python examples/scripts/grpo_sentiment.py --compare_with outputs/ppo_sentiment/metrics.jsonl
    # rollouts on a colocated vLLM engine (all prompts x k samples in one engine call); the engine's
    # log-probs go to step(), which reports their gap to the policy's (rollout/logprob_diff/*)
    python examples/scripts/grpo_sentiment.py --use_vllm

Every PPOConfig field is a flag too (--advantage_estimator rloo, --num_samples_per_query 8, ...).
Written to --output_dir: metrics.jsonl (one line per step), grpo_vs_ppo.png (with --compare_with:
reward against generated tokens, and step time, of both runs), model/ (the tuned plain transformers
policy and its tokenizer) and offline_models/ (the cached SFT and reward models).
"""

import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser  # noqa: E402

from trl_lite import LengthSampler, NoDatasetWarning, PPOConfig, PPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sentiment import (  # noqa: E402
    decode_pairs,
    first_and_last_rewards,
    is_main_process,
    load_reward_pipeline,
    reward_fn,
    start_run,
    step_record,
)


@dataclass
class ScriptArguments:
    """Flags of the demo besides PPOConfig's (which gives --model_name, --reward_model, --steps, ...)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Another name for --query_dataset (PPOConfig's, classic TRL's name), which it sets: a "
                  "dataset with a 'text' column; default: the offline reviews. Giving both with different values "
                  "is an error."},
    )  # fmt: skip
    output_dir: str = field(default="outputs/grpo_sentiment", metadata={"help": "Where metrics, plot and model go."})
    reward_label: str = field(default="POSITIVE", metadata={"help": "Classifier label whose logit is the reward."})
    input_min_text_length: int = field(default=2, metadata={"help": "Shortest prompt, in tokens."})
    input_max_text_length: int = field(default=8, metadata={"help": "Prompts are shorter than this, in tokens."})
    output_min_length: int = field(default=4, metadata={"help": "Fewest new tokens per generation call."})
    output_max_length: int = field(default=16, metadata={"help": "New tokens per generation call stay below this."})
    generation_batch_size: int = field(
        default=2, metadata={"help": "Prompts generated together (each num_samples_per_query times)."}
    )
    sft_steps: int = field(default=300, metadata={"help": "Training steps of the offline SFT model."})
    reward_model_steps: int = field(default=200, metadata={"help": "Training steps of the offline classifier."})
    compare_with: str | None = field(
        default=None, metadata={"help": "metrics.jsonl of a ppo_sentiment.py run with the same --batch_size, to plot."}
    )


# The PPO demo's defaults (same rows and generated tokens per step) with GRPO's estimator.
OFFLINE_GRPO_DEFAULTS = {
    "steps": 100, "learning_rate": 1e-4, "batch_size": 32, "mini_batch_size": 8,
    "advantage_estimator": "grpo", "num_samples_per_query": 4,
    # PPOConfig's hub names default to classic TRL's; a name not given here means the offline models.
    "model_name": None, "reward_model": None, "query_dataset": None,
}  # fmt: skip


def load_policy(config: PPOConfig, offline):
    """A plain causal LM and its tokenizer: from `config.model_name`, else the offline SFT model."""
    if config.model_name is None:
        return offline.policy, offline.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(config.model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(config.model_name), tokenizer


def generated_tokens(records: list[dict], rows_per_step: int) -> np.ndarray:
    """Cumulative generated tokens after each step: mean response length times the rows of a step."""
    return np.cumsum([r["tokens/responses_len_mean"] * rows_per_step for r in records])


def plot_comparison(grpo: list[dict], ppo: list[dict], rows_per_step: int, path: Path) -> None:
    """Reward against generated tokens, and the time of step(), of the GRPO and the PPO run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for records, name, color in ((ppo, "PPO (GAE, value head)", "tab:blue"), (grpo, "GRPO (no critic)", "tab:green")):
        axes[0].plot(generated_tokens(records, rows_per_step), [r["env/reward_mean"] for r in records], color=color, label=name)
        axes[1].plot([r["step"] for r in records], [r["time/ppo/total"] for r in records], color=color, label=name)
    axes[0].set_xlabel("generated tokens")
    axes[0].set_title("reward: positive logit of the classifier")
    axes[1].set_xlabel("step")
    axes[1].set_title("seconds per step() call")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(trainer: PPOTrainer, loader, rewards_of, args: ScriptArguments, gen_kwargs: dict, main: bool) -> list[dict]:
    """GRPO iterations until `config.steps`: k continuations per prompt, scores, `step()`; one record each."""
    config, tokenizer = trainer.config, trainer.tokenizer
    k = config.num_samples_per_query
    length_sampler = LengthSampler(args.output_min_length, args.output_max_length)
    metrics_path = Path(args.output_dir) / "metrics.jsonl"
    records = []
    progress = tqdm(total=config.steps, desc="GRPO", disable=not main)
    while trainer.current_step < config.steps:
        for batch in loader:
            queries = batch["input_ids"]
            start = time.perf_counter()
            generated = trainer.generate(
                queries, return_prompt=False, length_sampler=length_sampler, batch_size=args.generation_batch_size,
                num_return_sequences=k, return_logprobs=config.use_vllm, **gen_kwargs,
            )  # fmt: skip
            responses, logprobs = generated if config.use_vllm else (generated, None)
            generate_seconds = time.perf_counter() - start
            rows = [q for q in queries for _ in range(k)]  # the k continuations of a prompt are consecutive
            rewards = rewards_of(decode_pairs(tokenizer, rows, responses))
            stats = trainer.step(rows, responses, rewards, generation_logprobs=logprobs)
            record = step_record(trainer, stats, rewards)
            record["time/generate"] = generate_seconds
            records.append(record)
            if main:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                progress.update(1)
                progress.set_postfix(reward=f"{record['env/reward_mean']:+.2f}", kl=f"{record['objective/kl']:.2f}")
            if trainer.current_step >= config.steps:
                break
    progress.close()
    return records


def run(args: ScriptArguments, config: PPOConfig) -> None:
    start_time = time.perf_counter()
    main = is_main_process()
    output_dir = Path(args.output_dir)
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.jsonl").write_text("")
    offline, model, tokenizer, prompts = start_run(args, config, main)
    with warnings.catch_warnings():  # the loader below batches the prompts for step()
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
    # A step holds batch_size rows: batch_size / k prompts, each continued k times.
    loader = DataLoader(
        prompts, batch_size=config.batch_size // config.num_samples_per_query, shuffle=True, drop_last=True,
        collate_fn=lambda rows: {key: [row[key] for row in rows] for key in rows[0]},
        generator=torch.Generator().manual_seed(config.seed),
    )  # fmt: skip
    loader = trainer.accelerator.prepare(loader)
    rewards_of = reward_fn(load_reward_pipeline(config, offline, args.reward_label, trainer.accelerator.device), args.reward_label)
    # Pure sampling, as in the PPO demo: the k continuations of a prompt differ.
    gen_kwargs = {"min_length": -1, "top_k": 0, "top_p": 1.0, "do_sample": True, "pad_token_id": tokenizer.eos_token_id}
    records = train(trainer, loader, rewards_of, args, gen_kwargs, main)
    trainer.save_pretrained(str(output_dir / "model"))
    trainer.accelerator.end_training()
    if not main:
        return
    n, first, last = first_and_last_rewards(records)
    step_seconds = np.median([r["time/ppo/total"] for r in records])
    print(f"mean reward: first {n} steps {first:+.3f}, last {n} steps {last:+.3f}; median step() {step_seconds:.3f} s")
    if args.compare_with is not None:
        ppo = [json.loads(line) for line in Path(args.compare_with).read_text().splitlines() if line.strip()]
        rows = config.batch_size * trainer.accelerator.num_processes
        plot_comparison(records, ppo, rows, output_dir / "grpo_vs_ppo.png")
        ppo_last = np.mean([r["env/reward_mean"] for r in ppo[-n:]])
        ppo_seconds = np.median([r["time/ppo/total"] for r in ppo])
        print(
            f"PPO run: last {n} steps {ppo_last:+.3f}; median step() {ppo_seconds:.3f} s; "
            f"generated tokens GRPO {generated_tokens(records, rows)[-1]:.0f}, PPO {generated_tokens(ppo, rows)[-1]:.0f}"
        )
    print(f"wrote metrics.jsonl and model/ to {output_dir} in {time.perf_counter() - start_time:.0f} s")


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**OFFLINE_GRPO_DEFAULTS)
    args, config = parser.parse_args_into_dataclasses()
    run(args, config)


if __name__ == "__main__":
    main()
