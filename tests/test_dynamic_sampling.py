"""DynamicSampler (DAPO's dynamic sampling) against scripted generate-and-score functions: refills, the
cap with its warning and fill, surplus groups, extras kept aligned, and bad input."""

import doctest
import random
import warnings

import numpy as np
import pytest
import torch

import trl_lite.extras.dynamic_sampling as dynamic_sampling
from trl_lite.extras import DynamicSampler, SampledBatch


class Script:
    """A deterministic generate_and_score: call `c` returns the groups `plan[c]` (lists of row scores).
    Each row is tagged `(call, group, row)` in queries, responses and the extra key "tag", so that where
    every output row came from can be checked. `asked` records each call's `num_groups`."""

    def __init__(self, plan):
        self.plan = plan
        self.asked = []

    def __call__(self, num_groups):
        call = len(self.asked)
        self.asked.append(num_groups)
        groups = self.plan[call]
        tags = [(call, g, r) for g, scores in enumerate(groups) for r in range(len(scores))]
        return {
            "queries": [torch.tensor([100 + call, g]) for call, g, _ in tags],
            "responses": [torch.tensor([call, g, r]) for call, g, r in tags],
            "scores": [torch.tensor(float(s)) for scores in groups for s in scores],
            "tag": tags,
        }


def tags_of(batch):
    return [tuple(t) for t in batch.extras["tag"]]


def group_tags(call, group, size):
    return [(call, group, r) for r in range(size)]


def test_exported_from_extras():
    assert dynamic_sampling.DynamicSampler is DynamicSampler and dynamic_sampling.SampledBatch is SampledBatch


def test_docstring_example_runs():
    assert doctest.testmod(dynamic_sampling).failed == 0


def test_full_first_call_is_returned_as_is():
    script = Script([[[0, 1], [1, 0.5], [0.25, 0]]])
    batch = DynamicSampler(batch_size=6, group_size=2)(script)
    assert script.asked == [3]
    assert (batch.tries, batch.dropped_groups, batch.filled_with_zero_std) == (1, 0, 0)
    assert [float(s) for s in batch.scores] == [0, 1, 1, 0.5, 0.25, 0]
    assert tags_of(batch) == [(0, g, r) for g in range(3) for r in range(2)]
    assert len(batch.queries) == len(batch.responses) == 6


def test_refills_ask_for_the_missing_groups_and_keep_arrival_order():
    plan = [
        [[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 1, 0]],  # 2 of 4 kept
        [[0, 0, 0], [1, 1, 1]],  # none kept
        [[1, 0, 0], [0.5, 0.5, 0.5]],  # the 3rd kept, then a zero-std group
        [[0, 0, 1]],
    ]
    script = Script(plan)
    batch = DynamicSampler(batch_size=12, group_size=3, max_tries=8)(script)
    assert script.asked == [4, 2, 2, 1]
    assert (batch.tries, batch.dropped_groups, batch.filled_with_zero_std) == (4, 5, 0)
    expected = group_tags(0, 1, 3) + group_tags(0, 3, 3) + group_tags(2, 0, 3) + group_tags(3, 0, 3)
    assert tags_of(batch) == expected
    assert [float(s) for s in batch.scores] == [0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1]


def test_surplus_groups_beyond_the_batch_are_cut():
    # Asked for 2 groups, the function returns 5, of which 4 have a signal: the first 2 are kept.
    script = Script([[[0, 1], [1, 1], [1, 0], [0, 0.5], [0.5, 1]]])
    batch = DynamicSampler(batch_size=4, group_size=2)(script)
    assert script.asked == [2] and batch.tries == 1 and batch.dropped_groups == 1
    assert tags_of(batch) == group_tags(0, 0, 2) + group_tags(0, 2, 2)


def test_cap_warns_and_fills_with_the_earliest_dropped_groups():
    plan = [[[1, 1], [0, 1], [0, 0]], [[1, 1], [0, 0]], [[0.5, 0.5], [3, 3]]]
    script = Script(plan)
    with pytest.warns(UserWarning, match=r"max_tries=3 calls.*2 of the 3 groups were still missing.*Raise max_tries"):
        batch = DynamicSampler(batch_size=6, group_size=2, max_tries=3)(script)
    assert script.asked == [3, 2, 2]
    assert (batch.tries, batch.dropped_groups, batch.filled_with_zero_std) == (3, 6, 2)
    # The one group with a signal first, then the first two dropped groups.
    assert tags_of(batch) == group_tags(0, 1, 2) + group_tags(0, 0, 2) + group_tags(0, 2, 2)
    assert [float(s) for s in batch.scores] == [0, 1, 1, 1, 0, 0]


def test_no_warning_when_the_batch_fills_on_the_last_try():
    script = Script([[[1, 1], [1, 1]], [[0, 1], [1, 0]]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = DynamicSampler(batch_size=4, group_size=2, max_tries=2)(script)
    assert batch.filled_with_zero_std == 0 and batch.tries == 2


@pytest.mark.parametrize("seed", range(20))
def test_random_scripts_follow_the_rule(seed):
    """Random scripts (all-equal groups frequent, calls returning 0-2 surplus groups); the result is checked
    against the rule applied to the log of what the script returned."""
    rng = random.Random(seed)
    size, needed, max_tries = rng.choice([2, 3, 4]), rng.randint(1, 5), rng.randint(1, 6)

    class RandomScript(Script):
        def __call__(self, num_groups):
            groups = []
            for _ in range(num_groups + rng.randint(0, 2)):
                p = rng.choice([0.0, 0.2, 0.9, 1.0])
                groups.append([float(rng.random() < p) for _ in range(size)])
            self.plan.append(groups)
            return super().__call__(num_groups)

    script = RandomScript([])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = DynamicSampler(batch_size=size * needed, group_size=size, max_tries=max_tries)(script)

    log = [(c, g, scores) for c, groups in enumerate(script.plan) for g, scores in enumerate(groups)]
    signal = [(c, g) for c, g, scores in log if len(set(scores)) > 1]
    flat = [(c, g) for c, g, scores in log if len(set(scores)) == 1]
    calls = len(script.plan)
    # Each call asks for what the earlier calls left missing; it stops when full or at the cap.
    for c in range(calls):
        assert script.asked[c] == needed - sum(1 for sc, _ in signal if sc < c)
    assert sum(1 for sc, _ in signal if sc < calls - 1) < needed
    assert len(signal) >= needed or calls == max_tries
    short = max(needed - len(signal), 0)
    chosen = (signal[:needed] + flat[:short])
    assert tags_of(batch) == [(c, g, r) for c, g in chosen for r in range(size)]
    assert (batch.tries, batch.dropped_groups, batch.filled_with_zero_std) == (calls, len(flat), short)
    assert len(caught) == (1 if short else 0)
    assert len(batch.queries) == len(batch.responses) == len(batch.scores) == size * needed


def test_extras_stay_aligned_with_their_rows_for_tensor_and_array_values():
    """Scores as one tensor, responses as a 2-D tensor, extras as a list and a numpy array: every output
    row's entries come from one input row."""
    calls = []

    def generate_and_score(num_groups):
        call = len(calls)
        calls.append(num_groups)
        n = 2 * (num_groups + 1)
        ids = torch.arange(n) + 100 * call
        # Rows 0-1 of every call tie (dropped), later pairs differ.
        scores = torch.where(torch.arange(n) < 2, torch.tensor(7.0), (ids % 2).float())
        return {
            "queries": [torch.tensor([int(i)]) for i in ids],
            "responses": torch.stack([ids, -ids], dim=1),
            "scores": scores,
            "text": [f"row{int(i)}" for i in ids],
            "id": ids.numpy(),
        }

    batch = DynamicSampler(batch_size=6, group_size=2)(generate_and_score)
    assert calls == [3] and batch.dropped_groups == 1
    assert set(batch.extras) == {"text", "id"}
    for query, response, score, text, row_id in zip(
        batch.queries, batch.responses, batch.scores, batch.extras["text"], batch.extras["id"]
    ):
        assert int(query) == int(row_id) == int(response[0]) == -int(response[1])
        assert text == f"row{int(row_id)}" and float(score) == int(row_id) % 2
    assert [int(i) for i in batch.extras["id"]] == [2, 3, 4, 5, 6, 7]


def test_metric_filters_on_an_extra_key():
    """With metric="correct", groups whose correctness is equal are dropped even when their scores differ."""

    def generate_and_score(num_groups):
        return {
            "queries": [0, 0, 1, 1, 2, 2],
            "responses": [0, 1, 2, 3, 4, 5],
            "scores": [1.0, 0.9, 0.0, 1.0, 0.2, 0.2],
            "correct": [1, 1, 0, 1, 0, 0],
        }

    batch = DynamicSampler(batch_size=2, group_size=2, metric="correct")(generate_and_score)
    assert batch.responses == [2, 3] and batch.dropped_groups == 2
    assert DynamicSampler(batch_size=2, group_size=2)(generate_and_score).responses == [0, 1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 6, "group_size": 4}, ValueError, r"batch_size must be a multiple of group_size.*batch_size=6"),
        ({"batch_size": 4, "group_size": 1}, ValueError, r"group_size must be an int >= 2.*got 1"),
        ({"batch_size": 0, "group_size": 2}, ValueError, r"batch_size must be an int >= 1, got 0"),
        ({"batch_size": 4.0, "group_size": 2}, ValueError, r"batch_size must be an int >= 1, got 4.0"),
        ({"batch_size": 4, "group_size": True}, ValueError, r"group_size must be an int >= 2.*got True"),
        ({"batch_size": 4, "group_size": 2, "max_tries": 0}, ValueError, r"max_tries must be an int >= 1, got 0"),
        ({"batch_size": 4, "group_size": 2, "metric": "responses"}, ValueError, r"metric must be 'scores'.*'responses'"),
        ({"batch_size": 4, "group_size": 2, "metric": 3}, ValueError, r"metric must be.*got 3"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicSampler(**kwargs)


def test_numpy_integer_sizes_are_accepted():
    sampler = DynamicSampler(batch_size=np.int64(4), group_size=np.int64(2))
    assert (sampler.batch_size, sampler.group_size, sampler.num_groups) == (4, 2, 2)
    assert "batch_size=4" in repr(sampler)


def rows(n, **overrides):
    out = {"queries": list(range(n)), "responses": list(range(n)), "scores": [float(i % 2) for i in range(n)]}
    out.update(overrides)
    return out


@pytest.mark.parametrize(
    ("output", "error", "match"),
    [
        ([1, 2, 3, 4], TypeError, r"must return a dict with keys queries, responses, scores.*returned list"),
        ({"queries": [0] * 4, "scores": [0, 1, 0, 1]}, ValueError, r"call 1 lacks 'responses'"),
        (rows(4, responses=[0, 1, 2]), ValueError, r"one entry per row.*'responses': 3"),
        (rows(4, extra=[0] * 5), ValueError, r"one entry per row.*'extra': 5"),
        (rows(5), ValueError, r"whole number of groups of group_size=2.*returned 5 rows"),
        (rows(2), ValueError, r"num_groups=2.*at least num_groups.*>= 4 rows.*returned 2 rows"),
        (rows(4, scores=torch.tensor(1.0)), TypeError, r"'scores' as Tensor of shape \(\)"),
        (rows(4, responses="abcd"), TypeError, r"'responses' as str"),
        (rows(4, scores=[0.0, "x", 1.0, 0.0]), TypeError, r"one number per row.*row 1 as str"),
        (rows(4, scores=[0.0, torch.ones(2), 1.0, 0.0]), ValueError, r"row 1 with 2 elements"),
        (rows(4, scores=[0.0, float("nan"), 1.0, 0.0]), ValueError, r"must be finite.*row 1 = nan"),
    ],
    ids=[
        "not_a_dict", "missing_key", "short_responses", "long_extra", "partial_group", "too_few_groups",
        "0d_tensor", "string_column", "string_score", "vector_score", "nan_score",
    ],
)
def test_bad_returns_of_generate_and_score(output, error, match):
    with pytest.raises(error, match=match):
        DynamicSampler(batch_size=4, group_size=2)(lambda num_groups: output)


def test_keys_must_not_change_between_calls_and_the_metric_must_be_returned():
    outputs = iter([rows(4, scores=[1.0] * 4), rows(4, extra=[0] * 4)])
    with pytest.raises(ValueError, match=r"same keys on every call; call 1 returned .* call 2 returned .*'extra'"):
        DynamicSampler(batch_size=4, group_size=2)(lambda num_groups: next(outputs))
    with pytest.raises(ValueError, match=r"keys queries, responses, scores, correct; call 1 lacks 'correct'"):
        DynamicSampler(batch_size=4, group_size=2, metric="correct")(lambda num_groups: rows(4))
    with pytest.raises(TypeError, match=r"generate_and_score must be a callable.*got list"):
        DynamicSampler(batch_size=4, group_size=2)([rows(4)])
