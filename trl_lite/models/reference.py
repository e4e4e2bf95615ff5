"""Reference models: a frozen copy of the policy, optionally sharing its first layers (classic
``create_reference_model``)."""

import re
from contextlib import contextmanager
from copy import deepcopy

from torch import nn

from .modeling_base import is_peft_model

# Names of the first parameter of decoder layer `{layer}` in common architectures, tried in order.
LAYER_PATTERNS = (
    "transformer.h.{layer}",  # GPT-2, GPT-J, BLOOM, Falcon
    "model.decoder.layers.{layer}",  # OPT, BART-style decoders
    "gpt_neox.layers.{layer}",  # GPT-NeoX, Pythia
    "model.layers.{layer}",  # Llama, Mistral, Qwen, Gemma
    "encoder.block.{layer}",  # T5 (shares the embeddings and the first encoder blocks)
)


def _layer_regex(pattern: str, num_shared_layers: int):
    """Regex matching parameter names inside layer `num_shared_layers` of `pattern` (dot-delimited)."""
    return re.compile(r"(^|\.)" + re.escape(pattern.format(layer=num_shared_layers)) + r"\.")


def _check_reference_arguments(model, num_shared_layers, pattern) -> None:
    """Raise ValueError/TypeError for arguments `create_reference_model` cannot honour."""
    # ZeRO-3 marks the parameters it has partitioned with `ds_id`; a model not yet prepared copies fine
    # even while a ZeRO-3 config is active (PPOTrainer creates the reference before `prepare`).
    if any(hasattr(param, "ds_id") for param in model.parameters()):
        raise ValueError(
            "create_reference_model cannot copy a model partitioned by DeepSpeed ZeRO-3; "
            "load the reference model separately with from_pretrained"
        )
    if getattr(model, "is_peft_model", False) or is_peft_model(model):
        raise ValueError(
            "create_reference_model does not copy PEFT models: the reference of a PEFT model is the same "
            "model with its adapter disabled (pass ref_model=None to the trainer)"
        )
    if num_shared_layers is not None and (
        not isinstance(num_shared_layers, int) or isinstance(num_shared_layers, bool) or num_shared_layers < 0
    ):
        raise ValueError(f"num_shared_layers must be None or an int >= 0, got {num_shared_layers!r}")
    if pattern is not None and (not isinstance(pattern, str) or "{layer}" not in pattern):
        raise ValueError(
            f"pattern must be a str containing '{{layer}}' (e.g. 'transformer.h.{{layer}}'), got {pattern!r}"
        )


def _first_unshared_index(names: list, num_shared_layers: int, pattern) -> int:
    """Index in `names` of the first parameter of layer `num_shared_layers`; ValueError when absent."""
    patterns = [pattern] if pattern is not None else LAYER_PATTERNS
    for candidate in patterns:
        regex = _layer_regex(candidate, num_shared_layers)
        for index, name in enumerate(names):
            if regex.search(name):
                return index
    raise ValueError(
        f"no parameter matches layer {num_shared_layers} of pattern(s) {list(patterns)}: num_shared_layers must be "
        "smaller than the number of layers, and pattern must match the model's parameter names"
    )


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None):
    """A frozen copy of `model` in eval mode, to compute the reference log-probabilities of PPO.

    With `num_shared_layers=n`, every parameter before layer `n` (the embeddings and layers `0..n-1`,
    located with `pattern`, e.g. "transformer.h.{layer}", or with `LAYER_PATTERNS`) is not copied but
    shared: the reference holds the policy's own Parameter objects, and these are frozen in the policy
    too (as in classic TRL), which saves their memory and their optimizer state.
    """
    _check_reference_arguments(model, num_shared_layers, pattern)
    memo = {}
    if num_shared_layers is not None:
        named = list(model.named_parameters())
        first_unshared = _first_unshared_index([name for name, _ in named], num_shared_layers, pattern)
        # deepcopy returns the object itself for anything already in its memo, so the shared Parameters
        # (and tied aliases of them, e.g. GPT-2's lm_head.weight) are reused, never copied.
        memo = {id(param): param for _, param in named[:first_unshared]}
    ref_model = deepcopy(model, memo)
    # This also freezes the shared Parameters in the policy, which holds the very same objects.
    for param in ref_model.parameters():
        param.requires_grad_(False)
    return ref_model.eval()


@contextmanager
def reference_context(reference, policy, unwrapped_policy):
    """Yield the module that computes reference log-probs: ``reference``, or the PEFT ``policy`` with its adapter off."""
    if reference is not None:
        yield reference
    else:
        with unwrapped_policy.pretrained_model.disable_adapter():
            yield policy
