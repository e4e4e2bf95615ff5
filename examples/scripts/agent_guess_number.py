"""A multi-turn game on the CPU: a tiny chat model plays guess-the-number against a step environment, SFT then GRPO.

1. The game: the environment holds a secret in 1..--max_number and answers each guess with "higher",
   "lower" or "correct" (reward 1, the episode ends); a guess that is not a number in range gets
   "invalid". The model has --max_turns guesses: with 7 numbers and 3 guesses, halving the range
   every time (4, then 2 or 6) always wins, and guessing anywhere in what is still possible wins about
   68% of the games.
2. A word-level tokenizer with a ChatML chat template and a tiny GPT-2, SFT'd with transformers'
   `Trainer` on games of that second kind (each guess drawn uniformly from the numbers still possible),
   in exactly the token layout of the RL episodes, loss on the model's guesses only.
3. GRPO with trl_lite on episodes from `trl_lite.agents.run_episodes` with the game as a step
   environment (`reset(secret=...)`, `step(text) -> (observation, reward, done)`): 8 games per secret,
   rewarded at the end (1 for a win within the turns, else 0).
4. The success rate within --max_turns, before GRPO (the SFT model) and after: greedy over every
   secret, and sampled over --num_eval_games games.

    python examples/scripts/agent_guess_number.py               # 4 to 10 minutes on two CPU cores, by their load
    python examples/scripts/agent_guess_number.py --use_vllm    # rollouts on vLLM when installed
    python examples/scripts/agent_guess_number.py --sft_steps 20 --steps 2 --num_eval_games 32   # a smoke test

Every PPOConfig field is a flag too. Written to --output_dir: metrics.json (success rates before and
after, episodes per second, one record per GRPO step), sample_games.txt, model/ and sft_model/.
"""

import json
import os
import random
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, disable_progress_bars
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    PrinterCallback,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as transformers_logging

from trl_lite import NoDatasetWarning, PPOConfig, PPOTrainer, set_seed
from trl_lite.agents import ChatFormat, episode_stats, run_episodes, step_inputs

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "guess", "a", "number", "from", "to", "higher", "lower", "correct", "invalid", "\n", " "]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class ScriptArguments:
    """Flags of the demo besides PPOConfig's (which gives --steps, --learning_rate, --use_vllm, ...)."""

    output_dir: str = field(default="outputs/agent_guess_number", metadata={"help": "Where metrics and models go."})
    max_number: int = field(default=7, metadata={"help": "The secret is in 1..max_number."})
    max_turns: int = field(default=3, metadata={"help": "Guesses per game."})
    num_sft: int = field(default=4000, metadata={"help": "Games of the SFT set."})
    sft_steps: int = field(default=600, metadata={"help": "Optimizer steps of the SFT stage."})
    sft_batch_size: int = field(default=32, metadata={"help": "Games per SFT step."})
    sft_learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate of the SFT stage."})
    n_embd: int = field(default=128, metadata={"help": "Width of the tiny GPT-2 (head size 32: vLLM's CPU minimum)."})
    n_layer: int = field(default=4, metadata={"help": "Layers of the tiny GPT-2."})
    num_eval_games: int = field(default=700, metadata={"help": "Sampled games of the evaluation (secrets in turn)."})
    eval_every: int = field(default=25, metadata={"help": "Evaluation every this many GRPO steps."})

    def __post_init__(self):
        for name in ("max_number", "max_turns", "num_sft", "sft_steps", "sft_batch_size", "num_eval_games", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")


GRPO_DEFAULTS = {
    "steps": 200, "learning_rate": 3e-4, "max_grad_norm": 1.0, "batch_size": 64, "mini_batch_size": 32,
    "ppo_epochs": 1, "advantage_estimator": "grpo", "num_samples_per_query": 8, "loss_type": "dapo",
    "cliprange_high": 0.28, "init_kl_coef": 0.02, "adap_kl_ctrl": False,
}  # fmt: skip


class GuessTheNumber:
    """The step environment: `reset(secret)`, then `step(guess text) -> (feedback, reward, done)`."""

    def __init__(self, max_number: int):
        self.max_number = max_number

    def reset(self, secret: int) -> None:
        self.secret = secret

    def step(self, text: str) -> tuple[str, float, bool]:
        guess = int(text) if text.isdigit() else None
        if guess is None or not 1 <= guess <= self.max_number:
            return "invalid", 0.0, False
        if guess == self.secret:
            return "correct", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


def build_tokenizer(max_number: int) -> PreTrainedTokenizerFast:
    """One token per ChatML tag, word, number 1..max_number, newline and space."""
    numbers = [str(n) for n in range(1, max_number + 1)]
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS + numbers)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_(?:start|end)\|>|<pad>|[0-9]+|[a-z]+|\s"), "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=SPECIAL[1:])  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_of(secret: int, max_number: int) -> dict:
    """A run_episodes prompt: the messages and the environment's reset argument."""
    return {"prompt": [{"role": "user", "content": f"guess a number from 1 to {max_number}"}], "secret": secret}


def consistent_game(secret: int, max_number: int, max_turns: int, rng: random.Random) -> list[int]:
    """The SFT policy's guesses: each uniform over the numbers the feedback so far leaves possible."""
    low, high, guesses = 1, max_number, []
    while len(guesses) < max_turns:
        guesses.append(rng.randint(low, high))
        if guesses[-1] == secret:
            break
        low, high = (guesses[-1] + 1, high) if guesses[-1] < secret else (low, guesses[-1] - 1)
    return guesses


def sft_rows(args: ScriptArguments, tokenizer, chat: ChatFormat, rng: random.Random) -> Dataset:
    """Games of the consistent policy in the token layout of run_episodes (query, then each guess and the
    template's tokens for the feedback after it), `labels` -100 except on the guesses."""
    rows = []
    for _ in range(args.num_sft):
        secret = rng.randint(1, args.max_number)
        env = GuessTheNumber(args.max_number)
        env.reset(secret)
        messages = prompt_of(secret, args.max_number)["prompt"]
        ids, rendered = chat.query(messages)
        labels = [-100] * len(ids)
        guesses = consistent_game(secret, args.max_number, args.max_turns, rng)
        for index, guess in enumerate(guesses):
            turn = tokenizer(str(guess), add_special_tokens=False)["input_ids"] + [chat.end_of_turn_id]
            ids, labels = ids + turn, labels + turn
            messages = messages + [{"role": "assistant", "content": str(guess)}]
            feedback, _, done = env.step(str(guess))
            if not done and index + 1 < len(guesses):
                answer = [{"role": "user", "content": feedback}]
                added, rendered = chat.continuation(rendered, messages, answer)
                ids, labels, messages = ids + added, labels + [-100] * len(added), messages + answer
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)


def supervised_finetune(model, tokenizer, args: ScriptArguments, seed: int) -> float:
    """The SFT stage with transformers' `Trainer`; returns the last logged loss."""
    rows = sft_rows(args, tokenizer, ChatFormat(tokenizer), random.Random(seed))
    pad = tokenizer.pad_token_id

    def collate(batch: list[dict]) -> dict:
        input_ids = pad_sequence([torch.tensor(r["input_ids"]) for r in batch], batch_first=True, padding_value=pad)
        labels = pad_sequence([torch.tensor(r["labels"]) for r in batch], batch_first=True, padding_value=-100)
        attention = pad_sequence([torch.ones(len(r["input_ids"]), dtype=torch.long) for r in batch], batch_first=True)
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    with tempfile.TemporaryDirectory() as scratch:
        training_args = TrainingArguments(
            output_dir=scratch, max_steps=args.sft_steps, per_device_train_batch_size=args.sft_batch_size,
            learning_rate=args.sft_learning_rate, lr_scheduler_type="cosine", warmup_steps=args.sft_steps // 10,
            weight_decay=0.0, logging_steps=max(args.sft_steps // 10, 1), save_strategy="no", report_to="none",
            use_cpu=True, disable_tqdm=True, seed=seed, data_seed=seed, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(model=model, args=training_args, train_dataset=rows, data_collator=collate)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    model.eval()
    return float([entry["loss"] for entry in trainer.state.log_history if "loss" in entry][-1])


def build_model(args: ScriptArguments, tokenizer) -> GPT2LMHeadModel:
    """A tiny GPT-2 from a config; dropout off so that GRPO's first ratio is exactly 1."""
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_embd // 32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # transformers picks a model's loss by its class name, and "GPT2LMHeadModel" names none, so the SFT loss
    # would fall back to the causal-LM loss with a warning; it is that loss, so say so.
    model.loss_type = "ForCausalLM"
    return model


def play(trainer, secrets: list[int], args: ScriptArguments, **generation) -> tuple[list, float]:
    """Games against `secrets` (as many per secret as `num_generations` says) and the seconds they took."""
    start = time.perf_counter()
    episodes = run_episodes(
        trainer, [prompt_of(s, args.max_number) for s in secrets], environment_factory=lambda: GuessTheNumber(args.max_number),
        max_turns=args.max_turns, max_new_tokens=2, **generation,
    )  # fmt: skip
    return episodes, time.perf_counter() - start


def evaluate(trainer, args: ScriptArguments) -> dict:
    """Success rate within the turns: greedy against every secret, sampled over `num_eval_games` games; mean
    turns of the sampled games; episodes/s of both."""
    secrets = list(range(1, args.max_number + 1))
    greedy, greedy_seconds = play(trainer, secrets, args, do_sample=False)
    sampled_secrets = [secrets[i % len(secrets)] for i in range(args.num_eval_games)]
    sampled, sampled_seconds = play(trainer, sampled_secrets, args, do_sample=True, top_k=0)
    return {
        "greedy_success": float(np.mean([e.reward for e in greedy])),
        "sampled_success": float(np.mean([e.reward for e in sampled])),
        "sampled_turns": float(np.mean([e.num_turns for e in sampled])),
        "episodes_per_second": (len(greedy) + len(sampled)) / (greedy_seconds + sampled_seconds),
    }


def train(trainer, args: ScriptArguments, evaluations: list[dict]) -> tuple[list[dict], list]:
    """`config.steps` GRPO steps on `batch_size / k` random secrets each, k games per secret; a record per step."""
    config = trainer.config
    k = config.num_samples_per_query
    rng = random.Random(config.seed)
    records, episodes = [], []
    progress = tqdm(range(1, config.steps + 1), desc="GRPO")
    for step in progress:
        secrets = [rng.randint(1, args.max_number) for _ in range(config.batch_size // k)]
        # Sampled at PPOConfig.temperature (--temperature), the temperature the trainer scores at.
        episodes, seconds = play(trainer, secrets, args, num_generations=k, do_sample=True, top_k=0)
        scores = [torch.tensor(e.reward) for e in episodes]
        stats = trainer.step(**step_inputs(episodes), scores=scores)
        record = {"step": step, "success": float(np.mean([e.reward for e in episodes])),
                  "episodes_per_second": len(episodes) / seconds}  # fmt: skip
        record.update(episode_stats(episodes))
        record.update({key: float(value) for key, value in stats.items() if np.ndim(value) == 0})
        records.append(record)
        if step % args.eval_every == 0 or step == config.steps:
            evaluations.append({"step": step, **evaluate(trainer, args)})
        progress.set_postfix(success=f"{record['success']:.2f}", greedy=f"{evaluations[-1]['greedy_success']:.2f}")
    return records, episodes


def describe(measure: dict) -> str:
    return (
        f"success {measure['greedy_success']:.1%} greedy, {measure['sampled_success']:.1%} sampled "
        f"({measure['sampled_turns']:.2f} turns)"
    )


def run(args: ScriptArguments, config: PPOConfig) -> dict:
    """SFT, the success rates before, GRPO, after; returns metrics.json's content."""
    start_time = time.perf_counter()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # matrices of a 128-wide model are too small for a second thread to pay off
    if config.use_vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    set_seed(config.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.max_number)
    model = build_model(args, tokenizer)
    sft_start = time.perf_counter()
    sft_loss = supervised_finetune(model, tokenizer, args, config.seed)
    sft_seconds = time.perf_counter() - sft_start
    model.save_pretrained(output_dir / "sft_model")
    tokenizer.save_pretrained(output_dir / "sft_model")

    with warnings.catch_warnings():  # step() gets run_episodes' batch_size episodes, not a dataset's
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
    before = evaluate(trainer, args)
    print(f"SFT: {args.sft_steps} steps in {sft_seconds:.0f} s, last loss {sft_loss:.3f}; {describe(before)}")
    evaluations = [{"step": 0, **before}]
    grpo_start = time.perf_counter()
    records, last_episodes = train(trainer, args, evaluations)
    grpo_seconds = time.perf_counter() - grpo_start
    after = evaluations[-1]
    trainer.save_pretrained(str(output_dir / "model"))
    k = config.num_samples_per_query
    (output_dir / "sample_games.txt").write_text("\n\n".join(e.conversation for e in last_episodes[::k]))
    metrics = {
        "before": before, "after": after, "max_number": args.max_number, "max_turns": args.max_turns,
        "sft_steps": args.sft_steps, "sft_seconds": sft_seconds, "sft_final_loss": sft_loss, "grpo_steps": config.steps,
        "grpo_seconds": grpo_seconds, "rollout_episodes_per_second": float(np.mean([r["episodes_per_second"] for r in records])),
        "total_seconds": time.perf_counter() - start_time, "use_vllm": config.use_vllm, "evaluations": evaluations,
        "records": records,
    }  # fmt: skip
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(
        f"SFT -> GRPO: {describe(before)} -> {describe(after)}; {config.steps} GRPO steps in {grpo_seconds:.0f} s, "
        f"rollouts {metrics['rollout_episodes_per_second']:.1f} episodes/s; wrote {output_dir}"
    )
    return metrics


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig]:
    """The demo's flags and PPOConfig's, PPOConfig's defaults replaced by GRPO_DEFAULTS; `argv` None: sys.argv."""
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**GRPO_DEFAULTS)
    return tuple(parser.parse_args_into_dataclasses(args=argv))


def main() -> None:
    run(*parse_args())


if __name__ == "__main__":
    main()
