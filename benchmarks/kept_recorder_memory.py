"""Peak memory of one truncated `PPOTrainer.generate()` on the transformers engine (issue 62: recording the sampler's
kept sets). A 2-layer GPT-2 with GPT-2's vocabulary (50257), random weights, `rows` queries in one chunk, `tokens`
new tokens each (EOS is never drawn). Prints the live-tensor peak of the call (`tensor_peak_mb`, the profiler's CPU
allocations, from the call's start), for `top_k`/`top_p` and `top_p` alone, and the recorded sets' bytes.

Which trl_lite is measured is the one on `PYTHONPATH` (printed): run it once with a checkout from before the streaming
recorder and once after, e.g.
    PYTHONPATH=<an older checkout> python benchmarks/kept_recorder_memory.py
    PYTHONPATH=$PWD python benchmarks/kept_recorder_memory.py
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import trl_lite  # noqa: E402
from peak_memory import tensor_peak_mb  # noqa: E402
from tiny_models import make_tokenizer  # noqa: E402
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer  # noqa: E402

CUTS = {"top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9), "top_p=0.9": dict(top_p=0.9)}


def measure(cut: dict, rows: int, tokens: int) -> tuple[float, int]:
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=2, n_embd=64, n_head=2, n_positions=256))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    config = PPOConfig(batch_size=rows, mini_batch_size=rows, temperature=0.7, seed=0, **cut)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config=config, model=model, tokenizer=make_tokenizer(padding_side="left"))
    queries = [torch.randint(3, 50257, (8,)) for _ in range(rows)]
    kwargs = dict(return_prompt=False, do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, batch_size=rows)
    trainer.generate(queries[:2], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    trainer.generation.records.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        responses = trainer.generate(queries, **kwargs)
    kept = trainer.generation.records.take(queries, responses)
    nbytes = sum(k.nbytes for k in kept) if kept else 0
    return tensor_peak_mb(prof), nbytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"trl_lite: {trl_lite.__file__}; torch {torch.__version__}; rows {args.rows}, tokens {args.tokens}")
    print(f"scores of the whole call, rows x tokens x vocabulary float32: {args.rows * args.tokens * 50257 * 4 / 2**20:.1f} MB")
    for name, cut in CUTS.items():
        tensors, nbytes = measure(cut, args.rows, args.tokens)
        print(f"{name}: tensor peak {tensors:.1f} MB, recorded sets {nbytes / 2**10:.1f} KiB")


if __name__ == "__main__":
    main()
