"""The offline pieces of the sentiment demo: corpus, tokenizer, SFT policy and reward classifier.

Everything is built on the CPU in seconds from `examples/data/movie_reviews.jsonl` (short labelled
reviews written for this project), so the demo runs without the model hub:
1. a word-level tokenizer trained on the corpus with the `tokenizers` library;
2. the SFT stage: a tiny GPT-2 trained as a language model on the reviews;
3. the reward-model stage: a tiny DistilBERT classifier trained on the labels, used through a
   transformers `pipeline("sentiment-analysis")` exactly as the hub classifier of the classic demo.
`ppo_sentiment.py` and the walkthrough notebook import these functions.
"""

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    DistilBertConfig,
    DistilBertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

REVIEWS_PATH = Path(__file__).resolve().parents[1] / "data" / "movie_reviews.jsonl"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<cls>"]
LABELS = {0: "NEGATIVE", 1: "POSITIVE"}
MAX_LENGTH = 128


def load_reviews(path: str | Path = REVIEWS_PATH) -> list[dict]:
    """The labelled reviews of a JSON-lines file: `[{"text": str, "label": 0 or 1}, ...]`."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A lower-cased word-level tokenizer over every word and punctuation mark of `texts`.

    Special tokens: `<pad>` (id 0), `<eos>` (1), `<unk>` (2), `<cls>` (3). Nothing is added to encoded
    text: the language model gets `<eos>` appended by hand, the classifier uses `classifier_tokenizer`.
    """
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        cls_token="<cls>",
        model_max_length=MAX_LENGTH,
    )


def classifier_tokenizer(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The same vocabulary with `<cls>` put in front of every text, where DistilBERT pools."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    cls_id = tokenizer.cls_token_id
    backend.post_processor = processors.TemplateProcessing(single="<cls> $A", special_tokens=[("<cls>", cls_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        cls_token="<cls>",
        model_max_length=MAX_LENGTH,
    )


def _batches(n_rows: int, batch_size: int, steps: int, seed: int):
    """Yields `steps` lists of row indices, each `batch_size` rows drawn in shuffled passes over the data."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            pass_order = list(range(n_rows))
            rng.shuffle(pass_order)
            order += pass_order
        yield order[:batch_size]
        order = order[batch_size:]


def train_sft_model(
    texts: list[str], tokenizer: PreTrainedTokenizerFast, steps: int = 300, batch_size: int = 32, seed: int = 0
) -> GPT2LMHeadModel:
    """The SFT stage: a 2-layer GPT-2 trained to predict the reviews word by word, each ending in `<eos>`.

    Dropout is off so that the PPO ratio starts at exactly 1 in the first epoch.
    """
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=MAX_LENGTH,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    encoded = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for rows in _batches(len(encoded), batch_size, steps, seed):
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, return_tensors="pt")
        # Padding positions predict nothing: label -100 is ignored by the loss.
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


def train_reward_model(
    reviews: list[dict], tokenizer: PreTrainedTokenizerFast, steps: int = 200, batch_size: int = 32, seed: int = 0
) -> DistilBertForSequenceClassification:
    """The reward-model stage: a 2-layer DistilBERT trained to tell positive (label 1) from negative reviews.

    `tokenizer` must be the one from `classifier_tokenizer` (it puts `<cls>` first, where DistilBERT pools).
    """
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_LENGTH,
        dim=64,
        hidden_dim=128,
        n_layers=2,
        n_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        id2label=LABELS,
        label2id={name: i for i, name in LABELS.items()},
    )
    model = DistilBertForSequenceClassification(config)
    encoded = tokenizer([r["text"] for r in reviews])["input_ids"]
    labels = torch.tensor([r["label"] for r in reviews])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for rows in _batches(len(encoded), batch_size, steps, seed):
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, return_tensors="pt")
        loss = model(**batch, labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model
