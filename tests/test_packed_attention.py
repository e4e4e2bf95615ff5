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
from devices import assert_close, equal, on_cpu
from test_packing import _assert_same_steps, _steps
from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_tokenizer, random_batch
from transformers import LlamaConfig, LlamaForCausalLM

import trl_lite.models.packed_attention as packed_attention
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.models.packed_attention import (
    PACKED_SDPA,
    ROW_LENGTHS,
    DeferredMask,
    attend_per_row,
    packed_sdpa_attention_forward,
    packed_sdpa_mask,
)

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
    assert_close(out.double(), expected, rtol=0, atol=1e-5)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * upstream).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), leaves)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad.double(), expected_grad, rtol=0, atol=1e-5)


def test_without_row_lengths_it_is_sdpa_with_the_given_mask():
    module = types.SimpleNamespace(is_causal=True)
    query, key, value = _inputs(2, 2)
    row = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    n = len(row)
    block_causal = (row[:, None] == row[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    out, _ = packed_sdpa_attention_forward(module, query, key, value, block_causal[None, None], scaling=0.3)
    expected = _reference_attention(query, key, value, LENGTHS, scale=0.3)
    assert_close(out.double(), expected, rtol=0, atol=1e-5)
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
        values.append(on_cpu(trainer.experience_maker.passes(trainer.forward.make_rows(queries, responses, None))[2]))
    assert values[0].abs().sum() > 0
    np.testing.assert_allclose(values[0].numpy(), values[1].numpy(), rtol=0, atol=1e-5)


def test_registered_under_its_own_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[PACKED_SDPA] is packed_sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping[PACKED_SDPA] is packed_sdpa_mask


def _packed_inputs(lengths, seed=0):
    """One packed sequence of rows of ``lengths`` tokens: input ids and restarting position ids, ``(1, N)``."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB_SIZE, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return input_ids, position_ids


def test_packed_passes_build_no_block_diagonal_mask_yet_attend_within_rows(monkeypatch):
    built = []
    sdpa_mask = packed_attention.sdpa_mask

    def counting_sdpa_mask(**kwargs):
        built.append((kwargs["q_length"], kwargs["kv_length"]))
        return sdpa_mask(**kwargs)

    monkeypatch.setattr(packed_attention, "sdpa_mask", counting_sdpa_mask)
    lm = make_gpt2(seed=4).eval()
    input_ids, position_ids = _packed_inputs(LENGTHS)
    # Independent reference: every row alone, through plain sdpa, without packing.
    rows = [lm(input_ids=ids[None]).logits[0] for ids in input_ids[0].split(LENGTHS)]
    expected = torch.cat(rows)
    with torch.no_grad(), packed_attention.attend_per_row([lm]):
        per_row = lm(input_ids=input_ids, position_ids=position_ids, use_cache=False, **{ROW_LENGTHS: LENGTHS}).logits
        assert built == []  # the per-row attention needed no mask, so none was built
        # Without the row lengths the layers build the deferred mask, once for the pass, and use it.
        masked = lm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    assert built == [(sum(LENGTHS), sum(LENGTHS))]
    assert_close(per_row[0], expected.detach(), rtol=0, atol=1e-5)
    assert_close(masked[0], expected.detach(), rtol=0, atol=1e-5)


def test_a_packed_step_hands_every_model_the_placeholder_and_builds_no_mask(monkeypatch):
    deferred, built = [], []

    class CountingDeferredMask(DeferredMask):
        def __init__(self, mask_kwargs):
            deferred.append(mask_kwargs["q_length"])
            super().__init__(mask_kwargs)

        def build(self):
            built.append(1)
            return super().build()

    monkeypatch.setattr(packed_attention, "DeferredMask", CountingDeferredMask)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2))
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1), model, tokenizer=make_tokenizer())
    queries, responses, scores = random_batch(4, seed=0, query_len=(1, 7), response_len=(1, 9))
    trainer.step(queries, responses, scores)
    # Every pass (policy and reference passes of both rollout mini-batches, then the two training passes) hands its
    # model the placeholder of rows_mask, on the CPU too: transformers passes it on and makes no mask of its own.
    assert deferred == [] and built == []


def test_the_deferred_mask_is_the_block_diagonal_causal_mask():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
    )

    n = sum(LENGTHS)
    row = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    mask_function = and_masks(causal_mask_function, packed_sequence_mask_function(row[None]))
    deferred = packed_sdpa_mask(batch_size=1, q_length=n, kv_length=n, mask_function=mask_function,
                                allow_is_causal_skip=False)  # fmt: skip
    assert isinstance(deferred, DeferredMask)
    block_causal = (row[:, None] == row[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    assert equal(deferred.build(), block_causal[None, None]) and deferred.build() is deferred.build()
    # Padded batches (several rows, a padding mask) get their mask at once, as from sdpa_mask.
    padding = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    padded = packed_sdpa_mask(batch_size=2, q_length=3, kv_length=3, attention_mask=padding)
    assert isinstance(padded, torch.Tensor) and padded.shape == (2, 1, 3, 3) and not padded[0, 0, 2, 2]


def test_sliding_window_layers_attend_within_their_window_per_row():
    """A Qwen2 whose layers use a sliding window of 3 tokens, over packed rows longer than the window: each
    row's logits equal those of transformers' own eager attention over the row alone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=3,
        max_window_layers=0, attn_implementation="eager",
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).double().eval()
    assert model.config.layer_types == ["sliding_attention"] * 2
    lengths = (7, 2, 9)
    ids = torch.randint(3, VOCAB_SIZE, (1, sum(lengths)))
    with torch.no_grad():
        expected = [model(input_ids=row).logits for row in ids.split(list(lengths), dim=1)]
        model.config._attn_implementation = "sdpa"
        with attend_per_row([model]):
            positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            packed = model(input_ids=ids, position_ids=positions, **{ROW_LENGTHS: lengths}).logits
        # Without the window the rows longer than 3 tokens would differ: the check can fail.
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        with attend_per_row([model]):
            unwindowed = model(input_ids=ids, position_ids=positions, **{ROW_LENGTHS: lengths}).logits
    # atol: eager attention takes its softmax in float32, whatever the model's dtype.
    torch.testing.assert_close(packed, torch.cat(expected, dim=1), rtol=0, atol=1e-6)
    assert (unwindowed[:, :7] - expected[0]).abs().max() > 1e-3
