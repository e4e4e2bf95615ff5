"""The log-prob gap of a truncated SmolLM2 run (issue 62, PPO_SPEC sections 15 and 23), before and after scoring
under the truncated distribution.

SmolLM2-135M-Instruct (float32, CPU) samples with PPOConfig temperature 0.7, top-k 20, top-p 0.8 on the
transformers engine, whose log-probs are the sampler's, `log pi_T^K`; one step() on those rows reports
`rollout/logprob_diff/max|mean` - the gap between the engine and the trainer's `lp_old` (after: `lp_old` is
`log pi_T^K` over each position's kept set). "Before" is the gap the full-vocabulary scoring had against the
distribution that sampled: the same rows' untruncated `log pi_T` (the reference pass, an untouched copy of the
same weights) against the engine's `log pi_T^K`. Also the first pass's ratio (1 when the trainer scores what
sampled) and the truncated and untruncated entropies.

Usage: python benchmarks/truncated_gap.py [--prompts 8] [--new-tokens 24] [--threads 1]
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "scripts"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from smollm2 import load_smollm2

    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    lm, tokenizer = load_smollm2(dtype=torch.float32)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    config = PPOConfig(batch_size=args.prompts, mini_batch_size=args.prompts, ppo_epochs=1, temperature=0.7, top_k=20,
                       top_p=0.8, seed=0, compute_reference_kl=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, model, tokenizer=tokenizer)
    topics = ["the sea", "a cat", "bread", "winter", "a robot", "music", "a garden", "the moon", "trains", "tea"]
    texts = [f"Write one sentence about {topics[i % len(topics)]}." for i in range(args.prompts)]
    queries = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"][0] for t in texts]  # fmt: skip
    torch.manual_seed(0)
    start = time.perf_counter()
    responses, engine_lp = trainer.generate(queries, return_prompt=False, do_sample=True, max_new_tokens=args.new_tokens,
                                            return_logprobs=True, batch_size=args.prompts)  # fmt: skip
    seen = []
    make = trainer.experience_maker.make
    trainer.experience_maker.make = lambda batch: seen.append(make(batch)) or seen[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = trainer.step(queries, list(responses), [torch.tensor(0.0)] * len(queries), generation_logprobs=engine_lp)
    experience = seen[0]
    full = torch.cat([experience.ref_logprobs[i, : len(r)] for i, r in enumerate(responses)])
    gen = torch.cat(list(engine_lp)).to(full.device)
    before = (full - gen).abs()
    ratio = torch.as_tensor(stats["ppo/policy/ratio"])
    print(f"rows {len(responses)}, tokens {len(gen)}, {time.perf_counter() - start:.1f} s")
    print(f"before (full-vocabulary scoring vs the sampler): logprob_diff/max {before.max():.4f}, mean {before.mean():.4f}")
    print(f"after: rollout/logprob_diff/max {float(stats['rollout/logprob_diff/max']):.2e}, "
          f"mean {float(stats['rollout/logprob_diff/mean']):.2e}")  # fmt: skip
    print(f"first pass ratio: max |ratio - 1| {float((ratio - 1).abs().max()):.2e}")
    print(f"entropy: truncated {float(stats['ppo/policy/entropy']):.3f}, untruncated "
          f"{float(stats['policy/entropy_untruncated']):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
