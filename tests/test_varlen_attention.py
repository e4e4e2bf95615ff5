"""Packed passes on the varlen kernel (trl_lite.models.varlen_attention), checked on the CPU.

torch's ``varlen_attn`` runs on CUDA only, so these tests swap the kernel for CPU references of the
same signature, written here from sdpa over each segment of the offsets: one in torch 2.13's keywords
(``window_size``, ``enable_gqa``, ``scale``) and one in torch 2.10's (``is_causal``, neither grouped
heads nor a scale). They pin the offsets a pass builds, exactly one kernel call per layer per pass,
the choice between the kernel and per-row sdpa with the message that says it, and that steps on the
kernel give the per-row steps' log-probs, values, statistics and trained weights - with grouped
key/value heads (a tiny Qwen2), a separate critic and gradient checkpointing.
"""

import inspect
import logging
import types

import numpy as np
import pytest
import torch
from test_packing import _assert_same_steps, _steps
from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_tokenizer, random_batch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.models import varlen_attention
from trl_lite.models.packed_attention import ROW_LENGTHS, packed_sdpa_attention_forward, rows_mask
from trl_lite.models.varlen_attention import VarlenKernel, packed_rows, varlen_unsupported

LENGTHS = (3, 5, 1, 7)


def _segments(query, key, value, cu_seq_q, cu_seq_k, scale, groups):
    """Causal attention of each segment alone, by sdpa in the inputs' dtype: ``query (T, Hq, D)`` -> ``(T, Hq, D)``.

    Written from the offsets alone (nothing of trl_lite's per-row path), in the dtype of the per-row
    steps it is compared with, so two steps' rounding stays within their usual tolerances.
    """
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    offsets = cu_seq_q.tolist()
    out = []
    for start, stop in zip(offsets[:-1], offsets[1:]):
        q, k, v = (t[start:stop].transpose(0, 1) for t in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """torch 2.13's ``varlen_attn`` signature on the CPU (causal windows only)."""
    assert window_size == (-1, 0) and return_aux is None
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    assert enable_gqa or query.shape[1] == key.shape[1]
    return _segments(query, key, value, cu_seq_q, cu_seq_k, scale, query.shape[1] // key.shape[1])


def reference_varlen_attn_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    """torch 2.10's ``varlen_attn`` signature on the CPU: ``is_causal``, default scale, and a kernel that refuses
    unequal head counts (raising before it runs, as a kernel's input check does)."""
    assert is_causal
    if query.shape[1] != key.shape[1]:
        raise RuntimeError(f"number of heads in key/value must equal the query's, got {key.shape[1]} and {query.shape[1]}")
    return _segments(query, key, value, cu_seq_q, cu_seq_k, None, 1)


def reference_varlen_attn_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                              window_size=(-1, -1)):  # fmt: skip
    """torch 2.11's ``varlen_attn`` signature (``window_size`` and ``scale``, no ``enable_gqa``) with
    FlashAttention-2's input checks: one dtype, last-dim stride 1, int32 offsets, a head dimension that is a
    multiple of 8 up to 256, and key/value heads dividing the query heads (taken unrepeated)."""
    assert window_size == (-1, 0) and return_aux is None
    assert query.dtype == key.dtype == value.dtype and cu_seq_q.dtype == torch.int32
    assert all(t.stride(-1) == 1 for t in (query, key, value))
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    assert isinstance(max_q, int) and max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    if query.shape[1] % key.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    return _segments(query, key, value, cu_seq_q, cu_seq_k, scale, query.shape[1] // key.shape[1])


class _Counting:
    """A kernel that records each call's total tokens and offsets, then runs ``kernel``."""

    def __init__(self, kernel):
        self.kernel, self.calls, self.heads = kernel, [], []
        self.__signature__ = inspect.signature(kernel)

    def __call__(self, query, *args, **kwargs):
        out = self.kernel(query, *args, **kwargs)  # a refused call (it raises) is not counted
        self.calls.append((query.shape[0], args[2].tolist()))
        self.heads.append((query.shape[1], args[0].shape[1]))
        return out


# The devices the stand-in kernel is registered for: the CPU, and CUDA where the trainer runs there (the suite
# under scripts/gpu_check.py), so that the trainer's passes reach it on whichever device they run.
STAND_IN_DEVICES = frozenset({"cpu", "cuda"})


def _with_stand_in(monkeypatch, kernel=reference_varlen_attn, dtypes=(torch.float32, torch.float64)):
    """Make ``kernel`` the varlen kernel, for ``dtypes`` on the CPU and CUDA; return the counting wrapper."""
    counting = _Counting(kernel)
    monkeypatch.setattr(varlen_attention, "KERNEL", VarlenKernel(counting, STAND_IN_DEVICES, frozenset(dtypes)))
    return counting


def _qkv(heads, kv_heads, dim=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    return [torch.randn(1, h, n, dim, generator=g, dtype=dtype).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def test_the_offsets_are_built_once_on_the_host_as_int32():
    rows = packed_rows(LENGTHS, "cpu")
    # Where the kernel does not run, only the host lengths: the per-row path needs nothing else.
    assert rows.lengths == LENGTHS and rows.max_length == 7 and rows.total == 16 and rows.cu_seqlens is None
    with pytest.MonkeyPatch.context() as mp:
        _with_stand_in(mp)
        rows = packed_rows(iter(LENGTHS), torch.device("cpu"))
    assert rows.cu_seqlens.dtype == torch.int32 and rows.cu_seqlens.tolist() == [0, 3, 8, 9, 16]
    assert isinstance(rows.max_length, int) and rows.max_length == 7
    for bad in ((), (3, 0)):
        with pytest.raises(ValueError, match="lengths must be one or more positive row lengths"):
            packed_rows(bad, "cpu")


@pytest.mark.parametrize("kernel", [reference_varlen_attn, reference_varlen_attn_210, reference_varlen_attn_211])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)])
def test_one_kernel_call_equals_per_row_attention(monkeypatch, kernel, heads, kv_heads):
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads, training=False)
    query, key, value = _qkv(heads, kv_heads)
    expected, _ = packed_sdpa_attention_forward(module, query, key, value, None, scaling=0.3, **{ROW_LENGTHS: LENGTHS})
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), (query, key, value))
    counting = _with_stand_in(monkeypatch, kernel)
    rows = packed_rows(LENGTHS, "cpu")
    out, weights = packed_sdpa_attention_forward(module, query, key, value, None, scaling=0.3, **{ROW_LENGTHS: rows})
    assert weights is None and out.shape == (1, 16, heads, 8)
    assert counting.calls == [(16, [0, 3, 8, 9, 16])]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    for grad, expected_grad in zip(torch.autograd.grad(out.pow(2).sum(), (query, key, value)), expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel, unrepeated", [(reference_varlen_attn_211, True), (reference_varlen_attn_210, False)])
def test_grouped_heads_go_unrepeated_where_the_kernel_takes_them(monkeypatch, caplog, kernel, unrepeated):
    """Without ``enable_gqa`` the kernel is first given the Hkv key/value heads; one that refuses gets them
    repeated, from then on (said once). Both give per-row attention's outputs and gradients."""
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=3, training=False)
    query, key, value = _qkv(6, 2)
    expected, _ = packed_sdpa_attention_forward(module, query, key, value, None, scaling=0.3, **{ROW_LENGTHS: LENGTHS})
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), (query, key, value))
    counting = _with_stand_in(monkeypatch, kernel)
    rows = packed_rows(LENGTHS, "cpu")
    with caplog.at_level(logging.INFO, logger=varlen_attention.__name__):
        for _ in range(2):
            out, _ = packed_sdpa_attention_forward(module, query, key, value, None, scaling=0.3, **{ROW_LENGTHS: rows})
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
            grads = torch.autograd.grad(out.pow(2).sum(), (query, key, value))
            for grad, expected_grad in zip(grads, expected_grads):
                torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5)
    assert counting.heads == [(6, 2 if unrepeated else 6)] * 2
    refusals = [r for r in caplog.records if "refuses unrepeated grouped key/value heads" in r.getMessage()]
    assert len(refusals) == (0 if unrepeated else 1)


@pytest.mark.parametrize("head_dim, takes", [(8, True), (64, True), (256, True), (12, False), (4, False), (264, False)])
def test_head_dims_flash_attention_refuses_go_row_by_row(monkeypatch, head_dim, takes):
    """FlashAttention-2 takes head dimensions that are multiples of 8 up to 256; others attend row by row,
    with the reason (instead of an error inside the kernel)."""
    _with_stand_in(monkeypatch, reference_varlen_attn_211, dtypes=(torch.bfloat16,))
    rows = packed_rows(LENGTHS, "cpu")
    reason = varlen_unsupported(torch.zeros(1, 2, 16, head_dim, dtype=torch.bfloat16), rows, types.SimpleNamespace(), {})
    if takes:
        assert reason is None
    else:
        assert reason == f"the head dimension is {head_dim} and the varlen kernel takes multiples of 8 up to 256"


def test_layers_that_drop_the_keyword_read_the_rows_from_the_mask(monkeypatch):
    module = types.SimpleNamespace(is_causal=True, training=False)
    query, key, value = _qkv(2, 2)
    expected, _ = packed_sdpa_attention_forward(module, query, key, value, None, **{ROW_LENGTHS: LENGTHS})
    # Every device gets the placeholder: 4-D (transformers passes it on untouched), one byte, and no dtype sdpa
    # would take as a mask. The CPU's per-row path reads the rows from it ...
    mask = rows_mask(packed_rows(LENGTHS, "cpu"), "cpu")
    assert mask.shape == (1, 1, 16, 16) and mask.stride() == (0, 0, 0, 0) and mask.dtype == torch.uint8
    out, _ = packed_sdpa_attention_forward(module, query, key, value, mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    # ... and an attention that does not read them fails on it instead of attending over every row.
    with pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    counting = _with_stand_in(monkeypatch)  # the kernel's path (CUDA) reads them too
    out, _ = packed_sdpa_attention_forward(module, query, key, value, rows_mask(packed_rows(LENGTHS, "cpu"), "cpu"))
    assert len(counting.calls) == 1
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_the_path_chosen_and_why(monkeypatch):
    rows = packed_rows(LENGTHS, "cpu")
    query = torch.zeros(1, 2, 16, 8)
    module = types.SimpleNamespace(training=True)
    # Today's kernel does not run on the CPU: the CPU keeps its per-row path.
    assert "does not run on cpu" in varlen_unsupported(query, rows, module, {})
    monkeypatch.setattr(varlen_attention, "KERNEL", VarlenKernel(None, frozenset({"cpu"}), frozenset({torch.bfloat16})))
    assert "has no torch.nn.attention.varlen.varlen_attn" in varlen_unsupported(query, rows, module, {})
    _with_stand_in(monkeypatch, dtypes=(torch.bfloat16, torch.float16))
    rows = packed_rows(LENGTHS, "cpu")
    assert "inputs are float32 and the varlen kernel takes bfloat16/float16" in varlen_unsupported(query, rows, module, {})
    half = query.bfloat16()
    assert varlen_unsupported(half, rows, module, {"dropout": 0.0}) is None
    assert "no offsets" in varlen_unsupported(half, varlen_attention.PackedRows(LENGTHS, 7), module, {})
    assert "dropout" in varlen_unsupported(half, rows, module, {"dropout": 0.1})
    assert varlen_unsupported(half, rows, types.SimpleNamespace(training=False), {"dropout": 0.1}) is None
    assert "sliding window" in varlen_unsupported(half, rows, module, {"sliding_window": 4})

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("never called")

    _with_stand_in(monkeypatch, no_causal, dtypes=(torch.bfloat16,))
    assert "neither window_size nor is_causal" in varlen_unsupported(half, rows, module, {})


def test_the_path_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(varlen_attention, "_ANNOUNCED", set())
    module = types.SimpleNamespace(is_causal=True, training=False)
    query, key, value = _qkv(2, 2)
    with caplog.at_level(logging.INFO, logger=varlen_attention.__name__):
        for _ in range(3):
            packed_sdpa_attention_forward(module, query, key, value, None, **{ROW_LENGTHS: LENGTHS})
        _with_stand_in(monkeypatch, dtypes=(torch.bfloat16,))
        for _ in range(3):  # a kernel device without the kernel's dtype: a warning, once
            packed_sdpa_attention_forward(module, query, key, value, None, **{ROW_LENGTHS: packed_rows(LENGTHS, "cpu")})
        _with_stand_in(monkeypatch)
        for _ in range(3):
            packed_sdpa_attention_forward(module, query, key, value, None, **{ROW_LENGTHS: packed_rows(LENGTHS, "cpu")})
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("INFO", "packed passes attend row by row with sdpa: the varlen kernel does not run on cpu."),
        ("WARNING", "packed passes attend row by row with sdpa (cuDNN attention excluded): the attention inputs are "
                    "float32 and the varlen kernel takes bfloat16 (train under AMP or with 16-bit weights)."),
        ("INFO", "packed passes attend with one varlen_attn call per layer (cu_seqlens built once per pass)."),
    ]  # fmt: skip


def _qwen2():
    torch.manual_seed(7)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return AutoModelForCausalLMWithValueHead.from_pretrained(Qwen2ForCausalLM(config))


@pytest.mark.parametrize("kernel", [reference_varlen_attn, reference_varlen_attn_210, reference_varlen_attn_211])
def test_steps_on_the_kernel_equal_per_row_steps(monkeypatch, kernel):
    kwargs = dict(padding_side="left", with_masks=True, ppo_epochs=2)
    per_row = _steps(True, **kwargs)
    counting = _with_stand_in(monkeypatch, kernel)
    on_kernel = _steps(True, **kwargs)
    _assert_same_steps(on_kernel, per_row)
    # 2 steps of 8 rows in mini-batches of 4 (test_packing's trainer), 2 layers: the rollout's policy
    # and reference passes, then 2 epochs of training passes, each one kernel call per layer.
    assert len(counting.calls) == 2 * 2 * (2 * 2 + 2 * 2)
    assert all(offsets[-1] == total and len(offsets) == 5 for total, offsets in counting.calls)


def _qwen2_passes(gradient_checkpointing):
    """A tiny Qwen2 (6 query heads over 2 key/value heads, tied embeddings): its rollout log-probs,
    reference log-probs and values, and the gradients of one training pass's log-probs and values."""
    model = _qwen2()
    config = PPOConfig(batch_size=8, mini_batch_size=4, gradient_checkpointing=gradient_checkpointing)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer("left"))
    queries, responses, _ = random_batch(8, seed=2, query_len=(1, 7), response_len=(1, 9))
    forward = trainer.forward
    rows = forward.make_rows(queries, responses, None)
    rollout = trainer.experience_maker.passes(rows)[:3]
    model.train()
    with forward.per_row_attention():
        index, idx = next(forward.minibatches(rows))
        logprobs, values, _, _, _ = forward.logprobs(trainer.model, rows, index, idx)
        mask = rows.action_mask[idx, : logprobs.shape[1]]
        ((logprobs * mask).sum() + (values * mask).pow(2).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return rollout, grads


@pytest.mark.parametrize("kernel", [reference_varlen_attn, reference_varlen_attn_210, reference_varlen_attn_211])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_grouped_query_passes_on_the_kernel_equal_per_row_passes(monkeypatch, kernel, gradient_checkpointing):
    expected_rollout, expected_grads = _qwen2_passes(gradient_checkpointing)
    counting = _with_stand_in(monkeypatch, kernel)
    rollout, grads = _qwen2_passes(gradient_checkpointing)
    # Rollout: 2 mini-batches x (policy, reference) x 2 layers; training: 2 layers, recomputed once more
    # in the backward pass under gradient checkpointing.
    assert len(counting.calls) == 2 * 2 * 2 + 2 * (2 if gradient_checkpointing else 1)
    for got, expected in zip(rollout, expected_rollout):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_a_separate_critic_attends_on_the_kernel_with_the_policy_offsets(monkeypatch):
    def values():
        critic = make_gpt2_critic(seed=3)
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2))
        trainer = PPOTrainer(PPOConfig(batch_size=8, mini_batch_size=4), policy, tokenizer=make_tokenizer(), value_model=critic)
        queries, responses, _ = random_batch(8, seed=1, query_len=(1, 7), response_len=(1, 9))
        return trainer.experience_maker.passes(trainer.forward.make_rows(queries, responses, None))[:3]

    expected = values()
    counting = _with_stand_in(monkeypatch)
    got = values()
    # Two mini-batches: policy, critic and reference passes, 2 layers each.
    assert len(counting.calls) == 2 * 3 * 2
    assert [c[1] for c in counting.calls[:2]] == [c[1] for c in counting.calls[2:4]]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.fixture
def fresh_accelerate_state():
    """A bf16 Accelerator needs accelerate's process-wide state fresh, and leaves it fresh for other tests."""
    from test_mixed_precision import _reset_accelerate_state

    _reset_accelerate_state()
    yield _reset_accelerate_state
    _reset_accelerate_state()


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_amp_and_bf16_weights_attend_on_the_kernel(monkeypatch, fresh_accelerate_state, weights):
    """Under bf16 autocast (float32 weights) and with bf16 weights the attention inputs are bf16: a
    kernel of 16-bit dtypes takes every layer of every pass, and the step's log-probs, values and
    statistics are those of per-row attention within bf16 rounding."""

    def step():
        fresh_accelerate_state()
        lm = _qwen2().pretrained_model
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(lm.to(torch.bfloat16) if weights == "bf16" else lm)
        config = PPOConfig(batch_size=8, mini_batch_size=4, ppo_epochs=1, accelerator_kwargs={"mixed_precision": "bf16"})
        trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer())
        queries, responses, scores = random_batch(8, seed=3, query_len=(1, 7), response_len=(1, 9))
        rows = trainer.forward.make_rows(queries, responses, None)
        return trainer.experience_maker.passes(rows)[:3], trainer.step(queries, responses, scores)

    (expected_passes, expected_stats) = step()
    counting = _with_stand_in(monkeypatch, dtypes=(torch.bfloat16, torch.float16))
    passes, stats = step()
    # Rollout of make_rows (2 mini-batches, policy and reference), then the step's rollout and training.
    assert len(counting.calls) == (2 * 2 + 2 * 2 + 2) * 2
    for got, expected in zip(passes, expected_passes):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)
    for key in ("objective/kl", "ppo/loss/total", "ppo/policy/clipfrac", "objective/entropy"):
        np.testing.assert_allclose(stats[key], expected_stats[key], rtol=2e-2, atol=2e-2, err_msg=key)
