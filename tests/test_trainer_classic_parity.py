"""PPOTrainer behaviours a user porting classic TRL code meets: generation modes, constructor
warnings, score shapes and the classic private helpers."""

import functools
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from devices import equal
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, NoDatasetWarning, PPOConfig, PPOTrainer, create_reference_model
from trl_lite.core import respond_to_batch


def make_trainer(dropout=0.0, batch_size=4, **config_kwargs):
    config = PPOConfig(batch_size=batch_size, mini_batch_size=2, learning_rate=1e-3, ppo_epochs=1, **config_kwargs)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=5, dropout=dropout))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PPOTrainer(config, model, tokenizer=make_tokenizer())


# ----------------------------------------------------------------------------------------------
# Item 1: generation runs in eval mode
# ----------------------------------------------------------------------------------------------


def test_greedy_single_and_batched_generation_agree_with_dropout_after_a_step():
    trainer = make_trainer(dropout=0.5)
    trainer.step(*random_batch(4))
    assert trainer.model.training  # step() leaves the policy in train mode
    queries = [torch.tensor(q) for q in ([5, 9, 12], [7, 20, 3, 30, 8], [44], [6, 6])]
    kwargs = dict(return_prompt=False, do_sample=False, max_new_tokens=6, suppress_tokens=[0, 1, 2])
    batched, ref_batched = trainer.generate(queries, batch_size=4, generate_ref_response=True, **kwargs)
    assert trainer.model.training
    for query, response, ref_response in zip(queries, batched, ref_batched):
        single, ref_single = trainer.generate(query, generate_ref_response=True, **kwargs)
        assert trainer.model.training
        assert single[0].tolist() == response.tolist()
        assert ref_single[0].tolist() == ref_response.tolist()
        # The same tokens as a plain greedy decode of the policy in eval mode.
        policy = trainer.accelerator.unwrap_model(trainer.model).pretrained_model
        policy.eval()
        plain = policy.generate(query.unsqueeze(0), do_sample=False, max_new_tokens=6, suppress_tokens=[0, 1, 2], pad_token_id=0)
        policy.train()
        assert plain[0, len(query):].tolist() == response.tolist()


def test_generation_restores_each_submodules_own_mode():
    trainer = make_trainer(dropout=0.5)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.train()
    policy.v_head.eval()  # a user's choice that generation must not undo
    trainer.generate(torch.tensor([5, 9]), max_new_tokens=2, do_sample=False)
    trainer.generate([torch.tensor([5, 9]), torch.tensor([3])], max_new_tokens=2, do_sample=False)
    assert policy.training and policy.pretrained_model.training and not policy.v_head.training


# ----------------------------------------------------------------------------------------------
# Constructor warnings
# ----------------------------------------------------------------------------------------------


def test_num_shared_layers_with_a_ref_model_warns_and_is_ignored():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    ref = create_reference_model(model)
    config = PPOConfig(batch_size=2, mini_batch_size=2)
    with pytest.warns(UserWarning, match="num_shared_layers=1 is ignored: a ref_model was given"):
        trainer = PPOTrainer(config, model, ref_model=ref, tokenizer=make_tokenizer(), num_shared_layers=1)
    assert trainer.accelerator.unwrap_model(trainer.ref_model) is ref
    assert all(not p.requires_grad for p in ref.parameters())


# Classic TRL 0.11's stat keys that its test_ppo_step_no_dataset asserts.
CLASSIC_EXPECTED_STATS = [
    "objective/kl", "objective/kl_dist", "objective/logprobs", "objective/ref_logprobs", "objective/kl_coef",
    "objective/entropy", "ppo/mean_non_score_reward", "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total",
    "ppo/policy/entropy", "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac", "ppo/policy/advantages",
    "ppo/policy/advantages_mean", "ppo/policy/ratio", "ppo/returns/mean", "ppo/returns/var", "ppo/val/vpred",
    "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var", "ppo/val/var_explained",
    "time/ppo/forward_pass", "time/ppo/compute_rewards", "time/ppo/optimize_step", "time/ppo/calc_stats",
    "time/ppo/total", "ppo/learning_rate",
]  # fmt: skip


def test_classic_ppo_step_no_dataset():
    # Classic TRL 0.11's test_ppo_step_no_dataset with its imports changed and its hub models made locally.
    tokenizer = make_tokenizer()
    gpt2_model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    gpt2_model_ref = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    ppo_config = PPOConfig(batch_size=2, mini_batch_size=1, log_with=None)
    query_tensor = tokenizer.encode("This morning I went to the ", return_tensors="pt")
    ppo_config.batch_size = 1
    response_tensor = respond_to_batch(gpt2_model, query_tensor)
    with pytest.warns(UserWarning):
        ppo_trainer = PPOTrainer(config=ppo_config, model=gpt2_model, ref_model=gpt2_model_ref, tokenizer=tokenizer)
    ppo_trainer.optimizer.zero_grad = functools.partial(ppo_trainer.optimizer.zero_grad, set_to_none=False)
    train_stats = ppo_trainer.step([query_tensor[0]], [response_tensor[0]], [torch.tensor([1.0])])
    for name, param in ppo_trainer.model.named_parameters():
        assert param.grad is not None, f"Parameter {name} has no gradient"
    for name, param in ppo_trainer.ref_model.named_parameters():
        assert param.grad is None, f"Parameter {name} has a gradient"
    for stat in CLASSIC_EXPECTED_STATS:
        assert stat in train_stats, f"Train stats should contain {stat}"


def test_no_dataset_warning_names_batch_size_and_step_refuses_another_size():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    with pytest.warns(NoDatasetWarning, match=r"No dataset is provided\. .*config\.batch_size \(now 2\)") as record:
        trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, tokenizer=make_tokenizer())
    assert issubclass(NoDatasetWarning, UserWarning)
    assert [Path(w.filename).name for w in record] == [Path(__file__).name]  # points at the caller's line
    with pytest.raises(ValueError, match="config.batch_size=2"):
        trainer.step([torch.tensor([3, 4])] * 3, [torch.tensor([5])] * 3, [torch.tensor(1.0)] * 3)


def test_a_dataset_or_a_filter_on_the_category_keeps_the_constructor_silent():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    data = [{"input_ids": torch.tensor([3, 4])}] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, tokenizer=make_tokenizer(), dataset=data)
        with warnings.catch_warnings():  # what the examples do around a trainer that batches its own queries
            warnings.simplefilter("ignore", NoDatasetWarning)
            PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, tokenizer=make_tokenizer())


# ----------------------------------------------------------------------------------------------
# Score shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["float", "0-d", "1-element 1-D", "numpy 0-d"])
def test_accepted_score_forms(form):
    import numpy as np

    queries, responses, _ = random_batch(4, seed=3)
    values = [0.5, -1.0, 2.0, 0.25]
    make = {"float": float, "0-d": torch.tensor, "1-element 1-D": lambda v: torch.tensor([v]), "numpy 0-d": np.array}[form]
    stats = make_trainer().step(queries, responses, [make(v) for v in values])
    assert math.isclose(stats["ppo/mean_scores"], sum(values) / 4, rel_tol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1), (2,), (1, 1, 1), (0,)])
def test_other_score_shapes_are_rejected(shape):
    queries, responses, scores = random_batch(4, seed=3)
    trainer = make_trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    scores[2] = torch.ones(shape)
    with pytest.raises(ValueError, match=f"scores\\[2\\] must be one number.*got shape {re_shape(shape)}"):
        trainer.step(queries, responses, scores)
    assert trainer.current_step == 0
    assert all(equal(p, before[n]) for n, p in trainer.model.named_parameters())


def re_shape(shape):
    return str(tuple(shape)).replace("(", "\\(").replace(")", "\\)")


# ----------------------------------------------------------------------------------------------
# Classic private helpers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", ["kl", "abs", "mse", "full"])
def test_kl_penalty_matches_float64_formulas(penalty):
    trainer = make_trainer(kl_penalty=penalty)
    g = torch.Generator().manual_seed(0)
    if penalty == "full":
        lp = torch.log_softmax(torch.randn(2, 3, 5, generator=g, dtype=torch.float64), -1)
        ref = torch.log_softmax(torch.randn(2, 3, 5, generator=g, dtype=torch.float64), -1)
        out = trainer._kl_penalty(lp, ref)
        assert out.shape == (2, 3)
        for b in range(2):
            for t in range(3):
                want = sum(math.exp(lp[b, t, v]) * (float(lp[b, t, v]) - float(ref[b, t, v])) for v in range(5))
                assert abs(float(out[b, t]) - want) < 1e-12
        return
    lp = torch.randn(2, 4, generator=g, dtype=torch.float64)
    ref = torch.randn(2, 4, generator=g, dtype=torch.float64)
    formula = {"kl": lambda a, b: a - b, "abs": lambda a, b: abs(a - b), "mse": lambda a, b: 0.5 * (a - b) ** 2}[penalty]
    out = trainer._kl_penalty(lp, ref)
    for b in range(2):
        for t in range(4):
            assert abs(float(out[b, t]) - formula(float(lp[b, t]), float(ref[b, t]))) < 1e-12


def test_step_safety_checker():
    trainer = make_trainer()
    queries, responses, _ = random_batch(4, seed=4)
    scores = [torch.tensor([1.0]), torch.tensor(2.0), 3.0, torch.tensor([4.0])]
    q, r, s, m = trainer._step_safety_checker(4, queries, responses, scores)
    assert [x.tolist() for x in q] == [x.tolist() for x in queries] and m is None
    assert [x.shape for x in s] == [()] * 4 and [float(x) for x in s] == [1.0, 2.0, 3.0, 4.0]
    masks = [torch.ones_like(x) for x in responses]
    assert trainer._step_safety_checker(4, queries, responses, scores, masks)[3][0].tolist() == masks[0].tolist()
    with pytest.raises(ValueError, match="scores\\[1\\] must be one number"):
        trainer._step_safety_checker(4, queries, responses, [scores[0], torch.ones(1, 1), scores[2], scores[3]])
    with pytest.raises(ValueError, match="batch_size=3"):
        trainer._step_safety_checker(3, queries, responses, scores)


def test_gather_stats_on_one_process_keeps_the_values():
    trainer = make_trainer()
    stats = {"a": torch.tensor([1.0, 3.0]), "b": 2.5}
    out = trainer.gather_stats(stats)
    assert out["a"].tolist() == [1.0, 3.0] and out["b"] == 2.5


def test_record_step_stats_matches_hand_computation():
    trainer = make_trainer()
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    kls = torch.tensor([[0.1, 0.2, 9.0], [9.0, -0.3, 0.5]])
    logprobs = torch.tensor([[-1.0, -2.0, -5.0], [-5.0, -0.5, -1.5]])
    non_score = torch.tensor([[0.2, 0.4, 9.0], [9.0, 0.6, 0.8]])
    scores = torch.tensor([1.0, 3.0])
    train_stats = {"val/error": torch.tensor([0.5, 1.5]), "returns/var": torch.tensor([2.0, 2.0]), "loss/total": torch.tensor([1.0, 2.0])}
    stats = trainer.record_step_stats(
        0.2, masks=mask, kls=kls, logprobs=logprobs, ref_logprobs=logprobs, non_score_reward=non_score, scores=scores,
        queries=[torch.ones(2), torch.ones(4)], responses=[torch.ones(3), torch.ones(3)], train_stats=train_stats,
    )
    assert math.isclose(float(stats["objective/kl"]), ((0.1 + 0.2) + (-0.3 + 0.5)) / 2, rel_tol=1e-6)
    assert stats["objective/kl_dist"].tolist() == pytest.approx([0.3, 0.2])
    assert math.isclose(float(stats["objective/entropy"]), (3.0 + 2.0) / 2, rel_tol=1e-6)
    assert math.isclose(float(stats["ppo/mean_non_score_reward"]), (0.2 + 0.4 + 0.6 + 0.8) / 4, rel_tol=1e-6)
    assert float(stats["ppo/mean_scores"]) == 2.0 and math.isclose(float(stats["ppo/std_scores"]), math.sqrt(2), rel_tol=1e-6)
    assert stats["tokens/queries_len_mean"] == 3.0 and math.isclose(stats["tokens/queries_len_std"], math.sqrt(2), rel_tol=1e-6)
    assert stats["tokens/responses_dist"].tolist() == [3.0, 3.0] and stats["objective/kl_coef"] == 0.2
    assert float(stats["ppo/loss/total"]) == 1.5
    assert math.isclose(float(stats["ppo/val/var_explained"]), 1 - 1.0 / 2.0)


def test_save_pretrained_with_model_card(tmp_path):
    trainer = make_trainer()
    out = tmp_path / "tuned"
    trainer._save_pretrained(str(out))
    card = (out / "README.md").read_text()
    assert "# TRL Model" in card and str(out) in card and "trl_lite" in card
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(out))
    original = trainer.accelerator.unwrap_model(trainer.model)
    for (name, p), (_, q) in zip(original.state_dict().items(), reloaded.state_dict().items()):
        assert equal(p, q), name
    trainer.create_model_card(str(tmp_path / "card_only"), model_name="My PPO model")
    assert os.listdir(tmp_path / "card_only") == ["README.md"]
    assert "# My PPO model" in (tmp_path / "card_only" / "README.md").read_text()
