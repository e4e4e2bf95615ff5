"""``max_tokens_per_minibatch``: step() in passes by token budget (docs/algorithm.md section 18).

Every loss is taken over the whole backward batch, so a step with a budget must equal the float64
reference run with one mini-batch per backward batch (``plain_objectives``), for every option of
``test_objectives.CASES``, and the row-count split with ``mini_batch_size = backward_batch_size``;
the rollout passes, statistics, the warning for a row over the budget and gradient checkpointing too.
"""

import warnings

import numpy as np
import pytest
import torch
from test_objectives import CASES, _build_pair, compared_statistics, step_both
from test_step_reference import perturbed_copy
from tiny_models import make_gpt2, make_gpt2_critic, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

# Rows of make_batch hold 4 to 14 prompt+response tokens: a backward batch of 4 rows takes 2 to 4 passes.
BUDGET = 12


def _budget_pair(case: dict):
    """A trainer with 2 backward batches of 4 rows in passes of BUDGET tokens, and the float64 reference with
    one mini-batch of 4 rows per backward batch (the same rows: both draw the same shuffles)."""
    split = dict(mini_batch_size=2, gradient_accumulation_steps=2, max_tokens_per_minibatch=BUDGET)
    return _build_pair(case, split, dict(mini_batch_size=4, gradient_accumulation_steps=1))


@pytest.mark.parametrize("name", list(CASES))
def test_budget_steps_match_the_float64_reference_of_whole_backward_batches(name):
    """Two steps in passes of 12 tokens (2 to 4 per backward batch, 2 mini-batches x 2 accumulation steps
    of rows) take the float64 reference's steps on whole backward batches: weights and statistics."""
    case = CASES[name]
    trainer, plain, config, critic_free = _budget_pair(case)
    initial = {k: v.detach().double().clone() for k, v in plain.model.state_dict().items()}
    passes = []
    for step in range(2):
        got, want, _, _ = step_both(trainer, plain, config, case, step)
        compared = compared_statistics(config)
        compared += () if critic_free else ("ppo/loss/value",)
        for key in compared:
            np.testing.assert_allclose(got[key], float(want[key]), rtol=2e-5, atol=2e-6, err_msg=key)
        passes.append(got["ppo/minibatches"])
    # Passes, not the 8 mini-batches of the row split: 2 epochs x 2 backward batches x 2..4 passes each.
    assert all(8 <= p <= 16 for p in passes) and any(p != 8 for p in passes), passes
    got_weights = trainer.model.pretrained_model.state_dict() if critic_free else trainer.model.state_dict()
    moved = 0.0
    for key, want_value in plain.model.state_dict().items():
        update = want_value - initial[key]
        error = (got_weights[key].double() - want_value).norm()
        assert error <= 1e-4 * update.norm() + 1e-6, f"{key}: error {error:.3g}, update {update.norm():.3g}"
        moved = max(moved, float(update.norm()))
    assert moved > 1e-2


def _one_step(budget, mini_batch_size, accumulation, ptx=False, critic=False, **options):
    """Weights and statistics after one step of 8 rows (SGD), with ``options`` (loss type, coefficients)."""
    config = PPOConfig(
        batch_size=8, mini_batch_size=mini_batch_size, gradient_accumulation_steps=accumulation, ppo_epochs=2,
        learning_rate=0.5, max_tokens_per_minibatch=budget, seed=0, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    if critic:
        critic_model = make_gpt2_critic(seed=2)
        policy = make_gpt2(seed=0)
        kwargs = {"value_model": critic_model, "critic_optimizer": torch.optim.SGD(critic_model.parameters(), lr=0.5)}
    else:
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
        kwargs = {}
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer(), optimizer=optimizer, **kwargs)
    queries, responses, scores = random_batch(8, seed=3, query_len=(2, 5), response_len=(1, 12))
    ptx_inputs = None
    if ptx:
        ptx_inputs = [torch.cat((q, r)) for q, r in zip(*random_batch(8, seed=4, query_len=(2, 6), response_len=(1, 6))[:2])]
    torch.manual_seed(1)
    stats = trainer.step(queries, responses, scores, ptx_inputs=ptx_inputs)
    models = [trainer.model] + ([trainer.critic] if critic else [])
    weights = {f"{m}.{k}": v.detach().clone() for m, model in enumerate(models) for k, v in model.state_dict().items()}
    return weights, stats


SPLIT_CASES = {
    "token_mean_value_loss": dict(),
    "seq_mean_token_mean_entropy": dict(advantage_estimator="reinforce_pp", loss_type="seq_mean_token_mean", entropy_coef=0.1),
    "dr_grpo_kl_in_loss": dict(advantage_estimator="reinforce_pp", loss_type="dr_grpo", max_response_length=12,
                               kl_in_reward=False, init_kl_coef=0.5),
    "global_token_mean_ptx": dict(loss_type="global_token_mean", ptx=True, ptx_coef=0.5),
    "token_mean_ptx_separate_critic": dict(ptx=True, ptx_coef=0.5, critic=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_update_does_not_depend_on_how_the_backward_batch_is_split(name):
    """One backward batch of 8 rows: the row-count split's single mini-batch of 8, one pass under a large
    budget, and 3 to 8 passes under budgets of 9 and 24 tokens (1 x 8 and 2 x 4 rows of accumulation) give the
    same update and the same losses, with the value loss, entropy bonus, KL in the loss, PTX or a separate critic."""
    options = dict(SPLIT_CASES[name])
    want, want_stats = _one_step(None, 8, 1, **options)
    runs = {"one pass": (10_000, 8, 1), "9 tokens": (9, 1, 8), "24 tokens": (24, 2, 4)}
    for label, (budget, mini_batch_size, accumulation) in runs.items():
        got, stats = _one_step(budget, mini_batch_size, accumulation, **options)
        for key, value in want.items():
            error = (got[key] - value).abs().max().item()
            assert error <= 2e-6, f"{label}: {key} differs by {error:.3g}"
        for key in ("ppo/loss/policy", "ppo/loss/total", "ppo/policy/approxkl", "ppo/policy/entropy"):
            np.testing.assert_allclose(stats[key], want_stats[key], rtol=1e-4, atol=1e-6, err_msg=f"{label} {key}")
        assert stats["ppo/minibatches"] == 2 if label == "one pass" else stats["ppo/minibatches"] >= 6, label


def test_row_count_split_depends_on_the_split_and_the_budget_does_not():
    """The checks above have teeth: classic token_mean over 4 mini-batches of 2 rows averages their own means and
    gives another update than the backward batch's token mean, which any budget gives."""
    whole, _ = _one_step(None, 8, 1)
    classic, _ = _one_step(None, 2, 4)
    budget, _ = _one_step(12, 2, 4)
    assert max((whole[k] - classic[k]).abs().max().item() for k in whole) > 1e-4
    assert max((whole[k] - budget[k]).abs().max().item() for k in whole) <= 2e-6


def test_statistics_without_a_budget_count_mini_batches():
    _, stats = _one_step(None, 2, 2)
    assert stats["ppo/minibatches"] == 2 * 4  # 2 epochs x 4 mini-batches
    assert stats["ppo/tokens_per_minibatch/max"] >= stats["ppo/tokens_per_minibatch/mean"] > 0


def test_rollout_passes_follow_the_budget_and_match_the_row_split():
    """The no-grad passes (policy, reference, values; classic batched_forward_pass) give the same results in
    passes of a budget, and the fused head's logits buffer is sized by the budget, not by mini_batch_size rows."""
    queries, responses, _ = random_batch(8, seed=5, query_len=(2, 5), response_len=(3, 20))
    results = {}
    for budget in (None, 24):
        config = PPOConfig(batch_size=8, mini_batch_size=8, max_tokens_per_minibatch=budget, seed=0)
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
        trainer = PPOTrainer(config, policy, ref_model=perturbed_copy(policy, seed=1), tokenizer=make_tokenizer())
        rows = trainer.forward.make_rows(queries, responses, None)
        passes = list(trainer.forward.minibatches(rows))
        inputs = trainer.prepare_model_inputs(queries, responses)
        classic = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
        results[budget] = (trainer.experience_maker.passes(rows), classic)
        if budget is None:
            assert len(passes) == 1 and rows.buffer_rows == sum(len(r) for r in responses)
        else:
            assert len(passes) > 1 and sorted(i for index, _ in passes for i in index) == list(range(8))
            assert all(sum(rows.tokens(i) for i in index) <= budget for index, _ in passes)
            assert rows.buffer_rows == max(budget, max(len(r) for r in responses))
    (rollout, classic), (rollout_by_rows, classic_by_rows) = results[24], results[None]
    for got, want in zip(rollout[:3], rollout_by_rows[:3]):  # log-probs, reference log-probs, values
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for i in (0, 2, 3):  # batched_forward_pass: log-probs, values, masks
        torch.testing.assert_close(classic[i], classic_by_rows[i], rtol=1e-5, atol=1e-6)


def test_a_row_over_the_budget_gets_its_own_pass_with_one_warning():
    config = PPOConfig(batch_size=4, mini_batch_size=4, ppo_epochs=2, max_tokens_per_minibatch=10, seed=0)
    trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()), tokenizer=make_tokenizer())
    queries, responses, scores = random_batch(4, seed=6, query_len=(2, 3), response_len=(2, 4))
    responses[1] = torch.randint(3, 50, (30,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            stats = trainer.step(queries, responses, scores)
    over = [w for w in caught if "exceeds max_tokens_per_minibatch=10" in str(w.message)]
    assert len(over) == 1, [str(w.message) for w in caught]
    assert stats["ppo/tokens_per_minibatch/max"] == len(queries[1]) + 30


def test_gradient_checkpointing_takes_the_same_budget_step():
    plain, _ = _one_step(20, 2, 4)
    checkpointed, stats = _one_step(20, 2, 4, gradient_checkpointing=True)
    assert stats["ppo/minibatches"] > 4
    assert max((plain[k] - checkpointed[k]).abs().max().item() for k in plain) <= 2e-6
