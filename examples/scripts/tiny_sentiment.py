"""The offline pieces of the sentiment demo: corpus, tokenizer, SFT policy and reward classifier.

Everything is built on the CPU in seconds from `examples/data/movie_reviews.jsonl` (short labelled
reviews written for this project), so the demo runs without the model hub:
1. a word-level tokenizer trained on the corpus with the `tokenizers` library;
2. the SFT stage: a tiny GPT-2 trained as a language model on the reviews;
3. the reward-model stage: a tiny DistilBERT classifier trained on the labels, used through a
   transformers `pipeline("sentiment-analysis")` exactly as the hub classifier of the classic demo.
`ppo_sentiment.py` and the walkthrough notebook import these functions.
"""

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
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


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists padded on the right: `input_ids` and `attention_mask`, both `(len(rows), longest)`."""
    input_ids = pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=pad_id)
    lengths = torch.tensor([len(r) for r in rows])
    attention_mask = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
    return input_ids, attention_mask


def lm_loss(model: GPT2LMHeadModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the real tokens of right-padded `(B, S)` rows."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, S, V)
    # Position t predicts token t+1; padding positions predict nothing (label -100 is ignored).
    labels = input_ids.masked_fill(attention_mask == 0, -100)[:, 1:]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


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
    texts: list[str],
    tokenizer: PreTrainedTokenizerFast,
    steps: int = 300,
    batch_size: int = 32,
    seed: int = 0,
    n_head: int = 4,
) -> GPT2LMHeadModel:
    """The SFT stage: a 2-layer GPT-2 trained to predict the reviews word by word, each ending in `<eos>`.

    Dropout is off so that the PPO ratio starts at exactly 1 in the first epoch. ``n_head=2`` gives
    heads of size 32, the smallest vLLM's CPU attention runs (the runs with ``--use_vllm``).
    """
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=MAX_LENGTH,
        n_embd=64,
        n_layer=2,
        n_head=n_head,
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
        loss = lm_loss(model, *pad_right([encoded[i] for i in rows], tokenizer.pad_token_id))
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
        input_ids, attention_mask = pad_right([encoded[i] for i in rows], tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


@torch.no_grad()
def heldout_perplexity(model: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> float:
    """Per-token perplexity of `model` on `texts` (each ending in `<eos>`)."""
    encoded = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    return float(torch.exp(lm_loss(model, *pad_right(encoded, tokenizer.pad_token_id))))


@torch.no_grad()
def heldout_accuracy(model, tokenizer: PreTrainedTokenizerFast, reviews: list[dict]) -> float:
    """Fraction of `reviews` whose label the classifier predicts."""
    input_ids, attention_mask = pad_right(tokenizer([r["text"] for r in reviews])["input_ids"], tokenizer.pad_token_id)
    predictions = model(input_ids=input_ids, attention_mask=attention_mask).logits.argmax(-1)
    return float((predictions == torch.tensor([r["label"] for r in reviews])).float().mean())


@dataclass
class OfflineModels:
    """What the SFT and reward-model stages hand to PPO, with held-out quality figures."""

    policy: GPT2LMHeadModel
    tokenizer: PreTrainedTokenizerFast
    reward_model: DistilBertForSequenceClassification
    reward_tokenizer: PreTrainedTokenizerFast
    report: dict


def build_offline_models(
    cache_dir: str | Path | None = None,
    sft_steps: int = 300,
    reward_model_steps: int = 200,
    seed: int = 0,
    write_cache: bool = True,
    n_head: int = 4,
) -> OfflineModels:
    """Train the tokenizer, SFT policy and reward classifier, or load them from `cache_dir`.

    A cache is used only when it was written with the same corpus, steps and seed. One review in ten
    is held out of both trainings to measure the SFT perplexity and the classifier's accuracy.
    `write_cache=False` (non-main processes) trains the same models without writing anything.
    """
    settings = {
        "corpus_sha256": hashlib.sha256(REVIEWS_PATH.read_bytes()).hexdigest(),
        "sft_steps": sft_steps,
        "reward_model_steps": reward_model_steps,
        "seed": seed,
        "n_head": n_head,
    }
    cache = Path(cache_dir) if cache_dir is not None else None
    # stages.json is written last, so a cache without it (an interrupted write) is never read.
    if cache is not None and (cache / "stages.json").exists():
        saved = json.loads((cache / "stages.json").read_text())
        if saved["settings"] == settings:
            return OfflineModels(
                policy=GPT2LMHeadModel.from_pretrained(cache / "sft_model"),
                tokenizer=AutoTokenizer.from_pretrained(cache / "sft_model"),
                reward_model=DistilBertForSequenceClassification.from_pretrained(cache / "reward_model"),
                reward_tokenizer=AutoTokenizer.from_pretrained(cache / "reward_model"),
                report={**saved["report"], "cached": True},
            )

    reviews = load_reviews()
    train, heldout = [r for i, r in enumerate(reviews) if i % 10], reviews[::10]
    tokenizer = train_tokenizer([r["text"] for r in reviews])
    reward_tokenizer = classifier_tokenizer(tokenizer)
    start = time.perf_counter()
    policy = train_sft_model([r["text"] for r in train], tokenizer, steps=sft_steps, seed=seed, n_head=n_head)
    sft_seconds = time.perf_counter() - start
    start = time.perf_counter()
    reward_model = train_reward_model(train, reward_tokenizer, steps=reward_model_steps, seed=seed)
    report = {
        "sft_seconds": sft_seconds,
        "sft_heldout_perplexity": heldout_perplexity(policy, tokenizer, [r["text"] for r in heldout]),
        "reward_model_seconds": time.perf_counter() - start,
        "reward_model_heldout_accuracy": heldout_accuracy(reward_model, reward_tokenizer, heldout),
    }
    if cache is not None and write_cache:
        policy.save_pretrained(cache / "sft_model")
        tokenizer.save_pretrained(cache / "sft_model")
        reward_model.save_pretrained(cache / "reward_model")
        reward_tokenizer.save_pretrained(cache / "reward_model")
        (cache / "stages.json").write_text(json.dumps({"settings": settings, "report": report}, indent=2))
    return OfflineModels(policy, tokenizer, reward_model, reward_tokenizer, {**report, "cached": False})
