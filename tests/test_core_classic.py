"""The classic ``trl.core`` helpers in ``trl_lite.core``, checked against float64 / brute-force references."""

import math

import numpy as np
import pytest
import torch
from tiny_models import WORDS, make_gpt2, make_tokenizer

from trl_lite import core
from trl_lite.models import AutoModelForCausalLMWithValueHead


def test_classic_names_are_importable_from_core():
    classic_public = [
        "WANDB_PADDING", "top_k_top_p_filtering", "flatten_dict", "convert_to_scalar", "stack_dicts",
        "add_suffix", "pad_to_size", "logprobs_from_logits", "whiten", "masked_mean", "masked_var",
        "masked_whiten", "clip_by_value", "entropy_from_logits", "average_torch_dicts", "stats_to_np",
        "listify_batch", "build_bert_batch_from_txt", "respond_to_batch", "set_seed", "LengthSampler",
        "PPODecorators", "randn_tensor",
    ]
    for name in classic_public:
        assert name in core.__all__ and hasattr(core, name), name


# ----------------------------------------------------------------------------------------------
# whiten
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_float64_loops(shift_mean):
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 + 2
    items = values.flatten().tolist()
    mean = sum(items) / len(items)
    var = sum((x - mean) ** 2 for x in items) / (len(items) - 1)
    out = core.whiten(values, shift_mean=shift_mean)
    for got, x in zip(out.flatten().tolist(), items):
        expected = (x - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
        assert abs(got - expected) < 1e-12
    assert out.shape == values.shape


def test_whiten_float32_and_input_untouched():
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    before = values.clone()
    out = core.whiten(values, shift_mean=False)
    ref = core.whiten(values.double(), shift_mean=False)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.equal(values, before)


# ----------------------------------------------------------------------------------------------
# top_k_top_p_filtering
# ----------------------------------------------------------------------------------------------


def _filter_reference(row, top_k, top_p, min_keep):
    """Which tokens of one row survive: brute force in float64 on Python floats."""
    kept = set(range(len(row)))
    if top_k > 0:
        k = max(top_k, min_keep)
        kth = sorted(row, reverse=True)[k - 1]
        kept = {i for i in kept if row[i] >= kth}
    if 0 <= top_p <= 1.0:
        z = max(row[i] for i in kept)
        probs = {i: math.exp(row[i] - z) for i in kept}
        total = sum(probs.values())
        probs = {i: p / total for i, p in probs.items()}
        ascending = sorted(kept, key=lambda i: probs[i])
        # A token is dropped when the mass of it and every less likely token is <= 1 - top_p,
        # unless it is among the min_keep most likely.
        running, survivors = 0.0, set()
        for position, i in enumerate(ascending):
            running += probs[i]
            if running > 1 - top_p or position >= len(ascending) - min_keep:
                survivors.add(i)
        kept = survivors
    return kept


@pytest.mark.parametrize(
    "top_k,top_p,min_keep",
    [(0, 1.0, 1), (5, 1.0, 1), (0, 0.7, 1), (4, 0.5, 1), (0, 0.05, 3), (2, 0.0, 1), (1, 0.9, 1)],
)
def test_top_k_top_p_filtering_keeps_the_brute_force_set(top_k, top_p, min_keep):
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3)) * 2
    out = core.top_k_top_p_filtering(logits.clone(), top_k=top_k, top_p=top_p, min_tokens_to_keep=min_keep)
    for row in range(logits.shape[0]):
        expected = _filter_reference(logits[row].double().tolist(), top_k, top_p, min_keep)
        kept = {i for i in range(12) if out[row, i] != -float("inf")}
        assert kept == expected
        for i in kept:
            assert out[row, i] == logits[row, i]


def test_top_k_top_p_filtering_custom_filter_value():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = core.top_k_top_p_filtering(logits, top_k=2, filter_value=-1e4)
    assert out.tolist() == [[-1e4, 3.0, 2.0, -1e4]]


# ----------------------------------------------------------------------------------------------
# respond_to_batch
# ----------------------------------------------------------------------------------------------


def test_respond_to_batch_greedy_equals_a_hand_written_argmax_loop():
    model = make_gpt2(seed=4).eval()
    queries = torch.randint(3, 40, (3, 4), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    out = core.respond_to_batch(model, queries, txt_len=5, top_k=1)
    assert out.shape == (3, 5)
    with torch.no_grad():
        for row in range(3):
            ids = queries[row].tolist()
            for _ in range(5):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            assert out[row].tolist() == ids[-5:]


def test_respond_to_batch_samples_only_from_the_top_k_and_follows_the_seed():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=6)).eval()
    queries = torch.randint(3, 40, (4, 3), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(1)
    out = core.respond_to_batch(model, queries, txt_len=6, top_k=3)
    torch.manual_seed(1)
    again = core.respond_to_batch(model, queries, txt_len=6, top_k=3)
    assert torch.equal(out, again)
    with torch.no_grad():
        for row in range(4):
            ids = queries[row].tolist()
            for token in out[row].tolist():
                logits = model.pretrained_model(torch.tensor([ids])).logits[0, -1]
                assert token in logits.topk(3).indices.tolist()
                ids.append(token)


# ----------------------------------------------------------------------------------------------
# Dict and tensor helpers
# ----------------------------------------------------------------------------------------------


def test_convert_to_scalar():
    stats = {
        "t0": torch.tensor(1.5),
        "t1": torch.tensor([2.5]),
        "t2": torch.tensor([1.0, 2.0]),
        "t11": torch.tensor([[3.0]]),
        "a0": np.array(4.0),
        "a1": np.array([5]),
        "a2": np.array([1, 2]),
        "f": 6.0,
        "s": "text",
    }
    out = core.convert_to_scalar(stats)
    assert list(out) == list(stats)
    assert out["t0"] == 1.5 and type(out["t0"]) is float
    assert out["t1"] == 2.5 and type(out["t1"]) is float
    assert out["a0"] == 4.0 and type(out["a0"]) is float
    assert out["a1"] == 5 and type(out["a1"]) is int
    # Anything else is passed through untouched (the same object).
    for key in ("t2", "t11", "a2", "f", "s"):
        assert out[key] is stats[key]


def test_add_suffix_and_listify_batch():
    assert core.add_suffix({"a": 1, "b/c": 2}, "_x") == {"a_x": 1, "b/c_x": 2}
    batch = torch.arange(6).reshape(3, 2)
    rows = core.listify_batch(batch)
    assert len(rows) == 3 and [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]


def test_pad_to_size():
    t = torch.tensor([[1, 2], [3, 4]])
    assert core.pad_to_size(t, 2) is t
    assert core.pad_to_size(t, 4).tolist() == [[1, 2, 50256, 50256], [3, 4, 50256, 50256]]
    assert core.pad_to_size(t, 3, padding=0).tolist() == [[1, 2, 0], [3, 4, 0]]
    assert core.pad_to_size(torch.tensor([7]), 3, dim=0, padding=-1).tolist() == [7, -1, -1]


def test_average_torch_dicts_matches_float64_loops():
    g = torch.Generator().manual_seed(8)
    dicts = [{"a": torch.randn(2, 3, generator=g, dtype=torch.float64), "b": torch.randn((), generator=g, dtype=torch.float64)}
             for _ in range(4)]
    out = core.average_torch_dicts(dicts)
    assert out["a"].shape == (2, 3) and out["b"].shape == ()
    for i in range(2):
        for j in range(3):
            assert abs(float(out["a"][i, j]) - sum(float(d["a"][i, j]) for d in dicts) / 4) < 1e-12
    assert abs(float(out["b"]) - sum(float(d["b"]) for d in dicts) / 4) < 1e-12


def test_build_bert_batch_from_txt_pads_right_with_zeros():
    tokenizer = make_tokenizer()
    texts = ["the movie was good", "bad", "i loved this film so much"]
    ids, mask = core.build_bert_batch_from_txt(texts, tokenizer, "cpu")
    assert ids.shape == mask.shape == (3, 6)
    assert ids.dtype == torch.long and mask.dtype == torch.float32
    vocab = {w: i + 3 for i, w in enumerate(WORDS)}
    for row, text in enumerate(texts):
        words = text.split()
        expected = [vocab[w] for w in words] + [0] * (6 - len(words))
        assert ids[row].tolist() == expected
        assert mask[row].tolist() == [1.0] * len(words) + [0.0] * (6 - len(words))


# ----------------------------------------------------------------------------------------------
# PPODecorators, randn_tensor
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_ppo_decorators_empty_device_cache(monkeypatch, enabled):
    calls = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(core.PPODecorators, "optimize_device_cache", enabled)

    @core.PPODecorators.empty_device_cache()
    def work():
        calls.append("work")
        return 3

    assert work() == 3
    with core.PPODecorators.empty_device_cache():
        calls.append("block")
    assert calls == (["work", "empty", "block", "empty"] if enabled else ["work", "block"])


def test_randn_tensor_follows_its_generators():
    out = core.randn_tensor((2, 3), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert torch.equal(out, torch.randn(2, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    rows = core.randn_tensor((3, 4), generator=gens)
    for s, row in zip((1, 2, 3), rows):
        assert torch.equal(row, torch.randn(1, 4, generator=torch.Generator().manual_seed(s))[0])
    assert core.randn_tensor((5,)).shape == (5,)
    with pytest.raises(ValueError, match="got 2 generators for shape \\(3, 4\\)"):
        core.randn_tensor((3, 4), generator=gens[:2])
