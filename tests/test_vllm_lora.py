"""LoRA policies on vLLM (``vllm_lora_sync``): the engine serves the adapter, takes the base weights
once and then only the adapter, and its sampled log-probs equal the PEFT policy's own (float64
recompute) after every push - colocated and on a server launched with ``--max-lora-rank``; what vLLM
cannot serve as an adapter is pushed merged (with its reason warned) or refused when forced; one
adapter is held however many pushes; the rotary reload warning stays out of a Qwen2 push.

Engines started: two colocated (the adapter policy, a merged fallback), one server. The tiny Qwen2
is 64 wide with 2 heads of 32 (vLLM's CPU attention needs at least 32) and one key/value head.
"""

import copy
import logging
import os
import re
import warnings

import pytest
import requests
import torch
from engine_checks import assert_sampled_rows_and_logprobs
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from test_vllm_server import launched_server
from tiny_models import make_gpt2, make_qwen2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.engines import named_policy_weights
from trl_lite.engines.generation import _server_lora_blocker
from trl_lite.engines.lora_sync import (
    adapter_spec,
    named_adapter_weights,
    resolve_lora_sync,
    write_peft_adapter,
)
from trl_lite.engines.vllm_logging import configure_vllm_logging
from trl_lite.vllm_server import parse_args, vllm_serve_args

import vllm  # noqa: F401  (a test dependency: without it this module fails, it is not skipped)

pytestmark = pytest.mark.xdist_group("vllm_lora")

EOS = 1
QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15])]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARCH = ["Qwen2ForCausalLM"]
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def peft_qwen2(seed: int = 1, **lora):
    options = dict(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM")
    options.update(lora)
    return get_peft_model(make_qwen2(seed=seed), LoraConfig(**options))


def lora_config(**overrides):
    options = dict(
        batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=5e-2, advantage_estimator="grpo",
        num_samples_per_query=2, use_vllm=True, vllm_kv_cache_gb=1, vllm_max_model_len=64, vllm_dtype="float32",
        vllm_enable_sleep_mode=False,
    )  # fmt: skip
    options.update(overrides)
    return PPOConfig(**options)


def float64_merged(peft_model):
    """The policy as one float64 transformers model: PEFT's own merge of a float64 copy."""
    return copy.deepcopy(peft_model).double().merge_and_unload().eval()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adapter_bytes(peft_model) -> int:
    return tensor_bytes(p for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n)


def base_bytes(peft_model) -> int:
    """The whole model's bytes: every entry of a plain Qwen2's state dict (the tied LM head counted twice)."""
    return tensor_bytes(type(peft_model.get_base_model())(peft_model.config).state_dict().values())


class Records(logging.Filter):
    """Collects the records that the filters before it let through, and lets them through. A filter, not
    a handler: vLLM configures logging again at every engine start, which empties the handlers of the
    ``vllm.*`` loggers (and keeps their filters)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record):
        self.records.append(record)
        return True


@pytest.fixture(scope="module")
def reload_records():
    configure_vllm_logging()  # its filter first: Records sees what gets past it
    records = Records()
    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addFilter(records)
    yield records.records
    logger.removeFilter(records)


def grpo_step(trainer, seed: int):
    queries = [QUERIES[i] for i in (0, 0, 2, 2)]
    responses = trainer.generate(queries[::2], return_prompt=False, max_new_tokens=6, do_sample=True,
                                 num_return_sequences=2, seed=seed)  # fmt: skip
    scores = [torch.tensor(float(i % 2)) for i in range(4)]  # unequal within each group: a real update
    return trainer.step(queries, [r if len(r) else torch.tensor([3]) for r in responses], scores)


def sampled(trainer):
    return trainer.generate(QUERIES, return_prompt=True, max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0,
                            num_return_sequences=2, return_logprobs=True)  # fmt: skip


# ---------------------------------------------------------------- no engine


def test_vllm_lora_sync_must_be_none_or_a_bool():
    with pytest.raises(TypeError, match="vllm_lora_sync must be None, True or False, got 'yes'"):
        PPOConfig(vllm_lora_sync="yes")


@pytest.mark.parametrize(
    "model, reason",
    [
        (lambda: make_qwen2(), "not a PEFT model"),
        (lambda: get_peft_model(make_gpt2(n_embd=64), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)),
         r"vLLM has no LoRA support for \['GPT2LMHeadModel'\]"),
        (lambda: peft_qwen2(use_dora=True), "DoRA"),
        (lambda: peft_qwen2(modules_to_save=["post_attention_layernorm"]), "modules_to_save"),
        (lambda: peft_qwen2(bias="lora_only"), "bias='lora_only'"),
        (lambda: peft_qwen2(target_modules=["q_proj", "embed_tokens"]), r"\['embed_tokens'\], which are not linear"),
        (lambda: peft_qwen2(r=640), "rank 640 is over vLLM's largest max_lora_rank"),
    ],
    ids=["plain", "gpt2", "dora", "modules_to_save", "bias", "embedding", "rank"],
)  # fmt: skip
def test_what_vllm_cannot_serve_as_an_adapter_is_named(model, reason):
    built = model()
    architectures = list(built.config.architectures or [type(built.get_base_model()).__name__])
    spec, why = adapter_spec(built, architectures)
    assert spec is None
    assert re.search(reason, why)


def test_an_adapter_vllm_serves_gets_the_smallest_engine_rank_that_holds_it():
    spec, why = adapter_spec(peft_qwen2(r=4), ARCH)
    assert why is None and (spec.name, spec.rank, spec.engine_rank) == ("default", 4, 8)
    spec, _ = adapter_spec(peft_qwen2(r=16, rank_pattern={"q_proj": 24}), ARCH)
    assert (spec.rank, spec.engine_rank) == (24, 32)


def test_the_fallback_is_warned_forcing_it_is_refused_and_false_is_quiet():
    dora = peft_qwen2(use_dora=True)
    spec, reason = adapter_spec(dora, ARCH)
    with pytest.warns(UserWarning, match="vllm_lora_sync: pushing the merged model to vLLM at each update: .*DoRA"):
        assert resolve_lora_sync(None, spec, reason) is None
    with pytest.raises(ValueError, match="vllm_lora_sync=True, but the adapter cannot be pushed to vLLM: .*DoRA"):
        resolve_lora_sync(True, spec, reason)
    served, _ = adapter_spec(peft_qwen2(), ARCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_lora_sync(False, served, None) is None
        assert resolve_lora_sync(None, served, None) is served
        assert resolve_lora_sync(None, *adapter_spec(make_qwen2(), ARCH)) is None  # a plain policy: nothing to say
    with pytest.raises(ValueError, match="not a PEFT model"):
        resolve_lora_sync(True, *adapter_spec(make_qwen2(), ARCH))


def test_the_pushed_adapter_is_peft_s_own_state_and_loads_as_a_peft_adapter(tmp_path):
    model = peft_qwen2()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)  # PEFT starts B at zero: make the adapter change the outputs
    spec, _ = adapter_spec(model, ARCH)
    pushed = dict(named_adapter_weights(model, spec))
    reference = get_peft_model_state_dict(model)  # PEFT's save_pretrained names, adapter name dropped
    assert set(pushed) == set(reference) and len(pushed) == 2 * 2 * len(TARGETS)
    assert all(torch.equal(pushed[k], v) for k, v in reference.items())
    write_peft_adapter(str(tmp_path), pushed.items(), spec.config)
    loaded = PeftModel.from_pretrained(make_qwen2(seed=1), str(tmp_path)).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-6)
        assert not torch.allclose(make_qwen2(seed=1)(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-3)


def test_the_base_push_is_the_unadapted_model_and_a_trained_layer_copy_goes_under_its_own_name():
    model = peft_qwen2(modules_to_save=["post_attention_layernorm"])
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    base = dict(named_policy_weights(model, merge_adapters=False))
    original = make_qwen2(seed=1).state_dict()
    assert set(base) == set(original)
    trained = {n for n in original if "post_attention_layernorm" in n}
    assert all(torch.equal(base[n], original[n]) for n in set(original) - trained)
    assert trained and all(not torch.equal(base[n], original[n]) for n in trained)  # the trained copies
    merged = dict(named_policy_weights(model))
    expected = float64_merged(model).state_dict()
    assert set(merged) == set(expected)
    assert all(torch.allclose(merged[n].double(), expected[n], atol=1e-6) for n in expected)


def test_the_launcher_enables_one_lora_slot_and_the_server_checks_name_what_blocks_an_adapter(tmp_path):
    make_qwen2().save_pretrained(tmp_path)
    command = vllm_serve_args(*parse_args(["--model", str(tmp_path), "--max-lora-rank", "16"]))
    lora = command[command.index("--enable-lora") :]
    assert lora[:7] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--max-cpu-loras", "1"]
    assert "--enable-lora" not in vllm_serve_args(*parse_args(["--model", str(tmp_path)]))
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path), "--max-lora-rank", "12"])  # not a rank vLLM accepts

    class Client:  # what _server_lora_blocker reads of a VLLMServerClient
        base_url = "http://127.0.0.1:1"

        def __init__(self, shared_dir, rank):
            self.shared_dir, self.rank = shared_dir, rank

        def max_lora_rank(self):
            return self.rank

    spec, _ = adapter_spec(peft_qwen2(r=16), ARCH)
    assert "cannot read this machine's files" in _server_lora_blocker(Client(None, 16), spec)
    assert "launched without LoRA" in _server_lora_blocker(Client("/tmp", None), spec)
    assert "--max-lora-rank 16" in _server_lora_blocker(Client("/tmp", None), spec)
    assert "rank 16 is over the server's --max-lora-rank 8" in _server_lora_blocker(Client("/tmp", 8), spec)
    assert _server_lora_blocker(Client("/tmp", 16), spec) is None


def test_the_rotary_cache_reload_warning_is_dropped_and_other_layers_are_kept(reload_records):
    logger = logging.getLogger(RELOAD_LOGGER)
    before = len(reload_records)
    for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear"):
        logger.warning("%s: Failed to load weights", layer)
    assert [r.getMessage() for r in reload_records[before:]] == ["QKVParallelLinear: Failed to load weights"]


# ---------------------------------------------------------------- colocated engines


def test_colocated_adapter_push_sends_the_base_once_then_the_adapter_and_logprobs_match_after_every_push(
    reload_records,
):
    start = len(reload_records)
    peft_model = peft_qwen2()
    trainer = PPOTrainer(lora_config(), AutoModelForCausalLMWithValueHead.from_pretrained(peft_model),
                         tokenizer=make_tokenizer())  # fmt: skip
    try:
        generation, backend = trainer.generation, trainer.generation.engine.backend
        policy = trainer.model.pretrained_model
        assert generation.last_push_bytes == base_bytes(policy) + adapter_bytes(policy)  # the first push: both
        base_pushes = []
        original = backend.load_weights
        backend.load_weights = lambda named: (base_pushes.append(1), original(named))
        for step in range(3):
            rows, logprobs = sampled(trainer)
            assert_sampled_rows_and_logprobs(rows, logprobs, float64_merged(policy), QUERIES, 2, 8, EOS)
            if step:
                assert generation.last_push_bytes == adapter_bytes(policy)  # the adapter alone
            grpo_step(trainer, seed=step)
        rows, logprobs = sampled(trainer)
        assert_sampled_rows_and_logprobs(rows, logprobs, float64_merged(policy), QUERIES, 2, 8, EOS)
        assert base_pushes == []
        # The adapter is what the engine runs: its log-probs are not the base model's.
        base = make_qwen2(seed=1).double().eval()
        with torch.no_grad():
            row = rows[0][None]
            base_lp = base(input_ids=row).logits[0].log_softmax(-1)[len(QUERIES[0]) - 1 : -1]
        base_lp = base_lp.gather(1, row[0, len(QUERIES[0]) :, None])[:, 0]
        assert (base_lp - logprobs[0].double()).abs().max() > 1e-2
        # Four versions pushed (the first with the base, then one after each step): one held, on disk too.
        assert backend.adapter_ids() == {4}
        assert [d for d in os.listdir(backend._dir) if d.startswith("adapter-")] == ["adapter-4"]
        assert not [r for r in reload_records[start:] if "Failed to load weights" in str(r.msg)]
    finally:
        generation.close()


def test_colocated_fallback_pushes_the_merged_model_exactly_and_quietly(reload_records):
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(peft_qwen2(modules_to_save=["post_attention_layernorm"]))
    with pytest.raises(ValueError, match="vllm_lora_sync=True, but .*modules_to_save"):
        PPOTrainer(lora_config(vllm_lora_sync=True), policy, tokenizer=make_tokenizer())
    start = len(reload_records)
    with pytest.warns(UserWarning, match="pushing the merged model to vLLM at each update: .*modules_to_save"):
        trainer = PPOTrainer(lora_config(), policy, tokenizer=make_tokenizer())
    try:
        for step in range(2):
            grpo_step(trainer, seed=step)
            rows, logprobs = sampled(trainer)
            merged = float64_merged(trainer.model.pretrained_model)
            assert_sampled_rows_and_logprobs(rows, logprobs, merged, QUERIES, 2, 8, EOS)
        assert trainer.generation.last_push_bytes == base_bytes(trainer.model.pretrained_model)
        assert not [r for r in reload_records[start:] if "Failed to load weights" in str(r.msg)]
    finally:
        trainer.generation.close()


# ---------------------------------------------------------------- a server


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("served_qwen2")
    make_qwen2(seed=5).save_pretrained(model_dir)  # not the policy's base: the first push must bring it
    log = tmp_path_factory.mktemp("lora_server_log") / "server.log"
    with launched_server(model_dir, log, 64, ("--max-lora-rank", "8")) as (url, _):
        yield url


def server_config(url, **overrides):
    return lora_config(vllm_mode="server", vllm_server_url=url, vllm_server_timeout=120, vllm_enable_sleep_mode=None,
                       **overrides)  # fmt: skip


def test_server_adapter_push_logprobs_match_after_every_push_and_the_server_holds_one_adapter(lora_server):
    trainer = PPOTrainer(server_config(lora_server), AutoModelForCausalLMWithValueHead.from_pretrained(peft_qwen2()),
                         tokenizer=make_tokenizer())  # fmt: skip
    try:
        generation, client = trainer.generation, trainer.generation.engine.backend
        policy = trainer.model.pretrained_model
        assert generation.last_push_bytes == base_bytes(policy) + adapter_bytes(policy)
        base_pushes = []
        original = client.load_weights
        client.load_weights = lambda named: (base_pushes.append(1), original(named))
        for step in range(3):
            grpo_step(trainer, seed=step)
            rows, logprobs = sampled(trainer)
            assert generation.last_push_bytes == adapter_bytes(policy)
            assert_sampled_rows_and_logprobs(rows, logprobs, float64_merged(policy), QUERIES, 2, 8, EOS)
        assert base_pushes == []
        served = requests.get(f"{lora_server}/v1/models", timeout=30).json()["data"]
        assert sorted(m["id"] for m in served if m.get("parent")) == ["trl_lite-policy-4"]
        engine = requests.post(f"{lora_server}/collective_rpc", json={"method": "list_loras"}, timeout=30).json()
        assert engine["results"] == [[4]]  # the engine's LoRA ids (one worker), not only the server's names
        assert [d for d in os.listdir(client.shared_dir) if d.startswith("adapter-")] == ["adapter-4"]
    finally:
        generation.close()


def test_a_rank_over_the_server_s_maximum_is_refused_when_forced_and_pushed_merged_otherwise(lora_server):
    """Last on the server: the merged push replaces its base weights."""
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(peft_qwen2(r=16))
    with pytest.raises(ValueError, match="rank 16 is over the server's --max-lora-rank 8"):
        PPOTrainer(server_config(lora_server, vllm_lora_sync=True), policy, tokenizer=make_tokenizer())
    with pytest.warns(UserWarning, match="rank 16 is over the server's --max-lora-rank 8"):
        trainer = PPOTrainer(server_config(lora_server), policy, tokenizer=make_tokenizer())
    try:
        grpo_step(trainer, seed=0)
        rows, logprobs = sampled(trainer)
        assert trainer.generation.last_push_bytes == base_bytes(trainer.model.pretrained_model)
        merged = float64_merged(trainer.model.pretrained_model)
        assert_sampled_rows_and_logprobs(rows, logprobs, merged, QUERIES, 2, 8, EOS)
    finally:
        trainer.generation.close()


def test_the_benchmark_counts_the_bytes_each_push_sends():
    """bench_loop --peft's bytes, against the Qwen2-0.5B shape's sizes worked out by hand (fp32, 1 layer)."""
    import importlib.util
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(benchmarks))  # loop_workloads imports its sibling modules by name
    try:
        spec = importlib.util.spec_from_file_location("loop_workloads", benchmarks / "loop_workloads.py")
        workloads = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(workloads)
    finally:
        sys.path.remove(str(benchmarks))
    counted = workloads.push_bytes(workloads.qwen2_lora_policy(1, device="meta"))
    hidden, kv, mlp, vocab, rank = 896, 128, 4864, 151936, 16  # 2 key/value heads of 64
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * mlp + 2 * hidden
    merged = 2 * vocab * hidden + layer + hidden  # embeddings and the tied LM head, one layer, the final norm
    adapter = rank * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + mlp))
    assert counted == {"merged": 4 * merged, "adapter": 4 * adapter}
