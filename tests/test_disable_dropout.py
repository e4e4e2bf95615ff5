"""``PPOConfig.disable_dropout``: every dropout of the policy, reference, critic and value head at 0 (a step
then equals one of the same weights built without dropout), nothing changed by default (classic TRL's
numbers), and on a varlen-kernel device every pass of a step on the kernel once dropout is off."""

import logging

import numpy as np
import pytest
import torch
from devices import FLOAT32_SLACK
from test_varlen_attention import _with_stand_in
from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_tokenizer, random_batch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.models import varlen_attention
from trl_lite.models.dropout import disable_dropout_in_model


def _policy(dropout):
    return AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2, dropout=dropout), summary_dropout_prob=dropout)


def _dropouts(*models):
    return [m.p for model in models for m in model.modules() if isinstance(m, torch.nn.Dropout)]


def _steps(trainer, steps=2):
    out = []
    for seed in range(steps):
        out.append(trainer.step(*random_batch(8, seed=seed, query_len=(1, 7), response_len=(1, 9))))
    return out


def _trainer(policy, **config):
    return PPOTrainer(PPOConfig(batch_size=8, mini_batch_size=4, seed=3, learning_rate=1e-3, **config), policy,
                      tokenizer=make_tokenizer())  # fmt: skip


def test_disable_dropout_zeroes_every_dropout_and_steps_as_a_model_without_one():
    critic = make_gpt2_critic(seed=3)
    critic.config.summary_first_dropout = 0.1
    trainer = PPOTrainer(
        PPOConfig(batch_size=8, mini_batch_size=4, seed=3, learning_rate=1e-3, disable_dropout=True),
        _policy(0.1), ref_model=_policy(0.1), tokenizer=make_tokenizer(), value_model=critic,
    )  # fmt: skip
    models = (trainer.model, trainer.ref_model, trainer.critic)
    assert len(_dropouts(*models)) > 10 and set(_dropouts(*models)) == {0.0}

    # The same weights with dropout 0.1 and disable_dropout, or built with dropout 0: the same steps.
    stats = _steps(_trainer(_policy(0.1), disable_dropout=True))
    expected = _steps(_trainer(_policy(0.0)))
    for got, want in zip(stats, expected):
        for key, value in want.items():
            if not key.startswith("time/"):
                # Equal on the CPU; a GPU's atomic gradient sums may differ in the last bits between two runs.
                np.testing.assert_allclose(got[key], value, rtol=1e-6 * FLOAT32_SLACK, atol=1e-7 * FLOAT32_SLACK, err_msg=key)


def test_by_default_the_models_keep_their_dropout():
    trainer = _trainer(_policy(0.1))
    assert set(_dropouts(trainer.model, trainer.ref_model)) == {0.1}
    # Dropout on in the training passes: the first mini-batch's ratio is no longer exactly 1.
    stats = _steps(trainer, steps=1)[0]
    assert stats["ppo/policy/approxkl"] > 0


def test_attention_dropout_attributes_are_zeroed_too():
    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.2)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    rates = [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout") and isinstance(m, torch.nn.Module)]
    assert rates == [0.2, 0.2]
    assert disable_dropout_in_model(model, None) == 2
    assert [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")] == [0.0, 0.0]
    assert disable_dropout_in_model(model) == 0


def test_disable_dropout_must_be_a_bool():
    with pytest.raises(TypeError, match="disable_dropout must be True or False, got 'yes'"):
        PPOConfig(disable_dropout="yes")


@pytest.mark.parametrize("disable_dropout", [False, True])
def test_without_dropout_every_pass_runs_on_the_kernel(monkeypatch, caplog, disable_dropout):
    """On a device where the varlen kernel runs (a CPU stand-in here), attention dropout sends the training
    passes row by row, said once; with ``disable_dropout`` every pass of the step is one call per layer."""
    monkeypatch.setattr(varlen_attention, "_ANNOUNCED", set())
    trainer = _trainer(_policy(0.1), padding_free=True, ppo_epochs=2, disable_dropout=disable_dropout)
    counting = _with_stand_in(monkeypatch)
    with caplog.at_level(logging.INFO, logger=varlen_attention.__name__):
        _steps(trainer)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    rollout_calls = 2 * 2 * 2 * 2  # 2 steps x 2 mini-batches x (policy, reference) x 2 layers
    training_calls = 2 * 2 * 2 * 2  # 2 steps x 2 epochs x 2 mini-batches x 2 layers
    if disable_dropout:
        assert warnings == [] and len(counting.calls) == rollout_calls + training_calls
    else:
        assert len(counting.calls) == rollout_calls
        assert warnings == [
            "packed passes attend row by row with sdpa (cuDNN attention excluded): the attention applies "
            "dropout, which the varlen kernel does not."
        ]
