"""Writes `movie_reviews.jsonl`: short labelled movie-review sentences for the offline sentiment demo.

The sentences come from templates and word lists written for this project, sampled with a fixed
seed, so the file is reproducible: `python examples/data/make_movie_reviews.py`. Each line is
`{"text": ..., "label": 0 or 1}` (0 negative, 1 positive). Most reviews open neutrally ("i watched the
sequel last night and ...") and reveal their sentiment later, so that a short prompt cut from the
start of a review leaves the sentiment to the continuation, as with the classic IMDB prompts.
"""

import argparse
import json
import random
from pathlib import Path

FILMS = [
    "this movie", "this film", "the new thriller", "the sequel", "this comedy", "the documentary",
    "this drama", "the remake", "the animated film", "this horror movie", "the musical", "the western",
    "this war film", "the detective story", "the romance", "this science fiction film", "the biopic",
    "the mystery", "this family film", "the adaptation", "the spy movie", "this period piece",
]
WHEN = [
    "last night", "on sunday", "at the cinema", "on a rainy afternoon", "at a festival", "on television",
    "yesterday", "last week", "on a long flight", "this weekend", "with my family", "after work",
]
PEOPLE = ["friends", "sister", "brother", "parents", "partner", "kids", "roommate", "grandmother", "colleagues"]
ASPECTS = [
    "acting", "plot", "story", "script", "music", "soundtrack", "dialogue", "cast", "ending", "camera work",
    "direction", "pacing", "lead actress", "lead actor", "villain", "special effects", "editing", "humor",
    "costumes", "score", "first act", "final scene", "writing", "photography",
]
GENRES = ["thrillers", "comedies", "dramas", "westerns", "musicals", "mysteries", "cartoons", "war films"]
NOUNS = ["movie", "film", "story", "ride", "experience", "evening", "debut", "picture"]

WORDS = {
    "adj": {
        1: ["great", "wonderful", "brilliant", "beautiful", "charming", "moving", "delightful", "excellent",
            "superb", "clever", "gripping", "lovely", "touching", "fantastic", "memorable", "stunning",
            "warm", "funny", "fresh", "powerful", "smart", "thrilling", "perfect", "enjoyable"],
        0: ["awful", "boring", "dull", "terrible", "bland", "clumsy", "tedious", "weak", "messy", "painful",
            "predictable", "silly", "lifeless", "forgettable", "dreadful", "flat", "poor", "lazy",
            "confusing", "annoying", "horrible", "stupid", "pointless", "bad"],
    },
    "adv": {
        1: ["really", "truly", "very", "quite", "simply", "absolutely", "so", "incredibly", "wonderfully"],
        0: ["really", "truly", "very", "quite", "simply", "absolutely", "so", "incredibly", "painfully"],
    },
    "vp": {
        1: ["kept me on the edge of my seat", "made me laugh out loud", "stayed with me for days",
            "brought tears to my eyes", "was worth every penny", "held my attention from start to finish",
            "made the whole audience cheer", "left me smiling", "won me over completely",
            "felt fresh and alive", "surprised me in the best way", "deserves every award"],
        0: ["put me to sleep", "made me check my watch", "felt like a waste of time", "dragged on forever",
            "made no sense at all", "was a waste of money", "made me want to leave early",
            "left me cold", "fell apart completely", "felt cheap and rushed", "annoyed me the whole time",
            "ruined the whole evening"],
    },
    "verb": {
        1: ["loved", "enjoyed", "adored", "liked", "admired", "appreciated"],
        0: ["hated", "disliked", "regretted", "endured", "could not stand", "did not enjoy"],
    },
    "verdict": {
        1: ["i would recommend it to anyone", "i would happily watch it again", "do not miss it",
            "it is a must see", "i will buy it on the day it comes out", "go and see it",
            "it was time well spent", "i want to see it again soon"],
        0: ["i would not recommend it to anyone", "i will never watch it again", "save your money",
            "skip this one", "avoid it at all costs", "i want those two hours back",
            "it was a complete waste of time", "stay at home instead"],
    },
    "superlative": {
        1: ["best", "finest", "most enjoyable", "most moving", "funniest"],
        0: ["worst", "weakest", "most boring", "most annoying", "dullest"],
    },
    "end": {1: [".", ".", "!"], 0: [".", ".", "!"]},
}

TEMPLATES = [
    "i watched {film} {when} and it was {adv} {adj} {end}",
    "i watched {film} {when} and the {aspect} was {adj} {end}",
    "we saw {film} {when} , and the {aspect} {vp} {end}",
    "my {people} took me to see {film} {when} and i {verb} it {end}",
    "i went to {film} with my {people} {when} , {verdict} {end}",
    "after reading the book i finally watched {film} and the {aspect} was {adv} {adj} {end}",
    "the {aspect} was {adv} {adj} and the {aspect2} {vp} {end}",
    "what a {adj} {noun} {end}",
    "{film} is one of the {superlative} films i have seen {end}",
    "i {verb} the {aspect} of {film} , {verdict} {end}",
    "honestly , the {aspect} {vp} {end}",
    "from the first scene the {aspect} {vp} {end}",
    "{film} has a {adj} {aspect} and a {adj2} {aspect2} {end}",
    "if you like {genre} , {film} is {adv} {adj} {end}",
    "i had heard a lot about {film} and it was {adv} {adj} {end}",
    "the first hour of {film} {vp} , {verdict} {end}",
    "my {people} and i thought the {aspect} was {adj} {end}",
    "overall {film} was {adj} , {verdict} {end}",
    "i expected a lot from {film} and the {aspect} {vp} {end}",
    "there is nothing more to say , {film} is {adv} {adj} {end}",
    "the director made a {adj} {noun} and the {aspect} {vp} {end}",
    "i saw {film} {when} with low hopes and i {verb} it {end}",
]


def fill(template: str, label: int, rng: random.Random) -> str:
    """One review from `template` with every slot drawn for sentiment `label` (0 negative, 1 positive)."""
    aspect, aspect2 = rng.sample(ASPECTS, 2)
    adj, adj2 = rng.sample(WORDS["adj"][label], 2)
    slots = {
        "film": rng.choice(FILMS), "when": rng.choice(WHEN), "people": rng.choice(PEOPLE),
        "genre": rng.choice(GENRES), "noun": rng.choice(NOUNS), "aspect": aspect, "aspect2": aspect2,
        "adj": adj, "adj2": adj2,
    }
    slots.update({key: rng.choice(WORDS[key][label]) for key in ("adv", "vp", "verb", "verdict", "superlative", "end")})
    return template.format(**slots)


def make_reviews(per_label: int = 320, seed: int = 0) -> list[dict]:
    """`per_label` distinct reviews of each sentiment, shuffled; each `{"text": str, "label": int}`."""
    rng = random.Random(seed)
    reviews = []
    for label in (0, 1):
        texts = set()
        while len(texts) < per_label:
            texts.add(fill(rng.choice(TEMPLATES), label, rng))
        reviews += [{"text": text, "label": label} for text in sorted(texts)]
    rng.shuffle(reviews)
    return reviews


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    path = Path(__file__).with_name("movie_reviews.jsonl")
    with path.open("w") as f:
        for review in make_reviews():
            f.write(json.dumps(review) + "\n")
    print(f"wrote {path}")
