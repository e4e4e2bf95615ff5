"""The wrapper base class: loading, saving and hub upload (reference models: :mod:`.reference`).

`PreTrainedModelWrapper` holds a transformers model (or a PEFT model around one) in `pretrained_model`
and adds small extra modules, named in `supported_modules` (the value head, `v_head`). Checkpoints keep
the classic layout: the extra modules' tensors sit next to the base weights in the transformers
weight file(s) under their own prefix (`v_head.summary.weight`, ...). A PEFT model saves only its
adapter, so the extra modules go to `v_head.safetensors` beside it.
"""

import json
import logging
import os
import re
import tempfile

import torch
from huggingface_hub import HfApi
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import cached_file, is_peft_available

if is_peft_available():
    from peft import PeftConfig, PeftModel, get_peft_model

from .gguf import drop_gguf_quantizer
from .reward_adapter import adapter_weights_file, check_reward_adapter_arguments, load_score_head

logger = logging.getLogger(__name__)

# Name of the file holding the extra modules of a PEFT checkpoint (the adapter file holds no base weights).
EXTRA_MODULES_FILE = "v_head.safetensors"
# Files that may hold the extra modules' tensors, searched in this order; the last four are the classic layouts.
_EXTRA_MODULE_SOURCES = (
    EXTRA_MODULES_FILE,
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
# Keyword arguments of `from_pretrained` that locate files on the hub; reused to find the value-head file.
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
# Of those, the ones that describe the adapter repository rather than its base model.
_ADAPTER_ONLY_HUB_KWARGS = ("revision", "subfolder")
# Attribute holding the wrapped model; `named_parameters()` names start with it, `state_dict()` keys do not.
_WRAPPED_PREFIX = "pretrained_model."


def is_peft_model(model) -> bool:
    """True when `model` is a `peft.PeftModel` (always False when peft is not installed)."""
    return is_peft_available() and isinstance(model, PeftModel)


def _check_wrappable(model, argument: str) -> None:
    """Raise TypeError unless `model` is a transformers `PreTrainedModel` or a `peft.PeftModel`."""
    if not (isinstance(model, PreTrainedModel) or is_peft_model(model)):
        raise TypeError(
            f"{argument} must be a transformers.PreTrainedModel or a peft.PeftModel, got {type(model).__name__}"
        )


def _resolve_file(name_or_path: str, filename: str, hub_kwargs: dict):
    """Local path of `filename` in a local directory or hub repository, or None when it has no such file."""
    return cached_file(
        name_or_path,
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub_kwargs,
    )


def _read_tensors(path: str, prefixes: tuple) -> dict:
    """The tensors whose names start with one of `prefixes` in a safetensors or torch weight file."""
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys() if key.startswith(prefixes)}
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    return {key: value for key, value in state_dict.items() if key.startswith(prefixes)}


def load_extra_modules_state_dict(name_or_path: str, module_names, hub_kwargs: dict | None = None) -> dict:
    """Find the extra modules' tensors (e.g. `v_head.summary.weight`) saved with a checkpoint.

    Looks in `v_head.safetensors`, then in the transformers weight file(s), sharded or not, safetensors
    or torch pickles (the classic layout). Returns the first non-empty match, or `{}` when the
    checkpoint is a plain transformers one.
    """
    hub_kwargs = hub_kwargs or {}
    prefixes = tuple(f"{name}." for name in module_names)
    for filename in _EXTRA_MODULE_SOURCES:
        path = _resolve_file(name_or_path, filename, hub_kwargs)
        if path is None:
            continue
        if filename.endswith(".index.json"):
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            # Only the shards that hold extra-module tensors are opened (or downloaded).
            shards = sorted({shard for key, shard in weight_map.items() if key.startswith(prefixes)})
            tensors = {}
            for shard in shards:
                tensors.update(_read_tensors(_resolve_file(name_or_path, shard, hub_kwargs), prefixes))
        else:
            tensors = _read_tensors(path, prefixes)
        if tensors:
            return tensors
    return {}


def _drop_wrapped_prefix(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook: the wrapped model's keys lose `pretrained_model.` (classic TRL's naming).

    `module.state_dict()` then holds the transformers (or PEFT) model's own keys plus `v_head.*`
    (and any other extra module's keys). Keys are re-inserted in their original order.
    """
    inner = prefix + _WRAPPED_PREFIX
    own = [key for key in state_dict if key.startswith(prefix)]
    for key in own:
        value = state_dict.pop(key)
        state_dict[prefix + key[len(inner) :] if key.startswith(inner) else key] = value


def _add_wrapped_prefix(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load-state-dict pre-hook: accept classic keys (no `pretrained_model.`) and prefixed ones alike.

    A key under `prefix` that names neither the wrapped model nor one of the wrapper's own modules
    belongs to the wrapped model and gets its prefix back, so torch's loading finds its parameter.
    """
    own_modules = {name for name in module._modules if name != _WRAPPED_PREFIX[:-1]}
    for key in [key for key in state_dict if key.startswith(prefix)]:
        rest = key[len(prefix) :]
        if not rest.startswith(_WRAPPED_PREFIX) and rest.split(".", 1)[0] not in own_modules:
            state_dict[prefix + _WRAPPED_PREFIX + rest] = state_dict.pop(key)


# The wrapped model's prefix as a whole name segment, at the start of a key or after an outer prefix.
_WRAPPED_SEGMENT = re.compile(r"(^|\.)" + re.escape(_WRAPPED_PREFIX))


def _report_classic_keys(module, incompatible_keys) -> None:
    """Load-state-dict post-hook: missing and unexpected keys are reported in `state_dict()` naming.

    Callers compare them with `state_dict()` keys (safetensors' `load_model`, used by accelerate's
    `load_state`, does so to ignore tied weights it did not save).
    """
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [_WRAPPED_SEGMENT.sub(r"\1", key, count=1) for key in keys]


class PreTrainedModelWrapper(nn.Module):
    """A transformers (or PEFT) model plus extra modules, with transformers-style loading and saving.

    Subclasses set `transformers_parent_class` (the Auto class used to load a name or path),
    `supported_args` (their own keyword arguments, split from those of transformers) and create the
    modules named in `supported_modules`.
    """

    transformers_parent_class = None
    supported_args = ()
    supported_modules = ("v_head",)
    # Names the score head of a reward adapter may have in its adapter file (classic TRL's).
    supported_rm_modules = ("score",)

    def __init__(self, pretrained_model):
        super().__init__()
        _check_wrappable(pretrained_model, "pretrained_model")
        self._check_model(pretrained_model)
        # A model loaded from a GGUF file holds float weights but keeps a quantizer that refuses saving.
        drop_gguf_quantizer(pretrained_model)
        self.pretrained_model = pretrained_model
        # Hooks rather than overriding state_dict/load_state_dict: they also run when the wrapper
        # sits inside DDP or a DeepSpeed engine, which save and load it under their own prefix.
        self.register_state_dict_post_hook(_drop_wrapped_prefix)
        self.register_load_state_dict_pre_hook(_add_wrapped_prefix)
        self.register_load_state_dict_post_hook(_report_classic_keys)
        self.supports_rm_adapter = False
        self.rm_adapter_name = None
        self.policy_adapter_name = pretrained_model.active_adapter if is_peft_model(pretrained_model) else "default"
        self.config = pretrained_model.config
        self.is_peft_model = is_peft_model(pretrained_model)
        self.is_encoder_decoder = bool(getattr(self.config, "is_encoder_decoder", False))
        self.supports_gradient_checkpointing = bool(
            getattr(self.transformers_model, "supports_gradient_checkpointing", False)
        )

    @property
    def transformers_model(self) -> PreTrainedModel:
        """The transformers model itself: `pretrained_model`, or for a PEFT model the model it adapts.

        PEFT injects its adapter layers (e.g. LoRA) into this model in place, so calling it or its
        submodules still applies the adapter.
        """
        if self.is_peft_model:
            return self.pretrained_model.get_base_model()
        return self.pretrained_model

    @classmethod
    def _split_kwargs(cls, kwargs: dict):
        """Split `kwargs` into (this wrapper's `supported_args`, everything else)."""
        supported = {key: value for key, value in kwargs.items() if key in cls.supported_args}
        unsupported = {key: value for key, value in kwargs.items() if key not in cls.supported_args}
        return supported, unsupported

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Build the wrapper from a hub name, a local directory, a transformers model or a PEFT model.

        Keyword arguments in `supported_args` configure the wrapper; `peft_config` (a `peft.PeftConfig`)
        wraps the model in a new adapter; `is_trainable` (default False, as in peft) applies when
        loading a saved adapter; every other argument goes to transformers' `from_pretrained`.
        A directory saved by `save_pretrained` (or by classic TRL) restores the value head too; a plain
        transformers checkpoint or model object gets a freshly initialised one.
        """
        wrapper_kwargs, hf_kwargs = cls._split_kwargs(kwargs)
        peft_config = hf_kwargs.pop("peft_config", None)
        is_trainable = hf_kwargs.pop("is_trainable", False)
        reward_adapter = hf_kwargs.pop("reward_adapter", None)
        reward_adapter_name = hf_kwargs.pop("reward_adapter_name", "reward_adapter")
        _check_peft_config(peft_config)
        source = pretrained_model_name_or_path
        hub_kwargs = {key: hf_kwargs[key] for key in _HUB_KWARGS if key in hf_kwargs}
        if reward_adapter is not None:
            check_reward_adapter_arguments(reward_adapter, reward_adapter_name)
            # A missing adapter file is reported before any model is loaded or adapted.
            adapter_weights_file(reward_adapter, lambda name: _resolve_file(reward_adapter, name, hub_kwargs))
        if isinstance(source, (str, os.PathLike)):
            source = os.fspath(source)
            pretrained_model = cls._load_from_name(source, model_args, hf_kwargs, is_trainable, peft_config)
        else:
            _check_wrappable(source, "pretrained_model_name_or_path (when not a str or path)")
            # Before peft injects an adapter into the caller's model in place.
            cls._check_model(source)
            pretrained_model = source
        if peft_config is not None:
            # Before peft sees it: a quantized model gets the adapter set-up of quantized training.
            drop_gguf_quantizer(pretrained_model)
            pretrained_model = _add_adapter(pretrained_model, peft_config)
        if reward_adapter is not None and not is_peft_model(pretrained_model):
            raise ValueError(
                "reward_adapter needs a PEFT policy (the reward adapter is loaded beside the policy adapter): "
                f"pass peft_config=... or a peft.PeftModel, got a {type(pretrained_model).__name__}"
            )
        model = cls(pretrained_model, **wrapper_kwargs)
        if reward_adapter is not None:
            model._attach_reward_adapter(reward_adapter, reward_adapter_name, hub_kwargs)
        if isinstance(source, str):
            state_dict = load_extra_modules_state_dict(source, cls.supported_modules, hub_kwargs)
            if not state_dict and cls.supported_modules:
                logger.warning(
                    "No %s weights found in %s: freshly initialised.", ", ".join(cls.supported_modules), source
                )
            model.post_init(state_dict)
        return model

    @classmethod
    def _load_from_name(cls, source: str, model_args, hf_kwargs: dict, is_trainable: bool, peft_config):
        """Load a transformers model, or a base model plus its saved PEFT adapter, from a name or path."""
        hub_kwargs = {key: hf_kwargs[key] for key in _HUB_KWARGS if key in hf_kwargs}
        if _resolve_file(source, "adapter_config.json", hub_kwargs) is None:
            return cls.transformers_parent_class.from_pretrained(source, *model_args, **hf_kwargs)
        if peft_config is not None:
            raise ValueError(
                f"peft_config was given but {source} already holds a PEFT adapter; pass peft_config=None to load it"
            )
        adapter_config = PeftConfig.from_pretrained(source, **hub_kwargs)
        base_name = adapter_config.base_model_name_or_path
        if not base_name:
            raise ValueError(
                f"the adapter in {source} does not name its base model (base_model_name_or_path is empty); "
                "load the base model yourself and pass PeftModel.from_pretrained(base, adapter_dir)"
            )
        base_kwargs = {key: value for key, value in hf_kwargs.items() if key not in _ADAPTER_ONLY_HUB_KWARGS}
        base = cls.transformers_parent_class.from_pretrained(base_name, *model_args, **base_kwargs)
        return PeftModel.from_pretrained(base, source, is_trainable=is_trainable, **hub_kwargs)

    @classmethod
    def _check_model(cls, model) -> None:
        """Raise ValueError when `model` cannot be wrapped by this class (subclasses say why)."""

    @classmethod
    def add_and_load_reward_modeling_adapter(
        cls, pretrained_model, adapter_model_id: str, adapter_name: str = "reward_model_adapter", token=None, **hub_kwargs
    ) -> nn.Linear:
        """Load a reward model's adapter into the `PeftModel` `pretrained_model` as `adapter_name`.

        The adapter is frozen and not activated; the model keeps its training mode. Returns the
        reward model's score head (frozen `nn.Linear`, in the model's dtype) read from the adapter file.
        """
        if token is not None:
            hub_kwargs["token"] = token
        weights = adapter_weights_file(
            adapter_model_id, lambda filename: _resolve_file(adapter_model_id, filename, hub_kwargs)
        )
        if adapter_name in pretrained_model.peft_config:
            raise ValueError(
                f"reward_adapter_name={adapter_name!r} is already an adapter of the model "
                f"({sorted(pretrained_model.peft_config)}); choose another name"
            )
        base = pretrained_model.get_base_model()
        output_embeddings = base.get_output_embeddings()
        device = output_embeddings.weight.device if output_embeddings is not None else base.device
        score = load_score_head(weights, cls.supported_rm_modules, base.dtype, device)
        was_training = pretrained_model.training
        # peft puts the whole model in eval mode when it loads an adapter for inference.
        pretrained_model.load_adapter(adapter_model_id, adapter_name, is_trainable=False, **hub_kwargs)
        pretrained_model.train(was_training)
        return score

    def _attach_reward_adapter(self, reward_adapter: str, reward_adapter_name: str, hub_kwargs: dict) -> None:
        """Load the reward adapter beside the policy adapter and keep its score head as `self.score`."""
        self.score = self.add_and_load_reward_modeling_adapter(
            self.pretrained_model, reward_adapter, reward_adapter_name, **hub_kwargs
        )
        self.supports_rm_adapter = True
        self.rm_adapter_name = reward_adapter_name

    def _last_hidden_states(self, input_ids, attention_mask, kwargs: dict) -> torch.Tensor:
        """Last hidden states (B, S, H) of the transformers model, after its final norm.

        The base model (`base_model_prefix`) alone when it has one: no vocabulary-sized logits are
        computed. PEFT's LoRA layers sit inside it, so the active adapter applies.
        """
        model = self.transformers_model
        # The tokenizer gives CPU tensors: move the batch to the embeddings' device in one copy each.
        device = model.get_input_embeddings().weight.device
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
        backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if isinstance(backbone, nn.Module) and backbone is not model:
            return backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        outputs = self.pretrained_model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, return_dict=True, **kwargs
        )
        return outputs.hidden_states[-1]

    def compute_reward_score(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """Reward scores at every position, with the reward adapter active; no gradient.

        Shapes: input_ids, attention_mask (B, S) -> scores (B, S, num_labels): the reward model's
        score head on each position's last hidden state (a sequence classifier reads the last
        non-padding position). ``input_ids`` and ``attention_mask`` may sit on the CPU or on the model's
        device: they are moved to the device of the model's input embeddings; the scores are on that
        device, in the score head's dtype (classic TRL's layout and device). The model runs in eval mode with only the reward adapter on; the
        policy adapter, the training mode and every parameter's `requires_grad` are restored after,
        also when the forward raises. Other kwargs go to the transformers model.
        """
        if not self.supports_rm_adapter:
            raise ValueError(
                "compute_reward_score needs a reward adapter: build the model with "
                "from_pretrained(..., peft_config=..., reward_adapter=<adapter dir or hub id>)"
            )
        peft_model = self.pretrained_model
        was_training = self.training
        # peft's set_adapter also flips requires_grad of the adapters it (de)activates.
        requires_grad = [(param, param.requires_grad) for param in self.parameters()]
        try:
            peft_model.set_adapter(self.rm_adapter_name)
            self.eval()
            with torch.no_grad():
                hidden_states = self._last_hidden_states(input_ids, attention_mask, kwargs)
                return self.score(hidden_states.to(self.score.weight.dtype))
        finally:
            peft_model.set_adapter(self.policy_adapter_name)
            self.train(was_training)
            for param, flag in requires_grad:
                param.requires_grad_(flag)

    def post_init(self, state_dict: dict) -> None:
        """Load the extra modules' weights from a state dict keyed like `v_head.summary.weight`.

        Modules without keys in `state_dict` keep their current (fresh) weights; a module with keys
        must match them exactly.
        """
        for name in self.supported_modules:
            prefix = f"{name}."
            module_state = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
            if module_state:
                getattr(self, name).load_state_dict(module_state, strict=True)

    def _checkpoint_state_dicts(self, state_dict: dict | None):
        """Split a wrapper state dict into (wrapped model's entries, extra modules' entries).

        Accepts the wrapper's `state_dict()` (classic keys, the default; also what
        `accelerator.get_state_dict` returns) or keys with the `pretrained_model.` prefix (as DeepSpeed
        ZeRO-3 names its consolidated weights). Entries of the reward adapter's score head are left
        out: they are loaded from the reward adapter, not saved with the policy.
        """
        if state_dict is None:
            state_dict = self.state_dict()
        prefixes = tuple(f"{name}." for name in self.supported_modules)
        others = tuple(f"{name}." for name in self._modules if name not in (_WRAPPED_PREFIX[:-1], *self.supported_modules))
        extra = {key: value for key, value in state_dict.items() if key.startswith(prefixes)}
        base = {
            key[len(_WRAPPED_PREFIX) :] if key.startswith(_WRAPPED_PREFIX) else key: value
            for key, value in state_dict.items()
            if not key.startswith(prefixes + others)
        }
        return base, extra

    def save_pretrained(self, save_directory, **kwargs):
        """Save the model so that `from_pretrained(save_directory)` restores it, value head included.

        A transformers model is saved by its own `save_pretrained` with the value-head tensors added to
        its weight file(s); a PEFT model saves its adapter and `v_head.safetensors`. `state_dict`, if
        given, is a wrapper state dict (e.g. from `accelerator.get_state_dict(model)`); other keyword
        arguments go to the underlying `save_pretrained`.
        """
        base_state, extra_state = self._checkpoint_state_dicts(kwargs.pop("state_dict", None))
        if not self.is_peft_model:
            state_dict = {**base_state, **extra_state}
            return self.pretrained_model.save_pretrained(save_directory, state_dict=state_dict, **kwargs)
        result = self.pretrained_model.save_pretrained(save_directory, state_dict=base_state, **kwargs)
        if kwargs.get("is_main_process", True):
            os.makedirs(save_directory, exist_ok=True)
            tensors = {key: value.detach().cpu().contiguous() for key, value in extra_state.items()}
            save_file(tensors, os.path.join(save_directory, EXTRA_MODULES_FILE), metadata={"format": "pt"})
        return result

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        **save_kwargs,
    ):
        """Upload what `save_pretrained` writes (value head included) to the hub repository `repo_id`."""
        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp_dir:
            self.save_pretrained(tmp_dir, **save_kwargs)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp_dir,
                commit_message=commit_message or "Upload model with value head",
                revision=revision,
                create_pr=create_pr,
            )

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        """Turn on activation checkpointing in the transformers model (kwargs go to torch's checkpoint)."""
        model = self.transformers_model
        if hasattr(model, "activation_checkpointing_enable"):
            # transformers 5 renamed the method and deprecated the old name.
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs
            )
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self):
        """Turn off activation checkpointing in the transformers model."""
        model = self.transformers_model
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()

    def generate(self, *args, **kwargs):
        """Generate with the wrapped model (its `generate`, adapter included); the value head is not used."""
        return self.pretrained_model.generate(*args, **kwargs)


def _check_peft_config(peft_config) -> None:
    """Raise unless `peft_config` is None or a `peft.PeftConfig` (ImportError when peft is missing)."""
    if peft_config is None:
        return
    if not is_peft_available():
        raise ImportError("peft_config needs the peft package: pip install peft")
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config).__name__}")


def _add_adapter(model, peft_config):
    """Wrap a transformers model in a new PEFT adapter (ValueError for a model that already is a PeftModel)."""
    if is_peft_model(model):
        raise ValueError("peft_config was given but the model already is a PeftModel; pass peft_config=None")
    return get_peft_model(model, peft_config)
