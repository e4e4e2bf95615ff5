"""Shared-prefix passes on the varlen kernel, checked on the CPU with a stand-in kernel.

The shared layout hands the kernel separate query and key offsets: query row ``j`` is a response (or a
prompt), key row ``j`` the prompt's keys followed by the response's own, gathered by ``key_index``. The
stand-in here is written from those offsets alone, with FlashAttention's causal alignment for a query
row shorter than its key row (bottom-right: query ``i`` of ``Lq`` reads keys ``j <= i + Lk - Lq``). The
tests pin the offsets, check the kernel's attention against each row computed alone, and a whole step on
the kernel against the per-row shared step.
"""

import inspect

import numpy as np
import pytest
import torch
from test_prefix_sharing import CASES, _two_steps

from trl_lite.models import varlen_attention
from trl_lite.models.packed_attention import ROW_LENGTHS, packed_sdpa_attention_forward
from trl_lite.models.shared_prefix_attention import shared_rows
from trl_lite.models.varlen_attention import VarlenKernel

GROUPS = ((3, (2, 4)), (5, ()), (2, (1, 6, 3)))


def bottom_right_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                             window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    """torch 2.13's ``varlen_attn`` on the CPU: causal (``window_size=(-1, 0)``) aligned bottom-right per segment."""
    assert window_size == (-1, 0) and cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    q_offsets, k_offsets = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert len(q_offsets) == len(k_offsets) and query.shape[0] == q_offsets[-1] and key.shape[0] == k_offsets[-1]
    assert max_q == max(b - a for a, b in zip(q_offsets, q_offsets[1:]))
    assert max_k == max(b - a for a, b in zip(k_offsets, k_offsets[1:]))
    out = []
    for qa, qb, ka, kb in zip(q_offsets, q_offsets[1:], k_offsets, k_offsets[1:]):
        lq, lk = qb - qa, kb - ka
        mask = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
        q, k, v = query[qa:qb].transpose(0, 1), key[ka:kb].transpose(0, 1), value[ka:kb].transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


class _Counting:
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []
        self.__signature__ = inspect.signature(kernel)

    def __call__(self, query, key, value, *args, **kwargs):
        self.calls.append((query.shape[0], key.shape[0]))
        return self.kernel(query, key, value, *args, **kwargs)


@pytest.fixture
def stand_in(monkeypatch):
    counting = _Counting(bottom_right_varlen_attn)
    kernel = VarlenKernel(counting, frozenset({"cpu", "cuda"}), frozenset({torch.float32, torch.float64}))
    monkeypatch.setattr(varlen_attention, "KERNEL", kernel)
    return counting


def test_the_shared_offsets(stand_in):
    rows = shared_rows(GROUPS, "cpu")
    assert rows.total == 3 + 2 + 4 + 5 + 2 + 1 + 6 + 3 and rows.lengths == (3, 2, 4, 5, 2, 1, 6, 3)
    assert rows.cu_seqlens.tolist() == [0, 3, 5, 9, 14, 16, 17, 23, 26]
    # Key rows: a prompt its own keys; a response its prompt's and its own.
    assert rows.cu_seqlens_k.tolist() == [0, 3, 8, 15, 20, 22, 25, 33, 38]
    assert rows.max_length == 6 and rows.max_key_length == 8
    assert rows.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, *range(9, 14), 14, 15,
                                       14, 15, 16, 14, 15, *range(17, 23), 14, 15, *range(23, 26)]  # fmt: skip
    with pytest.raises(ValueError, match="groups must be one or more"):
        shared_rows(((3, (0,)),), "cpu")


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_the_kernel_attends_as_each_row_alone(stand_in, kv_heads):
    g = torch.Generator().manual_seed(0)
    rows = shared_rows(GROUPS, "cpu")
    query, key, value = (torch.randn(1, h, rows.total, 8, generator=g, dtype=torch.float64) for h in (2, kv_heads, kv_heads))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2 // kv_heads
    got, _ = packed_sdpa_attention_forward(module, query, key, value, None, **{ROW_LENGTHS: rows})
    assert stand_in.calls == [(rows.total, int(rows.cu_seqlens_k[-1]))]
    per_row, _ = packed_sdpa_attention_forward(module, query, key, value, None, **{ROW_LENGTHS: shared_rows(GROUPS, "meta")})
    torch.testing.assert_close(got, per_row, rtol=0, atol=1e-12)
    # Each response against its own row prompt + response, causal, computed alone.
    start = 0
    k_all, v_all = key.repeat_interleave(2 // kv_heads, 1), value.repeat_interleave(2 // kv_heads, 1)
    for prompt, responses in GROUPS:
        offset = start + prompt
        for r in responses:
            idx = torch.cat((torch.arange(start, start + prompt), torch.arange(offset, offset + r)))
            alone = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, idx], k_all[:, :, idx], v_all[:, :, idx], is_causal=True
            ).transpose(1, 2)
            torch.testing.assert_close(got[:, offset : offset + r], alone[:, prompt:], rtol=0, atol=1e-12)
            torch.testing.assert_close(got[:, start : start + prompt], alone[:, :prompt], rtol=0, atol=1e-12)
            offset += r
        start = offset


@pytest.mark.parametrize("name", ["grpo", "gae"])
def test_steps_on_the_kernel_equal_per_row_shared_steps(monkeypatch, name):
    _, expected_stats, expected_weights = _two_steps(True, **CASES[name])
    counting = _Counting(bottom_right_varlen_attn)
    monkeypatch.setattr(varlen_attention, "KERNEL", VarlenKernel(counting, frozenset({"cpu"}), frozenset({torch.float32})))
    _, stats, weights = _two_steps(True, **CASES[name])
    # Each shared pass runs one kernel call per layer whose key rows are longer than its query rows.
    assert counting.calls and all(k > q for q, k in counting.calls)
    for got, want in zip(stats, expected_stats):
        for key in ("ppo/loss/policy", "ppo/policy/entropy", "objective/kl", "ppo/policy/approxkl"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key, weight in expected_weights.items():
        torch.testing.assert_close(weights[key], weight, rtol=1e-5, atol=1e-6)
