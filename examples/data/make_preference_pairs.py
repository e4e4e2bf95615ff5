"""Writes `preference_pairs.jsonl`: preference pairs for the offline reward-model and RLHF examples.

Each pair is one opening of a movie review continued twice: the same review template of
`make_movie_reviews.py` filled twice from the same random draws, once with positive and once with
negative sentiment words, so the two reviews agree word for word except where the sentiment
shows. The prompt is a random prefix (2 words or more) of the part they share; `chosen` continues it
positively, `rejected` negatively. Lines: `{"prompt": "i watched the sequel ", "chosen": "last night
and it was great .", "rejected": "last night and it was dull ."}` (the prompt ends with the space that
joins it to either answer). Reproducible: `python examples/data/make_preference_pairs.py`.
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_movie_reviews import TEMPLATES, fill  # noqa: E402

MIN_PROMPT_WORDS = 2


def twin_reviews(template: str, rng: random.Random) -> tuple[str, str]:
    """A positive and a negative review from `template`, drawn with the same random numbers.

    The word lists of the two sentiments have equal lengths, so both fills make the same draws and
    differ only in the sentiment words.
    """
    state = rng.getstate()
    positive = fill(template, 1, rng)
    rng.setstate(state)
    negative = fill(template, 0, rng)
    return positive, negative


def make_pair(template: str, rng: random.Random) -> dict | None:
    """A pair cut from twin reviews, or None when they share fewer than `MIN_PROMPT_WORDS` opening words."""
    positive, negative = twin_reviews(template, rng)
    pos_words, neg_words = positive.split(), negative.split()
    shared = 0
    while shared < min(len(pos_words), len(neg_words)) and pos_words[shared] == neg_words[shared]:
        shared += 1
    if shared < MIN_PROMPT_WORDS:
        return None
    cut = rng.randint(MIN_PROMPT_WORDS, shared)
    return {
        "prompt": " ".join(pos_words[:cut]) + " ",
        "chosen": " ".join(pos_words[cut:]),
        "rejected": " ".join(neg_words[cut:]),
    }


def make_pairs(count: int = 800, seed: int = 0) -> list[dict]:
    """`count` distinct pairs in a shuffled order."""
    rng = random.Random(seed)
    pairs, seen = [], set()
    while len(pairs) < count:
        pair = make_pair(rng.choice(TEMPLATES), rng)
        if pair is not None and (key := tuple(pair.values())) not in seen:
            seen.add(key)
            pairs.append(pair)
    rng.shuffle(pairs)
    return pairs


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    path = Path(__file__).with_name("preference_pairs.jsonl")
    with path.open("w") as f:
        for pair in make_pairs():
            f.write(json.dumps(pair) + "\n")
    print(f"wrote {path}")
