"""benchmarks/smollm2_generation.py's arithmetic: the decode's FLOPs per token and the table built from results."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import smollm2_generation  # noqa: E402


@pytest.mark.parametrize("head_dim", [None, 24])
def test_decode_products_cover_every_linear_weight_of_the_model_once(head_dim):
    # Grouped-query attention, a head size that is not hidden / heads (head_dim 24), tied embeddings: the products
    # must hold exactly the weights of the model's nn.Linear modules, the LM head once.
    options = dict(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=3, vocab_size=101, tie_word_embeddings=True)  # fmt: skip
    config = LlamaConfig(**options, **({"head_dim": head_dim} if head_dim else {}))
    model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    products = smollm2_generation.decode_products(config)
    assert sum(k * n * count for k, n, count in products) == linear


def test_table_gives_each_engine_its_ratio_to_the_float32_call_and_its_share_of_the_ceiling():
    result = {
        "transformers fp32, one call": {"tokens": 64, "seconds": 2.0, "tokens_per_s": 32.0, "setup_s": 1.0, "ceiling": 128.0},
        "vLLM bf16, compiled": {"tokens": 64, "seconds": 0.5, "tokens_per_s": 128.0, "setup_s": 50.0, "ceiling": 512.0},
    }
    rows = smollm2_generation.format_table(result).splitlines()[2:]
    assert rows[0] == "| transformers fp32, one call | 64 | 2.00 | 32.0 | 1.00x | 128 | 0.25 | 1.0 |"
    assert rows[1] == "| vLLM bf16, compiled | 64 | 0.50 | 128.0 | 4.00x | 512 | 0.25 | 50.0 |"
