"""Generation for the rollout: one query or a batch of them, from the policy or the reference,
with full weights gathered once per call under ZeRO-3."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn.utils.rnn import pad_sequence


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


class GenerationMixin:
    """``PPOTrainer.generate`` and its batching: :class:`PPOTrainer` mixes it in."""

    @contextmanager
    def _generation_model(self, model):
        """The unwrapped model with full weights: under ZeRO-3 gathered once for the whole call."""
        unwrapped = self.accelerator.unwrap_model(model)
        if self._is_zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
                yield unwrapped
        else:
            yield unwrapped

    @torch.no_grad()
    def generate(
        self,
        query_tensor,
        length_sampler=None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        remove_padding: bool = True,
        **generation_kwargs,
    ):
        """Generate responses for one query (1-D tensor) or a list of them.

        A list is generated in chunks of ``batch_size`` queries with left padding and returned as a
        list of 1-D tensors with padding (and anything after the first EOS) removed. With
        ``num_return_sequences=k`` (a generation kwarg; sampling or beams) each query gets k responses,
        next to each other: entries ``i*k .. i*k+k-1`` answer query ``i``, the layout ``step()``
        expects for ``num_samples_per_query=k``. ``length_sampler`` draws ``max_new_tokens`` per call
        (per chunk for a list). With ``generate_ref_response`` the reference model's responses are returned too.

        Under ZeRO-3 generation is collective: every process must call ``generate`` the same number
        of times, but the processes may pass different numbers of queries and lengths.

        The call's wall-clock time counts in ``time/rollout/generate`` of the next ``step()``'s statistics.
        """
        with self.timed("rollout/generate"):
            return self._generate(
                query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response, remove_padding,
                **generation_kwargs,
            )  # fmt: skip

    def _generate(
        self, query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response, remove_padding,
        **generation_kwargs,
    ):  # fmt: skip
        if isinstance(query_tensor, (list, tuple)):
            responses = self._generate_batched(
                self.model, query_tensor, length_sampler, batch_size, return_prompt, remove_padding, **generation_kwargs
            )
            if not generate_ref_response:
                return responses
            with self._reference() as ref:
                ref_responses = self._generate_batched(
                    ref, query_tensor, length_sampler, batch_size, return_prompt, remove_padding, **generation_kwargs
                )
            return responses, ref_responses
        if not isinstance(query_tensor, torch.Tensor) or query_tensor.dim() != 1:
            raise ValueError(
                "query_tensor must be a 1-D tensor of token ids or a list of them, got "
                f"{type(query_tensor).__name__}{tuple(query_tensor.shape) if isinstance(query_tensor, torch.Tensor) else ''}."
            )
        if length_sampler is not None:
            generation_kwargs["max_new_tokens"] = length_sampler()
        query = query_tensor.unsqueeze(0).to(self.current_device)
        with eval_mode(self.model), self._generation_model(self.model) as model:
            response = model.generate(input_ids=query, **generation_kwargs)
        if not return_prompt and not self.is_encoder_decoder:
            response = response[:, query.shape[1] :]
        if not generate_ref_response:
            return response
        with self._reference() as ref, eval_mode(ref), self._generation_model(ref) as ref_model:
            ref_response = ref_model.generate(input_ids=query, **generation_kwargs)
        if not return_prompt and not self.is_encoder_decoder:
            ref_response = ref_response[:, query.shape[1] :]
        return response, ref_response

    def _generate_batched(self, model, queries, length_sampler, batch_size, return_prompt, remove_padding, **kwargs):
        """Generate for a list of queries in left-padded chunks; one 1-D tensor per query, in the given order.

        The queries are sorted by length before being cut into chunks, so a chunk holds queries of
        similar length and little left padding is computed (at every decoding step, too: the padding
        stays in the key/value cache). ``length_sampler`` is still drawn once per chunk.
        """
        if self.tokenizer is None:
            raise ValueError("generate() with a list of queries needs the trainer's tokenizer (for padding); got None.")
        device = self.current_device
        pad = self._pad_id
        kwargs.setdefault("pad_token_id", pad)
        # transformers returns the k sequences of each prompt next to each other (repeat_interleave).
        per_query = int(kwargs.get("num_return_sequences") or 1)
        outputs = [None] * (len(queries) * per_query)
        order = sorted(range(len(queries)), key=lambda i: len(queries[i]))
        starts = range(0, len(queries), batch_size)
        with eval_mode(model), self._generation_model(model) as gen_model:
            for _ in range(self._missing_generate_calls(len(starts))):
                # Under ZeRO-3 every forward pass is a collective, so a process with fewer chunks
                # than another joins the extra calls with a one-row stand-in whose output is dropped.
                stand_in = (queries[0][:1] if len(queries) else torch.tensor([pad])).to(device).unsqueeze(0)
                gen_model.generate(input_ids=stand_in, attention_mask=torch.ones_like(stand_in), **kwargs)
            for start in starts:
                if length_sampler is not None:
                    kwargs["max_new_tokens"] = length_sampler()
                rows = order[start : start + batch_size]
                chunk = [queries[i].to(device) for i in rows]
                input_ids = pad_sequence(chunk, batch_first=True, padding_value=pad, padding_side="left")
                lengths = [len(q) for q in chunk]
                attention_mask = (
                    torch.arange(input_ids.shape[1], device=device)
                    >= (input_ids.shape[1] - torch.tensor(lengths, device=device)).unsqueeze(1)
                ).long()
                generations = gen_model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                trimmed = self._trim_generations(
                    generations, input_ids.shape[1], [n for n in lengths for _ in range(per_query)], return_prompt,
                    remove_padding,
                )  # fmt: skip
                for index, generation in enumerate(trimmed):
                    outputs[rows[index // per_query] * per_query + index % per_query] = generation
        return outputs

    def _trim_generations(self, generations, prompt_width, lengths, return_prompt, remove_padding) -> list:
        """Rows of one chunk's ``generate`` output ``(n, S)`` without the prompt's left padding (and the
        prompt unless ``return_prompt``), cut after the first EOS when ``remove_padding``: n 1-D views.

        Where each row ends is found for the whole chunk at once: one host transfer per chunk.
        """
        eos = self.tokenizer.eos_token_id
        width = generations.shape[1]
        if self.is_encoder_decoder:
            begins = [0] * len(lengths)  # the decoder start token is kept; EOS is searched after it
            search_from = 1
        else:
            begins = [prompt_width - n if return_prompt else prompt_width for n in lengths]
            search_from = prompt_width  # an EOS inside a prompt does not end its response
        ends = [width] * len(lengths)
        if remove_padding and eos is not None:
            is_eos = generations[:, search_from:] == eos
            first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + search_from + 1, width)
            ends = first.tolist()
        return [generation[begin:end] for generation, begin, end in zip(generations, begins, ends)]

    def _missing_generate_calls(self, calls: int) -> int:
        """How many fewer ``generate`` calls this process makes than the busiest one (0 unless ZeRO-3)."""
        if not self._is_zero3 or self.accelerator.num_processes == 1:
            return 0
        counts = self.accelerator.gather(torch.tensor([calls], device=self.current_device))
        return int(counts.max()) - calls
