"""A tiny reward model and preference pairs with a planted preference, for the reward-model tests
and the multi-process scripts. Nothing here touches the network."""

import random

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from tiny_models import VOCAB_SIZE

NEUTRAL = "the a this that movie film story plot actor scene music ending was is and i we they it".split()
POSITIVE = "good great wonderful fine funny loved liked enjoyed".split()
NEGATIVE = "bad awful boring dull sad hated never too".split()


def make_reward_model(seed: int = 0, n_embd: int = 32, dropout: float = 0.0) -> GPT2ForSequenceClassification:
    """A randomly initialised 2-layer GPT-2 with a one-output score head over the tiny tokenizer's vocabulary."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=64, n_embd=n_embd, n_layer=2, n_head=2, num_labels=1,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return GPT2ForSequenceClassification(config)


def planted_pairs(n: int, seed: int) -> list[dict]:
    """Pairs whose chosen answer holds a positive word and rejected one a negative word, in random
    neutral context of random length: the preference a reward model must find."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(1, 5))) + " "

        def answer(words):
            before = [rng.choice(NEUTRAL) for _ in range(rng.randint(0, 3))]
            after = [rng.choice(NEUTRAL) for _ in range(rng.randint(0, 3))]
            return " ".join(before + [rng.choice(words)] + after)

        rows.append({"prompt": prompt, "chosen": answer(POSITIVE), "rejected": answer(NEGATIVE)})
    return rows
