"""The trainer as parts (ForwardPass, ExperienceMaker, Learner, StepStatistics, Checkpointer) and the
defects fixed on the way: ``loss/total`` as computed, the guarded classic ``train_minibatch``, EOS ids
looked up once, the action-mask rule in one place, the facade's single mixin, ``policy_version``."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from tiny_models import make_gpt2, make_gpt2_critic, make_t5, make_tokenizer, random_batch

import trl_lite.trainer.ppo_trainer as ppo_trainer_module
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.trainer.classic.helpers import ClassicHelpersMixin
from trl_lite.trainer.step.experience import Experience
from trl_lite.trainer.layout.rows import action_mask, actions_per_row


def make_trainer(batch_size=4, mini_batch_size=2, value_model=None, **config_kwargs):
    config_kwargs.setdefault("learning_rate", 1e-3)
    config = PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size, **config_kwargs)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    return PPOTrainer(config, model, tokenizer=make_tokenizer(), value_model=value_model)


def test_the_facade_holds_one_mixin_and_its_parts():
    mixins = [c for c in PPOTrainer.__mro__ if c not in (PPOTrainer, object)]
    assert mixins == [ClassicHelpersMixin]
    trainer = make_trainer()
    for part in ("forward", "experience_maker", "learner", "statistics", "checkpointer", "generation"):
        assert getattr(trainer, part) is not None


@pytest.mark.parametrize("shift", [0, 1])
def test_action_mask_is_the_brute_force_rule(shift):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 2, 5, 3, 7])
    masks = [(torch.rand(int(n), generator=g) > 0.3).float() for n in lengths]
    padded = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    got = action_mask(lengths, padded, shift)
    width = max(int(lengths.max()) - shift, 1)
    want = torch.zeros(len(lengths), width)
    for b, n in enumerate(lengths.tolist()):
        for k in range(width):
            token = k + shift  # the response token column k predicts
            # Encoder-decoder: decoder token 0 is the start token and token 1's prediction is no action.
            if token < n and (shift == 0 or token >= 2) and masks[b][token] == 1:
                want[b, k] = 1.0
    assert torch.equal(got, want)
    responses = [torch.zeros(int(n)) for n in lengths]
    assert actions_per_row(responses, masks, shift) == tuple(int(n) for n in want.sum(-1))
    assert actions_per_row(responses, None, shift) == tuple(max(int(n) - 2 * shift, 0) for n in lengths)


def test_experience_is_built_once_and_frozen_and_minibatches_slice_it():
    trainer = make_trainer(batch_size=4, mini_batch_size=2)
    queries, responses, scores = random_batch(4, seed=1)
    batch = trainer._check_step_inputs(queries, responses, scores, None, None, None, None, None)
    experience = trainer.experience_maker.make(batch)
    assert isinstance(experience, Experience) and len(experience) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        experience.advantages = None
    mb = experience.minibatch([3, 1])
    width = max(len(responses[3]), len(responses[1]))
    assert mb.width == width and mb.index == [3, 1] and mb.idx.tolist() == [3, 1]
    for name, full in (("old_logprobs", experience.logprobs), ("advantages", experience.advantages),
                       ("returns", experience.returns), ("old_values", experience.values),
                       ("mask", experience.action_mask)):  # fmt: skip
        assert torch.equal(getattr(mb, name), full[[3, 1], :width]), name
    assert mb.ref_logprobs is None  # the KL is in the reward by default
    # Training leaves the experience as it was built.
    before = {f.name: getattr(experience, f.name) for f in dataclasses.fields(experience)}
    before = {k: v.clone() for k, v in before.items() if isinstance(v, torch.Tensor)}
    trainer.learner.train(experience)
    for key, value in before.items():
        assert torch.equal(getattr(experience, key), value), key


def test_loss_total_is_the_sum_the_losses_were_computed_from():
    # Separate critic and PTX: loss/total = loss/policy + vf_coef * loss/value + ptx_coef * loss/ptx,
    # averaged over mini-batches like each of its terms (a linear relation survives the averaging).
    trainer = make_trainer(value_model=make_gpt2_critic(seed=3), vf_coef=0.3, ptx_coef=0.5)
    queries, responses, scores = random_batch(4, seed=2)
    ptx = random_batch(4, seed=9, query_len=(3, 6))[0]
    stats = trainer.step(queries, responses, scores, ptx_inputs=ptx)
    want = stats["ppo/loss/policy"] + 0.3 * stats["ppo/loss/value"] + 0.5 * stats["ppo/loss/ptx"]
    assert stats["ppo/loss/total"] == pytest.approx(want, rel=1e-5)
    # The shared value head gives the same sum without PTX.
    shared = make_trainer(vf_coef=0.3).step(queries, responses, scores)
    assert shared["ppo/loss/total"] == pytest.approx(shared["ppo/loss/policy"] + 0.3 * shared["ppo/loss/value"], rel=1e-5)


def test_classic_train_minibatch_is_guarded_like_the_step():
    trainer = make_trainer(ratio_threshold=2.0)
    queries, responses, scores = random_batch(4, seed=3)
    inputs = trainer.prepare_model_inputs(queries, responses)
    old, _, values, masks = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
    trainer.model.train()
    logits, _, vpreds = trainer.model(**inputs)
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    advantages = torch.ones_like(old) * masks
    # log-probs 3 nats above the old ones: a mean ratio of e^3 > ratio_threshold, so no update.
    with pytest.warns(UserWarning, match="exceeds ratio_threshold"):
        stats = trainer.train_minibatch(old - 3 * masks, values, logprobs, logits[:, :-1], vpreds[:, :-1], masks,
                                        advantages, values)  # fmt: skip
    assert trainer.skipped_minibatches == 1 and math.isfinite(float(stats["loss/total"]))
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None or not p.grad.any(), name


def test_eos_ids_are_looked_up_once(monkeypatch):
    calls = []
    real = ppo_trainer_module.resolve_stop_token_ids
    monkeypatch.setattr(ppo_trainer_module, "resolve_stop_token_ids", lambda *a: calls.append(1) or real(*a))
    trainer = make_trainer()
    for seed in range(2):
        stats = trainer.step(*random_batch(4, seed=seed))
    assert len(calls) == 1 and "env/eos_fraction" in stats


def test_missing_eos_penalty_set_on_the_trainer_later_is_refused_before_any_state_changes():
    config = PPOConfig(batch_size=4, mini_batch_size=2)
    model = make_t5()
    model.config.eos_token_id = None
    from trl_lite import AutoModelForSeq2SeqLMWithValueHead

    trainer = PPOTrainer(config, AutoModelForSeq2SeqLMWithValueHead.from_pretrained(model))
    trainer.config.missing_eos_penalty = -1.0
    with pytest.raises(ValueError, match="missing_eos_penalty=-1.0 needs an EOS token id"):
        trainer.step(*random_batch(4, response_len=(3, 6)))
    assert trainer.current_step == 0


def test_policy_version_reports_staleness_and_bad_versions_are_refused_first():
    trainer = make_trainer()
    trainer.step(*random_batch(4, seed=0))
    trainer.step(*random_batch(4, seed=1))
    stats = trainer.step(*random_batch(4, seed=2), policy_version=[0, 1, 2, 1])
    # At the start of the third step current_step is 2: staleness 2, 1, 0, 1.
    assert stats["rollout/staleness/mean"] == pytest.approx(1.0) and stats["rollout/staleness/max"] == 2.0
    assert trainer.step(*random_batch(4, seed=3), policy_version=3)["rollout/staleness/max"] == 0.0
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for bad, match in ((5, r"policy_version\[0\] must be an int in \[0, 4\]"), ([1, 2], "a list of config.batch_size=4"),
                       ("3", "an int or a list"), ([0, 1, 2, -1], r"policy_version\[3\]")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            trainer.step(*random_batch(4, seed=4), policy_version=bad)
    assert trainer.current_step == 4
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, weights[name])


def test_ema_is_saved_and_restored_by_its_one_owner(tmp_path):
    trainer = make_trainer(ema_decay=0.5)
    trainer.step(*random_batch(4, seed=0))
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    want = {k: v.clone() for k, v in trainer._ema.state_dict().items()}
    fresh = make_trainer(ema_decay=0.5)
    assert any(not torch.equal(fresh._ema.state_dict()[k], v) for k, v in want.items())
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    got = fresh._ema.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert np.isfinite(fresh.step(*random_batch(4, seed=1))["ppo/loss/total"])


def test_a_loaded_dataloader_position_is_saved_again_before_it_is_iterated():
    from trl_lite.trainer.state.resumable_loader import ResumableLoader

    def loader():
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.DataLoader(list(range(12)), batch_size=3, shuffle=True, generator=g)
        return ResumableLoader(data, g)

    first = loader()
    batches = iter(first)
    seen = [next(batches), next(batches)]
    state = first.state_dict()
    assert state["served"] == 2
    resumed = loader()
    resumed.load_state_dict(state)
    # Saved again before the next batch is drawn (a checkpoint right after a resume): the same position.
    assert resumed.state_dict() == state
    rest = list(resumed)
    straight = list(loader())
    assert all(torch.equal(a, b) for a, b in zip(seen + rest, straight)) and len(rest) == 2
