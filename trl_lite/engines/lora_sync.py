"""LoRA policies on vLLM: the engine serves the adapter, and each update pushes only the adapter.

With ``PPOConfig.vllm_lora_sync`` on, the engine is started with vLLM's LoRA support for the adapter's
rank, takes the base weights once (unmerged: the base layers' own weights), and after each update
takes only the adapter's ``lora_A``/``lora_B`` matrices, written in PEFT's format (an
``adapter_config.json`` and an ``adapter_model.safetensors``: the format vLLM loads adapters from)
into a directory the engine reads - the colocated engine's own temporary directory, or the directory
a server shares with the trainer. Each version is loaded under a new LoRA id and replaces the one
before it, so the engine holds one adapter however many updates there are; generation runs with it.

What vLLM cannot serve as an adapter is pushed merged instead (:func:`adapter_spec`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from .weight_sync import gathered, named_policy_weights

# vLLM 0.32's accepted values of max_lora_rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class AdapterSpec:
    """The policy's one active LoRA adapter, as the engine is started for and loads it.

    ``name``: PEFT's adapter name; ``rank``: its largest rank (``r`` and ``rank_pattern``);
    ``config``: its ``LoraConfig`` (written beside the weights as ``adapter_config.json``).
    """

    name: str
    rank: int
    config: object

    @property
    def engine_rank(self) -> int:
        """The smallest ``max_lora_rank`` vLLM accepts that holds the adapter."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)


def adapter_spec(model: torch.nn.Module, architectures: list[str]) -> tuple[AdapterSpec | None, str | None]:
    """The adapter vLLM can serve for ``model``, or None and the reason it cannot.

    ``model``: the policy's language model (a ``PeftModel`` for a LoRA policy); ``architectures``:
    its transformers architectures. vLLM serves one LoRA adapter without DoRA, bias, extra trained
    layers (``modules_to_save``, trainable tokens) or layer replication, on the linear projections
    of a model whose vLLM implementation supports LoRA, with a rank up to 512; adapters on
    embeddings or the LM head are pushed merged here.
    """
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or not config:
        return None, "the policy is not a PEFT model"
    if len(config) > 1:
        return None, f"the policy has {len(config)} adapters ({sorted(config)}); vLLM is given one"
    name, lora = next(iter(config.items()))
    peft_type = str(getattr(lora, "peft_type", ""))
    if not peft_type.endswith("LORA") or peft_type.endswith("ADALORA"):
        return None, f"the adapter is {peft_type or type(lora).__name__}, not LoRA"
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    classes = [ModelRegistry._try_load_model_cls(arch) for arch in architectures]
    if not any(cls is not None and supports_lora(cls) for cls in classes):
        return None, f"vLLM has no LoRA support for {architectures}"
    unsupported = [
        (bool(getattr(lora, "use_dora", False)), "DoRA"),
        (getattr(lora, "bias", "none") != "none", f"bias={lora.bias!r}"),
        (bool(getattr(lora, "lora_bias", False)), "lora_bias"),
        (bool(getattr(lora, "modules_to_save", None)), f"modules_to_save={lora.modules_to_save}"),
        (bool(getattr(lora, "trainable_token_indices", None)), "trainable_token_indices"),
        (bool(getattr(lora, "layer_replication", None)), "layer_replication"),
        (bool(getattr(lora, "alora_invocation_tokens", None)), "aLoRA"),
        (bool(getattr(lora, "use_qalora", False)), "QALoRA"),
        (bool(getattr(lora, "use_bdlora", False)), "block-diagonal LoRA"),
    ]
    features = [what for present, what in unsupported if present]
    if features:
        return None, f"vLLM cannot serve an adapter with {', '.join(features)}"
    adapted = [(prefix, module) for prefix, module in model.named_modules() if _holds(module, name)]
    if not adapted:
        return None, f"the adapter {name!r} adapts no layer"
    not_linear = sorted({prefix.rsplit(".", 1)[-1] for prefix, m in adapted if not _linear_base(m)})
    if not_linear:
        return None, f"the adapter adapts {not_linear}, which are not linear projections"
    head = _output_head(model)
    if any(m.get_base_layer() is head for _, m in adapted):
        return None, "the adapter adapts the LM head"
    trained_outside = [
        n for n, p in model.named_parameters() if p.requires_grad and ".lora_A." not in n and ".lora_B." not in n
    ]
    if trained_outside:
        return None, f"parameters outside the adapter are trained ({trained_outside[:3]}...)"
    rank = max([int(lora.r), *[int(r) for r in (getattr(lora, "rank_pattern", None) or {}).values()]])
    if rank > VLLM_LORA_RANKS[-1]:
        return None, f"the adapter's rank {rank} is over vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    return AdapterSpec(name, rank, lora), None


def _holds(module: torch.nn.Module, name: str) -> bool:
    lora_a = getattr(module, "lora_A", None)
    embedding_a = getattr(module, "lora_embedding_A", None)
    return (isinstance(lora_a, torch.nn.ModuleDict) and name in lora_a) or (
        isinstance(embedding_a, torch.nn.ParameterDict) and name in embedding_a
    )


def _linear_base(module: torch.nn.Module) -> bool:
    """A LoRA layer on a ``torch.nn.Linear`` (not an embedding, not GPT-2's ``Conv1D``)."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
    return isinstance(base, torch.nn.Linear) and not getattr(module, "lora_embedding_A", None)


def _output_head(model: torch.nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None


def resolve_lora_sync(requested: bool | None, spec: AdapterSpec | None, reason: str | None) -> AdapterSpec | None:
    """Whether the adapter goes to the engine (the spec) or the merged model (None).

    ``requested``: ``PPOConfig.vllm_lora_sync``. None: the adapter where vLLM can serve it, else the
    merged model, with the reason warned once - for a PEFT policy (a plain policy has nothing to say);
    True: the adapter, or ``ValueError`` with the reason; False: the merged model.
    """
    if requested is False:
        return None
    if spec is not None:
        return spec
    if requested:
        raise ValueError(
            f"vllm_lora_sync=True, but the adapter cannot be pushed to vLLM: {reason}. Set vllm_lora_sync=None "
            "(the merged model is pushed where the adapter cannot be) or False (always the merged model)."
        )
    if reason != "the policy is not a PEFT model":
        warnings.warn(f"vllm_lora_sync: pushing the merged model to vLLM at each update: {reason}.", stacklevel=3)
    return None


def named_adapter_weights(model: torch.nn.Module, spec: AdapterSpec,
                          is_zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The adapter's ``lora_A``/``lora_B`` weights under PEFT's saved names
    (``base_model.model.<layer>.lora_A.weight``): nothing of the base. Under ZeRO-3 each layer's two
    matrices are gathered while the caller consumes them (the base layer is never gathered)."""
    for prefix, module in model.named_modules():
        if not _holds(module, spec.name):
            continue
        a, b = module.lora_A[spec.name].weight, module.lora_B[spec.name].weight
        with gathered([a, b], is_zero3):
            yield f"{prefix}.lora_A.weight", a.detach()
            yield f"{prefix}.lora_B.weight", b.detach()


def write_peft_adapter(directory: str, named_tensors, config) -> None:
    """Write an adapter as PEFT saves one: ``adapter_model.safetensors`` (the tensors, copied to the
    CPU as they are read) and ``adapter_config.json`` (``config``, a PEFT ``LoraConfig``)."""
    os.makedirs(directory, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in named_tensors}
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config.save_pretrained(directory)


class ByteTally:
    """Counts the bytes of the tensors an iterator of ``(name, tensor)`` pairs gives, as they pass."""

    def __init__(self):
        self.bytes = 0

    def wrap(self, named_tensors):
        for name, tensor in named_tensors:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


@dataclass
class AdapterUpdate:
    """One adapter push: the base weights (None once the engine holds them) and the adapter."""

    base: Iterator | None
    adapter: Iterator

    def __iter__(self):
        """Every tensor, base first: what a process that does not push consumes to join ZeRO-3's gathers."""
        if self.base is not None:
            yield from self.base
        yield from self.adapter

    def counted(self, tally: ByteTally) -> AdapterUpdate:
        base = None if self.base is None else tally.wrap(self.base)
        return AdapterUpdate(base, tally.wrap(self.adapter))


class AdapterSync:
    """The adapter pushes of one engine: the base weights with the first (and after every wake of an
    engine that sleeps, whose sleep dropped them), the adapter every time.

    Args:
        model: the policy's ``PeftModel``; spec: its adapter (:func:`adapter_spec`);
        engine: the :class:`~.vllm_engine.VLLMEngine`; is_zero3: gather one layer at a time.
    """

    def __init__(self, model: torch.nn.Module, spec: AdapterSpec, engine, is_zero3: bool):
        self.model = model
        self.spec = spec
        self.engine = engine
        self.is_zero3 = is_zero3
        self._base_held = False

    def updates(self) -> AdapterUpdate:
        """What the next push sends (lazily: nothing is gathered before it is consumed)."""
        base = None
        if not self._base_held or self.engine.sleeps:
            base = named_policy_weights(self.model, self.is_zero3, merge_adapters=False)
            # Here, not in push(): under one server for several processes only the main one pushes,
            # and every process must gather the same tensors.
            self._base_held = True
        return AdapterUpdate(base, named_adapter_weights(self.model, self.spec, self.is_zero3))

    def push(self, update: AdapterUpdate) -> None:
        if update.base is not None:
            self.engine.load_weights(update.base)
        self.engine.load_adapter(update.adapter, self.spec.config)
