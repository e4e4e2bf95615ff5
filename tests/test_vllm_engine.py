"""The colocated vLLM engine inside the trainer: greedy tokens equal transformers' before and after
steps (the weight push works, once and lazily), EOS stops and layout as on the transformers path,
num_return_sequences laid out for GRPO, the engine's log-probs against a float64 recomputation, and
a PEFT policy pushed as merged weights while its adapter stays unmerged.

One engine per policy kind, started once per module. The tiny GPT-2 is 64 wide with 2 heads: vLLM's
CPU attention needs a head size of at least 32.
"""


import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from engine_checks import assert_sampled_rows_and_logprobs
from tiny_models import make_gpt2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.engines import ColocatedVLLM
from trl_lite.engines.weight_sync import named_policy_weights

import vllm  # noqa: F401  (a test dependency: without it this module fails, it is not skipped)

# One worker runs the whole module, in file order: one engine at a time per process, started once.
pytestmark = pytest.mark.xdist_group("vllm_engine")

EOS = 1
QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21])]


def vllm_config(**overrides):
    options = dict(
        batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=5e-2, advantage_estimator="grpo",
        num_samples_per_query=2, use_vllm=True, vllm_kv_cache_gb=1, vllm_max_model_len=64, vllm_dtype="float32",
        vllm_enable_sleep_mode=False,  # the tests count the pushes of an engine that keeps its weights
    )  # fmt: skip
    options.update(overrides)
    return PPOConfig(**options)


@pytest.fixture(scope="module")
def trainer():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1, n_embd=64))
    trainer = PPOTrainer(vllm_config(), model, tokenizer=make_tokenizer())
    yield trainer
    trainer.generation.close()


def test_starting_an_engine_leaves_the_global_random_state_alone():
    # First in this module, before the module's engine starts: vLLM keeps its parallel groups in
    # process-wide state, and an engine is meant to be alone in its process.
    lm = make_gpt2(seed=0, n_embd=64)
    lm.config.architectures = ["GPT2LMHeadModel"]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    backend = ColocatedVLLM(lm.config, lm.generation_config, dtype="float32", max_model_len=32, kv_cache_gb=1, seed=7)
    try:
        assert torch.equal(torch.rand(3), expected)  # vLLM seeds torch with 7 as it starts; the state is put back
    finally:
        backend.close()


def test_float32_weights_pushed_into_a_bfloat16_engine_are_rounded_there_without_a_warning_each():
    # A float32 policy with vllm_dtype="bfloat16": vLLM rounds each weight as it loads it and used to log one
    # warning per norm, embedding and head weight at every push (123 lines a push for SmolLM2).
    lm = make_gpt2(seed=0, n_embd=64)
    lm.config.architectures = ["GPT2LMHeadModel"]
    backend = ColocatedVLLM(lm.config, lm.generation_config, dtype="bfloat16", max_model_len=32, kv_cache_gb=1)
    loader = logging.getLogger("vllm.model_executor.models.utils")
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loader.addHandler(handler)
    try:
        backend.load_weights(named_policy_weights(lm))
        engine = dict(backend.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.named_parameters())
    finally:
        loader.removeHandler(handler)
        backend.close()
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    policy = dict(lm.named_parameters())
    for name in ("transformer.wte.weight", "transformer.h.1.ln_2.weight", "transformer.ln_f.bias"):
        loaded = engine[name][: len(policy[name])]  # vLLM pads the vocabulary rows of the embedding
        assert loaded.dtype == torch.bfloat16
        assert torch.equal(loaded, policy[name].detach().to(torch.bfloat16)), name


def transformers_greedy(lm, query, max_new_tokens, eos=(EOS,)):
    """Greedy tokens of ``lm`` for one query, one token at a time, stopped after the first of ``eos``."""
    tokens = query.tolist()
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = lm(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
            if tokens[-1] in eos:
                break
    return tokens[len(query) :]


def count_pushes(trainer):
    """Wrap the trainer's weight push to count the pushes."""
    generation = trainer.generation
    calls = []
    original = generation.push

    def push(named):
        calls.append(1)
        return original(named)

    generation.push = push
    return calls


def test_greedy_equals_transformers_before_and_after_steps_and_weights_are_pushed_once(trainer):
    lm = trainer.model.pretrained_model.eval()
    pushes = count_pushes(trainer)
    before = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=False)
    assert [r.tolist() for r in before] == [transformers_greedy(lm, q, 8) for q in QUERIES]
    assert pushes == []  # nothing changed since the engine started with the policy's weights
    for step in range(2):
        queries = [QUERIES[i] for i in (0, 0, 2, 2)]
        responses = trainer.generate(queries[::2], return_prompt=False, max_new_tokens=6, do_sample=True,
                                     num_return_sequences=2, seed=step)  # fmt: skip
        scores = [torch.tensor(float(i % 2)) for i in range(4)]  # unequal within each group: a real update
        stats = trainer.step(queries, [r if len(r) else torch.tensor([3]) for r in responses], scores)
        assert ("time/rollout/weight_sync" in stats) == (step == 1)  # the push before step 1's generate
    after = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=False)
    trainer.generate(QUERIES[:1], max_new_tokens=2, do_sample=False)
    assert len(pushes) == 2  # once after each step, not again without a step
    expected = [transformers_greedy(lm, q, 8) for q in QUERIES]
    assert [r.tolist() for r in after] == expected
    assert [r.tolist() for r in after] != [r.tolist() for r in before]  # the steps changed the policy
    stats = trainer.step(*_grpo_batch(trainer))
    assert stats["time/rollout/weight_sync"] > 0 and stats["time/rollout/generate"] > 0


def _grpo_batch(trainer):
    queries = [QUERIES[i] for i in (1, 1, 3, 3)]
    responses = trainer.generate(queries[::2], return_prompt=False, max_new_tokens=4, do_sample=True,
                                 num_return_sequences=2)  # fmt: skip
    return queries, [r if len(r) else torch.tensor([3]) for r in responses], [torch.tensor(1.0), torch.tensor(0.0)] * 2


def test_loading_a_checkpoint_pushes_its_weights_before_the_next_generate(trainer, tmp_path):
    lm = trainer.model.pretrained_model.eval()
    trainer.save_checkpoint(str(tmp_path / "checkpoint"))
    saved = [transformers_greedy(lm, q, 8) for q in QUERIES]
    trainer.step(*_grpo_batch(trainer))
    trainer.generate(QUERIES[:1], return_prompt=False, max_new_tokens=2, do_sample=False)  # pushes the step's weights
    pushes = count_pushes(trainer)
    trainer.load_checkpoint(str(tmp_path / "checkpoint"))  # no optimizer step: the trainer must still push
    rows = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=False)
    assert len(pushes) == 1 and [r.tolist() for r in rows] == saved


def test_stop_tokens_prompt_and_single_query_layout_match_the_transformers_engine(trainer):
    lm = trainer.model.pretrained_model.eval()
    # A token greedy decoding produces often, used as an extra EOS: both engines must stop after it.
    first_tokens = [transformers_greedy(lm, q, 3)[-1] for q in QUERIES]
    stop = max(set(first_tokens), key=first_tokens.count)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=[EOS, stop])
    rows = trainer.generate(QUERIES, return_prompt=True, **kwargs)
    expected = [q.tolist() + transformers_greedy(lm, q, 6, eos=(EOS, stop)) for q in QUERIES]
    assert [r.tolist() for r in rows] == expected
    assert any(r[-1] == stop and len(r) < len(q) + 6 for r, q in zip(rows, QUERIES))
    single = trainer.generate(QUERIES[0], return_prompt=False, **kwargs)
    assert single.shape[0] == 1 and single[0].tolist() == expected[0][len(QUERIES[0]) :]


def test_sampled_rows_for_grpo_are_adjacent_cut_after_eos_and_logprobs_match_a_float64_recomputation(trainer):
    lm = trainer.model.pretrained_model.eval()
    k, new = 3, 12
    rows, logprobs = trainer.generate(QUERIES, return_prompt=True, max_new_tokens=new, do_sample=True,
                                      temperature=1.0, top_k=0, num_return_sequences=k, return_logprobs=True)  # fmt: skip
    assert_sampled_rows_and_logprobs(rows, logprobs, lm, QUERIES, k, new, EOS)
    # Sampling really samples: the k rows of a query are not all equal.
    assert any(len({tuple(rows[i * k + j].tolist()) for j in range(k)}) > 1 for i in range(len(QUERIES)))


def test_length_sampler_draws_one_length_per_query_and_unmappable_kwargs_are_refused(trainer):
    lengths = iter([1, 2, 3, 4, 5, 6])
    rows = trainer.generate(QUERIES, return_prompt=False, length_sampler=lambda: next(lengths), do_sample=False,
                            eos_token_id=[])  # fmt: skip
    assert [len(r) for r in rows] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        trainer.generate(QUERIES, max_new_tokens=2, no_repeat_ngram_size=2)
    with pytest.raises(ValueError, match="beam search"):
        trainer.generate(QUERIES, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="return_logprobs=True needs a list"):
        trainer.generate(QUERIES[0], max_new_tokens=2, return_logprobs=True)


def _float64_copy(lm):
    copy = make_gpt2(seed=0, n_embd=64).double().eval()
    copy.load_state_dict({k: v.double() for k, v in lm.state_dict().items()})
    return copy


def test_peft_policy_is_pushed_merged_and_its_adapter_stays_unmerged():
    base = make_gpt2(seed=2, n_embd=64)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_fc"], task_type="CAUSAL_LM", fan_in_fan_out=True)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(get_peft_model(base, lora))
    trainer = PPOTrainer(vllm_config(learning_rate=1e-1), model, tokenizer=make_tokenizer())
    try:
        for step in range(2):
            stats = trainer.step(*_grpo_batch(trainer))
        peft_model = trainer.model.pretrained_model
        assert not any(getattr(m, "merged", False) for m in peft_model.modules())
        merged = _float64_copy(make_gpt2(seed=2, n_embd=64))
        merged.load_state_dict({k: v.double() for k, v in _merged_reference(peft_model).items()})
        rows = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=False)
        assert [r.tolist() for r in rows] == [transformers_greedy(merged, q, 8) for q in QUERIES]
        assert "ppo/loss/policy" in stats
    finally:
        trainer.generation.close()


def _merged_reference(peft_model):
    """The merged state dict, computed here from the LoRA factors: W + (alpha / r) * (B A)^T for Conv1D."""
    base = peft_model.get_base_model()
    merged = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        merged[name.replace(".base_layer.", ".")] = tensor.clone().double()
    for name, module in base.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a = module.lora_A["default"].weight.double()
            b = module.lora_B["default"].weight.double()
            merged[f"{name}.weight"] += (module.scaling["default"] * (b @ a)).T
    return merged


@pytest.mark.cpu_only  # the missing kernel is vLLM's CPU attention's
def test_a_model_the_backend_cannot_run_is_refused_at_construction():
    # Head size 16 (32 wide, 2 heads): vLLM starts, but its CPU attention has no kernel for it.
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0, n_embd=32))
    with pytest.raises(ValueError, match=r"vLLM started but cannot generate with this model \(\['GPT2LMHeadModel'\]\)"):
        PPOTrainer(vllm_config(), model, tokenizer=make_tokenizer())

