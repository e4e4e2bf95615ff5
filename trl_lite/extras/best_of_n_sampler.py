"""Best-of-n sampling: draw several continuations per query, keep the ones a scoring function ranks highest."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig, PreTrainedTokenizerBase

from ..core import set_seed
from ..models import PreTrainedModelWrapper
from ..engines.generation import eval_mode
from ..engines.temperature import Sampling, resolve_sampling_kwargs


def _as_query_list(tokenized_query) -> list[torch.Tensor]:
    """The query argument of :meth:`BestOfNSampler.generate` as a list of 1-D int64 tensors."""
    accepted = "a list of ints, a list of lists of ints, a 1-D tensor or a list of 1-D tensors"
    if isinstance(tokenized_query, torch.Tensor):
        if tokenized_query.ndim != 1:
            raise ValueError(f"tokenized_query must be {accepted}; got a tensor of shape {tuple(tokenized_query.shape)}.")
        queries = [tokenized_query]
    elif isinstance(tokenized_query, Sequence) and not isinstance(tokenized_query, str) and len(tokenized_query) > 0:
        if all(isinstance(token, int) for token in tokenized_query):
            queries = [torch.tensor(tokenized_query)]
        elif all(isinstance(q, torch.Tensor) for q in tokenized_query):
            queries = [q.reshape(-1) for q in tokenized_query]
        elif all(isinstance(q, Sequence) and all(isinstance(t, int) for t in q) for q in tokenized_query):
            queries = [torch.tensor(q, dtype=torch.long) for q in tokenized_query]
        else:
            kinds = sorted({type(q).__name__ for q in tokenized_query})
            raise TypeError(f"tokenized_query must be {accepted}; got a list of {', '.join(kinds)}.")
    else:
        raise TypeError(f"tokenized_query must be {accepted}; got {type(tokenized_query).__name__} {tokenized_query!r:.60}.")
    for query in queries:
        if query.numel() == 0 or query.is_floating_point():
            raise ValueError(f"tokenized_query must hold non-empty integer token ids; got a query of dtype {query.dtype} and {query.numel()} tokens.")
    return [q.long() for q in queries]


class BestOfNSampler:
    """Generate ``sample_size`` continuations of each query and keep the ``n_candidates`` best-scored texts.

    Args:
        model: a value-head wrapper (``AutoModelForCausalLMWithValueHead`` or
            ``AutoModelForSeq2SeqLMWithValueHead``) whose ``generate`` samples the continuations.
        tokenizer: the model's tokenizer; decodes the samples.
        queries_to_scores: ``list[str] -> list[float]``, the score of each decoded text (the query
            and its continuation for decoder-only models, the continuation for encoder-decoders).
        length_sampler: callable returning the number of new tokens to draw for a query (e.g. ``LengthSampler``).
        sample_size: continuations drawn per query.
        seed: when given, ``set_seed(seed)`` is called once here.
        n_candidates: texts returned per query, best first.
        generation_config: passed to ``model.generate``; keyword arguments of :meth:`generate` override it.
        temperature: the policy's ``PPOConfig.temperature``: samples are drawn at it, untruncated (a sampling
            kwarg that disagrees is refused; ``generation_config``'s and the model's own sampling settings are
            overridden with a warning; docs/temperature.md).
    """

    def __init__(
        self,
        model: PreTrainedModelWrapper,
        tokenizer: PreTrainedTokenizerBase,
        queries_to_scores: Callable[[list[str]], list[float]],
        length_sampler: Any,
        sample_size: int = 4,
        seed: int | None = None,
        n_candidates: int = 1,
        generation_config: GenerationConfig | None = None,
        temperature: float = 1.0,
    ) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise ValueError(f"tokenizer must be a PreTrainedTokenizer or PreTrainedTokenizerFast, got {type(tokenizer).__name__}.")
        if not isinstance(model, PreTrainedModelWrapper):
            raise ValueError(
                f"model must be a PreTrainedModelWrapper (AutoModelForCausalLMWithValueHead or "
                f"AutoModelForSeq2SeqLMWithValueHead), got {type(model).__name__}."
            )
        if not callable(queries_to_scores) or not callable(length_sampler):
            raise TypeError("queries_to_scores and length_sampler must be callables.")
        if not (isinstance(sample_size, int) and isinstance(n_candidates, int) and 1 <= n_candidates <= sample_size):
            raise ValueError(f"BestOfNSampler needs integers 1 <= n_candidates <= sample_size, got n_candidates={n_candidates!r}, sample_size={sample_size!r}.")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
            raise ValueError(f"temperature must be a positive finite number, got {temperature!r}.")
        if seed is not None:
            set_seed(seed)
        self.model = model
        self.tokenizer = tokenizer
        self.queries_to_scores = queries_to_scores
        self.length_sampler = length_sampler
        self.gen_config = generation_config
        self.sample_size = sample_size
        self.n_candidates = n_candidates
        self.temperature = temperature

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        if pad is None:
            raise ValueError("BestOfNSampler pads queries on the left and needs tokenizer.pad_token_id or tokenizer.eos_token_id; both are None.")
        return pad

    def generate(
        self,
        tokenized_query: list[int] | torch.Tensor | list[torch.Tensor] | list[list[int]],
        skip_special_tokens: bool = True,
        device: str | torch.device | None = None,
        **generation_kwargs,
    ) -> list[list[str]]:
        """Best ``n_candidates`` texts of each query, best first: a list (one per query) of lists of str.

        ``tokenized_query`` is one query (a list of ints or a 1-D tensor) or several (a list of
        lists of ints or a list of 1-D tensors). All ``queries x sample_size`` samples are drawn in
        one ``model.generate`` call on left-padded inputs, in eval mode (the model's mode is restored
        after). Each query draws its own ``length_sampler()`` new tokens, as if it were generated
        alone. ``device`` defaults to the model's device; the queries may sit on the CPU or on any device
        (they are moved there in one copy).
        """
        queries = _as_query_list(tokenized_query)
        defaults = self.gen_config if self.gen_config is not None else self.model.pretrained_model.generation_config
        generation_kwargs = resolve_sampling_kwargs(generation_kwargs, Sampling(self.temperature), defaults)
        lengths = [int(self.length_sampler()) for _ in queries]
        pad_id = self._pad_id()
        device = device if device is not None else next(self.model.parameters()).device

        # Left padding, so every row's new tokens start at the same column; padded where the queries are
        # (the CPU for a tokenizer's output), then moved in one copy.
        width = max(len(q) for q in queries)
        if len({query.device for query in queries}) > 1:
            queries = [query.to(device) for query in queries]
        padded = pad_sequence(queries, batch_first=True, padding_value=pad_id, padding_side="left").to(device)
        starts = torch.tensor([width - len(q) for q in queries], device=device)
        mask = (torch.arange(width, device=device) >= starts[:, None]).long()
        input_ids = padded.repeat_interleave(self.sample_size, dim=0)
        attention_mask = mask.repeat_interleave(self.sample_size, dim=0)

        generation_kwargs["max_new_tokens"] = max(lengths)
        if self.gen_config is not None:
            # transformers wants either a config or loose settings: fold the settings into a copy of the
            # config; what is not a generation setting (a logits processor, ...) comes back from update().
            config = copy.deepcopy(self.gen_config)
            extra = config.update(**generation_kwargs)
            if config.pad_token_id is None:
                config.pad_token_id = pad_id
            generation_kwargs = {"generation_config": config, **extra}
        else:
            generation_kwargs.setdefault("pad_token_id", pad_id)
        with eval_mode(self.model), torch.no_grad():
            # Decoding reads the token ids on the host: one copy for all rows.
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs).cpu()

        prompt_width = 0 if self.model.is_encoder_decoder else width
        result = []
        for index, query in enumerate(queries):
            rows = output[index * self.sample_size : (index + 1) * self.sample_size]
            # Drop the left padding and the tokens past this query's own sampled length.
            end = prompt_width + lengths[index] + (1 if self.model.is_encoder_decoder else 0)
            rows = rows[:, (width - len(query) if prompt_width else 0) : end]
            texts = self.tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
            scores = torch.as_tensor(self.queries_to_scores(texts), dtype=torch.float64).reshape(-1)
            if len(scores) != len(texts):
                raise ValueError(f"queries_to_scores must return one score per text: got {len(scores)} scores for {len(texts)} texts.")
            result.append([texts[i] for i in scores.topk(self.n_candidates).indices.tolist()])
        return result
