"""Sentiment tuning with PPO: teach a language model to continue movie reviews positively.

Every step cuts prompts from reviews, lets the policy continue them (`trainer.generate` with a
`LengthSampler`), scores each prompt+continuation with a sentiment classifier run through a
transformers `pipeline` (the reward is the classifier's positive logit), and trains on the
(prompt, continuation, reward) triplets with `trainer.step`.

    # offline default, under a minute on two CPU cores: tiny models trained here (tiny_sentiment.py)
    python examples/scripts/ppo_sentiment.py
    # the classic setup from the model hub
    python examples/scripts/ppo_sentiment.py --model_name lvwerra/gpt2-imdb \
        --reward_model sentiment-analysis:lvwerra/distilbert-imdb --query_dataset stanfordnlp/imdb \
        --learning_rate 1.41e-5 --batch_size 128 --mini_batch_size 128 --steps 195 --generation_batch_size 16
    # a separate critic (DeepSpeed-Chat/OpenRLHF style), initialised from a one-label reward model
    # that reads the policy's tokens (e.g. RewardTrainer's output); written to model/value_model
    python examples/scripts/ppo_sentiment.py --value_model path/to/reward_model
    # rollouts on a colocated vLLM engine; its log-probs go to step() (rollout/logprob_diff/*)
    python examples/scripts/ppo_sentiment.py --use_vllm
    # ... on a vLLM server started with `python -m trl_lite.vllm_server --model <dir>`
    python examples/scripts/ppo_sentiment.py --use_vllm --vllm_mode server --model_name <dir> ...
    # the next batches generated and scored on a producer thread while step() trains (trl_lite.rollouts)
    python examples/scripts/ppo_sentiment.py --async_rollouts --max_staleness 1
    # several processes (only the main one prints and writes files)
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 \
        examples/scripts/ppo_sentiment.py

Each of --model_name, --reward_model and --query_dataset that is not given comes from the offline
default. --reward_model has PPOConfig's (classic TRL's) meaning, `task:model`
(sentiment-analysis:lvwerra/distilbert-imdb); a bare model name means the sentiment-analysis task.
--dataset_name is another name for --query_dataset (give one; both, different, is an error). Every PPOConfig field is a flag too (--ppo_epochs, --init_kl_coef, --target, ...). Written to
--output_dir: metrics.jsonl (one line per step), training_curves.png (redrawn as training goes),
model/ (the tuned policy with its value head, and the tokenizer; the critic in model/value_model), runs/ (with --log_with tensorboard),
checkpoint/ (with --save_every) and offline_models/ (the cached SFT and reward models).
"""

import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset, disable_progress_bars, load_dataset  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoTokenizer, HfArgumentParser, pipeline  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from trl_lite import (  # noqa: E402
    AutoModelForCausalLMWithValueHead,
    LengthSampler,
    PPOConfig,
    PPOTrainer,
    ValueModel,
    set_seed,
)
from trl_lite.rollouts import AsyncRollouts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_record import load_average, record_run  # noqa: E402
from tiny_sentiment import OfflineModels, build_offline_models, load_reviews  # noqa: E402


@dataclass
class ScriptArguments:
    """Flags of the demo besides PPOConfig's (which gives --model_name, --reward_model, --steps, ...)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Another name for --query_dataset (PPOConfig's, classic TRL's name), which it sets: a "
                  "dataset with a 'text' column (hub name or local path); default: the offline reviews. Giving "
                  "both with different values is an error."},
    )  # fmt: skip
    output_dir: str = field(
        default="outputs/ppo_sentiment", metadata={"help": "Where metrics, curves and the model go."}
    )
    reward_label: str = field(default="POSITIVE", metadata={"help": "Classifier label whose logit is the reward."})
    input_min_text_length: int = field(default=2, metadata={"help": "Shortest prompt, in tokens."})
    input_max_text_length: int = field(default=8, metadata={"help": "Prompts are shorter than this, in tokens."})
    output_min_length: int = field(default=4, metadata={"help": "Fewest new tokens per generation call."})
    output_max_length: int = field(default=16, metadata={"help": "New tokens per generation call stay below this."})
    generation_batch_size: int = field(default=8, metadata={"help": "Prompts generated together by trainer.generate."})
    sft_steps: int = field(default=300, metadata={"help": "Training steps of the offline SFT model."})
    reward_model_steps: int = field(default=200, metadata={"help": "Training steps of the offline classifier."})
    num_samples: int = field(default=6, metadata={"help": "Prompts of the before/after table."})
    plot_every: int = field(default=10, metadata={"help": "Redraw training_curves.png every this many steps."})
    save_every: int = field(default=0, metadata={"help": "Write OUTPUT_DIR/checkpoint every N steps; 0: never."})
    resume_from: str | None = field(default=None, metadata={"help": "Checkpoint directory to continue from."})
    value_model: str | None = field(
        default=None,
        metadata={
            "help": "A one-label sequence-classification model (hub name or directory, e.g. a reward model over "
            "the policy's tokenizer) that initialises a separate critic; default: the policy's value head."
        },
    )

    async_rollouts: bool = field(
        default=False,
        metadata={"help": "Generate and score the next batches on a producer thread while step() trains "
                  "(trl_lite.rollouts.AsyncRollouts)."},
    )  # fmt: skip
    max_staleness: int = field(
        default=1, metadata={"help": "With --async_rollouts: steps a batch's policy may lag behind (0: synchronous)."}
    )
    record_results: str | None = field(
        default=None,
        metadata={"help": "Also write the printed results, with the command, commit, date, machine and load, as "
                  "this command's section of a markdown file (e.g. benchmarks/RESULTS.md)."},
    )  # fmt: skip

    def __post_init__(self):
        minimums = (("plot_every", 1), ("num_samples", 1), ("save_every", 0), ("sft_steps", 1), ("max_staleness", 0))
        for name, minimum in minimums:
            if getattr(self, name) < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {getattr(self, name)}.")
        if self.reward_model_steps < 1:
            raise ValueError(f"reward_model_steps must be an int >= 1, got {self.reward_model_steps}.")


# PPOConfig defaults that suit the offline default; the classic values are in the module docstring.
# PPOConfig's hub names default to classic TRL's (gpt2, its IMDb classifier and dataset); here a name that is
# not given means the offline models, so the demo runs with no network.
OFFLINE_PPO_DEFAULTS = {
    "steps": 100, "learning_rate": 1e-4, "batch_size": 32, "mini_batch_size": 8,
    "model_name": None, "reward_model": None, "query_dataset": None,
}  # fmt: skip


def is_main_process() -> bool:
    """True on the process of rank 0, read from the launcher's environment (the trainer does not exist yet)."""
    return int(os.environ.get("RANK", "0")) == 0


def load_policy(config: PPOConfig, offline: OfflineModels | None):
    """The policy with a value head and its tokenizer: from `config.model_name`, else the offline SFT model."""
    if config.model_name is None:
        return AutoModelForCausalLMWithValueHead.from_pretrained(offline.policy), offline.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(config.model_name)
    if tokenizer.pad_token is None:
        # GPT-2 has no padding token; its end-of-text token pads, as in the classic demo.
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLMWithValueHead.from_pretrained(config.model_name), tokenizer


def reward_task_and_model(reward_model: str) -> tuple[str, str]:
    """PPOConfig's `reward_model`, classic TRL's `task:model` (`sentiment-analysis:lvwerra/distilbert-imdb`), as
    (task, model); a bare model name (no ':') means the sentiment-analysis task."""
    task, colon, model = reward_model.partition(":")
    if not colon:
        return "sentiment-analysis", reward_model
    if not task or not model:
        raise ValueError(f"reward_model must be 'task:model' or a model name, got {reward_model!r}.")
    return task, model


def query_dataset(args: ScriptArguments, config: PPOConfig) -> str | None:
    """The prompts' dataset: --query_dataset, or --dataset_name, its other name; both, different: a ValueError."""
    if args.dataset_name is not None and config.query_dataset is not None and args.dataset_name != config.query_dataset:
        raise ValueError(
            f"--dataset_name ({args.dataset_name!r}) and --query_dataset ({config.query_dataset!r}) name the same "
            "setting, the prompts' dataset; give one of them."
        )
    return config.query_dataset if config.query_dataset is not None else args.dataset_name


def load_reward_pipeline(config: PPOConfig, offline: OfflineModels | None, label: str, device):
    """The sentiment classifier as a `pipeline`: from `config.reward_model`, else the offline one."""
    if config.reward_model is None:
        pipe = pipeline(
            "sentiment-analysis", model=offline.reward_model, tokenizer=offline.reward_tokenizer, device=device
        )
    else:
        task, model = reward_task_and_model(config.reward_model)
        pipe = pipeline(task, model=model, device=device)
    labels = list(pipe.model.config.id2label.values())
    if label not in labels:
        raise ValueError(f"reward_label={label!r} is not a label of the reward model; accepted: {labels}.")
    return pipe


def reward_fn(pipe, label: str):
    """A function from texts to rewards: the classifier's raw logit of `label`, one 0-d tensor per text."""

    def rewards(texts: list[str]) -> list[torch.Tensor]:
        outputs = pipe(texts, top_k=None, function_to_apply="none", batch_size=16, truncation=True)
        return [torch.tensor(next(o["score"] for o in out if o["label"] == label)) for out in outputs]

    return rewards


def build_prompt_dataset(reviews: Dataset, tokenizer, min_length: int, max_length: int) -> Dataset:
    """Prompts cut from the start of each review's 'text', `LengthSampler(min_length, max_length)` tokens long.

    Rows: 'input_ids' (1-D tensor) and 'query' (its text). Reviews shorter than `min_length` are dropped.
    """
    sampler = LengthSampler(min_length, max_length)

    def cut(row):
        input_ids = tokenizer(row["text"], truncation=True, max_length=max_length)["input_ids"][: sampler()]
        return {"input_ids": input_ids, "query": tokenizer.decode(input_ids)}

    prompts = reviews.map(cut, remove_columns=reviews.column_names)
    prompts = prompts.filter(lambda row: len(row["input_ids"]) >= min_length)
    prompts.set_format("torch")
    return prompts


def load_review_texts(dataset_name: str | None) -> Dataset:
    """The reviews to cut prompts from: the 'train' split of `dataset_name`, else the offline corpus."""
    if dataset_name is None:
        return Dataset.from_list(load_reviews())
    return load_dataset(dataset_name, split="train")


def decode_pairs(tokenizer, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> list[str]:
    """Prompt+continuation texts, decoded together so that word-level and BPE tokenizers both space them right."""
    pairs = [torch.cat([q.cpu(), r.cpu()]) for q, r in zip(queries, responses)]
    return tokenizer.batch_decode(pairs, skip_special_tokens=True)


def step_record(trainer: PPOTrainer, stats: dict, rewards: list[torch.Tensor]) -> dict:
    """The step's scalar statistics plus the reward mean and std over every process's rows."""
    all_rewards = trainer.accelerator.gather(torch.stack(rewards).to(trainer.accelerator.device)).float()
    record = {"step": trainer.current_step}
    record["env/reward_mean"] = all_rewards.mean().item()
    record["env/reward_std"] = all_rewards.std().item() if all_rewards.numel() > 1 else 0.0
    record.update({key: float(value) for key, value in stats.items() if np.ndim(value) == 0})
    return record


def read_metrics(path: Path, up_to_step: int) -> list[dict]:
    """The records of `path` up to `up_to_step` (those a resumed run keeps)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= up_to_step]


def plot_curves(records: list[dict], path: Path, kl_target: float | None,
                reward_title: str = "reward: positive logit of the classifier") -> None:
    """Reward (mean with a one-std band), KL and KL coefficient against step, written atomically to `path`."""
    steps = np.array([r["step"] for r in records])
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    mean = np.array([r["env/reward_mean"] for r in records])
    std = np.array([r["env/reward_std"] for r in records])
    axes[0].plot(steps, mean, color="tab:green")
    axes[0].fill_between(steps, mean - std, mean + std, color="tab:green", alpha=0.2)
    axes[0].set_title(reward_title)
    axes[1].plot(steps, [r["objective/kl"] for r in records], color="tab:red")
    if kl_target is not None:
        axes[1].axhline(kl_target, color="gray", linestyle="--", label="target")
        axes[1].legend()
    axes[1].set_title("KL(policy || reference), per response")
    axes[2].plot(steps, [r["objective/kl_coef"] for r in records], color="tab:blue")
    axes[2].set_title("KL coefficient")
    for ax in axes:
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    # Renamed into place so that an image viewer never reads a half-written file.
    os.replace(tmp, path)


def format_table(headers: list[str], rows: list[list[str]], widths: list[int]) -> str:
    """A plain-text table whose cells wrap to `widths` characters."""
    lines = []
    for cells in [headers, *rows]:
        wrapped = [textwrap.wrap(str(cell), width) or [""] for cell, width in zip(cells, widths)]
        for i in range(max(len(w) for w in wrapped)):
            lines.append(" | ".join((w[i] if i < len(w) else "").ljust(width) for w, width in zip(wrapped, widths)))
        lines.append("-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def sample_table(trainer: PPOTrainer, tokenizer, queries: list[torch.Tensor], rewards_of, gen_kwargs: dict) -> str:
    """Continuations of `queries` by the reference (before PPO) and the policy (after), with their rewards."""
    responses, ref_responses = trainer.generate(queries, return_prompt=False, generate_ref_response=True, **gen_kwargs)
    prompts = tokenizer.batch_decode(queries, skip_special_tokens=True)
    before = tokenizer.batch_decode(ref_responses, skip_special_tokens=True)
    after = tokenizer.batch_decode(responses, skip_special_tokens=True)
    before_rewards = rewards_of(decode_pairs(tokenizer, queries, ref_responses))
    after_rewards = rewards_of(decode_pairs(tokenizer, queries, responses))
    rows = [
        [p, b, f"{float(rb):+.2f}", a, f"{float(ra):+.2f}"]
        for p, b, rb, a, ra in zip(prompts, before, before_rewards, after, after_rewards)
    ]
    headers = ["prompt", "before PPO (reference)", "reward", "after PPO (policy)", "reward"]
    return format_table(headers, rows, [22, 36, 6, 36, 6])


def offline_stages(args: ScriptArguments, config: PPOConfig, main: bool) -> OfflineModels | None:
    """The SFT and reward-model stages of the offline default, when a model is not given by name."""
    if config.model_name is not None and config.reward_model is not None:
        return None
    if not torch.cuda.is_available():
        # The tiny models' matrices are too small for several threads to pay off, and on a busy
        # machine the extra threads mostly wait for each other.
        torch.set_num_threads(1)
    # Every process trains the same models from the same seed; only the main one writes the cache.
    offline = build_offline_models(
        Path(args.output_dir) / "offline_models", args.sft_steps, args.reward_model_steps, config.seed, write_cache=main,
        n_head=2 if config.use_vllm else 4,  # vLLM's CPU attention needs heads of 32 or more
    )  # fmt: skip
    if main:
        report = offline.report
        origin = "loaded from the cache" if report["cached"] else "trained"
        print(
            f"SFT stage: tiny GPT-2 {origin} ({args.sft_steps} steps, {report['sft_seconds']:.1f} s), "
            f"held-out perplexity {report['sft_heldout_perplexity']:.2f}"
        )
        print(
            f"Reward-model stage: tiny DistilBERT {origin} ({args.reward_model_steps} steps, "
            f"{report['reward_model_seconds']:.1f} s), held-out accuracy {report['reward_model_heldout_accuracy']:.0%}"
        )
    return offline


def rollout(generate, tokenizer, batch: dict, rewards_of, length_sampler, gen_kwargs: dict, chunk: int,
            engine_logprobs: bool) -> dict:  # fmt: skip
    """`step()`'s arguments for a batch of prompts: continuations from `generate` (`trainer.generate`, or
    AsyncRollouts' handle on its producer thread) and their rewards (one 0-d tensor per prompt).

    With `engine_logprobs` (`--use_vllm`, `--async_rollouts`) the engine's log-probs of the sampled
    tokens go to `step()`, which reports their gap to the policy's (`rollout/logprob_diff/*`) and, with
    `importance_sampling_correction="tis"`, corrects for it.
    """
    query_tensors = batch["input_ids"]
    generated = generate(
        query_tensors, return_prompt=False, length_sampler=length_sampler, batch_size=chunk,
        return_logprobs=engine_logprobs, **gen_kwargs,
    )  # fmt: skip
    response_tensors, logprobs = generated if engine_logprobs else (generated, None)
    # To the host at once: decoding reads every row there, and step() moves the batch in one copy.
    response_tensors = on_host(response_tensors)
    logprobs = on_host(logprobs) if logprobs is not None else None
    rewards = rewards_of(decode_pairs(tokenizer, query_tensors, response_tensors))
    return {"queries": query_tensors, "responses": response_tensors, "scores": rewards, "generation_logprobs": logprobs}


def on_host(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """1-D tensors of one dtype on the host, moved in one copy when they are on a device (one sync, not one per row)."""
    if not rows or all(r.device.type == "cpu" for r in rows):
        return list(rows)
    return list(torch.cat([r.to(rows[0].device) for r in rows]).cpu().split([len(r) for r in rows]))


def step_and_log(trainer: PPOTrainer, arguments: dict) -> tuple:
    """`step(**arguments)` and `log_stats()` with the decoded prompts and continuations; returns the
    step's statistics and the rewards."""
    stats = trainer.step(**arguments)
    decode = trainer.tokenizer.batch_decode
    texts = {"query": decode(arguments["queries"], skip_special_tokens=True)}
    texts["response"] = decode(arguments["responses"], skip_special_tokens=True)
    trainer.log_stats(stats, texts, arguments["scores"])
    return stats, arguments["scores"]


def ppo_iterations(trainer: PPOTrainer, rewards_of, args: ScriptArguments, length_sampler, gen_kwargs: dict):
    """The classic PPO iterations up to `config.steps`: generate, score, `step()`, `log_stats()`; yields each
    step's statistics and rewards.

    Synchronous by default, over `trainer.dataloader` (which continues where a loaded checkpoint left
    off, mid-epoch included). With --async_rollouts the next batches are generated and scored on
    AsyncRollouts' producer thread while `step()` trains, at most --max_staleness steps behind the
    policy; a checkpoint then records the position of the last batch `step()` took.
    """
    config = trainer.config

    def rollout_fn(batch, generate) -> dict:
        return rollout(
            generate, trainer.tokenizer, batch, rewards_of, length_sampler, gen_kwargs, args.generation_batch_size,
            engine_logprobs=config.use_vllm or args.async_rollouts,
        )  # fmt: skip

    if not args.async_rollouts:
        while trainer.current_step < config.steps:
            for batch in trainer.dataloader:
                yield step_and_log(trainer, rollout_fn(batch, trainer.generate))
                if trainer.current_step >= config.steps:
                    return
        return
    if trainer.current_step >= config.steps:
        return
    staleness = args.max_staleness
    with AsyncRollouts(trainer, trainer.dataloader, rollout_fn, max_staleness=staleness, num_epochs=None) as rollouts:
        for arguments in rollouts:
            yield step_and_log(trainer, arguments)
            if trainer.current_step >= config.steps:
                return


def train(trainer: PPOTrainer, rewards_of, args: ScriptArguments, gen_kwargs: dict, main: bool) -> list[dict]:
    """PPO steps from `trainer.current_step` to `config.steps`, with metrics, curves and checkpoints.

    Returns the records of every step, those of the run a checkpoint came from included.
    """
    config, output_dir = trainer.config, Path(args.output_dir)
    metrics_path, curves_path = output_dir / "metrics.jsonl", output_dir / "training_curves.png"
    # A resumed run keeps the records up to its checkpoint and drops those of steps it will redo.
    records = read_metrics(metrics_path, trainer.current_step) if args.resume_from is not None else []
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    length_sampler = LengthSampler(args.output_min_length, args.output_max_length)
    kl_target = config.target if config.adap_kl_ctrl else None
    progress = tqdm(total=config.steps, initial=trainer.current_step, desc="PPO", disable=not main)
    for stats, rewards in ppo_iterations(trainer, rewards_of, args, length_sampler, gen_kwargs):
        record = step_record(trainer, stats, rewards)
        records.append(record)
        if main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if trainer.current_step % args.plot_every == 0 or trainer.current_step == config.steps:
                plot_curves(records, curves_path, kl_target)
            progress.update(1)
            progress.set_postfix(reward=f"{record['env/reward_mean']:+.2f}", kl=f"{record['objective/kl']:.2f}")
        if args.save_every and trainer.current_step % args.save_every == 0:
            trainer.save_checkpoint(str(output_dir / "checkpoint"))
    progress.close()
    return records


def start_run(args, config: PPOConfig, main: bool):
    """What every demo run does first: quiet progress bars, the seed, the offline stages (when
    asked for), the policy with its tokenizer and the prompt dataset. Returns ``(offline, model,
    tokenizer, prompts)``."""
    config.query_dataset = query_dataset(args, config)  # a conflict is refused before anything is trained
    # One progress bar, the training one: none for dataset maps or weight files.
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    set_seed(config.seed)
    offline = offline_stages(args, config, main)
    model, tokenizer = load_policy(config, offline)
    reviews = load_review_texts(config.query_dataset)
    prompts = build_prompt_dataset(reviews, tokenizer, args.input_min_text_length, args.input_max_text_length)
    return offline, model, tokenizer, prompts


def first_and_last_rewards(records: list[dict]) -> tuple[int, float, float]:
    """``(n, mean reward of the first n steps, of the last n)``, n = up to 10 and at most half the run."""
    n = min(10, max(len(records) // 2, 1))
    first = np.mean([r["env/reward_mean"] for r in records[:n]])
    return n, first, np.mean([r["env/reward_mean"] for r in records[-n:]])


def run(args: ScriptArguments, config: PPOConfig) -> None:
    """The three stages, `config.steps` PPO steps, the saved model and the before/after table."""
    start_time, load_at_start = time.perf_counter(), load_average()
    main = is_main_process()
    output_dir = Path(args.output_dir)
    config.project_kwargs.setdefault("logging_dir", str(output_dir / "runs"))
    offline, model, tokenizer, prompts = start_run(args, config, main)
    samples = [prompts[i]["input_ids"] for i in range(min(args.num_samples, len(prompts)))]

    def collator(rows):
        return {key: [row[key] for row in rows] for key in rows[0]}

    critic = ValueModel.from_pretrained(args.value_model) if args.value_model is not None else None
    trainer = PPOTrainer(
        config, model, ref_model=None, tokenizer=tokenizer, dataset=prompts, data_collator=collator, value_model=critic
    )
    if len(trainer.dataloader) == 0:
        raise ValueError(
            f"the dataset gives {len(prompts)} prompts, fewer than batch_size={config.batch_size} per process."
        )
    pipe = load_reward_pipeline(config, offline, args.reward_label, trainer.accelerator.device)
    rewards_of = reward_fn(pipe, args.reward_label)
    if args.resume_from is not None:
        trainer.load_checkpoint(args.resume_from)

    # Pure sampling from the policy, as in the classic demo; finished rows are filled with EOS.
    gen_kwargs = {"min_length": -1, "top_k": 0, "top_p": 1.0, "do_sample": True, "pad_token_id": tokenizer.eos_token_id}
    records = train(trainer, rewards_of, args, gen_kwargs, main)
    trainer.save_pretrained(str(output_dir / "model"), save_value_model=critic is not None)
    sample_kwargs = {**gen_kwargs, "max_new_tokens": args.output_max_length - 1}
    table = sample_table(trainer, tokenizer, samples, rewards_of, sample_kwargs)
    trainer.accelerator.end_training()
    if main:
        print(table)
        if len(records) >= 2:
            n, first, last = first_and_last_rewards(records)
            print(f"mean reward: first {n} steps {first:+.3f}, last {n} steps {last:+.3f}")
        seconds = time.perf_counter() - start_time
        print(f"wrote metrics.jsonl, training_curves.png and model/ to {output_dir} in {seconds:.0f} s")
        if args.record_results is not None and len(records) >= 2:
            kl = records[-1]["objective/kl"]
            lines = [f"mean reward: first {n} steps {first:+.3f}, last {n} steps {last:+.3f}; KL at the end {kl:.2f}"]
            record_run(args.record_results, lines, load_at_start, seconds)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**OFFLINE_PPO_DEFAULTS)
    args, config = parser.parse_args_into_dataclasses()
    run(args, config)


if __name__ == "__main__":
    main()
