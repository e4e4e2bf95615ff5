"""Behaviour of PPOTrainer: what step() moves, the KL controllers, score shaping, early stopping,
encoder-decoder and PEFT models, generation, logging, saving and the dataloader.

Exact numeric agreement of step() with the plain spec formulation is in test_step_reference.py.
"""

import copy
import glob
import math

import numpy as np
import pytest
import torch
from devices import assert_close, equal, on_cpu
from tiny_models import make_gpt2, make_t5, make_tokenizer, random_batch

from trl_lite import (
    AdaptiveKLController,
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    FixedKLController,
    PPOConfig,
    PPOTrainer,
)


def make_trainer(batch_size=4, mini_batch_size=2, model=None, tokenizer=None, **config_kwargs):
    config_kwargs.setdefault("learning_rate", 1e-3)
    config_kwargs.setdefault("ppo_epochs", 2)
    config = PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size, **config_kwargs)
    model = model or AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    return PPOTrainer(config, model, tokenizer=tokenizer or make_tokenizer())


def snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_step_moves_policy_and_value_head_but_not_the_reference():
    trainer = make_trainer()
    policy_before = snapshot(trainer.model)
    ref_before = snapshot(trainer.ref_model)
    stats = trainer.step(*random_batch(4))
    changed = [n for n, p in trainer.model.named_parameters() if not equal(p, policy_before[n])]
    assert any(n.startswith("v_head.") for n in changed)
    assert any(n.startswith("pretrained_model.") for n in changed)
    for name, p in trainer.ref_model.named_parameters():
        assert equal(p, ref_before[name]), name
        assert not p.requires_grad
    assert trainer.current_step == 1
    for key in ("objective/kl", "ppo/loss/total", "ppo/val/var_explained", "time/ppo/total"):
        assert math.isfinite(stats[key]), key


def test_step_returns_every_statistic_of_the_spec():
    stats = make_trainer().step(*random_batch(4))
    expected = [
        "objective/kl", "objective/kl_dist", "objective/logprobs", "objective/ref_logprobs", "objective/kl_coef",
        "objective/entropy", "ppo/mean_non_score_reward", "ppo/mean_scores", "ppo/std_scores",
        "tokens/queries_len_mean", "tokens/queries_len_std", "tokens/queries_dist", "tokens/responses_len_mean",
        "tokens/responses_len_std", "tokens/responses_dist", "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total",
        "ppo/policy/entropy", "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac",
        "ppo/policy/advantages", "ppo/policy/advantages_mean", "ppo/policy/ratio", "ppo/returns/mean",
        "ppo/returns/var", "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var",
        "ppo/val/var_explained", "ppo/learning_rate", "time/ppo/forward_pass", "time/ppo/compute_rewards",
        "time/ppo/compute_advantages", "time/ppo/optimize_step", "time/ppo/calc_stats", "time/ppo/total",
    ]  # fmt: skip
    assert not set(expected) - set(stats)
    queries, responses, _ = random_batch(4)
    assert stats["tokens/queries_dist"].tolist() == [len(q) for q in queries]
    assert stats["tokens/responses_dist"].tolist() == [len(r) for r in responses]
    assert stats["objective/kl_dist"].shape == (4,)
    assert stats["objective/logprobs"].shape == (sum(len(r) for r in responses),)


def test_first_step_has_zero_kl_and_the_entropy_statistic_is_the_mean_negative_logprob_sum():
    trainer = make_trainer()
    queries, responses, scores = random_batch(4)
    stats = trainer.step(queries, responses, scores)
    # The reference is a copy of the untrained policy, so the first step's KL is exactly zero.
    assert stats["objective/kl"] == 0.0
    assert stats["ppo/mean_non_score_reward"] == 0.0
    lengths = [len(r) for r in responses]
    logprobs = torch.tensor(stats["objective/logprobs"], dtype=torch.float64)
    per_row = torch.stack([-chunk.sum() for chunk in logprobs.split(lengths)])
    assert stats["objective/entropy"] == pytest.approx(per_row.mean().item(), rel=1e-5)


@pytest.mark.parametrize("kl_penalty", ["kl", "abs", "mse", "full"])
def test_each_kl_penalty_trains_and_gives_its_estimator(kl_penalty):
    trainer = make_trainer(kl_penalty=kl_penalty)
    batch = random_batch(4)
    trainer.step(*batch)
    stats = trainer.step(*batch)
    assert math.isfinite(stats["ppo/loss/total"])
    assert stats["objective/kl"] != 0.0
    if kl_penalty in ("abs", "mse", "full"):
        assert (stats["objective/kl_dist"] >= -1e-6).all()
    if kl_penalty != "full":
        diff = torch.tensor(stats["objective/logprobs"], dtype=torch.float64) - torch.tensor(
            stats["objective/ref_logprobs"], dtype=torch.float64
        )
        per_token = {"kl": diff, "abs": diff.abs(), "mse": 0.5 * diff**2}[kl_penalty]
        lengths = [len(r) for r in batch[1]]
        per_row = torch.stack([c.sum() for c in per_token.split(lengths)])
        assert torch.allclose(torch.tensor(stats["objective/kl_dist"], dtype=torch.float64), per_row, atol=1e-5)


def test_adaptive_kl_controller_follows_ziegler_update():
    trainer = make_trainer(init_kl_coef=0.3, target=0.01, horizon=50)
    batch = random_batch(4)
    trainer.step(*batch)
    before = trainer.kl_ctl.value
    stats = trainer.step(*batch)
    assert stats["objective/kl_coef"] == pytest.approx(before)
    error = min(max(stats["objective/kl"] / 0.01 - 1, -0.2), 0.2)
    assert trainer.kl_ctl.value == pytest.approx(before * (1 + error * 4 / 50), rel=1e-12)
    assert trainer.kl_ctl.value != before


def test_fixed_kl_controller_never_changes():
    trainer = make_trainer(adap_kl_ctrl=False, init_kl_coef=0.05)
    assert isinstance(trainer.kl_ctl, FixedKLController)
    batch = random_batch(4)
    for _ in range(2):
        trainer.step(*batch)
    assert trainer.kl_ctl.value == 0.05


def test_kl_controllers_alone():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(12.0, n_steps=100)  # error clipped at +0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000))
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(5.7, n_steps=100)  # error -0.05
    assert ctl.value == pytest.approx(0.2 * (1 - 0.05 * 100 / 10000))


def test_score_scaling_norm_and_clip_follow_the_running_moments():
    trainer = make_trainer(use_score_scaling=True, use_score_norm=True, score_clip=0.5)
    queries, responses, _ = random_batch(4)
    seen = []
    for scores in ([1.0, 2.0, 3.0, 10.0], [-4.0, 0.5, 0.25, 7.0]):
        seen += scores
        stats = trainer.step(queries, responses, [torch.tensor(s) for s in scores])
        all_seen = torch.tensor(seen, dtype=torch.float64)
        expected = ((torch.tensor(scores, dtype=torch.float64) - all_seen.mean()) / (all_seen.std() + 1e-8)).clamp(-0.5, 0.5)
        assert stats["ppo/mean_scores"] == pytest.approx(expected.mean().item(), abs=1e-6)
        assert stats["ppo/std_scores"] == pytest.approx(expected.std().item(), abs=1e-6)
        assert trainer.running.mean == pytest.approx(all_seen.mean().item(), rel=1e-12)
        assert trainer.running.std == pytest.approx(all_seen.std().item(), rel=1e-12)


def test_score_scaling_without_norm_only_divides():
    trainer = make_trainer(use_score_scaling=True)
    queries, responses, _ = random_batch(4)
    scores = [3.0, 1.0, 2.0, 6.0]
    stats = trainer.step(queries, responses, [torch.tensor(s) for s in scores])
    s = torch.tensor(scores, dtype=torch.float64)
    assert stats["ppo/mean_scores"] == pytest.approx((s / (s.std() + 1e-8)).mean().item(), rel=1e-6)


def test_whiten_rewards_changes_the_update_but_not_the_kl():
    batch = random_batch(4)
    plain, whitened = make_trainer(), make_trainer(whiten_rewards=True)
    torch.manual_seed(0)
    stats_plain = plain.step(*batch)
    torch.manual_seed(0)
    stats_white = whitened.step(*batch)
    assert stats_plain["objective/kl"] == stats_white["objective/kl"]
    assert stats_plain["ppo/returns/mean"] != pytest.approx(stats_white["ppo/returns/mean"])


def test_early_stopping_stops_the_epochs_when_policykl_exceeds_the_target():
    trainer = make_trainer(ppo_epochs=4, early_stopping=True, target_kl=1e-9, learning_rate=5e-2)
    decisions = []
    original = trainer.learner.should_stop

    def record(epoch_policykl):
        decision = original(epoch_policykl)
        decisions.append((torch.stack(epoch_policykl).mean().item(), decision))
        return decision

    trainer.learner.should_stop = record
    for seed in range(3):
        trainer.step(*random_batch(4, seed=seed))
    assert decisions, "early stopping was never consulted"
    for policykl, decision in decisions:
        assert decision == (policykl > 1.5e-9)
    # Every step that stopped ran fewer than ppo_epochs epochs.
    assert any(decision for _, decision in decisions)
    assert len(decisions) < 3 * 4


def test_early_stopping_off_runs_every_epoch():
    trainer = make_trainer(ppo_epochs=3)
    calls = []
    original = trainer.learner.train_rows
    trainer.learner.train_rows = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.step(*random_batch(4))
    assert len(calls) == 3 * 2


def test_encoder_decoder_step_trains():
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5())
    trainer = make_trainer(model=model)
    before = snapshot(trainer.model)
    queries, responses, scores = random_batch(4, response_len=(3, 6))
    responses = [torch.cat([torch.tensor([0]), r]) for r in responses]  # decoder start token first
    stats = trainer.step(queries, responses, scores)
    assert stats["objective/kl"] == 0.0
    assert math.isfinite(stats["ppo/loss/total"])
    assert any(not equal(p, before[n]) for n, p in trainer.model.named_parameters())
    # Actions are decoder positions 1 .. len - 2 (predicting tokens 2 .. len - 1).
    assert stats["objective/logprobs"].shape == (sum(len(r) - 2 for r in responses),)


def test_peft_lora_step_moves_only_adapter_and_value_head_and_uses_the_disabled_adapter_as_reference():
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(), peft_config=lora)
    trainer = make_trainer(model=model, learning_rate=1e-2)
    assert trainer.ref_model is None
    before = snapshot(trainer.model)
    batch = random_batch(4)
    stats = trainer.step(*batch)
    assert stats["objective/kl"] == 0.0  # LoRA starts as the identity: policy == reference
    for name, p in trainer.model.named_parameters():
        moved = not equal(p, before[name])
        if "lora_" in name or name.startswith("v_head."):
            continue
        assert not moved, f"{name} is not an adapter or head weight but changed"
    assert any(not equal(p, before[n]) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    stats = trainer.step(*batch)
    assert stats["objective/kl"] != 0.0

    # The reference log-probs are those of the base model without the adapter.
    base = make_gpt2()
    queries, responses, _ = batch
    inputs = trainer.prepare_model_inputs(queries, responses)
    with torch.no_grad():
        with trainer.model.pretrained_model.disable_adapter():
            lp_ref, _, _, mask = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
        inputs, lp_ref, mask = on_cpu((inputs, lp_ref, mask))  # the reference runs on the CPU
        logits = base(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    expected = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp_ref[mask.bool()].double(), expected[mask.bool()], atol=1e-5)


def test_generate_strips_padding_and_the_prompt():
    tokenizer = make_tokenizer()
    trainer = make_trainer(tokenizer=tokenizer)
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]
    torch.manual_seed(0)
    with_prompt = trainer.generate(queries, batch_size=2, max_new_tokens=6, do_sample=True)
    torch.manual_seed(0)
    without = trainer.generate(queries, batch_size=2, return_prompt=False, max_new_tokens=6, do_sample=True)
    for q, full, resp in zip(queries, with_prompt, without):
        assert equal(full[: len(q)], q)
        assert equal(full[len(q) :], resp)
        assert 1 <= len(resp) <= 6
        eos = (resp == tokenizer.eos_token_id).nonzero()
        if len(eos):
            assert int(eos[0]) == len(resp) - 1  # cut right after the first EOS
    single = trainer.generate(queries[0], max_new_tokens=3, do_sample=False)
    assert single.shape[0] == 1 and equal(single[0, :3], queries[0])


def test_generate_with_reference_and_length_sampler():
    from trl_lite import LengthSampler

    trainer = make_trainer()
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses, ref_responses = trainer.generate(
        queries, return_prompt=False, generate_ref_response=True, length_sampler=LengthSampler(2, 4),
        do_sample=False, eos_token_id=None,
    )
    # Before training, greedy decoding of policy and its reference copy agree (each call draws its own length).
    for r, rr in zip(responses, ref_responses):
        n = min(len(r), len(rr))
        assert equal(r[:n], rr[:n])
        assert len(r) in (2, 3) and len(rr) in (2, 3)


def test_log_stats_writes_tensorboard_events(tmp_path):
    trainer = make_trainer(log_with="tensorboard", project_kwargs={"logging_dir": str(tmp_path)})
    queries, responses, scores = random_batch(4)
    stats = trainer.step(queries, responses, scores)
    batch = {"query": ["a"] * 4, "response": ["b"] * 4}
    trainer.log_stats(stats, batch, scores)
    trainer.accelerator.end_training()
    assert glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)


def test_trainer_save_pretrained_round_trip(tmp_path):
    trainer = make_trainer()
    trainer.step(*random_batch(4))
    trainer.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    saved = dict(trainer.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert equal(p, saved[name]), name
    assert (tmp_path / "tokenizer.json").exists()


def test_dataloader_is_shuffled_batches_of_batch_size_dropping_the_rest():
    data = [{"input_ids": torch.tensor([3 + i]), "query": str(i)} for i in range(10)]

    def collator(rows):
        return {key: [row[key] for row in rows] for key in rows[0]}

    config = PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-3)
    trainer = PPOTrainer(
        config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()), tokenizer=make_tokenizer(),
        dataset=data, data_collator=collator,
    )
    batches = list(trainer.dataloader)
    assert len(batches) == 2 and all(len(b["query"]) == 4 for b in batches)
    seen = [q for b in batches for q in b["query"]]
    assert len(set(seen)) == 8 and seen != [str(i) for i in range(8)]


def test_constructor_rejects_wrong_types():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    with pytest.raises(TypeError, match="model must be"):
        PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="config must be a PPOConfig"):
        PPOTrainer({"batch_size": 2}, model)
    with pytest.raises(ValueError, match="ref_model is the same object"):
        PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, ref_model=model)


def test_reference_sharing_layers_stays_frozen_where_shared():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    config = PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-3)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer(), num_shared_layers=1)
    ref_before = snapshot(trainer.ref_model)
    trainer.step(*random_batch(4))
    for name, p in trainer.ref_model.named_parameters():
        assert equal(p, ref_before[name]), name


def test_results_do_not_depend_on_other_rows():
    """A row's log-probs are the same alone or in a batch with longer rows."""
    trainer = make_trainer(batch_size=4, mini_batch_size=4)
    queries, responses, _ = random_batch(4)
    inputs = trainer.prepare_model_inputs(queries, responses)
    lp_all, _, _, mask_all = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
    for i in range(4):
        one = trainer.prepare_model_inputs(queries[i : i + 1], responses[i : i + 1])
        lp_one, _, _, mask_one = trainer.batched_forward_pass(trainer.model, queries[i : i + 1], responses[i : i + 1], one)
        assert torch.allclose(lp_all[i][mask_all[i].bool()], lp_one[0][mask_one[0].bool()], atol=1e-5)


def test_trainer_fills_the_derived_config_fields_in_its_own_copy():
    config = PPOConfig(batch_size=4, mini_batch_size=2, gradient_accumulation_steps=2)
    before = copy.deepcopy(config)
    trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()))
    # The user's config is left as it was given; the trainer's copy holds the derived values.
    assert config == before and config.world_size is None and config.is_encoder_decoder is None
    assert trainer.config is not config
    derived = trainer.config
    assert derived.backward_batch_size == 4
    assert derived.world_size == 1 and derived.global_batch_size == 4 and derived.global_backward_batch_size == 4
    assert derived.is_encoder_decoder is False and derived.is_peft_model is False


@pytest.mark.parametrize("encoder_decoder", [False, True])
def test_lm_head_and_softmax_see_only_the_response_token_slots(monkeypatch, encoder_decoder):
    # Compact padding (slots past a shorter response) never reaches the log-softmax, nor the LM head
    # of a decoder-only model: each call gets exactly one row per response token of its mini-batch
    # (one fewer per row for encoder-decoders, whose first decoder token is the start token).
    # Decoder-only models go through the fused head (core._lm_head_logits), T5 through its own head.
    import trl_lite.core.lm_head as core_module
    import trl_lite.trainer.step.head_path as forward_module  # the module that applies the LM head

    if encoder_decoder:
        model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5())
    else:
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    trainer = make_trainer(batch_size=4, mini_batch_size=2, ppo_epochs=1, model=model)
    queries, responses, scores = random_batch(4, seed=3)
    lengths = [len(r) - encoder_decoder for r in responses]
    assert len(set(lengths)) > 1  # the mini-batches do have padding to leave out
    softmax_rows, buffers = [], []
    for module, name in ((forward_module, "logprobs_from_logits"), (forward_module, "logprobs_and_entropy_from_logits")):
        real = getattr(module, name)

        def recording(logits, labels, *args, real=real, **kwargs):
            softmax_rows.append(tuple(logits.shape))
            return real(logits, labels, *args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    real_head_logits = core_module._lm_head_logits

    def recording_head(hidden, weight, bias, buffer_rows, out=None):
        logits = real_head_logits(hidden, weight, bias, buffer_rows, out)
        softmax_rows.append(tuple(logits.shape))
        buffers.append(logits.untyped_storage().nbytes() // (4 * logits.shape[1]))
        return logits

    monkeypatch.setattr(core_module, "_lm_head_logits", recording_head)
    lm_head_calls = []
    head = model.transformers_model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, output: lm_head_calls.append(tuple(output.shape)))
    trainer.step(queries, responses, scores)

    vocab = model.transformers_model.config.vocab_size
    pairs = {lengths[i] + lengths[j] for i in range(4) for j in range(i + 1, 4)}
    # Rollout: policy and reference on rows (0, 1) then (2, 3); training: two shuffled pairs.
    rollout, training = softmax_rows[:4], softmax_rows[4:]
    first, second = (lengths[0] + lengths[1], vocab), (lengths[2] + lengths[3], vocab)
    assert rollout == [first, first, second, second]
    assert len(training) == 2 and sum(n for n, _ in training) == sum(lengths)
    assert {n for n, _ in training} <= pairs and all(v == vocab for _, v in training)
    if not encoder_decoder:
        # The head module itself never runs; every buffer has the rows of the largest possible pair.
        assert lm_head_calls == []
        assert buffers == [max(pairs)] * 6


@pytest.mark.parametrize("untied_head_with_bias", [False, True])
def test_fused_lm_head_step_equals_the_model_head_step(monkeypatch, untied_head_with_bias):
    # The trainer applies a plain Linear head itself (logits turned into the softmax in place);
    # with linear_lm_head() reporting None it falls back to the model's own head. Both give the same
    # statistics and updated weights, with a tied head (GPT-2) and with an untied head with a bias.
    def run(fused: bool):
        gpt2 = make_gpt2(seed=2)
        if untied_head_with_bias:
            gpt2.config.tie_word_embeddings = False
            torch.manual_seed(5)
            gpt2.lm_head = torch.nn.Linear(gpt2.config.n_embd, gpt2.config.vocab_size, bias=True, device=gpt2.device)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
        assert model.linear_lm_head() is gpt2.lm_head
        if not fused:
            monkeypatch.setattr(model, "linear_lm_head", lambda: None)
        trainer = make_trainer(batch_size=4, mini_batch_size=2, model=model, seed=3)
        stats = [trainer.step(*random_batch(4, seed=s)) for s in (0, 1)]
        return stats, snapshot(trainer.model)

    (fused_stats, fused_weights), (plain_stats, plain_weights) = run(True), run(False)
    for fused, plain in zip(fused_stats, plain_stats):
        # The path taken differs, as it should: one buffer (0) against the model's own logits (-1).
        assert (fused["memory/lm_head_chunk_size"], plain["memory/lm_head_chunk_size"]) == (0, -1)
        for key, value in plain.items():
            if not key.startswith("time/") and key != "memory/lm_head_chunk_size":
                np.testing.assert_allclose(fused[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert fused_weights.keys() == plain_weights.keys()
    if untied_head_with_bias:
        assert "pretrained_model.lm_head.bias" in fused_weights
    for name, weight in plain_weights.items():
        assert_close(fused_weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_head_follows_a_head_replaced_after_the_trainer_was_made():
    # The trainer asks the model for its LM head on every pass, so a head swapped in later (as
    # resize_token_embeddings does) is the one applied.
    trainer = make_trainer(batch_size=2, mini_batch_size=2)
    queries, responses, scores = random_batch(2, seed=6)
    trainer.step(queries, responses, scores)  # the first head has been used
    gpt2 = trainer.model.pretrained_model
    gpt2.config.tie_word_embeddings = False
    torch.manual_seed(11)
    gpt2.lm_head = torch.nn.Linear(gpt2.config.n_embd, gpt2.config.vocab_size, bias=True)
    inputs = trainer.prepare_model_inputs(queries, responses)
    with torch.no_grad():
        logprobs, _, _, masks = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
        logits, _, _ = trainer.model(**inputs)
    expected = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    assert masks.sum() == sum(len(r) for r in responses)
    assert_close(logprobs[masks.bool()].double(), expected[masks.bool()], rtol=0, atol=1e-5)


@pytest.mark.cpu_only  # keep_freed_cpu_memory and its buffer act on CPU training only
@pytest.mark.parametrize("keep", [True, False])
def test_cpu_steps_reuse_one_logits_buffer_when_keeping_freed_memory(monkeypatch, keep):
    # With keep_freed_cpu_memory every fused-head pass of every step writes into one buffer, grown
    # when a step has longer responses; without it each pass allocates its own.
    import trl_lite.core.lm_head as core_module

    outs = []
    real_head_logits = core_module._lm_head_logits

    def recording_head(hidden, weight, bias, buffer_rows, out=None):
        outs.append(None if out is None else (out.data_ptr(), out.shape[0]))
        return real_head_logits(hidden, weight, bias, buffer_rows, out)

    monkeypatch.setattr(core_module, "_lm_head_logits", recording_head)
    trainer = make_trainer(batch_size=4, mini_batch_size=2, ppo_epochs=1, keep_freed_cpu_memory=keep)
    batches = [random_batch(4, seed=3, response_len=(2, 4)), random_batch(4, seed=4, response_len=(9, 12))]
    for batch in batches:
        trainer.step(*batch)
    assert len(outs) == 2 * (4 + 2)  # per step: policy and reference on 2 mini-batches, 2 training passes
    if not keep:
        assert outs == [None] * 12
        return
    largest = [sum(sorted((len(r) for r in responses), reverse=True)[:2]) for _, responses, _ in batches]
    assert largest[1] > largest[0]
    assert len(set(outs[:6])) == 1 and outs[0][1] == largest[0]
    assert len(set(outs[6:])) == 1 and outs[6][1] == largest[1]


def test_default_optimizer_is_fused_adam_with_the_config_learning_rate():
    trainer = make_trainer(learning_rate=3e-4)
    assert type(trainer.optimizer.optimizer) is torch.optim.Adam
    assert trainer.optimizer.defaults["fused"] is True and trainer.optimizer.defaults["lr"] == 3e-4
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == trainable


@pytest.mark.cpu_only  # the process's CPU heap is what is measured
@pytest.mark.parametrize("keep", [True, False])
def test_cpu_training_keeps_freed_memory_only_when_configured(monkeypatch, keep):
    import trl_lite.trainer.memory.cpu_memory as cpu_memory

    calls = []
    monkeypatch.setattr(cpu_memory, "keep_freed_cpu_memory", lambda *args: calls.append(args) or True)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    make_trainer(keep_freed_cpu_memory=keep)
    assert calls == ([()] if keep else [])  # one process: the 32 MiB default
