"""Classic TRL behaviours of the value-head wrappers: state-dict keys, class attributes, models without
an LM head. (Checkpoints and resume through these keys: test_reliability.py, test_distributed.py.)"""

import pytest
import torch
from peft import LoraConfig
from tiny_models import VOCAB_SIZE, make_gpt2, make_t5
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GPT2Model, T5Model

from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead


def test_state_dict_keys_are_the_transformers_keys_plus_the_value_head(gpt2, t5):
    for wrapper, model in ((AutoModelForCausalLMWithValueHead, gpt2), (AutoModelForSeq2SeqLMWithValueHead, t5)):
        wrapped = wrapper.from_pretrained(model)
        state = wrapped.state_dict()
        expected = [*model.state_dict(), "v_head.summary.weight", "v_head.summary.bias"]
        assert list(state) == expected  # same keys, same order, nothing prefixed with pretrained_model.
        for key, value in model.state_dict().items():
            assert state[key] is not None and torch.equal(state[key], value), key
        assert torch.equal(state["v_head.summary.weight"], wrapped.v_head.summary.weight)


def test_load_state_dict_accepts_classic_and_prefixed_keys(gpt2):
    source = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, v_head_init_strategy="normal")
    classic = source.state_dict()
    prefixed = {
        (key if key.startswith("v_head.") else f"pretrained_model.{key}"): value for key, value in classic.items()
    }
    for state in (classic, prefixed):
        target = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
        result = target.load_state_dict(state)
        assert result.missing_keys == [] and result.unexpected_keys == []
        for (name, got), (_, want) in zip(target.named_parameters(), source.named_parameters()):
            assert torch.equal(got, want), name


def test_load_state_dict_still_reports_missing_and_unexpected_keys(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    state = model.state_dict()
    del state["v_head.summary.bias"], state["transformer.h.0.mlp.c_fc.weight"]
    state["no_such.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(state)
    message = str(error.value)
    assert "v_head.summary.bias" in message and "transformer.h.0.mlp.c_fc.weight" in message
    assert "no_such.weight" in message
    result = model.load_state_dict(state, strict=False)
    assert set(result.missing_keys) == {"v_head.summary.bias", "transformer.h.0.mlp.c_fc.weight"}
    assert result.unexpected_keys == ["no_such.weight"]


def test_keys_inside_an_outer_module_keep_the_outer_prefix(gpt2):
    """DDP and DeepSpeed engines hold the wrapper as `module`: its keys get that prefix, nothing else."""
    outer = nn.ModuleDict({"module": AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)})
    state = outer.state_dict()
    assert "module.transformer.wte.weight" in state and "module.v_head.summary.weight" in state
    assert not any(".pretrained_model." in key or key.startswith("pretrained_model.") for key in state)
    other = nn.ModuleDict({"module": AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2))})
    other.load_state_dict(state)
    assert torch.equal(other["module"].pretrained_model.transformer.wte.weight, gpt2.transformer.wte.weight)


def test_peft_state_dict_keeps_the_adapter_weights(gpt2):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, peft_config=LoraConfig(r=4, target_modules=["c_attn"]))
    state = model.state_dict()
    lora = [key for key in state if "lora_B" in key]
    assert lora and all(key.startswith("base_model.model.transformer.") for key in lora)
    with torch.no_grad():
        for key in lora:
            state[key] = torch.full_like(state[key], 0.5)
    model.load_state_dict(state)
    assert all(torch.all(p == 0.5) for name, p in model.named_parameters() if "lora_B" in name)


def test_classic_class_attributes():
    assert AutoModelForCausalLMWithValueHead.transformers_parent_class is AutoModelForCausalLM
    assert AutoModelForSeq2SeqLMWithValueHead.transformers_parent_class is AutoModelForSeq2SeqLM
    assert AutoModelForCausalLMWithValueHead.lm_head_namings == ["lm_head", "embed_out"]
    assert AutoModelForSeq2SeqLMWithValueHead.lm_head_namings == ["lm_head", "embed_out", "output_projection"]
    for wrapper in (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead):
        assert wrapper.supported_args == ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
        assert wrapper.supported_modules == ("v_head",) and wrapper.supported_rm_modules == ("score",)


def test_models_without_an_lm_head_are_rejected(gpt2, t5):
    backbones = (
        (AutoModelForCausalLMWithValueHead, GPT2Model(gpt2.config), "GPT2Model"),
        (AutoModelForSeq2SeqLMWithValueHead, T5Model(t5.config), "T5Model"),
    )
    for wrapper, backbone, name in backbones:
        for build in (wrapper, wrapper.from_pretrained):
            with pytest.raises(ValueError, match=rf"needs a model with a language-model head, got {name}") as error:
                build(backbone)
            assert wrapper.transformers_parent_class.__name__ in str(error.value)


def test_rejection_comes_before_peft_touches_the_model(gpt2):
    backbone = GPT2Model(gpt2.config)
    before = [name for name, _ in backbone.named_modules()]
    with pytest.raises(ValueError, match="language-model head"):
        AutoModelForCausalLMWithValueHead.from_pretrained(backbone, peft_config=LoraConfig(target_modules=["c_attn"]))
    assert [name for name, _ in backbone.named_modules()] == before


def test_a_head_found_by_name_only_is_accepted(gpt2):
    """A model whose get_output_embeddings() is None but which has a module named like an LM head."""

    class NamedHeadOnly(type(gpt2)):
        def get_output_embeddings(self):
            return None

    model = NamedHeadOnly(gpt2.config)
    wrapped = AutoModelForCausalLMWithValueHead(model)
    logits, _, values = wrapped(torch.randint(3, VOCAB_SIZE, (1, 4)))
    assert logits.shape == (1, 4, VOCAB_SIZE) and values.shape == (1, 4)


def test_wrong_architecture_still_named(gpt2):
    with pytest.raises(ValueError, match="use AutoModelForSeq2SeqLMWithValueHead"):
        AutoModelForCausalLMWithValueHead(make_t5())
    with pytest.raises(ValueError, match="use AutoModelForCausalLMWithValueHead"):
        AutoModelForSeq2SeqLMWithValueHead.from_pretrained(gpt2)
