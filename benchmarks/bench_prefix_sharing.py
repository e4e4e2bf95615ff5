"""Time and tensor peak of `PPOTrainer.step()` with shared prompts (`PPOConfig.prefix_sharing`) against without.

Workload `shared_prefix` (issue 52): 4 prompts of 512 tokens, G = 8 responses of 32-96 tokens each, GRPO,
one pass per mini-batch of the whole batch (so every pass holds whole groups). Workload `short_pairs`: G = 2
and 16-token prompts, where sharing saves little: the automatic choice (None) against False. Each setting
(and for `short_pairs` also True) runs in this process one after the other, each with a warm-up step; the tensor peak is that of the first
step after warm-up, counted by `bench_step.tensor_peak_mb` (CPU tensors).

Usage:
    python benchmarks/bench_prefix_sharing.py [--workloads shared_prefix short_pairs] [--steps 3] [--threads 1]
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import tensor_peak_mb  # noqa: E402

WORKLOADS = {
    # name: (prompts, prompt tokens, G, response token range, compared settings)
    "shared_prefix": (4, 512, 8, (32, 96), (True, False)),
    "short_pairs": (16, 16, 2, (32, 96), (None, True, False)),
}


def make_batch(prompts: int, prompt_len: int, group: int, response_len: tuple, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    queries, responses = [], []
    for _ in range(prompts):
        query = torch.randint(vocab, (prompt_len,), generator=g)
        for _ in range(group):
            queries.append(query.clone())
            n = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
            responses.append(torch.randint(vocab, (n,), generator=g))
    scores = [torch.randn((), generator=g) for _ in queries]
    return queries, responses, scores


def make_trainer(batch_size: int, group: int, prefix_sharing, vocab: int):
    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
                        attn_implementation="sdpa")  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(GPT2LMHeadModel(config))
    ppo = PPOConfig(batch_size=batch_size, mini_batch_size=batch_size, ppo_epochs=2, advantage_estimator="grpo",
                    num_samples_per_query=group, prefix_sharing=prefix_sharing, seed=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PPOTrainer(ppo, model, tokenizer=None)


def measure(name: str, prefix_sharing, steps: int, vocab: int) -> dict:
    prompts, prompt_len, group, response_len, _ = WORKLOADS[name]
    batch = make_batch(prompts, prompt_len, group, response_len, vocab)
    trainer = make_trainer(len(batch[0]), group, prefix_sharing, vocab)
    stats = trainer.step(*batch)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(*batch)
    peak = tensor_peak_mb(prof)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = trainer.step(*batch)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(q) + len(r) for q, r in zip(*batch[:2]))
    saved = float(stats["prefix_sharing/tokens_saved_fraction"])
    return {"time_s": statistics.median(times), "peak_mb": peak, "tokens": tokens, "saved": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.workloads:
        settings = WORKLOADS[name][4]
        results = {s: measure(name, s, args.steps, args.vocab) for s in settings}
        base = results[False]
        for setting, r in results.items():
            print(f"{name} prefix_sharing={setting}: step {r['time_s']:.3f} s ({r['time_s'] / base['time_s']:.2f}x), "
                  f"tensor peak {r['peak_mb']:.0f} MB ({r['peak_mb'] / base['peak_mb']:.2f}x), "
                  f"tokens run {1 - r['saved']:.2f} of {r['tokens']}")  # fmt: skip


if __name__ == "__main__":
    main()
