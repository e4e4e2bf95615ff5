"""RL with verifiable rewards on the CPU: a tiny GPT-2 (or Qwen2) learns two-digit addition, SFT then GRPO.

1. Data, generated here from --seed: every `a+b=` with two-digit operands, split by unordered
   operand pair into an SFT set, a GRPO prompt set and a held-out set, so that no held-out problem
   (nor its `b+a=` twin) is seen in either training stage.
2. A character-level tokenizer (the `tokenizers` library: digits, '+', '=', <eos>, <pad>) and a tiny
   GPT-2 built from a config, trained briefly with transformers' `Trainer` on `a+b=` + answer + <eos>
   (loss on the answer only): right on part of the held-out problems, not all.
3. GRPO with trl_lite (PPOConfig advantage_estimator="grpo", 8 samples per prompt, DAPO's
   loss_type="dapo" and clip-higher, missing_eos_penalty): the reward is an exact-match check of the
   decoded answer written in plain Python (`exact_match_reward`), and DAPO's dynamic sampling
   (`trl_lite.extras.DynamicSampler`) refills the batch with groups whose rewards are not all equal.
4. Held-out greedy accuracy before GRPO (the SFT model) and after.

`--architecture qwen2` builds a tiny Qwen2 instead (rotary positions, gated MLP; an architecture vLLM
serves LoRA adapters for), and `--lora_rank R` trains a PEFT LoRA adapter of rank R on every attention and
MLP projection of the SFT model in the GRPO stage. Under `--use_vllm` the engine then serves the
adapter: it takes the base weights once and only the adapter after each step (`--vllm_lora_sync`,
default on where vLLM can; `--vllm_lora_sync False` pushes the merged model, GPT-2's only way).

    python examples/scripts/grpo_arithmetic.py                       # a few minutes on two CPU cores
    python examples/scripts/grpo_arithmetic.py --use_vllm            # generation with vLLM when installed
    python examples/scripts/grpo_arithmetic.py --async_rollouts      # the next batches generated during step()
    python examples/scripts/grpo_arithmetic.py --sft_steps 20 --steps 2 --num_heldout 64   # a smoke test
    python examples/scripts/grpo_arithmetic.py --architecture qwen2 --lora_rank 8 --learning_rate 2e-3 --use_vllm

Every PPOConfig field is a flag too (--learning_rate, --cliprange_high, --loss_type, ...). Written to
--output_dir: metrics.json (accuracies before and after, the evaluations, one record per step),
grpo_arithmetic.png (reward, held-out accuracy, response length and KL against step), model/ (the
tuned policy and its tokenizer) and sft_model/.
"""

import itertools
import json
import random
import re
import tempfile
import time
import warnings
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset, disable_progress_bars  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from torch.nn.utils.rnn import pad_sequence  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    PrinterCallback,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as transformers_logging  # noqa: E402

from trl_lite import NoDatasetWarning, PPOConfig, PPOTrainer, set_seed  # noqa: E402
from trl_lite.extras import DynamicSampler  # noqa: E402
from trl_lite.rollouts import AsyncRollouts  # noqa: E402

PAD, EOS = "<pad>", "<eos>"
VOCAB = [PAD, EOS, *"0123456789", "+", "="]
PROBLEM = re.compile(r"([0-9]+)\+([0-9]+)=")


@dataclass
class ScriptArguments:
    """Flags of the demo besides PPOConfig's (which gives --steps, --learning_rate, --use_vllm, ...)."""

    output_dir: str = field(default="outputs/grpo_arithmetic", metadata={"help": "Where metrics, plot and models go."})
    num_sft: int = field(default=300, metadata={"help": "Problems of the SFT set."})
    num_grpo: int = field(default=2000, metadata={"help": "Prompts of the GRPO set."})
    num_heldout: int = field(default=500, metadata={"help": "Held-out problems of the accuracy before and after."})
    sft_steps: int = field(default=1000, metadata={"help": "Optimizer steps of the SFT stage (transformers Trainer)."})
    sft_batch_size: int = field(default=32, metadata={"help": "Rows per SFT step."})
    sft_learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate of the SFT stage."})
    architecture: str = field(default="gpt2", metadata={"help": "The tiny model: 'gpt2' or 'qwen2'."})
    n_embd: int = field(default=128, metadata={"help": "Width of the tiny model."})
    n_layer: int = field(default=2, metadata={"help": "Layers of the tiny model."})
    n_head: int = field(default=4, metadata={"help": "Attention heads of the tiny model (Qwen2: 2 key/value heads)."})
    lora_rank: int = field(
        default=0,
        metadata={"help": "> 0: GRPO trains a LoRA adapter of this rank on the SFT model (PEFT); 0: all weights."},
    )
    max_tries: int = field(default=8, metadata={"help": "Dynamic sampling: generate-and-score calls per step at most."})
    eval_every: int = field(default=25, metadata={"help": "Held-out greedy accuracy every this many GRPO steps."})
    async_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Fill the next batches on a producer thread while step() trains (trl_lite.rollouts.AsyncRollouts)."
        },
    )
    max_staleness: int = field(
        default=1, metadata={"help": "With --async_rollouts: steps a batch's policy may lag behind (0: synchronous)."}
    )

    def __post_init__(self):
        for name in ("num_sft", "num_grpo", "num_heldout", "sft_steps", "sft_batch_size", "max_tries", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}.")
        if self.architecture not in ("gpt2", "qwen2"):
            raise ValueError(f"architecture must be 'gpt2' or 'qwen2', got {self.architecture!r}.")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be an int >= 0, got {self.lora_rank}.")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {self.max_staleness}.")
        if self.num_sft + self.num_grpo + self.num_heldout > len(unordered_pairs()):
            raise ValueError(
                f"num_sft + num_grpo + num_heldout must not exceed the {len(unordered_pairs())} unordered operand "
                f"pairs, got {self.num_sft} + {self.num_grpo} + {self.num_heldout}."
            )


# The DAPO recipe on GRPO's group baseline. A little KL in the loss and gradient clipping keep the
# policy near the SFT model: with learning rate 3e-4, init_kl_coef 0.01 and no clipping, the seed-0 run's
# held-out accuracy reached 80% at step 450, then fell to 63% by step 500.
GRPO_DEFAULTS = {
    "steps": 400, "learning_rate": 2e-4, "max_grad_norm": 1.0, "batch_size": 64, "mini_batch_size": 32, "ppo_epochs": 1,
    "advantage_estimator": "grpo", "num_samples_per_query": 8, "loss_type": "dapo", "cliprange_high": 0.28,
    "missing_eos_penalty": 0.5, "max_response_length": 5, "init_kl_coef": 0.04, "adap_kl_ctrl": False,
}  # fmt: skip


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: `<pad>` (id 0), `<eos>` (1), the digits, '+' and '='; decoding joins
    characters without spaces, so `decode(ids)` of `12+35=47<eos>` gives back that string."""
    backend = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(VOCAB)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, model_max_length=16)


def unordered_pairs() -> list[tuple[int, int]]:
    """Every pair `a <= b` of two-digit operands."""
    return [(a, b) for a in range(10, 100) for b in range(a, 100)]


def make_problems(seed: int, num_sft: int, num_grpo: int, num_heldout: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint `(a, b)` problem sets `{"sft", "grpo", "heldout"}`, cut from the shuffled unordered pairs:
    each pair is asked once, as `a+b=` or `b+a=` at random, so no set holds the twin of another's problem."""
    rng = random.Random(seed)
    pairs = unordered_pairs()
    rng.shuffle(pairs)
    oriented = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs]
    return {
        "sft": oriented[:num_sft],
        "grpo": oriented[num_sft : num_sft + num_grpo],
        "heldout": oriented[num_sft + num_grpo : num_sft + num_grpo + num_heldout],
    }


def prompt_of(problem: tuple[int, int]) -> str:
    return f"{problem[0]}+{problem[1]}="


def exact_match_reward(prompt: str, completion: str) -> float:
    """1.0 when `completion` (the decoded response, special tokens kept) is exactly the sum of the
    prompt's operands followed by `<eos>`, else 0.0: a wrong number, anything around it, or a
    response that never ended all score 0 (PPOConfig's missing_eos_penalty lowers the last further)."""
    match = PROBLEM.fullmatch(prompt)
    if match is None:
        raise ValueError(f"prompt must look like 'a+b=' with decimal operands, got {prompt!r}.")
    return 1.0 if completion == f"{int(match[1]) + int(match[2])}{EOS}" else 0.0


def build_model(args: ScriptArguments, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A tiny GPT-2 or Qwen2 from a config; dropout off so that GRPO's first ratio is exactly 1."""
    if args.architecture == "qwen2":
        config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=args.n_embd, intermediate_size=4 * args.n_embd,
            num_hidden_layers=args.n_layer, num_attention_heads=args.n_head, num_key_value_heads=2,
            max_position_embeddings=16, tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
        model.config.architectures = ["Qwen2ForCausalLM"]
        return model
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=16, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # transformers 5 finds the loss by the class name, which names none for GPT-2 (it warns, then uses this one).
    model.loss_type = "ForCausalLM"
    return model


def with_lora(model: PreTrainedModel, args: ScriptArguments):
    """The SFT model with a fresh LoRA adapter of rank ``args.lora_rank`` on every attention and MLP projection."""
    targets = ["c_attn", "c_proj", "c_fc"] if args.architecture == "gpt2" else [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # fmt: skip
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=targets, lora_dropout=0.0,
                      fan_in_fan_out=args.architecture == "gpt2", task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, lora)


def sft_rows(problems: list[tuple[int, int]], tokenizer: PreTrainedTokenizerFast) -> Dataset:
    """`input_ids` of `a+b=` + answer + `<eos>`, `labels` -100 on the prompt (loss on the answer only)."""
    rows = []
    for a, b in problems:
        prompt = tokenizer(prompt_of((a, b)))["input_ids"]
        answer = tokenizer(str(a + b))["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return Dataset.from_list(rows)


def sft_collator(pad_id: int):
    """Right-pads `input_ids` (with `pad_id`) and `labels` (with -100) of a list of rows into tensors."""

    def collate(rows: list[dict]) -> dict:
        input_ids = pad_sequence([torch.tensor(r["input_ids"]) for r in rows], batch_first=True, padding_value=pad_id)
        labels = pad_sequence([torch.tensor(r["labels"]) for r in rows], batch_first=True, padding_value=-100)
        return {"input_ids": input_ids, "attention_mask": (input_ids != pad_id).long(), "labels": labels}

    return collate


def supervised_finetune(model, tokenizer, problems, args: ScriptArguments, seed: int) -> float:
    """The SFT stage with transformers' `Trainer` (no saving, no trackers); returns the last logged loss."""
    with tempfile.TemporaryDirectory() as scratch:
        training_args = TrainingArguments(
            output_dir=scratch, max_steps=args.sft_steps, per_device_train_batch_size=args.sft_batch_size,
            learning_rate=args.sft_learning_rate, lr_scheduler_type="cosine", warmup_steps=args.sft_steps // 10,
            weight_decay=0.0, logging_steps=max(args.sft_steps // 10, 1), save_strategy="no", report_to="none",
            use_cpu=True, disable_tqdm=True, seed=seed, data_seed=seed, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=training_args, train_dataset=sft_rows(problems, tokenizer),
            data_collator=sft_collator(tokenizer.pad_token_id),
        )  # fmt: skip
        # Without a progress bar Trainer prints every log dict; the last loss is reported once instead.
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    model.eval()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return float(losses[-1])


def encode_prompts(tokenizer, problems: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [torch.tensor(ids) for ids in tokenizer([prompt_of(p) for p in problems])["input_ids"]]


def heldout_accuracy(trainer: PPOTrainer, problems: list[tuple[int, int]], max_new_tokens: int) -> float:
    """Fraction of `problems` whose greedy answer (through `trainer.generate`, so vLLM when on) is exact."""
    tokenizer = trainer.tokenizer
    responses = trainer.generate(
        encode_prompts(tokenizer, problems), return_prompt=False, batch_size=256, do_sample=False,
        max_new_tokens=max_new_tokens,
    )  # fmt: skip
    completions = tokenizer.batch_decode(responses)
    return float(np.mean([exact_match_reward(prompt_of(p), c) for p, c in zip(problems, completions)]))


def rollout_function(trainer: PPOTrainer, problems, args: ScriptArguments, seed: int, tally: dict):
    """The `generate_and_score(num_groups, generate=None)` of DynamicSampler: draws GRPO prompts (shuffled
    passes over `problems`), samples k responses to each with `generate` (default `trainer.generate`;
    AsyncRollouts' handle on its producer thread) and scores them. Every generated row is counted in
    `tally` ("rows", "correct", "eos"), the groups dynamic sampling drops included.

    As in DAPO, a call answers at least a whole batch of prompts even when fewer groups are missing:
    once most groups are all right (or all wrong), asking for just the missing ones would take many
    small calls, each costing a full decoding loop."""
    config, tokenizer = trainer.config, trainer.tokenizer
    k = config.num_samples_per_query
    rng = random.Random(seed)
    order: list[int] = []
    gen_kwargs = {
        "do_sample": True, "top_k": 0, "top_p": 1.0,  # at PPOConfig.temperature (--temperature)
        "max_new_tokens": config.max_response_length, "num_return_sequences": k,
    }  # fmt: skip

    # On vLLM (and with --async_rollouts) the engine's log-probs of its samples go to step() too
    # (rollout/logprob_diff/*; the importance weights of batches from older policies).
    engine_logprobs = config.use_vllm or args.async_rollouts

    def generate_and_score(num_groups: int, generate=None) -> dict:
        nonlocal order
        num_groups = max(num_groups, config.batch_size // k)
        while len(order) < num_groups:
            fresh = list(range(len(problems)))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = [problems[i] for i in order[:num_groups]], order[num_groups:]
        queries = encode_prompts(tokenizer, chosen)
        generated = (generate or trainer.generate)(
            queries, return_prompt=False, batch_size=len(queries), return_logprobs=engine_logprobs, **gen_kwargs
        )
        responses, logprobs = generated if engine_logprobs else (generated, None)
        prompts = [prompt_of(p) for p in chosen for _ in range(k)]  # rows of a prompt are adjacent
        completions = tokenizer.batch_decode(responses)
        rewards = [exact_match_reward(p, c) for p, c in zip(prompts, completions)]
        tally["rows"] += len(rewards)
        tally["correct"] += sum(rewards)
        tally["eos"] += sum(c.endswith(EOS) for c in completions)
        batch = {
            "queries": [q for q in queries for _ in range(k)],
            "responses": responses,
            "scores": [torch.tensor(r) for r in rewards],
        }
        if logprobs is not None:
            batch["generation_logprobs"] = logprobs
        return batch

    return generate_and_score


def moving_average(values: list[float], window: int = 10) -> np.ndarray:
    """Mean of the last `window` values at each point (fewer at the start)."""
    sums = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


def plot_curves(records: list[dict], evaluations: list[dict], path: Path) -> None:
    """Sampled reward, held-out greedy accuracy, response length and KL against the GRPO step; the
    per-step curves are faint, with their 10-step moving average on top."""
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    panels = (
        (axes[0], "rollout/accuracy", "tab:green", "all sampled rows"),
        (axes[0], "env/reward_mean", "tab:olive", "rows trained on (dynamic sampling)"),
        (axes[2], "tokens/responses_len_mean", "tab:purple", None),
        (axes[3], "objective/kl", "tab:red", None),
    )
    for ax, key, color, label in panels:
        values = [r[key] for r in records]
        ax.plot(steps, values, color=color, alpha=0.25)
        ax.plot(steps, moving_average(values), color=color, label=label)
    axes[0].set_title("exact-match reward of sampled answers")
    axes[0].legend()
    axes[1].plot([e["step"] for e in evaluations], [e["heldout_accuracy"] for e in evaluations], "o-", color="tab:blue")
    axes[1].set_title("held-out greedy accuracy (step 0: SFT)")
    axes[2].set_title("response length, tokens (EOS included)")
    axes[3].set_title("KL(policy || SFT model), per response")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextmanager
def filled_batches(trainer: PPOTrainer, fill, args: ScriptArguments):
    """``(batches, paused)``: endless ``(SampledBatch, its tally, policy version)`` triples from ``fill(generate)``,
    and the context to hold generation in while the loop uses ``trainer.generate`` (the evaluation).

    Synchronous by default (version None); with --async_rollouts ``fill`` runs on AsyncRollouts'
    producer thread, up to --max_staleness steps ahead of the loop."""
    if not args.async_rollouts:
        yield (fill(None) + (None,) for _ in itertools.count()), nullcontext
        return
    filled = deque()  # the producer appends, the loop takes, in order

    def rollout_fn(_, generate):
        batch, tally = fill(generate)
        filled.append((batch, tally))
        arguments = {"queries": batch.queries, "responses": batch.responses, "scores": batch.scores}
        return {**arguments, "generation_logprobs": batch.extras["generation_logprobs"]}

    with AsyncRollouts(trainer, range(trainer.config.steps), rollout_fn, max_staleness=args.max_staleness) as rollouts:
        yield ((*filled.popleft(), arguments["policy_version"]) for arguments in rollouts), rollouts.paused


def train(trainer: PPOTrainer, problems, args: ScriptArguments, evaluations: list[dict]) -> list[dict]:
    """`config.steps` GRPO steps, each on a batch that dynamic sampling filled; one record per step."""
    config = trainer.config
    tally = {"rows": 0, "correct": 0.0, "eos": 0}
    generate_and_score = rollout_function(trainer, problems["grpo"], args, config.seed, tally)
    k = config.num_samples_per_query
    sampler = DynamicSampler(batch_size=config.batch_size, group_size=k, max_tries=args.max_tries)

    def fill(generate) -> tuple:
        """A batch filled by dynamic sampling, with the tally of every row generated for it."""
        tally.update(rows=0, correct=0.0, eos=0)
        batch = sampler(lambda num_groups: generate_and_score(num_groups, generate))
        return batch, dict(tally)

    records = []
    progress = tqdm(range(1, config.steps + 1), desc="GRPO")
    with filled_batches(trainer, fill, args) as (batches, paused):
        for step, (batch, batch_tally, policy_version) in zip(progress, batches):
            stats = trainer.step(
                batch.queries, batch.responses, batch.scores,
                generation_logprobs=batch.extras.get("generation_logprobs"), policy_version=policy_version,
            )  # fmt: skip
            record = {"step": step, "dynamic_sampling/tries": batch.tries}
            record["dynamic_sampling/dropped_groups"] = batch.dropped_groups
            record["dynamic_sampling/filled_with_zero_std"] = batch.filled_with_zero_std
            record["rollout/accuracy"] = batch_tally["correct"] / batch_tally["rows"]
            record["rollout/eos_fraction"] = batch_tally["eos"] / batch_tally["rows"]
            record["env/reward_mean"] = float(torch.stack(batch.scores).float().mean())
            record.update({key: float(value) for key, value in stats.items() if np.ndim(value) == 0})
            records.append(record)
            if step % args.eval_every == 0 or step == config.steps:
                with paused():
                    accuracy = heldout_accuracy(trainer, problems["heldout"], config.max_response_length)
                evaluations.append({"step": step, "heldout_accuracy": accuracy})
            progress.set_postfix(
                sampled=f"{record['rollout/accuracy']:.2f}", heldout=f"{evaluations[-1]['heldout_accuracy']:.2f}"
            )
    return records


def run(args: ScriptArguments, config: PPOConfig) -> dict:
    """The data, the SFT stage, the accuracy before, GRPO, the accuracy after; returns metrics.json's content."""
    start_time = time.perf_counter()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    if config.max_response_length is None:
        raise ValueError("max_response_length must be set: it is the max_new_tokens of every generation, got None.")
    if not torch.cuda.is_available():
        # Matrices of a 128-wide model are too small for a second thread to pay off.
        torch.set_num_threads(1)
    set_seed(config.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    problems = make_problems(config.seed, args.num_sft, args.num_grpo, args.num_heldout)
    tokenizer = build_tokenizer()
    model = build_model(args, tokenizer)

    sft_start = time.perf_counter()
    sft_loss = supervised_finetune(model, tokenizer, problems["sft"], args, config.seed)
    sft_seconds = time.perf_counter() - sft_start
    model.save_pretrained(output_dir / "sft_model")
    tokenizer.save_pretrained(output_dir / "sft_model")
    if args.lora_rank:
        model = with_lora(model, args)

    with warnings.catch_warnings():  # step() gets DynamicSampler's batches of batch_size rows, not a dataset's
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
    before = heldout_accuracy(trainer, problems["heldout"], config.max_response_length)
    print(
        f"SFT: {args.sft_steps} steps in {sft_seconds:.0f} s, last loss {sft_loss:.3f}; "
        f"held-out greedy accuracy {before:.1%}"
    )
    evaluations = [{"step": 0, "heldout_accuracy": before}]
    grpo_start = time.perf_counter()
    records = train(trainer, problems, args, evaluations)
    grpo_seconds = time.perf_counter() - grpo_start
    after = evaluations[-1]["heldout_accuracy"]
    trainer.save_pretrained(str(output_dir / "model"))
    plot_curves(records, evaluations, output_dir / "grpo_arithmetic.png")
    metrics = {
        "heldout_accuracy_before": before, "heldout_accuracy_after": after, "num_heldout": len(problems["heldout"]),
        "sft_steps": args.sft_steps, "sft_seconds": sft_seconds, "sft_final_loss": sft_loss,
        "grpo_steps": config.steps, "grpo_seconds": grpo_seconds, "total_seconds": time.perf_counter() - start_time,
        "use_vllm": config.use_vllm, "architecture": args.architecture, "lora_rank": args.lora_rank,
        "last_push_bytes": trainer.generation.last_push_bytes if config.use_vllm else None,
        "max_staleness": args.max_staleness if args.async_rollouts else None,
        "evaluations": evaluations, "records": records,
    }  # fmt: skip
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(
        f"held-out greedy accuracy ({len(problems['heldout'])} problems): SFT {before:.1%} -> GRPO {after:.1%}; "
        f"{config.steps} GRPO steps in {grpo_seconds:.0f} s; wrote metrics.json, grpo_arithmetic.png, model/ "
        f"to {output_dir} in {metrics['total_seconds']:.0f} s"
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
