"""Tool use on the CPU: a tiny chat model learns when to call a calculator, SFT then GRPO on multi-turn episodes.

1. Tasks, generated here from --seed: hard ones, `a*b` with two-digit operands (no model this size
   multiplies in its head), and easy ones, `x*1` or `1*x` (the answer is x). Disjoint SFT, GRPO and
   held-out sets: no held-out product (nor its `b*a` twin) and no held-out x is seen in training.
2. A tokenizer with a ChatML chat template that renders the tool (a plain function, `calculator`,
   whose schema transformers' `get_json_schema` reads) and Hermes-style calls:
   `<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call>`, answered by
   a `<tool_response>` turn. A tiny GPT-2 is SFT'd with transformers' `Trainer` on conversations in
   exactly the token layout of the RL episodes (loss on the model's tokens only), half of them calling
   the calculator and half answering at once: it calls the tool about half of the time on either kind.
3. GRPO with trl_lite on episodes from `trl_lite.agents.run_episodes` (8 per task, up to 3 turns):
   the reward is 1 for the exact answer, minus --tool_cost per tool call. Calling is then worth it on
   hard tasks only, and the model learns to call the calculator there and to answer easy ones itself.
4. Held-out greedy accuracy and tool-call rate on hard and easy tasks, before GRPO (the SFT model) and after.

    python examples/scripts/agent_calculator.py                  # 4 to 10 minutes on two CPU cores, by their load
    python examples/scripts/agent_calculator.py --use_vllm       # rollouts on vLLM when installed
    python examples/scripts/agent_calculator.py --sft_steps 20 --steps 2 --num_heldout 16   # a smoke test

Every PPOConfig field is a flag too. Written to --output_dir: metrics.json (held-out measures before and
after, episodes per second, one record per GRPO step), sample_conversations.txt, model/ and sft_model/.
"""

import json
import os
import random
import re
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
from transformers.utils import get_json_schema
from transformers.utils import logging as transformers_logging

from trl_lite import NoDatasetWarning, PPOConfig, PPOTrainer, set_seed
from trl_lite.agents import ChatFormat, episode_stats, run_episodes, step_inputs

CALL_OPEN = '{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}'
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
WORDS = ["system", "user", "assistant", "tools:", "calculator", "<tool_response>", "</tool_response>", CALL_OPEN,
         CALL_CLOSE]  # fmt: skip
CHARACTERS = list("0123456789*+-/. \n")
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class ScriptArguments:
    """Flags of the demo besides PPOConfig's (which gives --steps, --learning_rate, --use_vllm, ...)."""

    output_dir: str = field(default="outputs/agent_calculator", metadata={"help": "Where metrics and models go."})
    num_sft: int = field(default=2000, metadata={"help": "Tasks of the SFT set (half hard, half easy)."})
    num_heldout: int = field(default=200, metadata={"help": "Held-out tasks of each kind."})
    sft_steps: int = field(default=1500, metadata={"help": "Optimizer steps of the SFT stage."})
    sft_batch_size: int = field(default=32, metadata={"help": "Conversations per SFT step."})
    sft_learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate of the SFT stage."})
    n_embd: int = field(default=128, metadata={"help": "Width of the tiny GPT-2 (head size 32: vLLM's CPU minimum)."})
    n_layer: int = field(default=3, metadata={"help": "Layers of the tiny GPT-2."})
    tool_cost: float = field(default=0.1, metadata={"help": "Reward subtracted per tool call."})
    max_turns: int = field(default=3, metadata={"help": "Model turns per episode at most."})
    max_new_tokens: int = field(default=12, metadata={"help": "Tokens per model turn at most."})
    eval_every: int = field(default=25, metadata={"help": "Held-out evaluation every this many GRPO steps."})

    def __post_init__(self):
        for name in ("num_sft", "num_heldout", "sft_steps", "sft_batch_size", "max_turns", "max_new_tokens", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")
        if self.tool_cost < 0:
            raise ValueError(f"tool_cost must be >= 0, got {self.tool_cost}.")


# 8 episodes per task; a fixed small KL to the SFT model and gradient clipping keep the policy near it.
GRPO_DEFAULTS = {
    "steps": 100, "learning_rate": 2e-4, "max_grad_norm": 1.0, "batch_size": 64, "mini_batch_size": 32,
    "ppo_epochs": 1, "advantage_estimator": "grpo", "num_samples_per_query": 8, "loss_type": "dapo",
    "cliprange_high": 0.28, "init_kl_coef": 0.04, "adap_kl_ctrl": False,
}  # fmt: skip


def calculator(expression: str) -> str:
    """Compute a sum, difference or product of two integers.

    Args:
        expression: two integers joined by +, - or *, e.g. "23*47"
    """
    match = re.fullmatch(r"\s*(-?[0-9]+)\s*([+\-*])\s*(-?[0-9]+)\s*", expression)
    if match is None:
        raise ValueError(f"cannot compute {expression!r}: expected two integers joined by +, - or *")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per ChatML tag, per word of the template, per piece of a calculator call and per character."""
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    pieces = sorted(SPECIAL + WORDS, key=len, reverse=True)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(map(re.escape, pieces)) + "|."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>", additional_special_tokens=SPECIAL[1:],
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tasks(seed: int, num_sft: int, num_heldout: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint task sets of `(a, b)` (asked as `a*b`): `sft` (half hard, half easy), `grpo_hard`, `grpo_easy`,
    `heldout_hard`, `heldout_easy`. Hard tasks come from shuffled unordered pairs of operands in 11..99, each
    asked one way round; easy ones `x*1` or `1*x` from shuffled x in 10..9999."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(11, 100) for b in range(a, 100)]
    rng.shuffle(pairs)
    hard = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs]
    xs = list(range(10, 10000))
    rng.shuffle(xs)
    easy = [(x, 1) if rng.random() < 0.5 else (1, x) for x in xs]
    half = num_sft // 2
    if half + num_heldout >= len(hard):
        raise ValueError(f"num_sft / 2 + num_heldout must stay below the {len(hard)} hard tasks, got {half + num_heldout}.")
    return {
        "heldout_hard": hard[:num_heldout], "heldout_easy": easy[:num_heldout],
        "sft": hard[num_heldout : num_heldout + half] + easy[num_heldout : num_heldout + num_sft - half],
        "grpo_hard": hard[num_heldout + half :], "grpo_easy": easy[num_heldout + num_sft - half :],
    }  # fmt: skip


def prompt_of(task: tuple[int, int]) -> list[dict]:
    return [{"role": "user", "content": f"{task[0]}*{task[1]}"}]


def tool_call_text(task: tuple[int, int]) -> str:
    return f"<tool_call>{CALL_OPEN}{task[0]}*{task[1]}{CALL_CLOSE}</tool_call>"


def reward(task: tuple[int, int], episode, tool_cost: float) -> float:
    """1.0 when the last model message is exactly the product (so the episode ended with an answer), minus
    `tool_cost` per tool call."""
    answer = episode.messages[-1]["content"] if episode.messages[-1]["role"] == "assistant" else None
    return float(answer == str(task[0] * task[1])) - tool_cost * episode.tool_calls


def sft_rows(tasks: list[tuple[int, int]], tokenizer, chat: ChatFormat, rng: random.Random) -> Dataset:
    """Each task's conversation in the token layout of run_episodes (query, then each model turn and the
    template's tokens after it), `labels` -100 except on the model's tokens: half call the calculator."""
    rows = []
    for task in tasks:
        messages = prompt_of(task)
        ids, rendered = chat.query(messages)
        labels = [-100] * len(ids)
        turns = [tool_call_text(task), str(task[0] * task[1])] if rng.random() < 0.5 else [str(task[0] * task[1])]
        for index, text in enumerate(turns):
            turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [chat.end_of_turn_id]
            ids, labels = ids + turn, labels + turn
            messages = messages + [{"role": "assistant", "content": text}]
            if index + 1 < len(turns):
                answer = [{"role": "tool", "content": calculator(f"{task[0]}*{task[1]}")}]
                added, rendered = chat.continuation(rendered, messages, answer)
                ids, labels, messages = ids + added, labels + [-100] * len(added), messages + answer
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)


def supervised_finetune(model, tokenizer, tasks, args: ScriptArguments, seed: int) -> float:
    """The SFT stage with transformers' `Trainer`; returns the last logged loss."""
    rows = sft_rows(tasks, tokenizer, ChatFormat(tokenizer, [get_json_schema(calculator)]), random.Random(seed))
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


def play(trainer, tasks, args: ScriptArguments, **generation) -> tuple[list, float]:
    """Episodes of `tasks` (as many per task as `num_generations` says) and the seconds they took."""
    start = time.perf_counter()
    episodes = run_episodes(trainer, [prompt_of(t) for t in tasks], tools=[calculator], max_turns=args.max_turns,
                            max_new_tokens=args.max_new_tokens, **generation)  # fmt: skip
    return episodes, time.perf_counter() - start


def evaluate(trainer, tasks: dict, args: ScriptArguments) -> dict:
    """Greedy held-out accuracy and tool-call rate (share of episodes with a call) per kind, and episodes/s."""
    result, seconds, count = {}, 0.0, 0
    for kind in ("hard", "easy"):
        chosen = tasks[f"heldout_{kind}"]
        episodes, took = play(trainer, chosen, args, do_sample=False)
        seconds, count = seconds + took, count + len(episodes)
        result[f"{kind}_accuracy"] = float(np.mean([reward(t, e, 0.0) > 0 for t, e in zip(chosen, episodes)]))
        result[f"{kind}_tool_rate"] = float(np.mean([e.tool_calls > 0 for e in episodes]))
    result["episodes_per_second"] = count / seconds
    return result


def train(trainer, tasks: dict, args: ScriptArguments, evaluations: list[dict]) -> tuple[list[dict], list]:
    """`config.steps` GRPO steps on `batch_size / k` tasks each (half hard, half easy, drawn in shuffled passes
    over each set), k episodes per task; one record per step."""
    config = trainer.config
    k = config.num_samples_per_query
    per_step = config.batch_size // k
    rng = random.Random(config.seed)
    pools = {kind: iter(()) for kind in ("hard", "easy")}

    def draw(kind: str) -> tuple[int, int]:
        task = next(pools[kind], None)
        if task is None:
            pools[kind] = iter(rng.sample(tasks[f"grpo_{kind}"], len(tasks[f"grpo_{kind}"])))
            task = next(pools[kind])
        return task

    records, episodes = [], []
    progress = tqdm(range(1, config.steps + 1), desc="GRPO")
    for step in progress:
        chosen = [draw("hard" if i % 2 == 0 else "easy") for i in range(per_step)]
        # Sampled at PPOConfig.temperature (--temperature), the temperature the trainer scores at.
        episodes, seconds = play(trainer, chosen, args, num_generations=k, do_sample=True, top_k=0)
        rewards = [reward(chosen[e.prompt_index], e, args.tool_cost) for e in episodes]
        stats = trainer.step(**step_inputs(episodes), scores=[torch.tensor(r) for r in rewards])
        is_hard = [min(chosen[e.prompt_index]) > 1 for e in episodes]
        record = {"step": step, "reward": float(np.mean(rewards)), "episodes_per_second": len(episodes) / seconds}
        record["accuracy"] = float(np.mean([reward(chosen[e.prompt_index], e, 0.0) > 0 for e in episodes]))
        record["tool_rate_hard"] = float(np.mean([e.tool_calls > 0 for e, h in zip(episodes, is_hard) if h] or [0]))
        record["tool_rate_easy"] = float(np.mean([e.tool_calls > 0 for e, h in zip(episodes, is_hard) if not h] or [0]))
        record.update(episode_stats(episodes))
        record.update({key: float(value) for key, value in stats.items() if np.ndim(value) == 0})
        records.append(record)
        if step % args.eval_every == 0 or step == config.steps:
            evaluations.append({"step": step, **evaluate(trainer, tasks, args)})
        progress.set_postfix(reward=f"{record['reward']:.2f}", hard=f"{evaluations[-1]['hard_accuracy']:.2f}")
    return records, episodes


def run(args: ScriptArguments, config: PPOConfig) -> dict:
    """The tasks, SFT, the held-out measures before, GRPO, after; returns metrics.json's content."""
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
    k = config.num_samples_per_query
    tasks = make_tasks(config.seed, args.num_sft, args.num_heldout)
    tokenizer = build_tokenizer()
    model = build_model(args, tokenizer)
    sft_start = time.perf_counter()
    sft_loss = supervised_finetune(model, tokenizer, tasks["sft"], args, config.seed)
    sft_seconds = time.perf_counter() - sft_start
    model.save_pretrained(output_dir / "sft_model")
    tokenizer.save_pretrained(output_dir / "sft_model")

    with warnings.catch_warnings():  # step() gets run_episodes' batch_size episodes, not a dataset's
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
    before = evaluate(trainer, tasks, args)
    print(f"SFT: {args.sft_steps} steps in {sft_seconds:.0f} s, last loss {sft_loss:.3f}; held-out {describe(before)}")
    evaluations = [{"step": 0, **before}]
    grpo_start = time.perf_counter()
    records, last_episodes = train(trainer, tasks, args, evaluations)
    grpo_seconds = time.perf_counter() - grpo_start
    after = evaluations[-1]
    trainer.save_pretrained(str(output_dir / "model"))
    (output_dir / "sample_conversations.txt").write_text("\n\n".join(e.conversation for e in last_episodes[:: k]))
    metrics = {
        "before": before, "after": after, "num_heldout": args.num_heldout, "sft_steps": args.sft_steps,
        "sft_seconds": sft_seconds, "sft_final_loss": sft_loss, "grpo_steps": config.steps, "grpo_seconds": grpo_seconds,
        "rollout_episodes_per_second": float(np.mean([r["episodes_per_second"] for r in records])),
        "total_seconds": time.perf_counter() - start_time, "use_vllm": config.use_vllm, "evaluations": evaluations,
        "records": records,
    }  # fmt: skip
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(
        f"held-out ({args.num_heldout} hard, {args.num_heldout} easy), SFT -> GRPO: {describe(before)} -> "
        f"{describe(after)}; {config.steps} GRPO steps in {grpo_seconds:.0f} s, rollouts "
        f"{metrics['rollout_episodes_per_second']:.1f} episodes/s; wrote {output_dir}"
    )
    return metrics


def describe(measure: dict) -> str:
    return (
        f"hard accuracy {measure['hard_accuracy']:.1%} (tool {measure['hard_tool_rate']:.0%}), easy accuracy "
        f"{measure['easy_accuracy']:.1%} (tool {measure['easy_tool_rate']:.0%})"
    )


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig]:
    """The demo's flags and PPOConfig's, PPOConfig's defaults replaced by GRPO_DEFAULTS; `argv` None: sys.argv."""
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**GRPO_DEFAULTS)
    return tuple(parser.parse_args_into_dataclasses(args=argv))


def main() -> None:
    run(*parse_args())


if __name__ == "__main__":
    main()
