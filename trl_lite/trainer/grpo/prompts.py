"""GRPO's prompts: which dataset rows each generation takes (TRL's order: shuffled with ``seed``, whole groups,
an incomplete last batch dropped), and their token ids (standard text, or conversations in the chat template).

:class:`PromptOrder` is the position in the dataset, saved in checkpoints; the permutation of epoch ``e`` is a
function of ``(seed, e)`` alone, so a resumed run takes the very rows the uninterrupted run takes.
"""

from __future__ import annotations

import torch


def is_conversational(prompt) -> bool:
    """Whether a prompt is a conversation: a list of ``{"role": ..., "content": ...}`` messages."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def prompt_ids(tokenizer, prompts: list, chat_template_kwargs: dict | None = None) -> list[torch.Tensor]:
    """One 1-D id tensor per prompt: conversations through the tokenizer's chat template with the generation prompt
    (as TRL), standard prompts tokenized as they are. Prompts are not truncated (TRL 1.x has no ``max_prompt_length``)."""
    if is_conversational(prompts[0]):
        ids = [tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True,
                                             **(chat_template_kwargs or {}))["input_ids"] for p in prompts]  # fmt: skip
    else:
        ids = tokenizer(list(prompts))["input_ids"]
    return [torch.tensor(i, dtype=torch.long) for i in ids]


def completions_of(prompts: list, texts: list[str]) -> list:
    """TRL's ``completions``: the texts, or for conversations one assistant message each."""
    if is_conversational(prompts[0]):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return list(texts)


class PromptOrder:
    """The dataset rows of each generation: ``prompts_per_generation`` distinct rows (all processes), each process
    taking its consecutive share, in a permutation drawn per epoch from ``(seed, epoch)``.

    Map-style datasets (with ``len``) are shuffled when ``shuffle``; an ``IterableDataset`` is read in order and
    its position on resume reached by skipping the rows taken. ``epoch`` and ``index`` (rows taken in this epoch)
    are the state (:meth:`state_dict`).
    """

    def __init__(self, dataset, prompts_per_generation: int, process_index: int, num_processes: int, seed: int,
                 shuffle: bool = True):  # fmt: skip
        self.dataset = dataset
        self.per_generation = prompts_per_generation
        self.per_process = prompts_per_generation // num_processes
        self.process_index = process_index
        self.seed = seed
        self.shuffle = shuffle
        self.sized = hasattr(dataset, "__len__")
        if self.sized and len(dataset) < prompts_per_generation:
            raise ValueError(f"train_dataset has {len(dataset)} rows, fewer than the {prompts_per_generation} prompts "
                             "of one generation (generation_batch_size / num_generations).")  # fmt: skip
        self.epoch, self.index = 0, 0
        self._iterator = None

    @property
    def generations_per_epoch(self) -> int | None:
        """Generations in one pass over a sized dataset (the incomplete last one dropped); None for an iterable."""
        return len(self.dataset) // self.per_generation if self.sized else None

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next_rows(self) -> list[dict]:
        """This process's rows of the next generation (dicts of the dataset's columns)."""
        if not self.sized:
            return self._next_iterable_rows()
        if self.index + self.per_generation > len(self.dataset):
            self.epoch, self.index = self.epoch + 1, 0
        order = self._permutation(self.epoch)[self.index : self.index + self.per_generation]
        self.index += self.per_generation
        mine = order[self.process_index * self.per_process : (self.process_index + 1) * self.per_process]
        return [self.dataset[i] for i in mine]

    def _next_iterable_rows(self) -> list[dict]:
        if self._iterator is None:
            self._iterator = iter(self.dataset)
            for _ in range(self.index):  # a resumed run: skip the rows taken before
                next(self._iterator)
        rows = []
        for _ in range(self.per_generation):
            try:
                rows.append(next(self._iterator))
            except StopIteration:
                self._iterator, self.epoch = iter(self.dataset), self.epoch + 1
                self.index, rows = 0, []
                return self._next_iterable_rows()
        self.index += self.per_generation
        return rows[self.process_index * self.per_process : (self.process_index + 1) * self.per_process]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self._iterator = state["epoch"], state["index"], None
