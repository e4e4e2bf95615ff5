"""Splitting rows into forward/backward passes by a token budget (docs/algorithm.md section 18).

Pure host-side code on lists of ints: :func:`split_by_tokens` packs rows of given token costs into as
few passes as fit a budget (first-fit-decreasing finds how many), spreads them over that many passes
as evenly as it can (longest-first onto the lightest pass, then moves and swaps off the heaviest),
and can be asked for more passes than it needs, so that every process of a run makes the same number
of passes (their collectives must line up).
"""

from __future__ import annotations

import math


def split_by_tokens(costs: list[int], budget: int, min_passes: int = 1) -> list[list[int]]:
    """The passes of items with token ``costs`` under ``budget``: lists of positions into ``costs``.

    Every position is in exactly one pass; a pass of several items costs at most ``budget``; an item
    costlier than ``budget`` is alone in its pass. The number of passes is first-fit-decreasing's (or
    fewer, when the balanced split fits in fewer), raised to ``min(min_passes, len(costs))``. Among
    splits with that number of passes, the heuristic looks for one whose heaviest pass is as light as
    it can find. Passes come heaviest first (a caching allocator then reuses the first pass's blocks
    for the later, smaller ones), the positions of a pass in increasing order.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int, got {budget!r}.")
    if not costs:
        return []
    oversized = [i for i, c in enumerate(costs) if c > budget]
    fitting = [i for i, c in enumerate(costs) if c <= budget]
    wanted = max(min(min_passes, len(costs)) - len(oversized), 0)
    bins = _balanced_bins(fitting, costs, budget, wanted)
    passes = [[i] for i in oversized] + [sorted(b) for b in bins]
    return sorted(passes, key=lambda p: (-sum(costs[i] for i in p), p[0]))


def first_fit_decreasing(items: list[int], costs: list[int], budget: int) -> list[list[int]]:
    """Bins of ``items`` (positions into ``costs``, each at most ``budget``) by first-fit-decreasing."""
    bins, loads = [], []
    for i in sorted(items, key=lambda i: -costs[i]):
        slot = next((b for b, load in enumerate(loads) if load + costs[i] <= budget), None)
        if slot is None:
            bins.append([i])
            loads.append(costs[i])
        else:
            bins[slot].append(i)
            loads[slot] += costs[i]
    return bins


def _balanced_bins(items: list[int], costs: list[int], budget: int, wanted: int) -> list[list[int]]:
    """``items`` (each at most ``budget``) in the fewest bins that fit the budget, at least ``wanted`` of them
    (at most one per item), balanced."""
    if not items:
        return []
    ffd = first_fit_decreasing(items, costs, budget)
    lower = max(math.ceil(sum(costs[i] for i in items) / budget), 1)
    for k in range(lower, len(ffd)):
        bins = _improve(_longest_first(items, costs, k), costs, budget)
        if _max_load(bins, costs) <= budget:
            return _more_bins(bins, costs, budget, wanted)
    # First-fit-decreasing's count: the longest-first split when it fits, else first-fit-decreasing's own.
    candidates = [_improve(_longest_first(items, costs, len(ffd)), costs, budget), _improve(ffd, costs, budget)]
    fitting = [bins for bins in candidates if _max_load(bins, costs) <= budget]
    return _more_bins(min(fitting, key=lambda bins: _max_load(bins, costs)), costs, budget, wanted)


def _more_bins(bins: list[list[int]], costs: list[int], budget: int, wanted: int) -> list[list[int]]:
    """``bins`` split further, the heaviest splittable bin in two each time, until there are ``wanted``."""
    bins = [list(b) for b in bins]
    while len(bins) < wanted:
        splittable = [b for b in bins if len(b) > 1]
        heaviest = max(splittable, key=lambda b: sum(costs[i] for i in b))
        bins.remove(heaviest)
        bins.extend(_longest_first(heaviest, costs, 2))
        bins = _improve(bins, costs, budget)
    return bins


def _longest_first(items: list[int], costs: list[int], k: int) -> list[list[int]]:
    """``items`` in ``k`` bins, each item (costliest first) onto the lightest bin; no bin left empty."""
    bins, loads = [[] for _ in range(k)], [0] * k
    for i in sorted(items, key=lambda i: -costs[i]):
        # Ties go to an empty bin first: with k <= len(items) every bin gets an item.
        b = min(range(k), key=lambda b: (loads[b], len(bins[b])))
        bins[b].append(i)
        loads[b] += costs[i]
    return bins


def _improve(bins: list[list[int]], costs: list[int], budget: int) -> list[list[int]]:
    """Moves and swaps of items off the heaviest bin while they lower it without pushing another bin past
    ``budget`` or above the heaviest's old load, and leave no bin empty. Each accepted change lowers the
    sorted load vector, so the loop ends."""
    bins = [list(b) for b in bins]
    while True:
        loads = [sum(costs[i] for i in b) for b in bins]
        h = max(range(len(bins)), key=lambda b: loads[b])
        change = _best_change(bins, loads, h, costs, budget)
        if change is None:
            return bins
        o, x, y = change
        bins[h].remove(x)
        bins[o].append(x)
        if y is not None:
            bins[o].remove(y)
            bins[h].append(y)


def _best_change(bins, loads, h, costs, budget):
    """The move ``(o, x, None)`` or swap ``(o, x, y)`` between the heaviest bin ``h`` and a bin ``o`` that
    makes the larger of the two new loads smallest, if it is below ``loads[h]``; else None."""
    best, best_peak = None, loads[h]
    for o in range(len(bins)):
        if o == h:
            continue
        for x in bins[h]:
            options = [None] + bins[o] if len(bins[h]) > 1 else bins[o]
            for y in options:
                delta = costs[x] - (0 if y is None else costs[y])
                new_h, new_o = loads[h] - delta, loads[o] + delta
                peak = max(new_h, new_o)
                if delta > 0 and new_o <= budget and peak < best_peak:
                    best, best_peak = (o, x, y), peak
    return best


def _max_load(bins: list[list[int]], costs: list[int]) -> int:
    return max(sum(costs[i] for i in b) for b in bins)
