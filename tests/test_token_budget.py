"""The split of rows into passes by a token budget (trl_lite/trainer/memory/token_budget.py), against brute force."""

import random

import pytest

from trl_lite.trainer.memory.token_budget import first_fit_decreasing, split_by_tokens


def _partitions(items):
    """Every partition of ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1 :]
        yield [[first]] + partition


def _brute_force(costs, budget):
    """Per number of passes, the lightest heaviest pass over every partition that fits the budget."""
    best = {}
    for partition in _partitions(list(range(len(costs)))):
        if any(len(b) > 1 and sum(costs[i] for i in b) > budget for b in partition):
            continue
        peak = max(sum(costs[i] for i in b) for b in partition)
        best[len(partition)] = min(best.get(len(partition), peak), peak)
    return best


def _loads(passes, costs):
    return [sum(costs[i] for i in p) for p in passes]


def _check_valid(passes, costs, budget):
    assert sorted(i for p in passes for i in p) == list(range(len(costs)))
    assert all(len(p) == 1 or load <= budget for p, load in zip(passes, _loads(passes, costs)))
    assert _loads(passes, costs) == sorted(_loads(passes, costs), reverse=True)  # heaviest first
    assert all(p == sorted(p) for p in passes)


def test_split_matches_brute_force_on_small_cases():
    """400 random cases of up to 8 rows: every row once, passes within the budget, exactly the fewest passes
    any split can have (raised to min_passes), and a heaviest pass within 10% of the lightest possible at that
    count (equal to it in all but a few cases)."""
    rng = random.Random(0)
    off_balance = 0
    for _ in range(400):
        costs = [rng.randint(1, 20) for _ in range(rng.randint(1, 8))]
        budget, min_passes = rng.randint(5, 40), rng.randint(1, 4)
        passes = split_by_tokens(costs, budget, min_passes)
        _check_valid(passes, costs, budget)
        best = _brute_force(costs, budget)
        fewest = min(k for k in best if k >= min(min_passes, len(costs)))
        assert len(passes) == fewest, (costs, budget, min_passes, passes)
        peak = max(_loads(passes, costs))
        assert peak <= 1.1 * best[fewest], (costs, budget, passes)
        off_balance += peak > best[fewest]
    assert off_balance <= 8


def test_split_is_never_worse_than_first_fit_decreasing_and_balances_it():
    """On rows of 256..8192 tokens: no more passes than first-fit-decreasing, and a heaviest pass lighter than its
    (first-fit fills the first passes and leaves a light last one)."""
    rng = random.Random(1)
    for _ in range(20):
        costs = [rng.randint(256, 8192) for _ in range(rng.randint(8, 64))]
        ffd = first_fit_decreasing(list(range(len(costs))), costs, 16384)
        passes = split_by_tokens(costs, 16384)
        _check_valid(passes, costs, 16384)
        assert len(passes) <= len(ffd)
        loads = _loads(passes, costs)
        assert max(loads) - min(loads) <= max(_loads(ffd, costs)) - min(_loads(ffd, costs))


def test_rows_over_the_budget_get_passes_of_their_own():
    costs = [50, 3, 4, 120, 2]
    passes = split_by_tokens(costs, 10)
    assert passes == [[3], [0], [1, 2, 4]]


def test_min_passes_raises_the_count_up_to_one_row_per_pass():
    costs = [3, 3, 3, 3]
    assert len(split_by_tokens(costs, 100)) == 1
    assert sorted(_loads(split_by_tokens(costs, 100, min_passes=2), costs)) == [6, 6]
    assert len(split_by_tokens(costs, 100, min_passes=3)) == 3
    assert split_by_tokens(costs, 100, min_passes=9) == [[0], [1], [2], [3]]
    assert split_by_tokens([], 100) == []


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, None])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget must be a positive int"):
        split_by_tokens([1, 2], budget)
