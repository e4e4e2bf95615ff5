"""Preference pairs for ``RewardTrainer``: checking and tokenizing a dataset, and the collator that
pads the chosen and rejected sequences of a batch to one width, for one forward pass."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase
from transformers.data.data_collator import pad_without_fast_tokenizer_warning

TEXT_COLUMNS = ("chosen", "rejected")
TOKEN_COLUMNS = ("input_ids_chosen", "input_ids_rejected")
# What the trainer reads from a prepared dataset.
PREPARED_COLUMNS = (*TOKEN_COLUMNS, "margin")

if TYPE_CHECKING:
    from datasets import Dataset


def _dataset_class():
    """``datasets.Dataset``, imported here: only the reward trainer needs the package, so ``import trl_lite``
    and PPO training work where it is not installed (the GPU machine's own Python has no ``datasets``)."""
    try:
        from datasets import Dataset
    except ImportError as error:
        raise ImportError(
            "RewardTrainer's data preparation needs the 'datasets' package, which is not installed: "
            "pip install datasets."
        ) from error
    return Dataset


def as_dataset(data, name: str) -> Dataset:
    """``data`` as a ``datasets.Dataset``: a Dataset is returned as is, a list of dicts converted."""
    Dataset = _dataset_class()
    if isinstance(data, Dataset):
        return data
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        if not data:
            raise ValueError(f"{name} is an empty list; give at least one preference pair.")
        for column in {key for row in data for key in row}:
            kinds = {type(row[column]).__name__ for row in data if row.get(column) is not None}
            if len(kinds) > 1:
                raise TypeError(f"{name}: column {column!r} holds values of different types {sorted(kinds)}.")
        return Dataset.from_list(data)
    raise TypeError(
        f"{name} must be a datasets.Dataset or a list of dicts with 'chosen'/'rejected' texts "
        f"(or 'input_ids_chosen'/'input_ids_rejected'), got {type(data).__name__}."
    )


@dataclass
class PreparedPairs:
    """A tokenized preference dataset and what preparing it did.

    ``dataset`` has ``input_ids_chosen``, ``input_ids_rejected`` (lists of ints) and ``margin``
    when the input had it; ``report`` counts the pairs read, kept, dropped or cut.
    """

    dataset: Dataset
    report: dict


def prepare_pairs(
    data,
    tokenizer: PreTrainedTokenizerBase | None,
    max_length: int | None,
    truncation_mode: str,
    pad_token_id: int | None,
    vocab_size: int,
    name: str = "train_dataset",
    num_proc: int | None = None,
) -> PreparedPairs:
    """Check and tokenize preference pairs.

    Accepted columns: ``chosen``/``rejected`` texts, with an optional shared ``prompt`` put in front of
    both as it is (DeepSpeed-Chat's ``prompt + chosen``: include any separating space in the data);
    or token ids ``input_ids_chosen``/``input_ids_rejected``. Optional ``margin`` (a finite number per pair).

    Errors (``ValueError``/``TypeError``, naming the row): a missing column, a text that is not a string
    or gives no tokens, a token id outside ``[0, vocab_size)``, a sequence that ends with the padding
    token (a classifier that pools at the last non-padding token would read an earlier token), a
    non-finite margin. Skipped with a warning and counted: pairs whose two sides are identical (they
    say nothing about a preference) and, with ``truncation_mode="drop"``, pairs with a side longer
    than ``max_length``; ``"keep_end"`` cuts such sides from the start instead, ``"error"`` raises.
    """
    dataset = as_dataset(data, name)
    columns = set(dataset.column_names)
    tokenized = set(TOKEN_COLUMNS) <= columns
    if not tokenized and not set(TEXT_COLUMNS) <= columns:
        raise ValueError(
            f"{name} has columns {sorted(columns)}; it needs 'chosen' and 'rejected' (texts, optionally with "
            "'prompt') or 'input_ids_chosen' and 'input_ids_rejected' (token ids), optionally 'margin'."
        )
    if not tokenized and tokenizer is None:
        raise ValueError(f"{name} holds texts ('chosen'/'rejected'): pass tokenizer= to tokenize them.")
    if len(dataset) == 0:
        raise ValueError(f"{name} has no rows; give at least one preference pair.")
    has_margin = "margin" in columns

    def process(batch: dict, indices: list[int]) -> dict:
        if tokenized:
            sides = [_token_ids(batch[c], c, indices, name) for c in TOKEN_COLUMNS]
        else:
            # A row without a prompt (None where other rows have one) has its whole dialogue in chosen/rejected.
            prompts = [p if p is not None else "" for p in batch.get("prompt", [None] * len(indices))]
            _check_texts(prompts, "prompt", indices, name, allow_empty=True)
            sides = []
            for column in TEXT_COLUMNS:
                _check_texts(batch[column], column, indices, name, allow_empty=False)
                texts = [p + t for p, t in zip(prompts, batch[column])]
                sides.append(tokenizer(texts, add_special_tokens=True)["input_ids"])
        out = {"input_ids_chosen": [], "input_ids_rejected": [], "_status": []}
        for i, index in enumerate(indices):
            pair = [sides[0][i], sides[1][i]]
            for column, ids in zip(TOKEN_COLUMNS, pair):
                _check_ids(ids, column, index, name, pad_token_id, vocab_size)
            status = "kept"
            if max_length is not None and max(len(ids) for ids in pair) > max_length:
                if truncation_mode == "error":
                    raise ValueError(
                        f"{name} row {index}: chosen has {len(pair[0])} tokens and rejected {len(pair[1])}, more "
                        f"than max_length={max_length}; raise max_length or set truncation_mode='drop' or 'keep_end'."
                    )
                status = "dropped_too_long" if truncation_mode == "drop" else "truncated"
                pair = [ids[-max_length:] for ids in pair]
            # Checked after any cut: two answers that differ only in a cut-off start are identical to the model.
            if pair[0] == pair[1] and status != "dropped_too_long":
                status = "dropped_identical"
            out["input_ids_chosen"].append(pair[0])
            out["input_ids_rejected"].append(pair[1])
            out["_status"].append(status)
        if has_margin:
            for margin, index in zip(batch["margin"], indices):
                if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                    raise ValueError(f"{name} row {index}: margin must be a finite number, got {margin!r}.")
        return out

    drop = [c for c in dataset.column_names if c != "margin"]
    processed = dataset.map(process, batched=True, with_indices=True, remove_columns=drop, num_proc=num_proc)
    statuses = processed["_status"]
    report = {"pairs_read": len(statuses)}
    for status in ("kept", "truncated", "dropped_too_long", "dropped_identical"):
        report[status] = statuses.count(status)
    report["kept"] += report["truncated"]
    kept = processed.filter(lambda row: not row["_status"].startswith("dropped"), num_proc=num_proc)
    kept = kept.remove_columns("_status")
    if report["dropped_too_long"] or report["truncated"]:
        what = "dropped" if report["dropped_too_long"] else "cut from the start"
        warnings.warn(
            f"{name}: {report['dropped_too_long'] + report['truncated']} of {len(statuses)} pairs have a side longer "
            f"than max_length={max_length} tokens and were {what} (truncation_mode={truncation_mode!r}).",
            stacklevel=3,
        )
    if report["dropped_identical"]:
        warnings.warn(
            f"{name}: {report['dropped_identical']} of {len(statuses)} pairs have identical chosen and rejected "
            "sequences and were skipped (they carry no preference).",
            stacklevel=3,
        )
    if len(kept) == 0:
        raise ValueError(f"{name}: no pair is left to train on ({report}).")
    return PreparedPairs(kept, report)


def _check_texts(texts: list, column: str, indices: list[int], name: str, allow_empty: bool) -> None:
    for text, index in zip(texts, indices):
        if not isinstance(text, str):
            raise TypeError(f"{name} row {index}: {column!r} must be a str, got {type(text).__name__}.")
        if not allow_empty and not text.strip():
            raise ValueError(f"{name} row {index}: {column!r} is empty; every pair needs two non-empty answers.")


def _token_ids(values: list, column: str, indices: list[int], name: str) -> list[list[int]]:
    rows = []
    for value, index in zip(values, indices):
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise TypeError(f"{name} row {index}: {column!r} must be a list of int token ids, got {value!r}.")
        rows.append(value)
    return rows


def _check_ids(ids: list[int], column: str, index: int, name: str, pad_token_id: int | None, vocab_size: int) -> None:
    if not ids:
        raise ValueError(f"{name} row {index}: {column!r} has no tokens; every pair needs two non-empty answers.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{name} row {index}: {column!r} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab_size})."
        )
    if pad_token_id is not None and ids[-1] == pad_token_id:
        raise ValueError(
            f"{name} row {index}: {column!r} ends with the padding token (id {pad_token_id}). A classifier that "
            "pools at the last non-padding token would score an earlier token; use a padding token distinct from "
            "the end-of-text token (tokenizer.add_special_tokens({'pad_token': ...}) and resize the embeddings)."
        )


@dataclass
class RewardDataCollatorWithPadding:
    """Pads the chosen and rejected sequences of a batch of pairs to one common width.

    Returns ``input_ids_chosen``, ``attention_mask_chosen``, ``input_ids_rejected``,
    ``attention_mask_rejected`` (all ``(P, S)`` with the same ``S``, so the trainer stacks them into
    one ``(2P, S)`` forward pass), and ``margin`` ``(P,)`` when the rows have it.
    Padding follows ``tokenizer.padding_side``.
    """

    tokenizer: PreTrainedTokenizerBase
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict:
        rows = [f["input_ids_chosen"] for f in features] + [f["input_ids_rejected"] for f in features]
        padded = pad_without_fast_tokenizer_warning(
            self.tokenizer,
            {"input_ids": rows},
            padding=True,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )
        n = len(features)
        batch = {
            "input_ids_chosen": padded["input_ids"][:n],
            "attention_mask_chosen": padded["attention_mask"][:n],
            "input_ids_rejected": padded["input_ids"][n:],
            "attention_mask_rejected": padded["attention_mask"][n:],
        }
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([float(f["margin"]) for f in features], dtype=torch.float32)
        return batch
