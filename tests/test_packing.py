"""Padding-free (packed) forward passes of step(): each mini-batch's rows concatenated into one sequence.

Packed passes must give what padded passes give: the log-probs and values of every row against a
float64 reference that runs each row alone (no padding, no other rows), and the whole step's
statistics and updated weights against the padded step, for either padding side, with response
masks, gradient accumulation, several epochs and a LoRA policy. The 2-process ZeRO-2 case is in
test_distributed_packing.py.
"""

import numpy as np
import pytest
import torch
from devices import assert_close, equal, on_cpu
from tiny_models import make_gpt2, make_t5, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer


def make_trainer(padding_free, padding_side="right", model=None, **config_kwargs):
    config_kwargs.setdefault("learning_rate", 1e-3)
    config_kwargs.setdefault("batch_size", 8)
    config_kwargs.setdefault("mini_batch_size", 4)
    config = PPOConfig(padding_free=padding_free, seed=3, **config_kwargs)
    model = model or AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2))
    return PPOTrainer(config, model, tokenizer=make_tokenizer(padding_side))


def _row_alone_reference(wrapper, query, response):
    """Log-probs of `response` and values at its action positions, the row run alone in float64 (on the
    model's device; returned on the CPU)."""
    model = wrapper.pretrained_model.double()
    head = wrapper.v_head.double()
    ids = torch.cat((query, response)).unsqueeze(0).to(model.device)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[0], -1)
    actions = torch.arange(len(query) - 1, len(ids[0]) - 1)
    values = head(out.hidden_states[-1])[0]
    wrapper.float()
    return on_cpu((logp[actions, ids[0, actions + 1]], values[actions]))


def assert_rows_equal_rows_alone(wrapper, queries, responses, logprobs, ref_logprobs, values):
    """Each row's log-probs, reference log-probs (the policy's own: a copy) and values ``(B, T)`` equal the row
    run alone in float64, and are zero past its response."""
    for b, (query, response) in enumerate(zip(queries, responses)):
        expected_lp, expected_values = _row_alone_reference(wrapper, query, response)
        n = len(response)
        assert_close(logprobs[b, :n].double(), expected_lp, rtol=0, atol=2e-5)
        assert_close(ref_logprobs[b, :n].double(), expected_lp, rtol=0, atol=2e-5)
        assert_close(values[b, :n].double(), expected_values, rtol=0, atol=2e-5)
        assert not logprobs[b, n:].any() and not values[b, n:].any()


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_packed_rows_give_each_row_its_own_logprobs_and_values(padding_side):
    trainer = make_trainer(None, padding_side)
    assert trainer._pack
    queries, responses, _ = random_batch(8, seed=4, query_len=(1, 7), response_len=(1, 9))
    rows = trainer.forward.make_rows(queries, responses, None)
    seen = []
    hook = trainer.model.pretrained_model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    logprobs, ref_logprobs, values, _ = trainer.experience_maker.passes(rows)
    hook.remove()
    # One row per pass of the policy, holding exactly the tokens of its rows: no padding token is computed.
    lengths = [len(q) + len(r) for q, r in zip(queries, responses)]
    assert seen == [torch.Size([1, sum(lengths[:4])]), torch.Size([1, sum(lengths[4:])])]
    assert_rows_equal_rows_alone(trainer.model, queries, responses, logprobs, ref_logprobs, values)


def _steps(padding_free, padding_side="right", model_factory=None, steps=2, with_masks=False, **config_kwargs):
    model = model_factory() if model_factory else None
    trainer = make_trainer(padding_free, padding_side, model=model, **config_kwargs)
    assert trainer._pack is bool(padding_free)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    stats = []
    for seed in range(steps):
        queries, responses, scores = random_batch(8, seed=seed, query_len=(1, 7), response_len=(1, 9))
        masks = None
        if with_masks:
            g = torch.Generator().manual_seed(seed + 10)
            masks = [(torch.rand(len(r), generator=g) > 0.3).long() for r in responses]
        stats.append(trainer.step(queries, responses, scores, response_masks=masks))
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return stats, weights, before


def _assert_same_steps(packed, padded):
    (packed_stats, packed_weights, _), (padded_stats, padded_weights, padded_before) = packed, padded
    for a, b in zip(packed_stats, padded_stats):
        assert a.keys() == b.keys()
        for key, value in b.items():
            if not key.startswith("time/"):
                np.testing.assert_allclose(a[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert packed_weights.keys() == padded_weights.keys()
    # atol: the key part of an attention bias has a zero gradient up to rounding, which Adam scales
    # to steps of size lr (1e-3), so those entries differ by a few 1e-6 between any two layouts.
    for name, weight in padded_weights.items():
        assert_close(packed_weights[name], weight, rtol=1e-5, atol=2e-5, msg=name)
    changed = [n for n, w in padded_weights.items() if not equal(w, padded_before[n])]
    assert changed, "the steps did not train"


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_packed_step_equals_padded_step(padding_side):
    kwargs = dict(padding_side=padding_side, with_masks=True, ppo_epochs=3, gradient_accumulation_steps=2)
    _assert_same_steps(_steps(True, **kwargs), _steps(False, **kwargs))


def test_packed_step_equals_padded_step_full_kl_and_mini_batches_of_one():
    kwargs = dict(kl_penalty="full", mini_batch_size=1, ppo_epochs=2, max_grad_norm=1.0)
    _assert_same_steps(_steps(True, **kwargs), _steps(False, **kwargs))


def test_packed_step_equals_padded_step_with_lora():
    from peft import LoraConfig

    def lora_model():
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
        return AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2), peft_config=lora)

    kwargs = dict(model_factory=lora_model, learning_rate=1e-2, ppo_epochs=2)
    packed, padded = _steps(True, **kwargs), _steps(False, **kwargs)
    _assert_same_steps(packed, padded)
    assert packed[0][1]["objective/kl"] != 0.0  # the second step's reference (adapter off) differs from the policy


def test_padding_free_is_decided_by_the_models():
    # Encoder-decoders keep padded passes by default, and refuse padding_free=True before any state changes.
    t5 = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5())
    config = PPOConfig(batch_size=4, mini_batch_size=2)
    assert not PPOTrainer(config, t5, tokenizer=make_tokenizer())._pack
    with pytest.raises(ValueError, match="padding_free=True, but model cannot take packed rows: it is an encoder-decoder"):
        PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, padding_free=True), t5, tokenizer=make_tokenizer())
    gpt2 = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    assert PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), gpt2, tokenizer=make_tokenizer())._pack
    gpt2 = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    assert not PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, padding_free=False), gpt2)._pack
    with pytest.raises(TypeError, match="padding_free must be None, True or False, got 'yes'"):
        PPOConfig(padding_free="yes")


def test_prompt_learning_adapters_keep_padded_passes():
    from peft import PromptTuningConfig

    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(), peft_config=config)
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), model, tokenizer=make_tokenizer())
    assert not trainer._pack
    with pytest.raises(ValueError, match="prompt-learning adapter prepends virtual tokens"):
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(), peft_config=config)
        PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, padding_free=True), model, tokenizer=make_tokenizer())
