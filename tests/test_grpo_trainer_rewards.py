"""GRPOTrainer's reward functions as TRL 1.x takes them: sync and async callables with TRL's signature, a
sequence-classification model or its path, a mix with weights; dataset columns passed through; TRL's None rule
(NaN-aware: an unscored row stays in the loss with advantage 0, out of its group's statistics); reward
functions logging with TRL's ``log_metric`` / ``log_extra``; and a bad reward function stopped with its name, row and value
before any weight changes."""

import math

import pytest
import torch
from grpo_helpers import count_good, dataset, tokenizer, trainer, weights
from tiny_models import make_gpt2_critic

from trl_lite.trainer.grpo.prompts import prompt_ids
from trl_lite.trainer.grpo.rewards import RewardFunctions
from trl_lite.core import grpo_advantages

PROMPTS = ["the movie", "a film"]
COMPLETIONS = ["was good good", "was bad"]
IDS = [[5, 6, 6], [5, 7]]


def test_sync_async_and_weights_give_trls_weighted_sum():
    def first(prompts, completions, completion_ids, **kwargs):
        return [1.0, 2.0]

    async def second(prompts, completions, completion_ids, **kwargs):
        return [10.0, None]

    rewards = RewardFunctions([first, second], reward_weights=[0.5, 2.0])
    per_func = rewards(PROMPTS, COMPLETIONS, IDS, {})
    assert rewards.names == ["first", "second"]
    assert torch.equal(per_func[:, 0], torch.tensor([1.0, 2.0]))
    assert per_func[0, 1] == 10.0 and math.isnan(per_func[1, 1])
    # NaN counts as absent in the sum (TRL's nansum)
    assert torch.equal(rewards.combine(per_func), torch.tensor([0.5 * 1.0 + 2.0 * 10.0, 0.5 * 2.0]))


def test_a_row_no_function_scored_is_nan_and_gets_advantage_zero_out_of_its_groups_statistics():
    values = [None, 1.0, 3.0, 4.0, None, None, None, 2.0, None]
    rewards = RewardFunctions([lambda prompts, completions, completion_ids, **kw: values])
    combined = rewards.combine(rewards(["p"] * 9, ["c"] * 9, [[5]] * 9, {}))
    assert [math.isnan(v) for v in combined.tolist()] == [v is None for v in values]
    # TRL's rule in float64, group by group (of 3): mean and unbiased std of the scored rows, eps 1e-4; 0 for an
    # unscored row, for a group with one scored row (TRL's NaN std) and a group with none
    expected = []
    for g in range(3):
        scored = [v for v in values[3 * g : 3 * g + 3] if v is not None]
        mean = sum(scored) / len(scored) if scored else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in scored) / (len(scored) - 1)) if len(scored) > 1 else None
        expected += [0.0 if v is None or std is None else (v - mean) / (std + 1e-4) for v in values[3 * g : 3 * g + 3]]
    got = grpo_advantages(combined.double(), torch.arange(9) // 3, True, 1e-4)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    centred = grpo_advantages(combined.double(), torch.arange(9) // 3, False)
    assert centred.tolist() == pytest.approx([0.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-12)


def test_dataset_columns_and_the_trainer_state_reach_the_functions():
    seen = {}

    def spy(prompts, completions, completion_ids, target, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, target=target,
                    state=trainer_state)  # fmt: skip
        return [float(t == "good") for t in target]

    rewards = RewardFunctions(spy)
    out = rewards(PROMPTS, COMPLETIONS, IDS, {"target": ["good", "bad"]}, trainer_state="STATE")
    assert out[:, 0].tolist() == [1.0, 0.0]
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "completion_ids": IDS, "target": ["good", "bad"],
                    "state": "STATE"}  # fmt: skip


def _classifier_reference(model, tok, texts):
    """Each text alone, unpadded: the model's logit."""
    with torch.no_grad():
        return torch.tensor([model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts])


def test_a_sequence_classification_model_and_its_path_score_prompt_plus_completion(tmp_path):
    model, tok = make_gpt2_critic(), tokenizer()
    tok.padding_side = "left"  # the reward model pads on the right whatever the tokenizer says
    want = _classifier_reference(model, tok, [p + " " + c for p, c in zip(PROMPTS, COMPLETIONS)])
    completions = [" " + c for c in COMPLETIONS]
    got = RewardFunctions([model], reward_processing_classes=[tok])(PROMPTS, completions, IDS, {})
    torch.testing.assert_close(got[:, 0], want, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    from_path = RewardFunctions([str(tmp_path / "rm"), count_good], reward_weights=[1.0, 0.5])
    assert from_path.names == ["rm", "count_good"]
    got = from_path(PROMPTS, completions, IDS, {})
    torch.testing.assert_close(got[:, 0], want, rtol=1e-5, atol=1e-5)
    assert got[:, 1].tolist() == [2.0, 0.0]


def test_a_reward_model_scores_conversations_in_its_chat_template():
    model, tok = make_gpt2_critic(), tokenizer()
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    got = RewardFunctions([model], reward_processing_classes=tok)(prompts, completions, IDS, {})
    torch.testing.assert_close(got[:, 0], _classifier_reference(model, tok, texts), rtol=1e-5, atol=1e-5)


def raises(prompts, completions, completion_ids, **kwargs):
    raise KeyError("answer")


def too_short(prompts, completions, completion_ids, **kwargs):
    return [1.0]


def not_a_number(prompts, completions, completion_ids, **kwargs):
    return [1.0] * (len(prompts) - 1) + ["1.0"]


def not_finite(prompts, completions, completion_ids, **kwargs):
    return [float("nan")] * len(prompts)


def not_a_list(prompts, completions, completion_ids, **kwargs):
    return 1.0


@pytest.mark.parametrize("func, error, message", [
    (raises, RuntimeError, r"reward function 'raises' \(reward_funcs\[1\]\) raised KeyError: 'answer'"),
    (too_short, ValueError, r"'too_short' \(reward_funcs\[1\]\) must return one reward per completion \(8\), got 1"),
    (not_a_number, ValueError, r"'not_a_number' \(reward_funcs\[1\]\) returned '1.0' for row 7"),
    (not_finite, ValueError, r"'not_finite' \(reward_funcs\[1\]\) returned nan for row 0"),
    (not_a_list, TypeError, r"'not_a_list' \(reward_funcs\[1\]\) must return a list of 8 floats"),
])  # fmt: skip
def test_a_bad_reward_function_is_named_with_row_and_value_before_any_weight_changes(tmp_path, func, error, message):
    run = trainer(tmp_path, reward_funcs=(count_good, func))
    before = weights(run)
    with pytest.raises(error, match=message):
        run.train()
    after = weights(run)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert run.optimizer.state_dict()["state"] == {} and run.state.global_step == 0


def test_async_functions_and_a_bad_async_one(tmp_path):
    async def good_async(prompts, completions, completion_ids, **kwargs):
        return [1.0] * len(prompts)

    async def bad_async(prompts, completions, completion_ids, **kwargs):
        raise ValueError("no answer")

    run = trainer(tmp_path, reward_funcs=(good_async, count_good), max_steps=1)
    run.train()
    assert run.state.log_history[-1]["rewards/good_async/mean"] == 1.0
    with pytest.raises(RuntimeError, match="'bad_async' .* raised ValueError: no answer"):
        trainer(tmp_path, reward_funcs=(bad_async,)).train()


def test_conversational_prompts_go_through_the_chat_template(tmp_path):
    tok = tokenizer()
    prompts = [[{"role": "user", "content": "the movie was"}]]
    want = tok(tok.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert prompt_ids(tok, prompts)[0].tolist() == want["input_ids"]
    seen = []

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [0.0] * len(prompts)

    run = trainer(tmp_path, reward_funcs=(spy,), train_dataset=dataset(conversational=True), max_steps=1)
    run.train()
    prompt, completion = seen[0]
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"
    assert isinstance(completion[0]["content"], str)


def test_unscored_rows_stay_in_the_loss_with_a_nan_score_and_the_logged_reward_is_nan_aware(tmp_path):
    def half(prompts, completions, completion_ids, **kwargs):
        return [None if i % 2 else float(i) for i in range(len(prompts))]

    run = trainer(tmp_path, reward_funcs=(half,), max_steps=1)
    generation = run.rollout.run(run.prompts.next_rows())
    assert generation.response_masks is None  # every completion is trained on (TRL: advantage 0 for unscored ones)
    scores = [float(s) for s in generation.scores]
    assert scores[::2] == [0.0, 2.0, 4.0, 6.0] and all(math.isnan(s) for s in scores[1::2])
    (metrics,) = run.rollout.metrics([generation.metric_rows], 4)
    assert metrics["reward"] == 3.0 and metrics["rewards/half/mean"] == 3.0
    before = weights(run)
    run.train()
    assert math.isfinite(run.state.log_history[0]["loss"])
    assert any((run.model.state_dict()[k] - v).abs().max() > 0 for k, v in before.items())


def test_reward_functions_log_metrics_and_completion_columns_as_in_trl(tmp_path):
    def scored(prompts, completions, completion_ids, log_metric, log_extra, **kwargs):
        lengths = [float(len(ids)) for ids in completion_ids]
        log_metric("mean_length_seen", sum(lengths) / len(lengths))
        log_metric("mean_length_seen", 0.0)  # logged twice in one generation: the mean of both
        log_extra("length", lengths)
        return lengths

    run = trainer(tmp_path, reward_funcs=(scored,), max_steps=2, log_completions=True)
    seen = []
    rollout_run = run.rollout.run
    run.rollout.run = lambda *a, **kw: seen.append(rollout_run(*a, **kw)) or seen[-1]
    run.train()
    for generation, logged in zip(seen, run.state.log_history):
        lengths = [float(len(r)) for r in generation.responses]
        assert logged["mean_length_seen"] == pytest.approx(sum(lengths) / len(lengths) / 2)
        assert generation.table["length"] == lengths
    evaluated = run.evaluate(dataset(2))
    assert evaluated["eval_mean_length_seen"] == pytest.approx(evaluated["eval_completions/mean_length"] / 2)


def test_reward_weights_must_match_the_functions(tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights must hold one weight per reward function \(1\), got 2"):
        trainer(tmp_path, reward_weights=[1.0, 2.0])
    with pytest.raises(TypeError, match=r"reward_funcs\[0\] must be a callable"):
        RewardFunctions([3])


def test_frac_reward_zero_std_is_per_group_or_of_the_whole_batch_as_the_advantages_scale(tmp_path):
    def by_prompt(prompts, completions, completion_ids, **kwargs):
        return [float(sum(map(ord, p))) for p in prompts]  # equal within each group, different between prompts

    for scale, want in (("group", 1.0), ("batch", 0.0)):
        run = trainer(tmp_path / scale, reward_funcs=(by_prompt,), max_steps=1, scale_rewards=scale)
        generation = run.rollout.run(run.prompts.next_rows())
        (metrics,) = run.rollout.metrics([generation.metric_rows], 4)
        assert metrics["reward_std"] > 0 and metrics["frac_reward_zero_std"] == want
