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


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tiny_models import make_qwen2

    path = tmp_path_factory.mktemp("base_qwen2")
    make_qwen2(seed=3, hidden=128).save_pretrained(path)  # 2 heads of 64, 1 key/value head
    return path


@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3"], ids=["zero2", "zero3"])
def test_every_colocated_engine_serves_the_trained_adapter_pushed_alone(config, qwen2_dir, tmp_path):
    """vllm_lora_sync on 2 processes: each engine takes the base once and then only the adapter (under
    ZeRO-3 gathered alone), holds one adapter, and decodes as the trained policy (merged by hand) does."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    launch(config, SCRIPT, "--base_model", str(qwen2_dir), "--output_dir", str(tmp_path), "--lora_sync")
    report = torch.load(tmp_path / "report.pt")
    assert report["zero3"] == (config == "deepspeed_zero3")
    assert torch.equal(report["weights"][0], report["weights"][1])
    assert [float(p) for p in report["pushes"]] == [2.0, 2.0]
    base = Qwen2ForCausalLM.from_pretrained(qwen2_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    shaped = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    adapter = sum(p.numel() * 4 for n, p in shaped.named_parameters() if "lora_" in n)
    whole = sum(t.numel() * 4 for t in Qwen2ForCausalLM(base.config).state_dict().values())
    for sizes in report["push_bytes"]:  # construction (base + adapter), then the adapter alone per push
        assert sizes.tolist() == [whole + adapter, adapter, adapter]
    assert [ids.tolist() for ids in report["adapter_ids"]] == [[3.0], [3.0]]
    trained = Qwen2ForCausalLM.from_pretrained(qwen2_dir).double().eval()
    missing, unexpected = trained.load_state_dict(report["state"], strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    expected = [greedy(trained, q) for q in FIXED_QUERIES]
    assert expected != [greedy(Qwen2ForCausalLM.from_pretrained(qwen2_dir).eval(), q) for q in FIXED_QUERIES]
    for tokens in report["tokens"]:
        assert [[int(t) for t in row if t >= 0] for row in tokens] == expected
