"""Colocated vLLM engines under `accelerate launch` with two processes (ZeRO-2, ZeRO-3, ZeRO-2 with
a LoRA policy): every process runs its own engine on its own queries, the processes end with equal
weights, and every engine follows them - its greedy tokens equal greedy decoding of the trained
policy's full weights (LoRA merged by hand) in float64 transformers, in this plain process. The
model is test_distributed's `base_model_dir`, GPT-2 256 wide with 2 heads: ZeRO-3 partitions its
largest matrices, and vLLM's CPU attention takes its head size of 128."""

import pytest
import torch
from test_distributed import REPO, base_model_dir, deepspeed_cpu_collectives, launch  # noqa: F401  (fixtures)
from transformers import GPT2LMHeadModel

pytestmark = pytest.mark.xdist_group("distributed")

SCRIPT = REPO / "tests" / "distributed" / "vllm_loop.py"
FIXED_QUERIES = [[5, 6, 7, 8], [10], [11, 12, 13], [20, 21]]  # as in the script
NEW_TOKENS = 6
def greedy(lm, query):
    """Greedy tokens of ``lm`` after ``query``, one forward pass per token, stopped after EOS (id 1)."""
    tokens = list(query)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(lm(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
            if tokens[-1] == 1:
                break
    return tokens[len(query) :]


@pytest.mark.parametrize(
    "config, extra", [("deepspeed_zero2", []), ("deepspeed_zero3", []), ("deepspeed_zero2", ["--peft"])],
    ids=["zero2", "zero3", "zero2-peft"],
)  # fmt: skip
def test_every_colocated_engine_follows_the_trained_weights(config, extra, base_model_dir, tmp_path):
    launch(config, SCRIPT, "--base_model", str(base_model_dir), "--output_dir", str(tmp_path), *extra)
    report = torch.load(tmp_path / "report.pt")
    assert report["zero3"] == (config == "deepspeed_zero3")
    assert torch.equal(report["weights"][0], report["weights"][1])  # the processes agree
    assert [float(p) for p in report["pushes"]] == [2.0, 2.0]  # one push after each of the 2 steps, on each engine
    trained = GPT2LMHeadModel.from_pretrained(base_model_dir).double().eval()
    missing, unexpected = trained.load_state_dict(report["state"], strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    expected = [greedy(trained, q) for q in FIXED_QUERIES]
    initial = [greedy(GPT2LMHeadModel.from_pretrained(base_model_dir).eval(), q) for q in FIXED_QUERIES]
    assert expected != initial  # the steps changed what greedy decoding says
    for tokens in report["tokens"]:  # every process's engine
        rows = [[int(t) for t in row if t >= 0] for row in tokens]
        assert rows == expected
