"""Shared pieces of the GRPOTrainer tests: a tiny dataset, reward functions, a tokenizer with a chat template, and
a trainer built the way a TRL 1.x script builds one."""

import os
import sys

from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_gpt2, make_qwen2, make_tokenizer  # noqa: E402

from trl_lite import GRPOConfig, GRPOTrainer  # noqa: E402

PROMPTS = ["the movie was", "i loved the", "this film is", "a story that", "they watched the", "it was very",
           "the actor was", "we saw a"]  # fmt: skip
# A ChatML-like template over the tiny vocabulary: role words are plain words of it.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] == 'user' and 'you' or 'i' }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}i {% endif %}"
)


def tokenizer():
    tok = make_tokenizer(padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def dataset(n: int = 8, conversational: bool = False) -> Dataset:
    prompts = PROMPTS[:n]
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts, "target": ["good", "bad", "good", "fine", "sad", "good", "bad", "fine"][:n]})


def count_good(prompts, completions, completion_ids, **kwargs):
    """1 per 'good' in the completion (plain or conversational)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(t.split().count("good")) for t in texts]


def length_reward(prompts, completions, completion_ids, **kwargs):
    """0.1 per token, plus the share of even token ids: varies within every group."""
    return [0.1 * len(ids) + sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def config(output_dir, **overrides) -> GRPOConfig:
    """Tiny sizes: 2 prompts x 4 completions of at most 6 tokens a generation, one optimizer step each."""
    kwargs = dict(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                  max_steps=4, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, seed=3)  # fmt: skip
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def trainer(output_dir, model="gpt2", reward_funcs=(count_good,), train_dataset=None, **overrides) -> GRPOTrainer:
    lm = {"gpt2": make_gpt2, "qwen2": make_qwen2}[model]() if isinstance(model, str) and model in ("gpt2", "qwen2") else model
    return GRPOTrainer(model=lm, reward_funcs=list(reward_funcs), args=config(output_dir, **overrides),
                       train_dataset=train_dataset if train_dataset is not None else dataset(),
                       processing_class=tokenizer())  # fmt: skip


def weights(grpo_trainer) -> dict:
    return {k: v.detach().clone() for k, v in grpo_trainer.model.state_dict().items()}
