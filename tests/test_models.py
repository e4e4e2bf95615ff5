"""Tests of trl_lite.models: value-head wrappers, their fast logits path, checkpoints, reference models."""

import json
import logging
import os

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import VOCAB_SIZE, make_gpt2
from torch import nn
from transformers import AutoModelForCausalLM

from trl_lite.models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    ValueHead,
    create_reference_model,
)
from trl_lite.models import modeling_base


def assert_state_dicts_equal(a: dict, b: dict) -> None:
    """Same keys and bit-identical tensors."""
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def left_padded_batch(seed: int = 0):
    """(input_ids, attention_mask, position_ids) of shape (3, 9) with left padding of 0, 2 and 5 tokens."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB_SIZE, (3, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate((0, 2, 5)):
        input_ids[row, :pad] = 0
        attention_mask[row, :pad] = 0
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def gather_rows(tensor, positions):
    """Reference gather with a Python loop: tensor (B, S, D), positions (B, K) -> (B, K, D)."""
    return torch.stack([tensor[b, positions[b]] for b in range(tensor.shape[0])])


def lora_config():
    """A LoRA adapter on GPT-2's attention with random (non-zero) B, so that it changes the outputs."""
    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["c_attn"],
        fan_in_fan_out=True,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )


# Positions (B=3, K=4) inside the non-padded part of each row of `left_padded_batch`.
POSITIONS = torch.tensor([[0, 3, 5, 8], [2, 4, 7, 8], [5, 6, 7, 8]])


# ValueHead ---------------------------------------------------------------------------------------


def test_value_head_reads_hidden_size_and_upcasts(gpt2, t5):
    assert ValueHead(gpt2.config).summary.in_features == 32  # n_embd
    assert ValueHead(t5.config).summary.in_features == 32  # d_model
    head = ValueHead(gpt2.config)
    assert isinstance(head.dropout, nn.Identity)
    hidden = torch.randn(2, 5, 32).bfloat16()
    value = head(hidden)
    assert value.shape == (2, 5) and value.dtype == torch.float32
    expected = hidden.float() @ head.summary.weight[0] + head.summary.bias[0]
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    assert ValueHead(gpt2.config, summary_dropout_prob=0.25).dropout.p == 0.25
    with pytest.raises(ValueError, match="summary_dropout_prob"):
        ValueHead(gpt2.config, summary_dropout_prob=1.5)


# Forward -----------------------------------------------------------------------------------------


def test_causal_forward_matches_transformers_model(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    input_ids, attention_mask, position_ids = left_padded_batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    lm_logits, loss, value = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)
    reference = gpt2(
        input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels, output_hidden_states=True
    )
    assert lm_logits.shape == (3, 9, VOCAB_SIZE) and lm_logits.dtype == torch.float32
    torch.testing.assert_close(lm_logits, reference.logits, rtol=0, atol=0)
    torch.testing.assert_close(loss, reference.loss, rtol=0, atol=0)
    w, b = model.v_head.summary.weight[0], model.v_head.summary.bias[0]
    assert value.shape == (3, 9)
    torch.testing.assert_close(value, reference.hidden_states[-1] @ w + b, rtol=1e-6, atol=1e-6)
    assert model.pretrained_model is gpt2 and model.config is gpt2.config
    assert not model.is_peft_model and not model.is_encoder_decoder and model.supports_gradient_checkpointing


def test_seq2seq_forward_shapes_values_and_positions(t5):
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5)
    input_ids, attention_mask, _ = left_padded_batch()
    decoder_input_ids = torch.randint(3, VOCAB_SIZE, (3, 5))
    lm_logits, loss, value = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    reference = t5(
        input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_hidden_states=True
    )
    assert lm_logits.shape == (3, 5, VOCAB_SIZE) and loss is None and value.shape == (3, 5)
    torch.testing.assert_close(lm_logits, reference.logits, rtol=0, atol=0)
    w, b = model.v_head.summary.weight[0], model.v_head.summary.bias[0]
    torch.testing.assert_close(value, reference.decoder_hidden_states[-1] @ w + b, rtol=1e-6, atol=1e-6)
    assert model.is_encoder_decoder
    positions = torch.tensor([[0, 4], [1, 2], [3, 3]])
    gathered, _, value_at = model(
        input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, logits_positions=positions
    )
    assert gathered.shape == (3, 2, VOCAB_SIZE)
    torch.testing.assert_close(gathered, gather_rows(reference.logits, positions), rtol=0, atol=0)
    torch.testing.assert_close(value_at, value, rtol=0, atol=0)


def record_lm_head_inputs(model):
    """Shapes of every input the transformers model's LM head sees, appended to the returned list."""
    shapes = []
    model.transformers_model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: shapes.append(tuple(args[0].shape))
    )
    return shapes


def test_fast_path_equals_full_forward_with_left_padding(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    input_ids, attention_mask, position_ids = left_padded_batch()
    lm_head_inputs = record_lm_head_inputs(model)
    full_logits, _, full_value = model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    fast_logits, loss, fast_value = model(
        input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_positions=POSITIONS
    )
    # The fast path sends only the (B, K, H) gathered hidden states through the LM head.
    assert lm_head_inputs == [(3, 9, 32), (3, 4, 32)]
    assert fast_logits.shape == (3, 4, VOCAB_SIZE) and loss is None
    torch.testing.assert_close(fast_logits, gather_rows(full_logits, POSITIONS), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_value, full_value, rtol=1e-6, atol=1e-6)


def test_fast_path_at_row_position_pairs(gpt2, t5):
    # (rows, positions) selects N single entries: the LM head sees (N, H), nothing else.
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    input_ids, attention_mask, position_ids = left_padded_batch()
    rows, cols = torch.tensor([0, 0, 2, 1, 2]), torch.tensor([8, 3, 5, 7, 5])
    inputs = dict(attention_mask=attention_mask, position_ids=position_ids)
    full_logits, _, full_value = model(input_ids, **inputs)
    lm_head_inputs = record_lm_head_inputs(model)
    picked, _, value = model(input_ids, logits_positions=(rows, cols), **inputs)
    assert lm_head_inputs == [(5, 32)] and picked.shape == (5, VOCAB_SIZE)
    expected = torch.stack([full_logits[r, c] for r, c in zip(rows.tolist(), cols.tolist())])
    torch.testing.assert_close(picked, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(value, full_value, rtol=1e-6, atol=1e-6)
    # The encoder-decoder twin gathers the same pairs from its full decoder logits.
    seq2seq = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5)
    decoder_input_ids = torch.randint(3, VOCAB_SIZE, (3, 5))
    enc = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    full_dec, _, _ = seq2seq(input_ids, **enc)
    rows, cols = torch.tensor([2, 0, 1]), torch.tensor([4, 0, 2])
    picked, _, _ = seq2seq(input_ids, logits_positions=(rows, cols), **enc)
    torch.testing.assert_close(picked, full_dec[rows, cols], rtol=0, atol=0)


def test_fast_path_with_lora_adapter_on_and_off(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, peft_config=lora_config())
    assert model.is_peft_model
    input_ids, attention_mask, position_ids = left_padded_batch(seed=1)
    inputs = dict(attention_mask=attention_mask, position_ids=position_ids)
    full_logits, _, full_value = model(input_ids, **inputs)
    fast_logits, _, fast_value = model(input_ids, logits_positions=POSITIONS, **inputs)
    torch.testing.assert_close(fast_logits, gather_rows(full_logits, POSITIONS), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_value, full_value, rtol=1e-6, atol=1e-6)
    with model.pretrained_model.disable_adapter():
        off_logits, _, _ = model(input_ids, logits_positions=POSITIONS, **inputs)
        base_logits = model.transformers_model(input_ids, **inputs).logits
    torch.testing.assert_close(off_logits, gather_rows(base_logits, POSITIONS), rtol=1e-6, atol=1e-6)
    assert (off_logits - fast_logits).abs().max() > 1e-3  # the adapter does change the logits


def test_fast_path_falls_back_without_backbone_and_with_labels(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    input_ids, attention_mask, position_ids = left_padded_batch()
    lm_head_inputs = record_lm_head_inputs(model)
    full_logits, _, _ = model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    _, loss, _ = model(input_ids, labels=input_ids, logits_positions=POSITIONS)
    assert loss is not None
    gpt2.base_model_prefix = "missing"  # no backbone attribute: full forward, then gather
    inputs = dict(attention_mask=attention_mask, position_ids=position_ids)
    logits, _, _ = model(input_ids, logits_positions=POSITIONS, **inputs)
    assert lm_head_inputs == [(3, 9, 32)] * 3
    torch.testing.assert_close(logits, gather_rows(full_logits, POSITIONS), rtol=0, atol=0)


def test_linear_lm_head_inputs_give_the_fast_path_logits(gpt2):
    # The head's inputs at the chosen entries, through the head the model reports, are the logits.
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    head = model.linear_lm_head()
    assert head is gpt2.lm_head
    input_ids, attention_mask, position_ids = left_padded_batch()
    inputs = dict(attention_mask=attention_mask, position_ids=position_ids)
    pairs = (torch.tensor([0, 2, 1]), torch.tensor([8, 5, 7]))
    logits, _, value = model(input_ids, logits_positions=pairs, **inputs)
    lm_head_inputs = record_lm_head_inputs(model)
    hidden, loss, hidden_value = model(input_ids, logits_positions=pairs, return_lm_head_inputs=True, **inputs)
    assert lm_head_inputs == [] and loss is None  # the model does not run its head
    assert hidden.shape == (3, 32)
    torch.testing.assert_close(head(hidden), logits, rtol=0, atol=0)
    torch.testing.assert_close(hidden_value, value, rtol=0, atol=0)
    # Half precision: the inputs stay in the model's dtype (the logits are upcast to float32).
    model.to(torch.bfloat16)
    hidden, _, _ = model(input_ids, logits_positions=POSITIONS, return_lm_head_inputs=True, **inputs)
    assert hidden.dtype == torch.bfloat16 and hidden.shape == (3, 4, 32)


def test_linear_lm_head_is_none_where_the_caller_may_not_apply_it(gpt2, t5):
    assert AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5).linear_lm_head() is None
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    gpt2.config.final_logit_softcapping = 30.0  # forward post-processes the logits
    assert model.linear_lm_head() is None
    gpt2.config.final_logit_softcapping = None

    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    gpt2.lm_head.__class__ = ScaledLinear  # a Linear subclass computes something else from its weight
    assert model.linear_lm_head() is None
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 5))
    with pytest.raises(ValueError, match="return_lm_head_inputs=True needs .*linear_lm_head\\(\\)=NoneType"):
        model(input_ids, logits_positions=torch.zeros(2, 1, dtype=torch.long), return_lm_head_inputs=True)
    gpt2.lm_head.__class__ = nn.Linear
    assert model.linear_lm_head() is gpt2.lm_head
    with pytest.raises(ValueError, match="logits_positions=NoneType"):
        model(input_ids, return_lm_head_inputs=True)
    with pytest.raises(ValueError, match="labels given"):
        model(input_ids, labels=input_ids, logits_positions=torch.zeros(2, 1, dtype=torch.long), return_lm_head_inputs=True)


def test_logits_positions_are_validated(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 5))
    with pytest.raises(TypeError, match="logits_positions"):
        model(input_ids, logits_positions=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="logits_positions"):
        model(input_ids, logits_positions=torch.zeros(3, 2, dtype=torch.long))
    long = torch.zeros(3, dtype=torch.long)
    for bad in [(long,), (long, long[:2]), (long, long.float()), (long.view(3, 1), long.view(3, 1)), (long, long, long)]:
        with pytest.raises(TypeError, match=r"logits_positions as a pair must be \(rows, positions\)"):
            model(input_ids, logits_positions=bad)


def test_past_key_values_continue_the_sequence(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 6))
    full_logits, _, full_value = model(input_ids)
    *_, past = model(input_ids[:, :-1], return_past_key_values=True)
    last_logits, _, last_value = model(input_ids[:, -1:], past_key_values=past)
    torch.testing.assert_close(last_logits[:, -1], full_logits[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last_value[:, -1], full_value[:, -1], rtol=1e-5, atol=1e-5)


# Construction ------------------------------------------------------------------------------------


def test_from_pretrained_splits_head_and_transformers_kwargs(gpt2, tmp_path):
    gpt2.save_pretrained(tmp_path)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        str(tmp_path), dtype=torch.float64, summary_dropout_prob=0.1, v_head_init_strategy="normal"
    )
    assert model.pretrained_model.dtype == torch.float64 and model.v_head.summary.weight.dtype == torch.float32
    assert model.v_head.dropout.p == 0.1


def test_value_head_init_strategies():
    wide = make_gpt2(n_layer=1, n_embd=1024)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        wide, v_head_init_strategy="normal", v_head_initializer_range=0.5
    )
    weight = model.v_head.summary.weight
    # 1024 draws of N(0, 0.5^2): the sample std and mean are within ~0.011 and ~0.016 of 0.5 and 0.
    assert abs(weight.std().item() - 0.5) < 0.05 and abs(weight.mean().item()) < 0.07
    assert torch.count_nonzero(model.v_head.summary.bias) == 0
    default = AutoModelForCausalLMWithValueHead.from_pretrained(wide)
    assert default.v_head.summary.weight.abs().max() <= 1024**-0.5  # torch's Linear default: U(-1/sqrt(H), 1/sqrt(H))
    assert default.v_head.summary.weight.std() < 0.05


def test_bad_arguments_are_rejected(gpt2, t5):
    with pytest.raises(TypeError, match="pretrained_model_name_or_path"):
        AutoModelForCausalLMWithValueHead.from_pretrained(123)
    with pytest.raises(TypeError, match="pretrained_model"):
        AutoModelForCausalLMWithValueHead(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="peft_config"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, peft_config={"r": 4})
    with pytest.raises(TypeError, match="unexpected keyword"):
        AutoModelForCausalLMWithValueHead(gpt2, v_head_size=3)
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, peft_config=lora_config(), v_head_init_strategy="x")
    assert not any("lora_" in name for name, _ in gpt2.named_parameters())  # rejected before the adapter was added
    with pytest.raises(ValueError, match="summary_dropout_prob"):
        AutoModelForCausalLMWithValueHead(gpt2, summary_dropout_prob=-0.1)
    with pytest.raises(ValueError, match="v_head_initializer_range"):
        AutoModelForCausalLMWithValueHead(gpt2, v_head_initializer_range=-1.0)
    with pytest.raises(ValueError, match="AutoModelForSeq2SeqLMWithValueHead"):
        AutoModelForCausalLMWithValueHead.from_pretrained(t5)
    with pytest.raises(ValueError, match="AutoModelForCausalLMWithValueHead"):
        AutoModelForSeq2SeqLMWithValueHead.from_pretrained(gpt2)


def test_state_dict_includes_the_head(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, v_head_init_strategy="normal")
    state = model.state_dict()
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(state)
    other = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    other.load_state_dict(state)
    assert_state_dicts_equal(other.state_dict(), state)


def test_gradient_checkpointing_and_generate_pass_through(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2).train()
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 6))

    def grads():
        model.zero_grad()
        logits, _, value = model(input_ids)
        (logits.logsumexp(-1).sum() + value.sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = grads()
    model.gradient_checkpointing_enable()
    assert gpt2.transformer.gradient_checkpointing
    checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6)
    model.gradient_checkpointing_disable()
    assert not gpt2.transformer.gradient_checkpointing
    generated = model.generate(input_ids, max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(generated, gpt2.generate(input_ids, max_new_tokens=3, do_sample=False))


# Checkpoints -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pass_state_dict", [False, True])
def test_causal_save_and_load_round_trip(gpt2, tmp_path, pass_state_dict):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, v_head_init_strategy="normal")
    kwargs = {"state_dict": model.state_dict()} if pass_state_dict else {}  # as from accelerator.get_state_dict
    model.save_pretrained(tmp_path, **kwargs)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert {"v_head.summary.weight", "v_head.summary.bias", "transformer.wte.weight"} <= keys
    assert not any(key.startswith("pretrained_model.") for key in keys)
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert_state_dicts_equal(loaded.state_dict(), model.state_dict())


def test_seq2seq_save_and_load_round_trip(t5, tmp_path):
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5, v_head_init_strategy="normal")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(tmp_path)  # a pathlib.Path works too
    assert_state_dicts_equal(loaded.state_dict(), model.state_dict())


def test_peft_save_and_load_round_trip(gpt2, tmp_path):
    gpt2.save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        str(tmp_path / "base"), peft_config=lora_config(), v_head_init_strategy="normal"
    )
    model.save_pretrained(tmp_path / "adapter")
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "v_head.safetensors"} <= files
    assert "model.safetensors" not in files  # the base weights stay in the base checkpoint
    with pytest.raises(ValueError, match="peft_config"):
        AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "adapter"), peft_config=lora_config())
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "adapter"), is_trainable=True)
    assert isinstance(loaded.pretrained_model, PeftModel)
    assert_state_dicts_equal(loaded.state_dict(), model.state_dict())
    assert all(p.requires_grad == ("lora_" in name) for name, p in loaded.pretrained_model.named_parameters())
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 5))
    for got, expected in zip(loaded(input_ids), model(input_ids)):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # A PeftModel object is wrapped as it is.
    rewrapped = AutoModelForCausalLMWithValueHead.from_pretrained(loaded.pretrained_model)
    assert rewrapped.is_peft_model and rewrapped.pretrained_model is loaded.pretrained_model
    with pytest.raises(ValueError, match="peft_config"):
        AutoModelForCausalLMWithValueHead.from_pretrained(loaded.pretrained_model, peft_config=lora_config())


def base_tensors(model) -> dict:
    """A transformers model's weights in checkpoint naming, tied duplicates dropped (as transformers saves)."""
    return {key: value.clone() for key, value in model.state_dict().items() if key != "lm_head.weight"}


@pytest.mark.parametrize("layout", ["safetensors", "sharded_safetensors", "pytorch_bin"])
def test_classic_layout_restores_value_head(gpt2, tmp_path, layout):
    gpt2.save_pretrained(tmp_path)  # for config.json
    os.remove(tmp_path / "model.safetensors")
    head = {"v_head.summary.weight": torch.randn(1, 32), "v_head.summary.bias": torch.randn(1)}
    tensors = {**base_tensors(gpt2), **head}
    if layout == "safetensors":
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    elif layout == "pytorch_bin":
        torch.save(tensors, tmp_path / "pytorch_model.bin")
    else:
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
        shards["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
        for shard, keys in shards.items():
            save_file({key: tensors[key] for key in keys}, tmp_path / shard, metadata={"format": "pt"})
        weight_map = {key: shard for shard, keys in shards.items() for key in keys}
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert torch.equal(model.v_head.summary.weight, head["v_head.summary.weight"])
    assert torch.equal(model.v_head.summary.bias, head["v_head.summary.bias"])
    assert torch.equal(model.pretrained_model.transformer.wte.weight, gpt2.transformer.wte.weight)


def test_plain_checkpoint_gets_fresh_head_with_warning(gpt2, tmp_path, caplog):
    gpt2.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger=modeling_base.__name__):
        model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert "freshly initialised" in caplog.text
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_state_dicts_equal(model.pretrained_model.state_dict(), plain.state_dict())
    assert model.v_head.summary.weight.shape == (1, 32)


def test_push_to_hub_uploads_what_save_pretrained_writes(gpt2, monkeypatch):
    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            uploaded["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("RepoUrl", (), {"repo_id": f"user/{repo_id}"})()

        def upload_folder(self, repo_id, folder_path, commit_message, revision, create_pr):
            uploaded["repo_id"] = repo_id
            with safe_open(os.path.join(folder_path, "model.safetensors"), framework="pt") as f:
                uploaded["head"] = f.get_tensor("v_head.summary.weight")
            return "commit-url"

    monkeypatch.setattr(modeling_base, "HfApi", FakeApi)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    assert model.push_to_hub("tiny-ppo", token="t") == "commit-url"
    assert uploaded["repo_id"] == "user/tiny-ppo" and uploaded["token"] == "t"
    assert torch.equal(uploaded["head"], model.v_head.summary.weight)


# Reference model ---------------------------------------------------------------------------------


def test_reference_model_is_a_frozen_independent_copy(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    ref = create_reference_model(model)
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert not {id(p) for p in ref.parameters()} & {id(p) for p in model.parameters()}
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 5))
    before = ref(input_ids)[0]
    torch.testing.assert_close(before, model(input_ids)[0], rtol=0, atol=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(ref(input_ids)[0], before, rtol=0, atol=0)


@pytest.mark.parametrize("pattern", [None, "transformer.h.{layer}"])
def test_reference_model_shares_the_first_layers(pattern):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(n_layer=3))
    ref = create_reference_model(model, num_shared_layers=1, pattern=pattern)
    for name, param in model.named_parameters():
        shared = ".wte." in name or ".wpe." in name or ".h.0." in name
        assert (ref.get_parameter(name) is param) == shared, name
        assert param.requires_grad == (not shared), name
        assert not ref.get_parameter(name).requires_grad
    # The tied LM head of the copy points at the shared embedding too, not at a duplicate.
    assert ref.pretrained_model.lm_head.weight is model.pretrained_model.transformer.wte.weight
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 5))
    torch.testing.assert_close(ref(input_ids)[0], model(input_ids)[0], rtol=0, atol=0)


def test_reference_model_default_pattern_for_t5(t5):
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5)
    ref = create_reference_model(model, num_shared_layers=1)
    shared = {name for name, param in model.named_parameters() if ref.get_parameter(name) is param}
    assert "pretrained_model.shared.weight" in shared
    assert all(name == "pretrained_model.shared.weight" or ".encoder.block.0." in name for name in shared)
    assert len(shared) > 1 and ref.pretrained_model.lm_head.weight is t5.shared.weight


def test_reference_model_rejects_bad_arguments(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_shared_layers"):
            create_reference_model(model, num_shared_layers=bad)
    with pytest.raises(ValueError, match="smaller than the number of layers"):
        create_reference_model(model, num_shared_layers=2)  # the tiny GPT-2 has layers 0 and 1
    with pytest.raises(ValueError, match="pattern"):
        create_reference_model(model, num_shared_layers=1, pattern="transformer.h")
    with pytest.raises(ValueError, match="pattern"):
        create_reference_model(model, num_shared_layers=1, pattern="decoder.blocks.{layer}")
    peft_model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(), peft_config=lora_config())
    with pytest.raises(ValueError, match="PEFT"):
        create_reference_model(peft_model)
