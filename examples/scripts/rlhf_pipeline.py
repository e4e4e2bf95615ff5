"""The three stages of RLHF end to end, on the CPU in a few minutes (InstructGPT, DeepSpeed-Chat's steps 1-3):

1. supervised fine-tuning (SFT): a language model learns to write movie reviews, with transformers' `Trainer`;
2. reward modelling: a copy of the SFT model with a one-output score head learns from preference pairs
   (the same review opening continued positively and negatively, positive preferred) with `RewardTrainer`;
3. RLHF: PPO tunes the SFT model to continue review openings so that the reward model scores them high
   (`examples/scripts/ppo_sentiment.py`, given the two models of stages 1 and 2).

    python examples/scripts/rlhf_pipeline.py          # offline default: tiny models, shipped data
    python examples/scripts/rlhf_pipeline.py --model_name gpt2 --sft_dataset_name stanfordnlp/imdb \
        --preference_dataset_name Anthropic/hh-rlhf --max_length 512 --rm_learning_rate 1e-5 ...

Each stage prints its held-out metric: the SFT model's perplexity on held-out reviews, the reward
model's preference accuracy on held-out pairs, and the mean reward of continuations of held-out
prompts sampled from the SFT model (before PPO) and from the tuned policy (after), all before and
after the stage. Written to --output_dir: sft_model/, reward_model/, ppo/ (metrics.jsonl,
training_curves.png, model/), rlhf_curves.png (one panel per stage) and summary.json.
"""

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset, disable_progress_bars, load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PrinterCallback,
    Trainer,
    TrainingArguments,
    pipeline,
)
from transformers.utils import logging as transformers_logging  # noqa: E402

from trl_lite import PPOConfig, RewardConfig, set_seed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_sentiment  # noqa: E402
from reward_modeling import load_pairs, load_reward_model, plot_reward_history, train_reward_model  # noqa: E402
from tiny_sentiment import MAX_LENGTH, load_reviews, train_tokenizer  # noqa: E402

REWARD_LABEL = "LABEL_0"  # the one output of a num_labels=1 classifier


@dataclass
class PipelineArguments:
    """Flags of the three stages (defaults: the offline run)."""

    output_dir: str = field(default="outputs/rlhf_pipeline", metadata={"help": "Where every stage writes."})
    seed: int = field(default=0, metadata={"help": "Seed of every stage."})
    model_name: str | None = field(
        default=None, metadata={"help": "Base language model (hub name or dir); default: a tiny GPT-2 built here."}
    )
    sft_dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset with a 'text' column for SFT; default: the shipped reviews."}
    )
    preference_dataset_name: str | None = field(
        default=None, metadata={"help": "Pairs ('prompt'/'chosen'/'rejected'); default: the shipped pairs."}
    )
    # Stage 1
    sft_steps: int = field(default=300, metadata={"help": "SFT optimizer steps."})
    sft_batch_size: int = field(default=32, metadata={"help": "SFT batch size."})
    sft_learning_rate: float = field(default=3e-3, metadata={"help": "SFT learning rate."})
    # Stage 2
    rm_epochs: int = field(default=2, metadata={"help": "Passes of the reward model over the training pairs."})
    rm_max_steps: int = field(default=-1, metadata={"help": "Reward-model steps; > 0 overrides rm_epochs."})
    rm_batch_size: int = field(default=16, metadata={"help": "Pairs per reward-model step."})
    rm_learning_rate: float = field(default=1e-3, metadata={"help": "Reward-model learning rate."})
    max_length: int = field(default=64, metadata={"help": "Longest prompt + answer of a pair, in tokens."})
    # Stage 3
    ppo_steps: int = field(default=100, metadata={"help": "PPO steps."})
    ppo_batch_size: int = field(default=32, metadata={"help": "Prompts per PPO step."})
    ppo_mini_batch_size: int = field(default=8, metadata={"help": "PPO mini-batch size."})
    ppo_learning_rate: float = field(default=1e-4, metadata={"help": "PPO learning rate."})
    eval_prompts: int = field(default=64, metadata={"help": "Held-out prompts scored before and after PPO."})
    samples_per_prompt: int = field(default=4, metadata={"help": "Continuations sampled per held-out prompt."})
    max_new_tokens: int = field(default=15, metadata={"help": "Longest continuation of a held-out prompt."})

    def __post_init__(self):
        for name in ("sft_steps", "sft_batch_size", "rm_epochs", "rm_batch_size", "ppo_steps", "ppo_batch_size",
                     "ppo_mini_batch_size", "eval_prompts", "samples_per_prompt", "max_new_tokens", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Stage 1: supervised fine-tuning with transformers' Trainer
# ------------------------------------------------------------------------------------------------
def base_model_and_texts(args: PipelineArguments):
    """The base language model, its tokenizer and the SFT texts (split 9:1 into train and held-out)."""
    if args.sft_dataset_name is None:
        texts = [r["text"] for r in load_reviews()]
    else:
        texts = load_dataset(args.sft_dataset_name, split="train")["text"]
    if args.model_name is None:
        tokenizer = train_tokenizer(texts)
        set_seed(args.seed)
        config = GPT2Config(
            vocab_size=len(tokenizer), n_positions=MAX_LENGTH, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model_name)
    train = [t for i, t in enumerate(texts) if i % 10]
    heldout = texts[::10]
    return model, tokenizer, train, heldout


def sft_stage(args: PipelineArguments, output_dir: Path) -> dict:
    """Train the language model on the texts, each ending in the end-of-text token; save it with its tokenizer."""
    model, tokenizer, train_texts, heldout_texts = base_model_and_texts(args)

    def encode(batch):
        ids = tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH - 1)["input_ids"]
        return {"input_ids": [row + [tokenizer.eos_token_id] for row in ids]}

    train, heldout = (Dataset.from_dict({"text": t}).map(encode, batched=True, remove_columns=["text"])
                      for t in (train_texts, heldout_texts))  # fmt: skip
    training_args = TrainingArguments(
        output_dir=str(output_dir / "sft_trainer"),
        max_steps=args.sft_steps,
        per_device_train_batch_size=args.sft_batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.sft_learning_rate,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=heldout,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.remove_callback(PrinterCallback)  # the stage prints one summary line; the losses are plotted
    start = time.perf_counter()
    before = math.exp(trainer.evaluate()["eval_loss"])
    trainer.train()
    after = math.exp(trainer.evaluate()["eval_loss"])
    trainer.save_model(str(output_dir / "sft_model"))
    tokenizer.save_pretrained(output_dir / "sft_model")
    return {
        "heldout_perplexity_before": before,
        "heldout_perplexity_after": after,
        "heldout_texts": len(heldout_texts),
        "seconds": time.perf_counter() - start,
        "log_history": trainer.state.log_history,
    }


# ------------------------------------------------------------------------------------------------
# Stage 2: reward model from preference pairs with RewardTrainer
# ------------------------------------------------------------------------------------------------
def reward_model_stage(args: PipelineArguments, output_dir: Path) -> dict:
    """A copy of the SFT model with a new one-output score head, trained on the pairs (InstructGPT and
    DeepSpeed-Chat start the reward model from a language model of the same family)."""
    model, tokenizer = load_reward_model(str(output_dir / "sft_model"))
    train, heldout = load_pairs(args.preference_dataset_name)
    config = RewardConfig(
        output_dir=str(output_dir / "reward_model"),
        per_device_train_batch_size=args.rm_batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.rm_learning_rate,
        num_train_epochs=args.rm_epochs,
        max_steps=args.rm_max_steps,
        warmup_ratio=0.1,
        logging_steps=5,
        max_length=args.max_length,
        seed=args.seed,
    )
    start = time.perf_counter()
    trainer, before, after = train_reward_model(model, tokenizer, train, heldout, config)
    return {
        "heldout_accuracy_before": before["before_accuracy"],
        "heldout_accuracy_after": after["eval_accuracy"],
        "heldout_loss_before": before["before_loss"],
        "heldout_loss_after": after["eval_loss"],
        "pairs": trainer.data_report,
        "seconds": time.perf_counter() - start,
        "log_history": trainer.log_history,
        "heldout_prompts": [p.strip() for p in heldout["prompt"]] if "prompt" in heldout.column_names else [],
    }


# ------------------------------------------------------------------------------------------------
# Stage 3: PPO against the reward model
# ------------------------------------------------------------------------------------------------
def ppo_stage(args: PipelineArguments, output_dir: Path) -> dict:
    """The sentiment PPO example with the SFT model as policy and the trained reward model as reward."""
    ppo_args = ppo_sentiment.ScriptArguments(
        output_dir=str(output_dir / "ppo"), reward_label=REWARD_LABEL,
        num_samples=4, plot_every=max(1, args.ppo_steps // 10),
    )  # fmt: skip
    config = PPOConfig(
        model_name=str(output_dir / "sft_model"),
        reward_model=str(output_dir / "reward_model"),
        query_dataset=args.sft_dataset_name,  # None: the reviews shipped in examples/data/
        steps=args.ppo_steps,
        batch_size=args.ppo_batch_size,
        mini_batch_size=args.ppo_mini_batch_size,
        learning_rate=args.ppo_learning_rate,
        seed=args.seed,
    )
    start = time.perf_counter()
    ppo_sentiment.run(ppo_args, config)
    records = ppo_sentiment.read_metrics(output_dir / "ppo" / "metrics.jsonl", args.ppo_steps)
    return {"seconds": time.perf_counter() - start, "reward_per_step": [r["env/reward_mean"] for r in records]}


@torch.no_grad()
def mean_reward(model_dir: Path, reward_dir: Path, prompts: list[str], args: PipelineArguments) -> float:
    """Mean reward-model score of `samples_per_prompt` continuations of each prompt sampled from the model
    in `model_dir` (pure sampling, as in PPO), with a fixed seed."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # a tuned policy's value head is not needed
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rewards_of = ppo_sentiment.reward_fn(pipeline("text-classification", model=str(reward_dir)), REWARD_LABEL)
    set_seed(args.seed)
    texts = []
    for prompt in prompts:
        query = tokenizer(prompt, return_tensors="pt")
        out = model.generate(
            query["input_ids"].repeat(args.samples_per_prompt, 1),
            attention_mask=query["attention_mask"].repeat(args.samples_per_prompt, 1),
            max_new_tokens=args.max_new_tokens, do_sample=True, top_k=0, top_p=1.0, pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        texts += tokenizer.batch_decode(out, skip_special_tokens=True)
    return float(np.mean([float(r) for r in rewards_of(texts)]))


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def plot_stages(summary: dict, path: Path) -> None:
    """One panel per stage: SFT loss, reward-model loss and accuracies, PPO reward per step."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    sft = [h for h in summary["sft"]["log_history"] if "loss" in h]
    axes[0].plot([h["step"] for h in sft], [h["loss"] for h in sft], color="tab:red")
    axes[0].set_title(f"1. SFT: held-out perplexity {summary['sft']['heldout_perplexity_after']:.1f}")
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("language-model loss")
    axes[0].grid(alpha=0.3)
    plot_reward_history(axes[1], summary["reward_model"]["log_history"], "2. reward model from pairs")
    rewards = summary["ppo"]["reward_per_step"]
    axes[2].plot(range(1, len(rewards) + 1), rewards, color="tab:green")
    axes[2].axhline(summary["ppo"]["heldout_reward_before"], color="gray", linestyle="--", label="SFT policy (held-out)")
    axes[2].axhline(summary["ppo"]["heldout_reward_after"], color="tab:green", linestyle=":", label="tuned (held-out)")
    axes[2].set_title("3. PPO: reward-model score")
    axes[2].set_xlabel("PPO step")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    args = HfArgumentParser(PipelineArguments).parse_args_into_dataclasses()[0]
    start = time.perf_counter()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    # The reward model's new score head is expected to be untrained; the warning saying so would alarm.
    transformers_logging.set_verbosity_error()
    if not torch.cuda.is_available():
        # Tiny models: extra threads mostly wait for each other on a busy CPU.
        torch.set_num_threads(1)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    sft = sft_stage(args, output_dir)
    print(
        f"1. SFT ({args.sft_steps} steps, {sft['seconds']:.0f} s): held-out perplexity "
        f"{sft['heldout_perplexity_before']:.1f} -> {sft['heldout_perplexity_after']:.2f} "
        f"({sft['heldout_texts']} texts)"
    )
    reward = reward_model_stage(args, output_dir)
    print(
        f"2. reward model ({reward['seconds']:.0f} s): held-out preference accuracy "
        f"{reward['heldout_accuracy_before']:.1%} -> {reward['heldout_accuracy_after']:.1%}, "
        f"loss {reward['heldout_loss_before']:.3f} -> {reward['heldout_loss_after']:.3f} "
        f"({reward['pairs']['eval']['kept']} pairs)"
    )
    ppo = ppo_stage(args, output_dir)
    prompts = reward.pop("heldout_prompts")[: args.eval_prompts]
    ppo["heldout_reward_before"] = mean_reward(output_dir / "sft_model", output_dir / "reward_model", prompts, args)
    ppo["heldout_reward_after"] = mean_reward(output_dir / "ppo" / "model", output_dir / "reward_model", prompts, args)
    ppo["heldout_prompts"] = len(prompts)
    print(
        f"3. PPO ({args.ppo_steps} steps, {ppo['seconds']:.0f} s): mean reward of {args.samples_per_prompt} "
        f"continuations of {len(prompts)} held-out prompts {ppo['heldout_reward_before']:+.3f} (SFT policy) -> "
        f"{ppo['heldout_reward_after']:+.3f} (tuned policy)"
    )
    summary = {"sft": sft, "reward_model": reward, "ppo": ppo, "seconds": time.perf_counter() - start}
    plot_stages(summary, output_dir / "rlhf_curves.png")
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote sft_model/, reward_model/, ppo/, rlhf_curves.png and summary.json to {output_dir} "
          f"in {summary['seconds']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
