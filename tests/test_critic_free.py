"""Critic-free PPO (docs/algorithm.md section 12): plain causal-LM policies, the value-head switch, the
estimators inside step(), group_ids, the KL-in-loss term and the configuration checks.

Exact agreement of a GRPO step with a plain implementation is in test_step_reference.py.
"""

import math

import pytest
import torch
from devices import FLOAT32_SLACK, assert_close, equal
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import make_gpt2, make_t5, make_tokenizer, random_batch
from transformers import AutoModelForCausalLM

from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer

VALUE_STATS = ("ppo/loss/value", "ppo/returns/mean", "ppo/returns/var", "ppo/val/vpred", "ppo/val/error",
               "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var", "ppo/val/var_explained")  # fmt: skip


def grouped_batch(batch_size=8, k=4, seed=0):
    """A batch whose consecutive runs of k rows share a query (the layout of num_samples_per_query=k)."""
    queries, responses, scores = random_batch(batch_size, seed=seed)
    queries = [queries[(i // k) * k] for i in range(batch_size)]
    return queries, responses, scores


def make_trainer(model=None, batch_size=8, mini_batch_size=4, **config_kwargs):
    config_kwargs.setdefault("learning_rate", 1e-3)
    config_kwargs.setdefault("ppo_epochs", 2)
    config_kwargs.setdefault("advantage_estimator", "rloo")
    config_kwargs.setdefault("num_samples_per_query", 4)
    config = PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size, **config_kwargs)
    return PPOTrainer(config, model if model is not None else make_gpt2(), tokenizer=make_tokenizer())


def count_calls(module):
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


# ---------------------------------------------------------------------------------------------
# The value-head switch of the wrappers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", [False, True])
def test_causal_forward_without_values_skips_the_head(positions):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    calls = count_calls(model.v_head)
    ids = torch.randint(3, 40, (2, 7))
    kwargs = {"logits_positions": torch.tensor([[2, 3], [4, 5]])} if positions else {}
    logits, _, values = model(ids, **kwargs)
    assert values.shape == (2, 7) and len(calls) == 1
    logits_off, _, values_off = model(ids, return_values=False, **kwargs)
    assert values_off is None and len(calls) == 1
    assert equal(logits, logits_off)


def test_seq2seq_forward_without_values_skips_the_head():
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5())
    calls = count_calls(model.v_head)
    enc, dec = torch.randint(3, 40, (2, 5)), torch.randint(3, 40, (2, 4))
    logits, _, values = model(enc, decoder_input_ids=dec)
    logits_off, _, values_off = model(enc, decoder_input_ids=dec, return_values=False)
    assert values.shape == (2, 4) and values_off is None and len(calls) == 1
    assert equal(logits, logits_off)


# ---------------------------------------------------------------------------------------------
# Plain causal-LM policies
# ---------------------------------------------------------------------------------------------
def test_rloo_step_on_a_plain_causal_lm_moves_the_policy_and_no_value_head():
    policy = make_gpt2()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer = make_trainer(policy)
    wrapper = trainer.model
    assert isinstance(wrapper, AutoModelForCausalLMWithValueHead) and wrapper.pretrained_model is policy
    head_before = {n: p.detach().clone() for n, p in wrapper.v_head.named_parameters()}
    calls = count_calls(wrapper.v_head)
    ref_calls = count_calls(trainer.ref_model.v_head)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in wrapper.v_head.parameters())

    # The head's gradients are read at every backward of the policy, before zero_grad could clear them.
    head_grads = []
    policy.get_input_embeddings().weight.register_post_accumulate_grad_hook(
        lambda _: head_grads.append([p.grad for p in wrapper.v_head.parameters()])
    )
    stats = trainer.step(*grouped_batch())

    assert head_grads and all(g is None for grads in head_grads for g in grads)
    assert calls == [] and ref_calls == []
    assert all(p.grad is None and not p.requires_grad for p in wrapper.v_head.parameters())
    assert all(equal(p, head_before[n]) for n, p in wrapper.v_head.named_parameters())
    moved = [n for n, p in policy.named_parameters() if not equal(p, before[n])]
    assert moved
    assert not set(VALUE_STATS) & set(stats)
    assert math.isfinite(stats["ppo/loss/total"]) and stats["ppo/loss/total"] == stats["ppo/loss/policy"]


def test_plain_policy_with_gae_needs_a_critic():
    config = PPOConfig(batch_size=4, mini_batch_size=2)
    with pytest.raises(ValueError, match="advantage_estimator='gae' needs values"):
        PPOTrainer(config, make_gpt2(), tokenizer=make_tokenizer())


def test_save_pretrained_writes_the_plain_model(tmp_path):
    trainer = make_trainer(make_gpt2(), advantage_estimator="grpo")
    trainer.step(*grouped_batch())
    trainer.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    trained = trainer.model.pretrained_model.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    for name, value in loaded.state_dict().items():
        assert equal(value, trained[name]), name
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if k.startswith("v_head")]


def test_value_head_model_with_a_critic_free_estimator_never_runs_its_head():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    head_before = model.v_head.summary.weight.detach().clone()
    calls = count_calls(model.v_head)
    trainer = make_trainer(model, advantage_estimator="reinforce_pp", num_samples_per_query=1)
    trainer.step(*random_batch(8))
    assert calls == [] and equal(model.v_head.summary.weight, head_before)
    assert not trainer._policy_is_plain and not trainer._uses_value_head


def test_plain_peft_policy_uses_the_disabled_adapter_as_reference(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                      init_lora_weights=False, task_type="CAUSAL_LM")  # fmt: skip
    policy = get_peft_model(make_gpt2(), lora)
    trainer = make_trainer(policy, advantage_estimator="grpo")
    assert trainer.ref_model is None and trainer.is_peft_model
    queries, responses, scores = grouped_batch()
    stats = trainer.step(queries, responses, scores)
    # The LoRA weights are random, so the policy differs from the base model (the reference) at once.
    assert stats["objective/kl"] != 0.0 and stats["ppo/policy/kl_loss"] > 0
    trainer.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(make_gpt2(), tmp_path)
    ids = torch.cat((queries[0], responses[0])).unsqueeze(0)
    with torch.no_grad():
        expected = trainer.model.pretrained_model(ids.to(trainer.accelerator.device)).logits
        assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-6 * FLOAT32_SLACK)


def test_plain_reference_model_is_accepted():
    trainer = make_trainer(make_gpt2(seed=0), advantage_estimator="grpo")
    config = PPOConfig(batch_size=8, mini_batch_size=4, advantage_estimator="grpo", num_samples_per_query=4)
    plain_ref = PPOTrainer(config, make_gpt2(seed=0), ref_model=make_gpt2(seed=1), tokenizer=make_tokenizer())
    assert isinstance(plain_ref.ref_model, AutoModelForCausalLMWithValueHead)
    batch = grouped_batch()
    assert trainer.step(*batch)["objective/kl"] == 0.0
    assert plain_ref.step(*batch)["objective/kl"] != 0.0


# ---------------------------------------------------------------------------------------------
# The estimators inside step()
# ---------------------------------------------------------------------------------------------
def token_advantages(stats, responses, ids, estimator):
    """Brute force: the expected advantage of every action token, in stat order, with KL coef 0."""
    scores = stats["scores"]
    expected = []
    for i, response in enumerate(responses):
        group = [j for j in range(len(ids)) if ids[j] == ids[i]]
        others = [scores[j] for j in group if j != i]
        if estimator == "rloo":
            a = scores[i] - sum(others) / len(others)
        else:
            mean = sum(scores[j] for j in group) / len(group)
            std = math.sqrt(sum((scores[j] - mean) ** 2 for j in group) / (len(group) - 1))
            a = (scores[i] - mean) / (std + 1e-6)
        expected += [a] * len(response)
    return expected


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_group_advantages_in_step_with_explicit_group_ids(estimator):
    queries, responses, scores = random_batch(8, seed=3)
    ids = [5, 2, 5, 9, 2, 9, 5, 9]
    first = {}
    queries = [first.setdefault(g, queries[i]) for i, g in enumerate(ids)]
    trainer = make_trainer(advantage_estimator=estimator, init_kl_coef=0.0, num_samples_per_query=1)
    stats = trainer.step(queries, responses, scores, group_ids=ids)
    expected = token_advantages({"scores": [float(s) for s in scores]}, responses, ids, estimator)
    assert stats["ppo/policy/advantages"].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_reinforce_pp_advantages_are_whitened_discounted_returns():
    queries, responses, scores = random_batch(8, seed=4)
    gamma = 0.9
    trainer = make_trainer(advantage_estimator="reinforce_pp", init_kl_coef=0.0, num_samples_per_query=1, gamma=gamma)
    stats = trainer.step(queries, responses, scores)
    returns = []
    for response, score in zip(responses, scores):
        n = len(response)
        returns += [gamma ** (n - 1 - t) * float(score) for t in range(n)]
    mean = sum(returns) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / (len(returns) - 1))
    expected = [(r - mean) / math.sqrt(std**2 + 1e-8) for r in returns]
    assert stats["ppo/policy/advantages"].tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("estimator, in_loss", [("grpo", True), ("rloo", False), ("reinforce_pp", False)])
def test_kl_in_loss_default_per_estimator(estimator, in_loss):
    trainer = make_trainer(advantage_estimator=estimator, num_samples_per_query=4)
    assert trainer.config.kl_in_reward_resolved is (not in_loss)
    stats = trainer.step(*grouped_batch())
    assert ("ppo/policy/kl_loss" in stats) is in_loss


def test_kl_in_reward_moves_the_kl_into_the_group_reward():
    """rloo with the KL in the reward: r_i = score_i + sum_t non_score_reward; in the loss: r_i = score_i."""
    model = make_gpt2()
    queries, responses, scores = grouped_batch(seed=5)
    ref = make_gpt2(seed=7)
    config = dict(advantage_estimator="rloo", num_samples_per_query=4, init_kl_coef=0.5, adap_kl_ctrl=False)
    in_reward = PPOTrainer(PPOConfig(batch_size=8, mini_batch_size=4, **config), model, ref_model=ref,
                           tokenizer=make_tokenizer()).step(queries, responses, scores)  # fmt: skip
    in_loss = PPOTrainer(
        PPOConfig(batch_size=8, mini_batch_size=4, kl_in_reward=False, **config), make_gpt2(), ref_model=make_gpt2(seed=7),
        tokenizer=make_tokenizer(),
    ).step(queries, responses, scores)
    kl_rows = in_reward["objective/kl_dist"].tolist()
    shaped = [float(s) - 0.5 * kl for s, kl in zip(scores, kl_rows)]
    plain = [float(s) for s in scores]
    ids = [i // 4 for i in range(8)]
    assert in_reward["ppo/policy/advantages"].tolist() == pytest.approx(
        token_advantages({"scores": shaped}, responses, ids, "rloo"), rel=1e-4, abs=1e-5
    )
    assert in_loss["ppo/policy/advantages"].tolist() == pytest.approx(
        token_advantages({"scores": plain}, responses, ids, "rloo"), rel=1e-4, abs=1e-5
    )
    assert in_loss["ppo/mean_non_score_reward"] == 0.0 and in_loss["ppo/policy/kl_loss"] > 0


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"advantage_estimator": "ppo"}, ValueError, "advantage_estimator must be one of"),
        ({"num_samples_per_query": 0}, ValueError, "num_samples_per_query"),
        ({"num_samples_per_query": 3}, ValueError, "multiple of num_samples_per_query"),
        ({"kl_in_reward": "yes"}, TypeError, "kl_in_reward"),
        ({"grpo_scale_rewards": 1}, TypeError, "grpo_scale_rewards"),
        ({"advantage_estimator": "rloo", "whiten_rewards": True}, ValueError, "whiten_rewards"),
    ],
)
def test_config_rejects_bad_critic_free_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        PPOConfig(batch_size=8, mini_batch_size=4, **kwargs)


@pytest.mark.parametrize(
    "config_kwargs, group_ids, error, match",
    [
        ({"num_samples_per_query": 1}, None, ValueError, "num_samples_per_query >= 2"),
        ({}, [0, 0, 0, 0, 1, 1, 1, 2], ValueError, "group 2 has 1 row"),
        ({}, [0, 0, 1, 1], ValueError, "one id per row"),
        ({}, [0.0] * 8, TypeError, "integer ids"),
        ({}, "abc", TypeError, "group_ids must be a list"),
        ({"advantage_estimator": "reinforce_pp"}, [0] * 8, ValueError, "apply only to advantage_estimator"),
    ],
)
def test_step_rejects_bad_groups_before_any_change(config_kwargs, group_ids, error, match):
    trainer = make_trainer(**config_kwargs)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(error, match=match):
        trainer.step(*grouped_batch(), group_ids=group_ids)
    assert trainer.current_step == 0
    assert all(equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_default_groups_must_share_their_query():
    trainer = make_trainer()
    with pytest.raises(ValueError, match="rows 0 and 1 are in one group but their queries differ"):
        trainer.step(*random_batch(8))


# ---------------------------------------------------------------------------------------------
# generate(num_return_sequences=k): the k responses of a query next to each other
# ---------------------------------------------------------------------------------------------
def test_generate_returns_the_k_responses_of_each_query_together():
    trainer = make_trainer()
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]
    beams = dict(num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=4, eos_token_id=None)
    batched = trainer.generate(queries, batch_size=2, **beams)
    assert len(batched) == 9
    for i, query in enumerate(queries):
        alone = trainer.generate([query], batch_size=1, **beams)
        for j in range(3):
            assert equal(batched[3 * i + j], alone[j]), (i, j)
            assert equal(batched[3 * i + j][: len(query)], query)
    torch.manual_seed(0)
    sampled = trainer.generate(queries, batch_size=2, return_prompt=False, num_return_sequences=4,
                               do_sample=True, max_new_tokens=5)  # fmt: skip
    assert len(sampled) == 12 and all(1 <= len(r) <= 5 for r in sampled)
    # The layout step() groups by: consecutive runs of 4 rows share their query.
    rows = [queries[i // 4] for i in range(12)]
    trainer = make_trainer(batch_size=12, mini_batch_size=4)
    stats = trainer.step(rows, sampled, [float(len(r)) for r in sampled])
    assert stats["ppo/policy/advantages"].shape == (sum(len(r) for r in sampled),)
