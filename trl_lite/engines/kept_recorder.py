"""The transformers engine's kept-set recorder: the tokens transformers' sampler drew each step's token from, compacted
as it samples (docs/truncated_sampling.md, docs/algorithm_rollouts.md section 23).

transformers builds its processor list per ``generate`` call: its own processors (repetition penalty, ...), then the
caller's ``logits_processor`` merged in, then the warpers (temperature, top-k, top-p, min-p, ...), then watermarking
and ``renormalize_logits``; the sampler draws from the softmax of that list's output. :func:`recording` appends a
:class:`KeptRecorder` at the very end of the list a ``generate`` call builds, so it sees exactly the scores the
sampler draws from (what ``output_scores`` would return) and leaves every other processor where transformers put it.
Each step's finite set is compacted right away (:func:`~trl_lite.core.kept_sets.finite_ids`: token ids, not
``rows x vocabulary`` floats); :meth:`KeptRecorder.step_sets` adds each step's sampled token once the call returned.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..core.kept_sets import MAX_KEPT, KeptSets, finite_ids, with_labels


class KeptRecorder:
    """A transformers ``LogitsProcessor`` (duck-typed: ``__call__(input_ids, scores) -> scores``) that records the
    finite set of every step's ``scores`` ``(n, V)`` and returns them unchanged. ``bound``: the stored cap of a set
    (:data:`~trl_lite.core.kept_sets.MAX_KEPT`)."""

    def __init__(self, bound: int = MAX_KEPT):
        self.bound = bound
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: ids (n, K) int32, counts (n,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids, counts = finite_ids(scores, self.bound)
        self.steps.append((ids.to(torch.int32), counts))
        return scores

    def step_sets(self, sequences: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sets of the ``steps`` generated tokens (the last ``steps`` columns of ``sequences`` ``(n, S)``): per
        step padded ids ``(n, K)`` int64 (padding: the token) and counts ``(n,)``, each set holding its token (as
        :func:`~trl_lite.core.kept_sets.ids_of_mask` of the sampler's scores). A step transformers ran and undid
        (a deferred stop check) is dropped."""
        if len(self.steps) < steps:
            raise RuntimeError(
                f"transformers' generate made {steps} tokens but ran the kept-set recorder {len(self.steps)} times: "
                "its processor list (GenerationMixin._get_logits_processor) is not built as trl_lite expects "
                "(docs/truncated_sampling.md); pin the tested transformers version."
            )
        tokens = sequences[:, sequences.shape[1] - steps :]
        return [with_labels(ids.to(torch.int64), counts, tokens[:, t], self.bound)
                for t, (ids, counts) in enumerate(self.steps[:steps])]  # fmt: skip


@contextmanager
def recording(model: torch.nn.Module, recorder: KeptRecorder):
    """Inside the block, every ``generate`` of ``model`` (or of a transformers model inside it: a value-head wrapper,
    a PEFT model) runs ``recorder`` last in its processor list. The models' own methods come back afterwards."""
    from transformers import GenerationMixin

    targets = [module for module in model.modules() if isinstance(module, GenerationMixin)]
    for module in targets:
        build = module._get_logits_processor

        def with_recorder(*args, _build=build, **kwargs):
            processors = _build(*args, **kwargs)
            processors.append(recorder)
            return processors

        module.__dict__["_get_logits_processor"] = with_recorder
    try:
        yield recorder
    finally:
        for module in targets:
            module.__dict__.pop("_get_logits_processor", None)


def recorded_rows(step_sets: list, counts: list[int]) -> list[KeptSets]:
    """Each row's one-row :class:`KeptSets` over its first ``counts[i]`` generated tokens from the per-step sets of
    :meth:`KeptRecorder.step_sets`."""
    n, steps = len(counts), len(step_sets)
    device = step_sets[0][0].device if steps else torch.device("cpu")
    passes = []
    for t, (ids, kept) in enumerate(step_sets):
        rows = [i for i in range(n) if counts[i] > t]
        if rows:
            index = torch.tensor(rows, device=device)
            passes.append((index * steps + t, ids[index], kept[index]))
    every = KeptSets.from_passes(n, steps, passes, device)
    offsets = every.offsets.tolist()  # one read for the chunk: where each row's sets begin and end
    return [KeptSets(every.offsets[i * steps : i * steps + counts[i] + 1] - offsets[i * steps],
                     every.ids[offsets[i * steps] : offsets[i * steps + counts[i]]], counts[i]) for i in range(n)]  # fmt: skip
