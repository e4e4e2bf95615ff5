"""The smallest complete PPO loop: your own reward function, no dataset, no model hub.

A randomly initialised tiny GPT-2 learns to answer every prompt with the word "yes": the reward,
written by hand below, is the share of "yes" among the words it generates.
    python examples/scripts/custom_rollout_loop.py
    python examples/scripts/custom_rollout_loop.py --use_vllm   # generation on a colocated vLLM engine
"""

import argparse
import random
import warnings

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from trl_lite import AutoModelForCausalLMWithValueHead, LengthSampler, NoDatasetWarning, PPOConfig, PPOTrainer, set_seed

WORDS = "<pad> <eos> yes no maybe the a cat dog sat ran on mat is it ?".split()
PROMPTS = ["is it a cat ?", "the dog sat on a mat", "the cat ran", "is the dog on the mat ?", "a dog ?"]


def reward(text: str) -> float:
    """Share of the words of `text` that are "yes" (0 for an empty text)."""
    words = text.split()
    return words.count("yes") / len(words) if words else 0.0


def main(steps: int = 30, batch_size: int = 16, use_vllm: bool = False) -> None:
    """Train for `steps` PPO steps of `batch_size` prompts, printing the mean reward of each.

    With `use_vllm` the rollouts come from a vLLM engine in this process, which gets the new weights
    before each generation, and the engine's log-probs of its tokens go to `step()` (which reports
    their gap to the policy's, `rollout/logprob_diff/*`); the model then has one attention head
    (vLLM's CPU attention needs a head size of at least 32; the parameters have the same shapes).
    """
    set_seed(0)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    special_ids = {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}
    n_head = 1 if use_vllm else 2
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(WORDS), n_embd=32, n_layer=2, n_head=n_head, **special_ids))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    config = PPOConfig(
        batch_size=batch_size, mini_batch_size=8, learning_rate=1e-3, init_kl_coef=0.05, steps=steps, use_vllm=use_vllm,
        vllm_kv_cache_gb=1, vllm_max_model_len=64,
    )  # fmt: skip
    with warnings.catch_warnings():  # the loop below draws batch_size prompts per step itself
        warnings.simplefilter("ignore", NoDatasetWarning)
        trainer = PPOTrainer(config, model, tokenizer=tokenizer)  # the reference model is a frozen copy
    lengths = LengthSampler(3, 7)  # new tokens per generation: 3 to 6

    for step in range(steps):
        # 1. Rollout: the policy continues a batch of prompts.
        queries = [tokenizer(p, return_tensors="pt").input_ids[0] for p in random.choices(PROMPTS, k=batch_size)]
        generated = trainer.generate(
            queries, return_prompt=False, length_sampler=lengths, batch_size=batch_size, do_sample=True,
            return_logprobs=use_vllm,
        )  # fmt: skip
        responses, logprobs = generated if use_vllm else (generated, None)
        # 2. Evaluation: one scalar score per (query, response) pair, from any code you like.
        scores = [torch.tensor(reward(text)) for text in tokenizer.batch_decode(responses, skip_special_tokens=True)]
        # 3. Optimisation: one PPO step on the triplets.
        stats = trainer.step(queries, responses, scores, generation_logprobs=logprobs)
        gap = f"  engine log-prob gap {stats['rollout/logprob_diff/mean']:.1e}" if use_vllm else ""
        print(f"step {step + 1:2d}  mean reward {stats['ppo/mean_scores']:.3f}  KL {stats['objective/kl']:.3f}{gap}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--use_vllm", action="store_true", help="generate on a colocated vLLM engine")
    main(use_vllm=parser.parse_args().use_vllm)
