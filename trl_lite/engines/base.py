"""The generation-engine interface the trainer holds: generate rows, take new weights, close.

An engine answers a list of queries with one 1-D response tensor per returned row, in the layout
``step()`` expects (``num_return_sequences=k``: rows ``i*k .. i*k+k-1`` answer query ``i``), the
prompt kept or not, cut after the first EOS. The trainer times each call (``time/rollout/generate``)
and each weight push (``time/rollout/weight_sync``); what an engine costs is what those phases show.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch

from .temperature import Sampling


class GenerationEngine(ABC):
    """Generates rollouts for the trainer; one implementation per backend.

    ``needs_weight_sync``: whether the engine holds its own copy of the policy's weights, which
    :meth:`load_weights` must refresh after every update (False for an engine that runs the trained
    model itself). ``sampling``: the run's distribution (``PPOConfig.temperature``, ``top_k``, ...), which its
    sampling follows (:func:`~.temperature.resolve_sampling_kwargs`); its log-probs are at ``temperature``.
    """

    needs_weight_sync: bool = False
    sampling: Sampling = Sampling()

    @property
    def temperature(self) -> float:
        """The run's temperature (``sampling.temperature``)."""
        return self.sampling.temperature

    @abstractmethod
    def generate(
        self,
        queries: list[torch.Tensor],
        generation_kwargs: dict,
        length_sampler: Callable[[], int] | None,
        batch_size: int,
        return_prompt: bool,
        remove_padding: bool,
        return_logprobs: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Responses for ``queries`` (1-D token-id tensors), ``len(queries) * k`` rows in query order.

        Returns the rows and, with ``return_logprobs``, one 1-D float tensor per row holding the
        log-probability of each generated token (the prompt excluded; ``len(row) - len(query)``
        entries with ``return_prompt``) under ``softmax(z / temperature)`` of the engine's model's logits
        ``z`` - when ``PPOConfig`` truncates (top-k/top-p/min-p), renormalised over the sampler's kept set
        (``log pi_T^K``, docs/algorithm_rollouts.md section 23); else None.
        """

    def take_kept_sets(self) -> list | None:
        """Per row of the last :meth:`generate` call the kept sets its sampler used (one-row
        :class:`~trl_lite.core.kept_sets.KeptSets` over the row's generated tokens), once; None when the call did not
        truncate or the engine cannot tell (:attr:`no_kept_sets`; the trainer then re-derives them)."""
        return None

    # Why an engine cannot return its sampler's kept sets (named in the trainer's once-per-run message), or None.
    no_kept_sets: str | None = None

    @abstractmethod
    def generate_one(self, query: torch.Tensor, generation_kwargs: dict, return_prompt: bool) -> torch.Tensor:
        """The classic single-query output: a ``(k, S)`` tensor of token ids, rows padded with the pad id."""

    @property
    def sleeps(self) -> bool:
        """Whether the engine releases its memory between rollouts: it then holds no weights while
        asleep, and the caller wakes it (:meth:`wake_up`), pushes the weights and puts it back to sleep."""
        return False

    def sleep(self) -> None:
        """Release the weights and the cache (an engine that :attr:`sleeps`); nothing by default."""

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Allocate again, empty, what ``tags`` name (``'weights'``, ``'kv_cache'``); nothing by default."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights (the transformers model's ``state_dict`` names); engines without a copy ignore it."""
        raise NotImplementedError(f"{type(self).__name__} generates with the trained model itself: it takes no weights.")

    def close(self) -> None:
        """Release what the engine holds (processes, memory); nothing by default."""


def trim_rows(generations: torch.Tensor, prompt_width: int, lengths: list[int], return_prompt: bool,
              remove_padding: bool, eos_token_id: int | None, is_encoder_decoder: bool) -> list[torch.Tensor]:  # fmt: skip
    """Rows of a left-padded ``generate`` output ``(n, S)`` without the prompt's padding (and the
    prompt unless ``return_prompt``), cut after the first EOS when ``remove_padding``: n 1-D views.

    ``lengths`` (n,): each row's query length; ``prompt_width``: the padded prompt width. Where each
    row ends is found for all rows at once: one host transfer per call. An EOS inside a prompt does
    not end its response; for an encoder-decoder the decoder start token is kept and EOS searched after it.
    """
    width = generations.shape[1]
    if is_encoder_decoder:
        begins = [0] * len(lengths)
        search_from = 1
    else:
        begins = [prompt_width - n if return_prompt else prompt_width for n in lengths]
        search_from = prompt_width
    ends = [width] * len(lengths)
    if remove_padding and eos_token_id is not None:
        is_eos = generations[:, search_from:] == eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + search_from + 1, width)
        ends = first.tolist()
    return [generation[begin:end] for generation, begin, end in zip(generations, begins, ends)]
