"""Checks of what users hand to ``PPOTrainer``: constructor arguments and ``step()``'s batch.

Every check raises before any state changes, with a message that names the argument (and row),
what was given and what is accepted.
"""

from __future__ import annotations

import inspect
import sys
import warnings

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
    ValueModel,
)
from ..core.kept_sets import KeptSets
from ..models.modeling_base import is_peft_model
from .layout.rows import actions_per_row, concat_by_device
from .ppo_config import PPOConfig

SUPPORTED_MODELS = (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead)
# Estimators whose baseline comes from the other responses to the same query.
GROUP_ESTIMATORS = ("rloo", "grpo")



class NoDatasetWarning(UserWarning):
    """A ``PPOTrainer`` was built without a dataset: the caller batches the queries for ``step()``."""


def warn_without_dataset(batch_size: int) -> None:
    """Classic TRL's warning for a trainer without a dataset, as a ``UserWarning`` (``NoDatasetWarning``).

    A loop that feeds ``step()`` its own batches on purpose silences it around the constructor with
    ``warnings.simplefilter("ignore", NoDatasetWarning)`` inside ``warnings.catch_warnings()``.
    """
    warnings.warn(
        f"No dataset is provided. Make sure to set config.batch_size (now {batch_size}) to the number of queries "
        "each process passes to step() before training: step() refuses batches of any other size.",
        NoDatasetWarning,
        stacklevel=3,  # the caller of PPOTrainer(...)
    )

def _is_plain_model(model) -> bool:
    """A transformers model or a PEFT model of one, without a value head."""
    return isinstance(model, PreTrainedModel) or is_peft_model(model)


def check_constructor_args(
    config, model, ref_model, tokenizer, optimizer, lr_scheduler, num_shared_layers, value_model=None
):
    if not isinstance(config, PPOConfig):
        raise TypeError(f"config must be a PPOConfig, got {type(config).__name__}.")
    config.validate()  # fields may have been changed after the config was built
    if not isinstance(model, SUPPORTED_MODELS) and not _is_plain_model(model):
        raise TypeError(
            "model must be an AutoModelForCausalLMWithValueHead or AutoModelForSeq2SeqLMWithValueHead, or (for a "
            "critic-free advantage_estimator) a plain transformers causal/seq2seq LM or PeftModel, "
            f"got {type(model).__name__}."
        )
    _check_plain_policy(config, model, value_model)
    if ref_model is not None and not isinstance(ref_model, SUPPORTED_MODELS) and not _is_plain_model(ref_model):
        raise TypeError(
            f"ref_model must be None, a value-head model or a plain transformers LM, got {type(ref_model).__name__}."
        )
    if ref_model is not None and ref_model is model:
        raise ValueError("ref_model is the same object as model; pass None to get a frozen copy.")
    if ref_model is not None and num_shared_layers is not None:
        # Classic ignores it with a warning; scripts that pass both must keep running.
        warnings.warn(
            f"num_shared_layers={num_shared_layers} is ignored: a ref_model was given, so the policy and the "
            "reference are separate models and share no layers.",
            UserWarning,
            stacklevel=3,
        )
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer or None, got {type(tokenizer).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        raise TypeError(f"lr_scheduler must be a torch LR scheduler or None, got {type(lr_scheduler).__name__}.")


def _check_plain_policy(config, model, value_model=None) -> None:
    """A plain LM has no value head to train: GAE needs one (or a critic), critic-free estimators do not."""
    if _is_plain_model(model) and not config.critic_free and value_model is None:
        raise ValueError(
            f"model is a plain {type(model).__name__} (no value head) but advantage_estimator='gae' needs values: "
            "pass a separate critic (value_model=...), use a critic-free advantage_estimator ('rloo', 'grpo', "
            "'reinforce_pp') or wrap the model with AutoModelForCausalLMWithValueHead.from_pretrained(model)."
        )


def wrap_plain_model(model):
    """``(value-head wrapper, True)`` for a plain transformers/PEFT LM, ``(model, False)`` otherwise.

    The wrapper gives the trainer ``logits_positions`` and the fused LM head; its value head is
    never run for a plain model. Made without touching the global RNG, so wrapping does not change
    what the run draws later.
    """
    if not _is_plain_model(model):
        return model, False
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    wrapper = AutoModelForSeq2SeqLMWithValueHead if encoder_decoder else AutoModelForCausalLMWithValueHead
    with torch.random.fork_rng(devices=[]):
        return wrapper(model), True


def choose_packing(config: PPOConfig, model, ref_model, critic) -> bool:
    """Whether ``step()`` packs mini-batches (``config.padding_free``): every model of its passes must support it.

    A reference made by the trainer copies ``model``; for a PEFT model it is ``model`` itself. The
    separate critic takes the policy's inputs, so it must pack too.
    """
    if config.padding_free is False:
        return False
    for name, wrapper in (("model", model), ("ref_model", ref_model), ("value_model", critic)):
        reason = packing_unsupported(wrapper) if wrapper is not None else None
        if reason is not None:
            if config.padding_free:
                raise ValueError(f"padding_free=True, but {name} cannot take packed rows: {reason}. Use padding_free=None or False.")
            return False
    return True


def packing_unsupported(wrapper: PreTrainedModelWrapper) -> str | None:
    """Why ``wrapper`` cannot take packed rows (:meth:`~.rows.InputLayout.packed`), or None when it can.

    Packing needs a decoder-only transformers model that takes ``position_ids`` and builds its
    attention mask with ``transformers.masking_utils`` (which detects packed rows from them), under an
    attention implementation that utility knows; prompt-learning adapters prepend tokens to each row.
    """
    if wrapper.is_encoder_decoder:
        return "it is an encoder-decoder"
    if wrapper.is_peft_model and wrapper.pretrained_model.active_peft_config.is_prompt_learning:
        return "its prompt-learning adapter prepends virtual tokens to every row"
    model = wrapper.transformers_model
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no position_ids"
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), model)
    if not hasattr(sys.modules.get(type(backbone).__module__), "create_causal_mask"):
        return f"{type(backbone).__name__} does not build its attention mask with transformers.masking_utils"
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"its attention implementation {implementation!r} is not one masking_utils builds packed masks for"
    return None


def check_critic_args(config, model, value_model, critic_optimizer):
    """Checks of the separate critic (docs/algorithm.md section 9); ValueModel checks the model itself."""
    if value_model is None:
        if critic_optimizer is not None:
            raise ValueError("critic_optimizer was given without value_model; pass both or neither.")
        return
    if not isinstance(value_model, (ValueModel, PreTrainedModel)) and not is_peft_model(value_model):
        raise TypeError(
            "value_model must be a transformers AutoModelForSequenceClassification (num_labels=1), a PEFT model "
            f"of one or a trl_lite ValueModel, got {type(value_model).__name__}."
        )
    policy = getattr(model, "pretrained_model", model)
    if value_model is model or value_model is policy:
        raise ValueError("value_model is the policy itself; the critic must be a model of its own.")
    if config.critic_free:
        raise ValueError(
            f"value_model was given but advantage_estimator={config.advantage_estimator!r} uses no values; "
            "a critic needs advantage_estimator='gae'."
        )
    if getattr(policy.config, "is_encoder_decoder", False):
        raise ValueError("value_model (a separate critic) needs a decoder-only policy, got an encoder-decoder.")
    policy_vocab = policy.get_input_embeddings().num_embeddings
    inner = value_model.pretrained_model if isinstance(value_model, ValueModel) else value_model
    critic_vocab = inner.get_input_embeddings().num_embeddings
    if critic_vocab < policy_vocab:
        raise ValueError(
            f"value_model reads the policy's token ids but its vocabulary has {critic_vocab} entries, fewer than "
            f"the policy's {policy_vocab}; a critic must use the policy's tokenizer."
        )
    if critic_optimizer is not None and not isinstance(critic_optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"critic_optimizer must be a torch.optim.Optimizer or None, got {type(critic_optimizer).__name__}."
        )


def resolve_group_ids(group_ids, queries, config) -> torch.Tensor | None:
    """The group id of each row ``(B,)`` for 'rloo'/'grpo' (None for the other estimators).

    Without ``group_ids``, consecutive runs of ``num_samples_per_query`` rows form the groups, and
    rows of one such group must hold the same query (else the batch was split or shuffled). Explicit
    ``group_ids`` name the groups themselves: their rows may hold different queries (members of a
    group that start apart, docs/algorithm.md section 16). Raises when a group has fewer than 2 rows,
    for such a mixed derived group, or for a malformed ``group_ids``.
    """
    estimator, n = config.advantage_estimator, config.batch_size
    if estimator not in GROUP_ESTIMATORS:
        if group_ids is not None:
            raise ValueError(
                f"group_ids apply only to advantage_estimator 'rloo' or 'grpo'; got group_ids with "
                f"advantage_estimator={estimator!r}."
            )
        return None
    if group_ids is None:
        if config.num_samples_per_query < 2:
            raise ValueError(
                f"advantage_estimator={estimator!r} needs groups of at least 2 responses per query: set "
                "num_samples_per_query >= 2 (consecutive rows form a group) or pass step(..., group_ids=...); "
                f"got num_samples_per_query={config.num_samples_per_query} and no group_ids."
            )
        ids = torch.arange(n) // config.num_samples_per_query
    else:
        if isinstance(group_ids, torch.Tensor):
            ids = group_ids.detach().cpu()
        elif isinstance(group_ids, (list, tuple)):
            ids = torch.as_tensor([int(g) if isinstance(g, (torch.Tensor, np.integer)) else g for g in group_ids])
        else:
            raise TypeError(f"group_ids must be a list or 1-D tensor of {n} ints, got {type(group_ids).__name__}.")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
            raise TypeError(f"group_ids must hold integer ids, got dtype {ids.dtype}.")
        if ids.dim() != 1 or len(ids) != n:
            raise ValueError(
                f"group_ids must hold one id per row, config.batch_size={n} (per process), got shape {tuple(ids.shape)}."
            )
    uniques, index, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        small = int(uniques[counts < 2][0])
        raise ValueError(
            f"group_ids: group {small} has {int(counts[counts < 2][0])} row in this batch; advantage_estimator="
            f"{estimator!r} needs at least 2 responses per query in each group, all in the same step() call "
            "of one process (a group must not be split across the batch or processes)."
        )
    if group_ids is None:
        size = config.num_samples_per_query
        for i in range(n):
            j = i - i % size
            if not torch.equal(queries[i].cpu(), queries[j].cpu()):
                raise ValueError(
                    f"rows {j} and {i} are in one group but their queries differ (num_samples_per_query={size} "
                    "consecutive rows form a group); the k responses of a query must be consecutive, as "
                    "generate(..., num_return_sequences=k) returns them, or pass step(..., group_ids=...) to name "
                    "the groups."
                )
    return index


def unscored_allowed(config) -> bool:
    """Whether ``step()`` takes NaN scores (unscored rows, docs/algorithm_objectives.md section 12): with the group
    estimators 'grpo' and 'rloo', without running-moment score scaling (a NaN would enter the moments)."""
    return config.advantage_estimator in ("grpo", "rloo") and not config.use_score_scaling


def validate_step_inputs(
    queries, responses, scores, response_masks, unscored: bool = False, *, batch_size: int, vocab_size: int | None,
    is_encoder_decoder: bool,
) -> None:
    """Reject a malformed batch with a message naming the argument and row, before any state changes.
    ``unscored``: a NaN score is accepted (:func:`unscored_allowed`); infinities never are.

    Returns per row its action tokens (host ints; the token budget's passes are planned from them)."""
    n = batch_size
    for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of {n} tensors, got {type(value).__name__}.")
        if len(value) != n:
            raise ValueError(
                f"{name} must hold config.batch_size={n} items (per process), got {len(value)}."
            )
    for name, seqs in (("queries", queries), ("responses", responses)):
        for i, seq in enumerate(seqs):
            if not isinstance(seq, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a 1-D torch.LongTensor of token ids, got {type(seq).__name__}.")
            if seq.dim() != 1:
                raise ValueError(f"{name}[{i}] must be 1-D (token ids), got shape {tuple(seq.shape)}.")
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise TypeError(f"{name}[{i}] must hold integer token ids, got dtype {seq.dtype}.")
            if seq.numel() == 0:
                raise ValueError(f"{name}[{i}] is empty; every query and response needs at least 1 token.")
        if vocab_size is not None and not _all_hold(seqs, lambda flat: (flat >= 0) & (flat < vocab_size)):
            lows = torch.stack([s.min().cpu() for s in seqs])
            highs = torch.stack([s.max().cpu() for s in seqs])
            i = int(((lows < 0) | (highs >= vocab_size)).nonzero()[0])
            raise ValueError(
                f"{name}[{i}] holds token ids outside [0, {vocab_size}) (the model's vocabulary): "
                f"min {int(lows[i])}, max {int(highs[i])}."
            )
    score_tensors = []
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, (torch.Tensor, int, float, np.number, np.ndarray)):
            raise TypeError(f"scores[{i}] must be a number or a 0-d tensor, got {type(score).__name__}.")
        score_t = torch.as_tensor(score)
        # As classic: a 1-element 1-D tensor is squeezed; anything with more dimensions is refused.
        if score_t.dim() > 1 or score_t.numel() != 1:
            raise ValueError(
                f"scores[{i}] must be one number: a float, a 0-d tensor or a 1-element 1-D tensor, got shape {tuple(score_t.shape)}."
            )
        score_tensors.append(score_t.float())
    def acceptable(t):
        return torch.isfinite(t) | (torch.isnan(t) if unscored else False)

    if not _all_hold(score_tensors, acceptable):
        i = next(i for i, t in enumerate(score_tensors) if not acceptable(t).all())
        accepted = "finite, or NaN for an unscored row" if unscored else "finite"
        raise ValueError(f"scores[{i}] must be {accepted}, got {score_tensors[i].item()}.")
    if response_masks is not None:
        if not isinstance(response_masks, (list, tuple)) or len(response_masks) != n:
            given = len(response_masks) if isinstance(response_masks, (list, tuple)) else type(response_masks).__name__
            raise ValueError(f"response_masks must be a list of {n} tensors (one per response), got {given}.")
        for i, (m, r) in enumerate(zip(response_masks, responses)):
            if not isinstance(m, torch.Tensor):
                raise TypeError(f"response_masks[{i}] must be a tensor of 0/1 like responses[{i}], got {type(m).__name__}.")
            if m.shape != r.shape:
                raise ValueError(
                    f"response_masks[{i}] must have the shape of responses[{i}], {tuple(r.shape)}, got {tuple(m.shape)}."
                )
        if not _all_hold(response_masks, lambda flat: (flat == 0) | (flat == 1)):
            i = next(i for i, m in enumerate(response_masks) if not ((m == 0) | (m == 1)).all())
            raise ValueError(f"response_masks[{i}] must hold only 0 and 1, got values {response_masks[i].unique().tolist()}.")
    actions = actions_per_row(responses, response_masks, shift=1 if is_encoder_decoder else 0)
    n_actions = sum(actions)
    if n_actions < 2:
        raise ValueError(
            f"responses/response_masks: the batch has {n_actions} action token(s) (response tokens with mask 1"
            f"{', excluding the first and last decoder token' if is_encoder_decoder else ''}); "
            "advantage whitening needs at least 2."
        )
    return actions


def _all_hold(tensors: list, check) -> bool:
    """Whether ``check`` (elementwise, to booleans) holds for every value of ``tensors``: one read of
    the host per device the tensors are on (one when they share it), however many rows there are."""
    return all(bool(check(flat).all()) for flat in concat_by_device(tensors))


def validate_generation_logprobs(generation_logprobs, responses) -> None:
    """``step(..., generation_logprobs=...)``: per response, a 1-D float tensor of its length holding
    finite log-probs (<= 0, up to rounding) - or None."""
    if generation_logprobs is None:
        return
    n = len(responses)
    if not isinstance(generation_logprobs, (list, tuple)) or len(generation_logprobs) != n:
        given = len(generation_logprobs) if isinstance(generation_logprobs, (list, tuple)) else type(generation_logprobs).__name__
        raise ValueError(f"generation_logprobs must be a list of {n} tensors (one per response), got {given}.")
    for i, (lp, r) in enumerate(zip(generation_logprobs, responses)):
        if not isinstance(lp, torch.Tensor) or not lp.dtype.is_floating_point:
            kind = f"a {lp.dtype} tensor" if isinstance(lp, torch.Tensor) else type(lp).__name__
            raise TypeError(f"generation_logprobs[{i}] must be a 1-D float tensor (one log-prob per token), got {kind}.")
        if lp.shape != r.shape:
            raise ValueError(
                f"generation_logprobs[{i}] must have the shape of responses[{i}], {tuple(r.shape)}, got {tuple(lp.shape)}."
            )

    def log_probability(flat):
        return torch.isfinite(flat) & (flat <= 1e-4)

    if not _all_hold([lp.float() for lp in generation_logprobs], log_probability):
        i, lp = next((i, lp) for i, lp in enumerate(generation_logprobs) if not log_probability(lp.float()).all())
        raise ValueError(
            f"generation_logprobs[{i}] must hold finite log-probabilities (<= 0), got values in "
            f"[{lp.min().item()}, {lp.max().item()}]."
        )


def kept_sets_of(kept_sets, queries, responses, is_encoder_decoder: bool, records) -> list | None:
    """``step(..., kept_sets=...)`` checked - per response a one-row :class:`~trl_lite.core.kept_sets.KeptSets` over
    its generated tokens (``len(response)``, an encoder-decoder's less its start token) or None - or, when not given,
    the sets ``records`` (the engine's :class:`~trl_lite.core.kept_sets.RecordedSets`) holds for the rows' tokens.
    ``records`` is emptied either way (docs/truncated_sampling.md)."""
    recorded = records.take(queries, responses) if kept_sets is None else records.clear()
    if kept_sets is None:
        return recorded
    if not isinstance(kept_sets, (list, tuple)) or len(kept_sets) != len(responses):
        given = len(kept_sets) if isinstance(kept_sets, (list, tuple)) else type(kept_sets).__name__
        raise ValueError(f"kept_sets must be a list of {len(responses)} KeptSets or None (one per response), got {given}.")
    shift = 1 if is_encoder_decoder else 0
    for i, (kept, response) in enumerate(zip(kept_sets, responses)):
        if kept is not None and (not isinstance(kept, KeptSets) or kept.width != max(len(response) - shift, 0)
                                 or kept.offsets.numel() != kept.width + 1):  # fmt: skip
            what = f"KeptSets of width {kept.width}" if isinstance(kept, KeptSets) else type(kept).__name__
            raise ValueError(f"kept_sets[{i}] must be None or a one-row KeptSets over the {len(response) - shift} "
                             f"generated tokens of responses[{i}], got {what}.")  # fmt: skip
    return list(kept_sets)


def validate_ptx_inputs(ptx_inputs, config, is_encoder_decoder: bool, vocab_size: int) -> None:
    """``step()``'s ``ptx_inputs``: None, or (with ``ptx_coef > 0``) ``batch_size`` 1-D token rows of 2+ tokens."""
    if ptx_inputs is None:
        return
    n = config.batch_size
    if config.ptx_coef <= 0:
        raise ValueError(f"ptx_inputs were given but config.ptx_coef={config.ptx_coef}; set ptx_coef > 0.")
    if is_encoder_decoder:
        raise ValueError("ptx_inputs (a language-modelling loss) need a decoder-only policy.")
    if not isinstance(ptx_inputs, (list, tuple)) or len(ptx_inputs) != n:
        given = len(ptx_inputs) if isinstance(ptx_inputs, (list, tuple)) else type(ptx_inputs).__name__
        raise ValueError(f"ptx_inputs must be a list of config.batch_size={n} 1-D token tensors, got {given}.")
    for i, seq in enumerate(ptx_inputs):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.dtype.is_floating_point:
            raise TypeError(f"ptx_inputs[{i}] must be a 1-D tensor of token ids, got {seq!r:.80}.")
        if len(seq) < 2:
            raise ValueError(f"ptx_inputs[{i}] has {len(seq)} token(s); a next-token loss needs at least 2.")
        if int(seq.min()) < 0 or int(seq.max()) >= vocab_size:
            raise ValueError(f"ptx_inputs[{i}] holds token ids outside [0, {vocab_size}) (the model's vocabulary).")


def staleness(policy_version, current_step: int, batch_size: int) -> torch.Tensor | None:
    """``step()``'s ``policy_version`` (the ``current_step`` whose weights generated the batch: one int,
    or one per row) as the rows' staleness ``current_step - version``, float ``(B,)``; None stays None."""
    if policy_version is None:
        return None
    versions = [policy_version] * batch_size if isinstance(policy_version, (int, np.integer)) else policy_version
    if isinstance(policy_version, bool) or not isinstance(versions, (list, tuple)) or len(versions) != batch_size:
        raise ValueError(
            f"policy_version must be an int or a list of config.batch_size={batch_size} ints, got {policy_version!r:.80}."
        )
    for i, version in enumerate(versions):
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or not 0 <= version <= current_step:
            raise ValueError(
                f"policy_version[{i}] must be an int in [0, {current_step}] (the trainer's step counter when the "
                f"row was generated, at most the current step), got {version!r}."
            )
    return torch.tensor([current_step - int(v) for v in versions], dtype=torch.float32)
