"""PPO teaches a tiny model to use a calculator tool, offline, through ``TextEnvironment``.

    python examples/scripts/ppo_calculator_tool.py

Tasks are sums and differences of two numbers below 10 (``"7+5?"``). A character-level tokenizer
and a 2-layer GPT-2 are first trained (SFT) on two kinds of transcripts in equal shares:

    7+5?<request><Calculator>7+5<call>12<response>Result=12<submit>   (asks the tool)
    7+5?Result=3<submit>                                              (guesses, mostly wrong)

so the model starts out asking the calculator about half of the time. Then PPO runs episodes in a
``TextEnvironment`` whose only tool is a plain Python function. The reward is 1 when the submitted
``Result=`` is right, else 0. ``step()`` gets the response masks of the histories, so the tool's
answer is not trained on, only the model's own tokens. The mean reward (and the share of episodes
that call the tool) rises from about a half towards one.
"""

from __future__ import annotations

import json
import random
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, PreTrainedTokenizerFast

from trl_lite import AutoModelForCausalLMWithValueHead, NoDatasetWarning, PPOConfig, PPOTrainer, TextEnvironment, set_seed

TAGS = ["<request>", "<call>", "<response>", "<submit>", "<Calculator>", "Result="]
CHARACTERS = list("0123456789+-?")


@dataclass
class Arguments:
    sft_steps: int = field(default=300, metadata={"help": "SFT optimizer steps (batches of 64 transcripts)."})
    ppo_steps: int = field(default=40, metadata={"help": "PPO steps."})
    batch_size: int = field(default=32, metadata={"help": "Episodes per PPO step."})
    mini_batch_size: int = field(default=16, metadata={"help": "PPO mini-batch size."})
    learning_rate: float = field(default=1e-4, metadata={"help": "PPO learning rate."})
    seed: int = field(default=0, metadata={"help": "Seed of data, models and sampling."})
    output_dir: str = field(default="outputs/ppo_calculator_tool", metadata={"help": "Where metrics.jsonl and summary.json go."})


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, per tag and for ``Result=``; decoding joins tokens without spaces."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", *TAGS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    pattern = "|".join(re.escape(tag) for tag in TAGS) + "|."
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def calculator(expression: str) -> str:
    """The tool: ``"17+25"`` -> ``"42"``; two integers joined by ``+``, ``-`` or ``*``."""
    match = re.fullmatch(r"\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*", expression)
    if match is None:
        raise ValueError(f"cannot compute {expression!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def make_tasks(n: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """``n`` tasks ``"a+b?"`` / ``"a-b?"`` with ``a, b < 10``, and their answers."""
    tasks, answers = [], []
    for _ in range(n):
        a, b, op = rng.randrange(10), rng.randrange(10), rng.choice("+-")
        tasks.append(f"{a}{op}{b}?")
        answers.append(int(calculator(f"{a}{op}{b}")))
    return tasks, answers


def exact_match_reward(responses: list[str], answers: list[int]) -> list[torch.Tensor]:
    """1.0 where the last segment submits ``Result=<the answer>``, else 0.0 (the classic calculator reward)."""
    rewards = []
    for response, answer in zip(responses, answers):
        found = re.findall(r"Result=(-?\d+)<submit>", response)
        rewards.append(torch.tensor(1.0 if found and int(found[0]) == answer else 0.0))
    return rewards


def sft_transcripts(n: int, rng: random.Random) -> list[str]:
    """Half tool use with the right result, half a direct guess."""
    tasks, answers = make_tasks(n, rng)
    texts = []
    for task, answer in zip(tasks, answers):
        if rng.random() < 0.5:
            texts.append(f"{task}<request><Calculator>{task[:-1]}<call>{answer}<response>Result={answer}<submit>")
        else:
            texts.append(f"{task}Result={rng.randrange(-9, 19)}<submit>")
    return texts


def train_sft(tokenizer: PreTrainedTokenizerFast, steps: int, seed: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 trained with next-token loss on :func:`sft_transcripts`."""
    torch.manual_seed(seed)
    ids = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=4, **ids))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = tokenizer(sft_transcripts(64, rng), padding=True, return_tensors="pt")
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def main(args: Arguments) -> dict:
    """SFT, then ``args.ppo_steps`` PPO steps in the environment; returns the summary written to summary.json."""
    set_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    tokenizer = make_tokenizer()
    sft_model = train_sft(tokenizer, args.sft_steps, args.seed)
    print(f"SFT: {args.sft_steps} steps in {time.time() - t0:.1f} s")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(sft_model)
    config = PPOConfig(batch_size=args.batch_size, mini_batch_size=args.mini_batch_size, learning_rate=args.learning_rate,
                       init_kl_coef=0.02, seed=args.seed)
    with warnings.catch_warnings():  # the loop draws batch_size tasks per step itself
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, tokenizer=tokenizer)
    env = TextEnvironment(
        trainer.model, tokenizer, {"Calculator": calculator}, exact_match_reward, max_turns=2,
        generation_kwargs={"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": 12, "pad_token_id": tokenizer.pad_token_id},
    )

    records = []
    with open(out / "metrics.jsonl", "w") as metrics:
        for step in range(args.ppo_steps):
            tasks, answers = make_tasks(args.batch_size, rng)
            queries, responses, masks, rewards, histories = env.run(tasks, answers=answers)
            stats = trainer.step(queries, responses, rewards, masks)
            record = {
                "step": step + 1,
                "env/reward_mean": float(torch.stack(rewards).mean()),
                "env/tool_use": sum("<call>" in h.text for h in histories) / len(histories),
                "objective/kl": stats["objective/kl"],
            }
            records.append(record)
            metrics.write(json.dumps(record) + "\n")
            print(f"step {step + 1:3d}  reward {record['env/reward_mean']:.3f}  tool use {record['env/tool_use']:.2f}  kl {record['objective/kl']:+.3f}")

    window = max(1, min(5, len(records) // 2))
    summary = {
        "first_reward": sum(r["env/reward_mean"] for r in records[:window]) / window,
        "last_reward": sum(r["env/reward_mean"] for r in records[-window:]) / window,
        "first_tool_use": sum(r["env/tool_use"] for r in records[:window]) / window,
        "last_tool_use": sum(r["env/tool_use"] for r in records[-window:]) / window,
        "window": window,
        "seconds": round(time.time() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    histories[0].show_text()
    print(f"mean reward: first {window} steps {summary['first_reward']:.3f}, last {window} steps {summary['last_reward']:.3f}; "
          f"tool use {summary['first_tool_use']:.2f} -> {summary['last_tool_use']:.2f} ({summary['seconds']} s)")
    return summary


if __name__ == "__main__":
    main(HfArgumentParser(Arguments).parse_args_into_dataclasses()[0])
