"""Per-row attention over packed rows (trl_lite.models.packed_attention) and its use in step().

The attention function is checked against a float64 brute-force attention of each row alone
(outputs and gradients, with and without grouped key/value heads); the trainer's packed passes
must call it with exactly the rows' lengths, leave the model's attention setting as it was, and
still give the padded step's results - also with gradient checkpointing, whose recomputation runs
after the switch has ended, and for a Llama model (rotary positions, grouped key/value heads).
"""

import types

import numpy as np
import pytest
import torch
from test_packing import _assert_same_steps, _steps
from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_tokenizer, random_batch
from transformers import LlamaConfig, LlamaForCausalLM

import trl_lite.models.packed_attention as packed_attention
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.models.packed_attention import PACKED_SDPA, ROW_LENGTHS, packed_sdpa_attention_forward

LENGTHS = (3, 5, 1, 7)


def _reference_attention(query, key, value, lengths, scale):
    """Causal softmax attention of each row alone, in float64 by explicit loops: ``(1, N, H, D)``."""
    query, key, value = query.double(), key.double(), value.double()
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.zeros_like(query)
    start = 0
    for length in lengths:
        for i in range(start, start + length):
            scores = (query[0, :, i, None, :] * key[0, :, start : i + 1, :]).sum(-1) * scale  # (H, i - start + 1)
            out[0, :, i] = (torch.softmax(scores, -1).unsqueeze(-1) * value[0, :, start : i + 1]).sum(1)
        start += length
    return out.transpose(1, 2)


def _inputs(heads, kv_heads, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    tensors = [torch.randn(1, h, n, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
    return [t.requires_grad_() for t in tensors]


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)])
def test_each_row_attends_to_itself_alone(heads, kv_heads):
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads)
    query, key, value = _inputs(heads, kv_heads)
    out, weights = packed_sdpa_attention_forward(
        module, query, key, value, None, dropout=0.0, scaling=0.3, **{ROW_LENGTHS: LENGTHS}
    )
    assert weights is None and out.shape == (1, sum(LENGTHS), heads, 8)
    leaves = [t.detach().double().requires_grad_() for t in (query, key, value)]
    expected = _reference_attention(*leaves, LENGTHS, scale=0.3)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * upstream).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), leaves)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad, rtol=0, atol=1e-5)


def test_without_row_lengths_it_is_sdpa_with_the_given_mask():
    module = types.SimpleNamespace(is_causal=True)
    query, key, value = _inputs(2, 2)
    row = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    n = len(row)
    block_causal = (row[:, None] == row[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    out, _ = packed_sdpa_attention_forward(module, query, key, value, block_causal[None, None], scaling=0.3)
    expected = _reference_attention(query, key, value, LENGTHS, scale=0.3)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    # Unmasked and without lengths, every token attends to all earlier tokens of the packed sequence.
    crossing, _ = packed_sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    assert not torch.allclose(crossing.double(), expected, atol=1e-3)


def test_packed_passes_attend_per_row_and_restore_the_setting(monkeypatch):
    calls = []
    sdpa = packed_attention.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(packed_attention, "sdpa_attention_forward", spy)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2))
    assert model.pretrained_model.config._attn_implementation == "sdpa"
    config = PPOConfig(batch_size=8, mini_batch_size=4, ppo_epochs=1)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    queries, responses, scores = random_batch(8, seed=0, query_len=(1, 7), response_len=(1, 9))
    trainer.step(queries, responses, scores)
    lengths = [len(q) + len(r) for q, r in zip(queries, responses)]
    # Rollout: policy and reference per mini-batch, 2 layers, one call per row, in order.
    first, second = lengths[:4] * 2, lengths[4:] * 2
    assert len(calls) == 8 * 6 and calls[:32] == first + first + second + second
    # One training pass per (shuffled) mini-batch: each row once per layer.
    assert sorted(calls[32:]) == sorted(lengths * 2)
    assert model.pretrained_model.config._attn_implementation == "sdpa"
    assert trainer.ref_model.pretrained_model.config._attn_implementation == "sdpa"


def test_packed_step_equals_padded_step_with_gradient_checkpointing():
    kwargs = dict(padding_side="left", with_masks=True, ppo_epochs=2, gradient_checkpointing=True)
    _assert_same_steps(_steps(True, **kwargs), _steps(False, **kwargs))


def _llama():
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return AutoModelForCausalLMWithValueHead.from_pretrained(LlamaForCausalLM(config))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_packed_llama_step_equals_padded_step(padding_side):
    kwargs = dict(model_factory=_llama, padding_side=padding_side, with_masks=True, ppo_epochs=2)
    _assert_same_steps(_steps(True, **kwargs), _steps(False, **kwargs))


def test_the_separate_critic_must_pack_too():
    def trainer(padding_free):
        critic = make_gpt2_critic(seed=3)
        critic.config._attn_implementation = "paged|eager"  # an implementation masking_utils builds no packed mask for
        config = PPOConfig(batch_size=4, mini_batch_size=2, padding_free=padding_free)
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
        return PPOTrainer(config, policy, tokenizer=make_tokenizer(), value_model=critic)

    assert not trainer(None)._pack
    with pytest.raises(ValueError, match="padding_free=True, but value_model cannot take packed rows"):
        trainer(True)


def test_critic_values_match_between_packed_and_padded_passes():
    values = []
    for padding_free in (True, False):
        critic = make_gpt2_critic(seed=3)
        config = PPOConfig(batch_size=8, mini_batch_size=4, padding_free=padding_free)
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2))
        trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer("left"), value_model=critic)
        assert trainer._pack is padding_free
        queries, responses, _ = random_batch(8, seed=1, query_len=(1, 7), response_len=(1, 9))
        values.append(trainer._rollout_forward(trainer._make_rows(queries, responses, None))[2])
    assert values[0].abs().sum() > 0
    np.testing.assert_allclose(values[0].numpy(), values[1].numpy(), rtol=0, atol=1e-5)


def test_registered_under_its_own_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert AttentionInterface._global_mapping[PACKED_SDPA] is packed_sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping[PACKED_SDPA] is sdpa_mask
