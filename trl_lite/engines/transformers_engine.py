"""Generation with transformers' ``generate`` on the trained model itself (the default engine)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch.nn.utils.rnn import pad_sequence

from ..parallel.fsdp import is_sharded, unsharded
from .base import GenerationEngine, trim_rows
from .kept_recorder import KeptRecorder, recorded_rows, recording
from .temperature import Sampling, resolve_sampling_kwargs

_NO_MASK_WARNING = "We strongly recommend passing in an `attention_mask`"


class _MaskIsPassed(logging.Filter):
    """Drops transformers' missing-mask warning while the engine generates: ``generate()`` drops an
    all-ones ``attention_mask`` itself (nothing is padded), and the model's forward then warns about the
    pad tokens that ``generate()`` appends to rows that have ended. Every call here passes the mask."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_MASK_WARNING)


@contextmanager
def _mask_is_passed():
    logger, drop = logging.getLogger("transformers.modeling_utils"), _MaskIsPassed()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Eval mode (no dropout) inside the block; afterwards every submodule gets back its own mode.

    Generation must not depend on the mode ``step()`` leaves the model in: with dropout on, greedy
    decoding of a query alone and of the same query in a batch would differ.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


class TransformersEngine(GenerationEngine):
    """transformers ``generate`` on a (prepared) model, in left-padded chunks of queries.

    Args:
        model_context: called once per ``generate``; a context manager yielding the prepared model to
            generate with (the policy, or the reference: for a PEFT policy, the policy with its adapter disabled).
        accelerator: the trainer's accelerator (unwrapping, and under ZeRO-3 the call count of every process).
        tokenizer: gives the EOS id that ends a response; a list of queries needs it (for padding).
        pad_token_id: the left padding of a chunk.
        is_encoder_decoder: responses then start with the decoder start token, and no prompt is cut off.
        is_zero3: weights are gathered once per call, and every process makes the same number of
            ``generate`` calls (a process with fewer chunks joins the others' with a one-row stand-in).
        sampling: the run's distribution (:meth:`~.temperature.Sampling.of` the ``PPOConfig``): calls sample as
            :func:`~.temperature.resolve_sampling_kwargs` says, and log-probs are ``log_softmax(z / temperature)``.
        halve_on_oom: a chunk that raises ``torch.OutOfMemoryError`` is generated again in halves, and the
            rest of the call in chunks of that size (``PPOConfig.oom_backoff``; not under ZeRO-3, whose
            ``generate`` calls are collectives every process must make alike).
    """

    def __init__(self, model_context: Callable[[], AbstractContextManager], accelerator, tokenizer, pad_token_id: int,
                 is_encoder_decoder: bool, is_zero3: bool, sampling: Sampling = Sampling(),
                 halve_on_oom: bool = False):  # fmt: skip
        self.model_context = model_context
        self.accelerator = accelerator
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.is_encoder_decoder = is_encoder_decoder
        self.is_zero3 = is_zero3
        self.sampling = sampling
        self.halve_on_oom = halve_on_oom
        # Whether PPOConfig truncates: returned log-probs are then log pi_T^K over the warpers' kept sets, and a
        # sampling call records those sets (take_kept_sets).
        self.truncates = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0.0
        self._kept = None  # the last generate's rows' kept sets (one-row KeptSets each), until taken

    @contextmanager
    def _generation_model(self):
        """The unwrapped model in eval mode with full weights: under ZeRO-3 or FSDP2 gathered once for the whole call."""
        with self.model_context() as model, eval_mode(model):
            unwrapped = self.accelerator.unwrap_model(model)
            if self.is_zero3:
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
                    yield unwrapped
            elif is_sharded(model):
                with unsharded(model):  # FSDP2: gathered for the call, resharded after
                    yield unwrapped
            else:
                yield unwrapped

    def generate_one(self, query, generation_kwargs, return_prompt):
        """One 1-D query (on the CPU or the accelerator's device) -> ``(k, S)`` on the accelerator's device (classic
        TRL's shape: the ``generate`` output as it is, a row ended early padded). A truncating sampling call records
        each row's kept sets over all its generated columns (:meth:`take_kept_sets`), as a list call does."""
        query = query.unsqueeze(0).to(self.accelerator.device)
        kwargs = resolve_sampling_kwargs(generation_kwargs, self.sampling)  # refused before the model is touched
        self._kept = None
        with self._generation_model() as model:
            # Again with the model's defaults: a call that leaves do_sample to them may sample.
            kwargs = resolve_sampling_kwargs(kwargs, self.sampling, _generation_defaults(model))
            recorder = KeptRecorder() if self._records(kwargs, _generation_defaults(model)) else None
            with recording(model, recorder) if recorder is not None else nullcontext():
                response = model.generate(input_ids=query, **kwargs)
        steps = response.shape[1] - (1 if self.is_encoder_decoder else query.shape[1])
        if recorder is not None:
            self._kept = recorded_rows(recorder.step_sets(response, steps), [steps] * response.shape[0])
        if not return_prompt and not self.is_encoder_decoder:
            response = response[:, query.shape[1] :]
        return response

    def _records(self, kwargs, defaults) -> bool:
        """Whether a call with (resolved) ``kwargs`` records its kept sets: ``PPOConfig`` truncates and the call samples
        one sequence at a time (``do_sample``, else the model's; ``num_beams`` 1). A greedy call records nothing: it
        drew from no distribution, and its rows are scored under ``PPOConfig``'s ``pi_T^K``, the sets re-derived
        (docs/truncated_sampling.md, "Greedy calls")."""
        samples = kwargs.get("do_sample") if kwargs.get("do_sample") is not None else getattr(defaults, "do_sample", 0)
        return bool(self.truncates and samples and int(kwargs.get("num_beams") or 1) == 1)

    def generate(self, queries, generation_kwargs, length_sampler, batch_size, return_prompt, remove_padding,
                 return_logprobs):  # fmt: skip
        """Chunks of ``batch_size`` queries; ``length_sampler`` draws ``max_new_tokens`` once per chunk. With
        ``halve_on_oom``, a chunk that runs out of memory goes on in halves (its draw kept, the random state of
        its start restored), and so do the chunks after it (docs/out_of_memory.md).

        The queries are sorted by length before being cut into chunks, so a chunk holds queries of
        similar length and little left padding is computed (at every decoding step, too: the padding
        stays in the key/value cache). Log-probs are ``log_softmax(z / temperature)`` of the raw logits
        ``generate`` returns (``output_logits``), the engine's temperature applied and nothing else - when
        ``PPOConfig`` truncates, renormalised over the set its warpers kept (the tokens finite in
        ``output_scores``), ``log pi_T^K`` (docs/algorithm_rollouts.md section 23, docs/truncated_sampling.md).

        Devices: the queries may sit on the CPU (a tokenizer's output) or on the accelerator's device;
        each chunk is padded where its queries are and moved in one copy. The responses and log-probs are
        on the accelerator's device (classic TRL's ``generate`` leaves them there too).
        """
        if self.tokenizer is None:
            raise ValueError("generate() with a list of queries needs the trainer's tokenizer (for padding); got None.")
        device = self.accelerator.device
        pad = self.pad_token_id
        kwargs = resolve_sampling_kwargs(generation_kwargs, self.sampling)
        kwargs.setdefault("pad_token_id", pad)
        if return_logprobs:
            if int(kwargs.get("num_beams") or 1) != 1:
                # generate's per-step logits follow the beams, not the sequences it returns.
                raise ValueError(f"return_logprobs=True needs num_beams=1, got num_beams={kwargs['num_beams']!r}.")
            kwargs.update(output_logits=True, return_dict_in_generate=True)
        self._kept = None
        # transformers returns the k sequences of each prompt next to each other (repeat_interleave).
        per_query = int(kwargs.get("num_return_sequences") or 1)
        outputs = [None] * (len(queries) * per_query)
        logprobs = [None] * len(outputs) if return_logprobs else None
        order = sorted(range(len(queries)), key=lambda i: len(queries[i]))
        starts = range(0, len(queries), batch_size)
        with self._generation_model() as gen_model, _mask_is_passed():
            # Again with the model's defaults: a call that leaves do_sample to them may sample.
            defaults = _generation_defaults(gen_model)
            kwargs = resolve_sampling_kwargs(kwargs, self.sampling, defaults)
            kept = [None] * len(outputs) if self._records(kwargs, defaults) else None
            for _ in range(self._missing_generate_calls(len(starts))):
                # Under ZeRO-3 every forward pass is a collective, so a process with fewer chunks
                # than another joins the extra calls with a one-row stand-in whose output is dropped.
                stand_in = (queries[0][:1] if len(queries) else torch.tensor([pad])).to(device).unsqueeze(0)
                gen_model.generate(input_ids=stand_in, attention_mask=torch.ones_like(stand_in), **kwargs)
            size = batch_size
            for start in starts:
                if length_sampler is not None:
                    kwargs["max_new_tokens"] = length_sampler()  # once per chunk, whatever the retries
                chunk, done = order[start : start + batch_size], 0
                while done < len(chunk):
                    rows, rng = chunk[done : done + size], self._rng_state()
                    try:
                        self._generate_rows(gen_model, queries, rows, kwargs, outputs, logprobs, return_prompt,
                                            remove_padding, kept)  # fmt: skip
                        done += len(rows)
                        continue
                    except torch.OutOfMemoryError:
                        if not self.halve_on_oom or len(rows) == 1 or self.is_zero3:
                            raise
                    # Outside the handler: the failed call's tensors are free. Its rows again, in halves, from the
                    # same random state (greedy decoding gives the same tokens).
                    size = len(rows) // 2
                    self._restore_rng(rng)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    warnings.warn(f"generate() ran out of memory on {len(rows)} queries: going on in chunks of {size}.")
        self._kept = kept
        return outputs, logprobs

    def take_kept_sets(self) -> list | None:
        """Per row of the last :meth:`generate` the kept sets its warpers left (one-row
        :class:`~trl_lite.core.kept_sets.KeptSets` over the generated tokens, capped as the trainer's), once; None
        when the call did not truncate (greedy, or ``PPOConfig`` untruncated)."""
        kept, self._kept = self._kept, None
        return kept

    def _generate_rows(self, gen_model, queries, rows, kwargs, outputs, logprobs, return_prompt, remove_padding,
                       kept=None):  # fmt: skip
        """One ``generate`` call on the queries ``rows`` (positions into ``queries``), left-padded; writes each
        row's responses (and log-probs, when ``logprobs`` is a list; kept sets, when ``kept`` is) into its slots."""
        device, pad = self.accelerator.device, self.pad_token_id
        per_query = int(kwargs.get("num_return_sequences") or 1)
        input_ids = _left_padded([queries[i] for i in rows], pad, device)
        lengths = [len(queries[i]) for i in rows]
        attention_mask = (
            torch.arange(input_ids.shape[1], device=device)
            >= (input_ids.shape[1] - torch.tensor(lengths, device=device)).unsqueeze(1)
        ).long()
        recorder = KeptRecorder() if kept is not None else None
        with recording(gen_model, recorder) if recorder is not None else nullcontext():
            generated = gen_model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return_logprobs = logprobs is not None
        sequences = generated.sequences if kwargs.get("return_dict_in_generate") else generated
        row_lengths = [n for n in lengths for _ in range(per_query)]
        trimmed = self.trim(sequences, input_ids.shape[1], row_lengths, return_prompt, remove_padding)
        steps = sequences.shape[1] - (1 if self.is_encoder_decoder else input_ids.shape[1])
        step_sets = recorder.step_sets(sequences, steps) if recorder is not None else None
        chunk_logprobs = None
        if return_logprobs:  # greedy rows (no step_sets): no warper, every token kept
            chunk_logprobs = _sampled_logprobs(sequences, generated.logits, self.temperature, step_sets)
        prompt = [(1 if self.is_encoder_decoder else n) if (return_prompt or self.is_encoder_decoder) else 0
                  for n in row_lengths]  # fmt: skip
        generated_counts = [len(generation) - p for generation, p in zip(trimmed, prompt)]
        chunk_kept = recorded_rows(step_sets, generated_counts) if kept is not None else None
        for index, generation in enumerate(trimmed):
            slot = rows[index // per_query] * per_query + index % per_query
            outputs[slot] = generation
            if return_logprobs:
                logprobs[slot] = chunk_logprobs[index, : generated_counts[index]]
            if kept is not None:
                kept[slot] = chunk_kept[index]

    def _rng_state(self):
        """torch's random state on the host and the device (to replay a failed chunk's draws), when it may be needed."""
        if not self.halve_on_oom:
            return None
        device = self.accelerator.device
        return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def _restore_rng(self, state) -> None:
        host, cuda = state
        torch.set_rng_state(host)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.accelerator.device)

    def trim(self, generations, prompt_width, lengths, return_prompt, remove_padding) -> list[torch.Tensor]:
        """:func:`trim_rows` with this engine's EOS (the tokenizer's) and model kind."""
        eos = self.tokenizer.eos_token_id
        return trim_rows(generations, prompt_width, lengths, return_prompt, remove_padding, eos, self.is_encoder_decoder)

    def _missing_generate_calls(self, calls: int) -> int:
        """How many fewer ``generate`` calls this process makes than the busiest one (0 unless ZeRO-3)."""
        if not self.is_zero3 or self.accelerator.num_processes == 1:
            return 0
        counts = self.accelerator.gather(torch.tensor([calls], device=self.accelerator.device))
        return int(counts.max()) - calls


def _left_padded(chunk: list[torch.Tensor], pad: int, device) -> torch.Tensor:
    """The 1-D queries of ``chunk`` left-padded with ``pad`` into ``(n, S)`` on ``device``: padded where the
    queries are, then moved in one copy (a copy per query would block the host once per row)."""
    if len({query.device for query in chunk}) > 1:
        chunk = [query.to(device) for query in chunk]  # queries on different devices cannot be stacked
    return pad_sequence(chunk, batch_first=True, padding_value=pad, padding_side="left").to(device)


def _generation_defaults(model):
    """The ``GenerationConfig`` of a model or of the transformers model inside a value-head wrapper (None if neither)."""
    config = getattr(model, "generation_config", None)
    return config if config is not None else getattr(getattr(model, "pretrained_model", None), "generation_config", None)


def _sampled_logprobs(sequences: torch.Tensor, logits: tuple[torch.Tensor, ...], temperature: float,
                      step_sets: list | None = None) -> torch.Tensor:  # fmt: skip
    """Log-probabilities ``(n, T)`` of the T generated tokens (the last T columns of ``sequences (n, S)``)
    under ``softmax(z / temperature)`` of the raw per-step logits ``z`` (T tensors ``(n, V)``), in float32 or
    wider. Dividing by 1.0 changes no bit: the classic run's log-probs are those of the raw logits.

    ``step_sets``: per step the sampler's kept sets (:meth:`~.kept_recorder.KeptRecorder.step_sets`: ids ``(n, K)``,
    counts ``(n,)``, each holding its token): the log-probs are then ``log pi_T^K``, ``softmax(z / temperature)``
    renormalised over the set the sampler kept (docs/algorithm_rollouts.md section 23) - the raw logits over the
    recorded set, not the processed scores (a penalty is not scored)."""
    steps = torch.stack(logits, dim=1)
    steps = steps.to(torch.promote_types(steps.dtype, torch.float32)) / temperature
    tokens = sequences[:, sequences.shape[1] - len(logits) :].unsqueeze(-1)
    if step_sets is None:
        return torch.log_softmax(steps, dim=-1).gather(-1, tokens).squeeze(-1)
    picked = steps.gather(-1, tokens).squeeze(-1)
    norms = []
    for t, (ids, counts) in enumerate(step_sets[: len(logits)]):
        kept = steps[:, t].gather(-1, ids.to(steps.device))
        inside = torch.arange(ids.shape[1], device=steps.device) < counts.to(steps.device).unsqueeze(-1)
        norms.append(torch.logsumexp(kept.masked_fill(~inside, -float("inf")), dim=-1))
    return picked - torch.stack(norms, dim=1)
