"""Reward modelling: train a scalar reward model on chosen/rejected preference pairs with RewardTrainer.

    # offline default, seconds on a CPU: a tiny GPT-2 reward model (tokenizer trained here) on the
    # shipped pairs of examples/data/preference_pairs.jsonl, one pair in ten held out
    python examples/scripts/reward_modeling.py
    # from the model and dataset hub, as with classic TRL
    python examples/scripts/reward_modeling.py --model_name_or_path gpt2 \
        --dataset_name Anthropic/hh-rlhf --max_length 512 --per_device_train_batch_size 8 \
        --learning_rate 1.41e-5 --num_train_epochs 1 --use_peft
    # several processes, DeepSpeed ZeRO-2
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \
        examples/scripts/reward_modeling.py

Every RewardConfig field is a flag (--num_train_epochs, --max_length, --center_rewards_coefficient,
--log_with tensorboard, --save_steps N with --resume_from_checkpoint DIR, ...). Written to --output_dir: the reward model with its tokenizer (loads with
`AutoModelForSequenceClassification.from_pretrained` and in `pipeline("text-classification")`, which
returns the raw reward), log_history.json and training_curves.png.
"""

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from datasets import Dataset, disable_progress_bars, load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    HfArgumentParser,
)
from transformers.utils import logging as transformers_logging  # noqa: E402

from trl_lite import RewardConfig, RewardTrainer, set_seed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_sentiment import MAX_LENGTH, load_reviews, train_tokenizer  # noqa: E402

PAIRS_PATH = Path(__file__).resolve().parents[1] / "data" / "preference_pairs.jsonl"
# RewardConfig defaults that suit the tiny offline model; the hub values are in the module docstring.
OFFLINE_REWARD_DEFAULTS = {
    "output_dir": "outputs/reward_modeling",
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "learning_rate": 1e-3,
    "num_train_epochs": 2,
    "warmup_ratio": 0.1,
    "logging_steps": 5,
    "max_length": 64,
}


@dataclass
class ScriptArguments:
    """Flags of the script besides RewardConfig's."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Model to start from (hub name or local dir); default: a tiny GPT-2 built here."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Pairs with 'chosen'/'rejected' (and 'prompt'): hub name or a local .json/.jsonl file."},
    )
    eval_every_nth: int = field(
        default=10, metadata={"help": "Without a 'test' split, every n-th pair is held out for evaluation."}
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "Checkpoint to continue from (written with --save_steps N)."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (and the score head) only."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})

    def __post_init__(self):
        if self.eval_every_nth < 2:
            raise ValueError(f"eval_every_nth must be an int >= 2, got {self.eval_every_nth}.")


def load_pairs(dataset_name: str | None, eval_every_nth: int = 10) -> tuple[Dataset, Dataset]:
    """Train and held-out pairs: the 'train' and 'test' splits of `dataset_name`, or every `eval_every_nth`
    pair of it (default: the shipped pairs) held out."""
    if dataset_name is None or dataset_name.endswith((".json", ".jsonl")):
        pairs = Dataset.from_json(str(dataset_name or PAIRS_PATH))
    else:
        splits = load_dataset(dataset_name)
        if "test" in splits:
            return splits["train"], splits["test"]
        pairs = splits["train"]
    heldout = [i for i in range(len(pairs)) if i % eval_every_nth == 0]
    train = [i for i in range(len(pairs)) if i % eval_every_nth != 0]
    return pairs.select(train), pairs.select(heldout)


def offline_tokenizer():
    """The word-level tokenizer of the sentiment demo, trained on the shipped reviews (which hold every word of the pairs)."""
    return train_tokenizer([r["text"] for r in load_reviews()])


def tiny_reward_model(tokenizer, seed: int = 0) -> GPT2ForSequenceClassification:
    """A randomly initialised 2-layer GPT-2 with a one-output score head."""
    set_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=MAX_LENGTH, n_embd=64, n_layer=2, n_head=4, num_labels=1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return GPT2ForSequenceClassification(config)


def load_reward_model(name_or_path: str):
    """A sequence classifier with one output from `name_or_path` (a fresh score head on a language model)
    and its tokenizer; GPT-2-like tokenizers without a padding token pad with their end-of-text token."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def lora_config(args: ScriptArguments):
    from peft import LoraConfig

    return LoraConfig(task_type="SEQ_CLS", r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0)


def plot_reward_history(ax, log_history: list[dict], title: str = "reward model") -> None:
    """Training loss, and training and held-out accuracy, against optimizer step on `ax`."""
    train = [h for h in log_history if "loss" in h]
    evals = [h for h in log_history if "eval_accuracy" in h]
    ax.plot([h["step"] for h in train], [h["loss"] for h in train], color="tab:red", label="train loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("pairwise ranking loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    accuracy = ax.twinx()
    accuracy.plot([h["step"] for h in train], [h["accuracy"] for h in train], color="tab:blue", label="train accuracy")
    accuracy.plot([h["step"] for h in evals], [h["eval_accuracy"] for h in evals], "o-", color="tab:green",
                  label="held-out accuracy")  # fmt: skip
    accuracy.set_ylim(0, 1.05)
    accuracy.set_ylabel("accuracy (chosen > rejected)")
    lines = ax.get_legend_handles_labels()[0] + accuracy.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="center right")


def train_reward_model(
    model, tokenizer, train: Dataset, heldout: Dataset, config: RewardConfig, peft_config=None, resume_from=None
):
    """Train with RewardTrainer (from checkpoint `resume_from` if given), saving to `config.output_dir`.
    Returns the trainer and the held-out metrics before and after training."""
    trainer = RewardTrainer(
        model, config, train_dataset=train, eval_dataset=heldout, tokenizer=tokenizer, peft_config=peft_config
    )
    before = trainer.evaluate(metric_key_prefix="before")
    trainer.train(resume_from_checkpoint=resume_from)
    after = trainer.evaluate()
    trainer.save_model()
    return trainer, before, after


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, RewardConfig))
    parser.set_defaults(**OFFLINE_REWARD_DEFAULTS)
    args, config = parser.parse_args_into_dataclasses()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    config.project_kwargs.setdefault("logging_dir", os.path.join(config.output_dir, "runs"))
    if args.model_name_or_path is None:
        tokenizer = offline_tokenizer()
        model = tiny_reward_model(tokenizer, config.seed)
    else:
        model, tokenizer = load_reward_model(args.model_name_or_path)
    train, heldout = load_pairs(args.dataset_name, args.eval_every_nth)
    peft_config = lora_config(args) if args.use_peft else None
    trainer, before, after = train_reward_model(
        model, tokenizer, train, heldout, config, peft_config, args.resume_from_checkpoint
    )
    if trainer.accelerator.is_main_process:
        output_dir = Path(config.output_dir)
        (output_dir / "log_history.json").write_text(json.dumps(trainer.log_history, indent=1))
        fig, ax = plt.subplots(figsize=(7, 4))
        plot_reward_history(ax, trainer.log_history)
        fig.tight_layout()
        fig.savefig(output_dir / "training_curves.png", dpi=100)
        plt.close(fig)
        print(f"pairs: {trainer.data_report}")
        print(
            f"held-out preference accuracy {before['before_accuracy']:.1%} -> {after['eval_accuracy']:.1%}, "
            f"loss {before['before_loss']:.3f} -> {after['eval_loss']:.3f} ({len(heldout)} pairs)"
        )
        print(f"wrote the reward model, log_history.json and training_curves.png to {output_dir}")
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
