"""The policy's weights as an engine takes them, and when to push them.

An engine with its own copy of the policy (vLLM) gets the transformers model's ``state_dict`` names
(no value head), one tensor at a time: for a PEFT model the merged weight ``W + delta`` of each
adapted layer, computed for the push while the adapter stays unmerged for training; under ZeRO-3
one module's parameters gathered at a time, so no process ever holds a second full copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch


def named_policy_weights(model: torch.nn.Module, is_zero3: bool = False,
                         merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """``(name, tensor)`` pairs of ``model``'s persistent state with transformers' names, merged for PEFT.

    ``merge_adapters=False``: a PEFT model's base weights alone, its adapters left out (an engine
    that serves the adapter itself; under ZeRO-3 only the base layer of an adapted layer is gathered).
    A layer PEFT trains whole (``modules_to_save``) is given as its active trained copy, under the
    layer's own name.

    ``model``: a transformers ``PreTrainedModel`` or a ``PeftModel`` of one (not a value-head wrapper:
    pass its ``pretrained_model``). A tensor shared by two modules (tied embeddings) is given under
    both names, as ``state_dict`` does: vLLM's CPU backend keeps its own LM head even when tied.
    Under ZeRO-3 each tensor is a full copy only while the caller consumes it (the next one is
    gathered after), so consume the iterator in order and copy what you keep.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inside_adapted: tuple[str, ...] = ()
    for prefix, module in base.named_modules():
        if inside_adapted and prefix.startswith(inside_adapted):
            continue  # the adapted layer's base_layer and lora_A/lora_B were handled with it
        if _is_trained_copy_wrapper(module):
            inside_adapted = (f"{prefix}.",)
            layer = _active_copy(module)
            tensors = list(layer.named_parameters()) + _persistent_buffers(layer)
            with gathered([t for _, t in tensors if isinstance(t, torch.nn.Parameter)], is_zero3):
                for name, tensor in tensors:
                    yield f"{prefix}.{name}", tensor.detach()
            continue
        if _is_adapted_layer(module):
            inside_adapted = (f"{prefix}.",)
            if not merge_adapters:
                base_layer = module.get_base_layer()
                with gathered(list(base_layer.parameters()), is_zero3):
                    yield from _base_layer(prefix, base_layer)
                continue
            with gathered(list(module.parameters()), is_zero3):
                yield from _merged_layer(prefix, module)
            continue
        tensors = [(n, p) for n, p in module.named_parameters(recurse=False)]
        tensors += [
            (n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set
        ]
        if not tensors:
            continue
        with gathered([t for _, t in tensors if isinstance(t, torch.nn.Parameter)], is_zero3):
            for name, tensor in tensors:
                yield (f"{prefix}.{name}" if prefix else name), tensor.detach()


def _is_adapted_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "active_adapters")


def _is_trained_copy_wrapper(module: torch.nn.Module) -> bool:
    """PEFT's ``ModulesToSaveWrapper``: the original layer and a trained copy per adapter."""
    return hasattr(module, "original_module") and isinstance(getattr(module, "modules_to_save", None),
                                                             torch.nn.ModuleDict)  # fmt: skip


def _active_copy(wrapper: torch.nn.Module) -> torch.nn.Module:
    """The copy the wrapper's forward runs: the active adapter's, else the original layer."""
    if not getattr(wrapper, "disable_adapters", False):
        for adapter in wrapper.active_adapters:
            if adapter in wrapper.modules_to_save:
                return wrapper.modules_to_save[adapter]
    return wrapper.original_module


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"{owner}.{name}" if owner else name, buffer)
        for owner, sub in module.named_modules()
        for name, buffer in sub.named_buffers(recurse=False)
        if name not in sub._non_persistent_buffers_set
    ]


def _merged_layer(prefix: str, layer) -> Iterator[tuple[str, torch.Tensor]]:
    """The base layer's weight plus the delta of every active adapter (unless merged already), and its bias."""
    if not hasattr(layer, "get_delta_weight"):
        raise ValueError(
            f"the adapted layer {prefix!r} ({type(layer).__name__}) cannot give a merged weight for the generation "
            "engine; LoRA-style adapters (LoRA, DoRA-free) on Linear/Conv1D/Embedding layers are supported."
        )
    base_layer = layer.get_base_layer()
    weight = base_layer.weight.detach()
    if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {}):
                weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    yield f"{prefix}.weight", weight
    yield from _bias(prefix, base_layer)


def _base_layer(prefix: str, base_layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """An adapted layer's own weight and bias, without its adapters."""
    yield f"{prefix}.weight", base_layer.weight.detach()
    yield from _bias(prefix, base_layer)


def _bias(prefix: str, base_layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    if getattr(base_layer, "bias", None) is not None:
        yield f"{prefix}.bias", base_layer.bias.detach()


def gathered(params: list, is_zero3: bool):
    """Under ZeRO-3, ``params`` gathered whole for the ``with`` block; otherwise nothing to do."""
    if not is_zero3 or not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


class WeightVersion:
    """Counts the policy's optimizer steps, so that an engine is pushed new weights once, lazily.

    A post-hook on the innermost torch optimizer (under accelerate and DeepSpeed wrappers alike)
    counts every update, from ``step()``, ``train_minibatch`` or the user's own loop;
    :meth:`bump` marks other changes (a loaded checkpoint).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.version = 0
        inner = optimizer
        while hasattr(inner, "optimizer") and inner.optimizer is not inner:
            inner = inner.optimizer
        self._handle = inner.register_step_post_hook(self._on_step) if hasattr(inner, "register_step_post_hook") else None

    def _on_step(self, *args) -> None:
        self.bump()

    def bump(self) -> None:
        self.version += 1

    def sync(self, current: int, push: Callable[[], None]) -> int:
        """Run ``push`` if ``current`` (the version the engine holds) is behind; return the version now held."""
        if current != self.version:
            push()
        return self.version
