"""Language models with a value head: one scalar value per token next to the next-token logits."""

import dataclasses
import functools
import inspect

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from .modeling_base import PreTrainedModelWrapper, is_peft_model

# Config attributes of architectures whose forward post-processes the LM head output (soft-capping,
# scaling); for these the fast path (backbone + LM head at chosen positions) would differ from forward.
_LOGIT_POSTPROCESSING_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling")
_INIT_STRATEGIES = (None, "normal")
# What a transformers forward calls its key/value cache: `cache` in later releases (5.24 warns on the old
# name, 5.40 drops it), classic `past_key_values` before. The wrappers keep classic's name for their callers.
_CACHE_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward) -> str:
    """The keyword under which a model's `forward` takes a cache, read from its signature."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in _CACHE_NAMES if name in parameters), "past_key_values")


def _returned_cache(outputs):
    """The cache a transformers output holds, under either name; None when it holds none."""
    # Read under the name the output's class declares: from 5.24 every look-up of the old name on an output
    # (`in` included) logs a deprecation, and a forward without a cache holds no `cache` entry to find first.
    declared = {field.name for field in dataclasses.fields(outputs)}
    return next((getattr(outputs, name) for name in _CACHE_NAMES if name in declared), None)


def _hidden_size(config) -> int:
    """Width of the last hidden state the value head reads (the decoder's, for encoder-decoders)."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for attribute in ("hidden_size", "n_embd", "d_model"):
        size = getattr(text_config, attribute, None)
        if isinstance(size, int):
            return size
    raise ValueError(
        f"cannot find the hidden size in {type(config).__name__}: expected one of hidden_size, n_embd, d_model"
    )


class ValueHead(nn.Module):
    """Optional dropout, then a linear map from each hidden state to one value.

    Shapes: hidden states (B, S, H) -> values (B, S). The head computes in its own dtype (float32
    unless cast), so low-precision hidden states are upcast first.
    """

    def __init__(self, config, summary_dropout_prob: float | None = None):
        super().__init__()
        if summary_dropout_prob is None:
            summary_dropout_prob = getattr(config, "summary_dropout_prob", None)
        if summary_dropout_prob is not None and not 0.0 <= summary_dropout_prob < 1.0:
            raise ValueError(f"summary_dropout_prob must be None or in [0, 1), got {summary_dropout_prob!r}")
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()
        self.summary = nn.Linear(_hidden_size(config), 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Values (B, S) from hidden states (B, S, H)."""
        # Moving to the head's device covers models split over devices (device_map), whose last layer
        # may not sit where the head does.
        hidden_states = hidden_states.to(device=self.summary.weight.device, dtype=self.summary.weight.dtype)
        return self.summary(self.dropout(hidden_states)).squeeze(-1)


def _check_logits_positions(logits_positions, batch_size: int) -> None:
    """Raise unless `logits_positions` is (batch_size, K) integers or a pair of equal-length 1-D integer tensors."""
    if isinstance(logits_positions, (tuple, list)):
        ok = len(logits_positions) == 2 and all(
            isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 1 for t in logits_positions
        )
        if not ok or logits_positions[0].shape != logits_positions[1].shape:
            raise TypeError(
                "logits_positions as a pair must be (rows, positions): two 1-D integer tensors of the same "
                f"length, got {logits_positions!r}"
            )
        return
    if not isinstance(logits_positions, torch.Tensor) or logits_positions.is_floating_point():
        raise TypeError(f"logits_positions must be an integer torch.Tensor, got {logits_positions!r}")
    if logits_positions.dim() != 2 or logits_positions.shape[0] != batch_size:
        raise ValueError(
            f"logits_positions must have shape (batch_size={batch_size}, K), got {tuple(logits_positions.shape)}"
        )


def gather_positions(tensor: torch.Tensor, positions) -> torch.Tensor:
    """Entries of `tensor` (B, S, D) at `positions`.

    `positions` (B, K) of sequence indices -> (B, K, D); or a pair `(rows, positions)` of 1-D
    tensors of length N -> (N, D), the entries `tensor[rows[n], positions[n]]`.
    """
    if isinstance(positions, (tuple, list)):
        rows, cols = (t.to(tensor.device) for t in positions)
        return tensor[rows, cols]
    index = positions.to(tensor.device).unsqueeze(-1).expand(-1, -1, tensor.shape[-1])
    return tensor.gather(1, index)


def _check_head_kwargs(kwargs: dict) -> None:
    """Raise ValueError for value-head arguments out of range (before any model is loaded or adapted)."""
    dropout = kwargs.get("summary_dropout_prob")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ValueError(f"summary_dropout_prob must be None or in [0, 1), got {dropout!r}")
    strategy = kwargs.get("v_head_init_strategy")
    if strategy not in _INIT_STRATEGIES:
        raise ValueError(f"v_head_init_strategy must be one of {_INIT_STRATEGIES}, got {strategy!r}")
    initializer_range = kwargs.get("v_head_initializer_range", 0.2)
    if not isinstance(initializer_range, (int, float)) or initializer_range < 0:
        raise ValueError(f"v_head_initializer_range must be a number >= 0, got {initializer_range!r}")


class _ValueHeadModel(PreTrainedModelWrapper):
    """What both value-head wrappers share: the head, its initialisation and the output tuple."""

    supported_args = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")

    def __init__(self, pretrained_model, **kwargs):
        super().__init__(pretrained_model)
        head_kwargs, unknown = self._split_kwargs(kwargs)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {sorted(unknown)}; "
                f"accepted: {list(self.supported_args)}"
            )
        _check_head_kwargs(head_kwargs)
        self.v_head = ValueHead(self.config, summary_dropout_prob=head_kwargs.get("summary_dropout_prob"))
        self._init_weights(
            head_kwargs.get("v_head_initializer_range", 0.2), head_kwargs.get("v_head_init_strategy", None)
        )
        output_embeddings = self.transformers_model.get_output_embeddings()
        if output_embeddings is not None:
            # Sit where the last hidden states come out, for models spread over devices.
            self.v_head.to(output_embeddings.weight.device)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """See `PreTrainedModelWrapper.from_pretrained`; value-head arguments are checked first."""
        _check_head_kwargs(kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _check_model(cls, model) -> None:
        """Raise ValueError for a model without a language-model head, or of the other architecture."""
        base = model.get_base_model() if is_peft_model(model) else model
        named = any(name.rpartition(".")[2] in cls.lm_head_namings for name, _ in base.named_modules())
        if base.get_output_embeddings() is None and not named:
            raise ValueError(
                f"{cls.__name__} needs a model with a language-model head, got {type(base).__name__}, which has "
                f"none (get_output_embeddings() is None and no module is named one of {cls.lm_head_namings}); "
                f"pass a model loaded with {cls.transformers_parent_class.__name__} (e.g. GPT2LMHeadModel, "
                "T5ForConditionalGeneration), or its name or path"
            )
        is_encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        expects_encoder_decoder = cls.transformers_parent_class is AutoModelForSeq2SeqLM
        if is_encoder_decoder != expects_encoder_decoder:
            kind = "an encoder-decoder" if is_encoder_decoder else "a decoder-only"
            other = f"AutoModelFor{'Seq2SeqLM' if is_encoder_decoder else 'CausalLM'}WithValueHead"
            raise ValueError(f"{cls.__name__} cannot wrap {kind} model ({type(model.config).__name__}); use {other}")

    def _init_weights(self, v_head_initializer_range: float = 0.2, v_head_init_strategy: str | None = None) -> None:
        """Initialise the head: None keeps torch's Linear default, "normal" draws N(0, range^2) weights, zero bias."""
        if v_head_init_strategy == "normal":
            self.v_head.summary.weight.data.normal_(mean=0.0, std=v_head_initializer_range)
            self.v_head.summary.bias.data.zero_()

    def linear_lm_head(self) -> nn.Linear | None:
        """The LM head, when a caller may apply it itself: a plain `nn.Linear` whose output at chosen
        positions is exactly the logits `forward` returns there. Otherwise None.

        With it, `forward(..., logits_positions=..., return_lm_head_inputs=True)` returns the head's
        inputs, and the caller can fuse the head with what it computes from the logits (see
        `trl_lite.core.logprobs_and_entropy_from_hidden`). None for encoder-decoders, heads of
        another type (PEFT adapters, quantised layers), and whenever `logits_positions` alone would run
        the full forward. A head partitioned by DeepSpeed ZeRO-3 holds only a shard of its weight (full
        shape `weight.ds_shape`) outside its own forward: a caller runs its computation inside the
        module's call (see `trl_lite.core.lm_head.call_head`).
        """
        return None

    @staticmethod
    def _outputs(lm_logits, loss, value, past_key_values, return_past_key_values: bool, upcast: bool = True):
        """The classic output tuple; logits in float32 so log-probabilities are computed in full precision."""
        if upcast:
            lm_logits = lm_logits.float()
        if return_past_key_values:
            return lm_logits, loss, value, past_key_values
        return lm_logits, loss, value

    def _prepare_kwargs(self, past_key_values, return_past_key_values: bool, kwargs: dict, callee: nn.Module) -> dict:
        """Forward kwargs: a cache built only when asked for or given (it costs memory in training), and a given
        one (as classic `past_key_values` or as `cache`) passed under the name `callee.forward` takes."""
        cache = kwargs.pop("cache", None)
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the key/value cache once, as past_key_values or as cache; both were given")
        cache = past_key_values if cache is None else cache
        kwargs.setdefault("use_cache", return_past_key_values or cache is not None)
        # Prompt-learning adapters (prefix tuning, ...) build their own cache.
        prompt_learning = self.is_peft_model and self.pretrained_model.active_peft_config.is_prompt_learning
        if cache is not None and not prompt_learning:
            kwargs[_cache_keyword(type(callee).forward)] = cache
        return kwargs


class AutoModelForCausalLMWithValueHead(_ValueHeadModel):
    """A decoder-only language model (transformers or PEFT) with a value head on its last hidden state.

    `model(input_ids, attention_mask=...)` returns `(lm_logits, loss, value)`: logits (B, S, V) in
    float32, the transformers loss (None without `labels`), values (B, S). With
    `logits_positions` (B, K), logits are computed only at those positions: (B, K, V); with a pair
    `(rows, positions)` of 1-D tensors of length N, only at those N entries: (N, V). Adding
    `return_lm_head_inputs=True` returns the LM head's inputs there instead of its logits (see
    `linear_lm_head`).
    """

    transformers_parent_class = AutoModelForCausalLM
    # Module names classic TRL looks for to decide that a model has an LM head (classic's values).
    lm_head_namings = ["lm_head", "embed_out"]

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        return_past_key_values: bool = False,
        logits_positions: torch.Tensor | None = None,
        return_lm_head_inputs: bool = False,
        return_values: bool = True,
        **kwargs,
    ):
        """Logits, loss and values; other kwargs (position_ids, labels, ...) go to the transformers model.

        Shapes: input_ids, attention_mask (B, S); logits_positions (B, K) of indices into S, or a
        pair (rows, positions) of N indices into B and S. Returns lm_logits (B, S, V), or (B, K, V)
        / (N, V) at `logits_positions`; loss or None; value (B, S);
        and past_key_values last when `return_past_key_values`. With `return_lm_head_inputs`, the
        first output is the LM head's input at `logits_positions`, (B, K, H) or (N, H), in the
        model's dtype. With `return_values=False` the value head does not run and value is None
        (critic-free training, a separate critic, the reference pass). A cache from an earlier call goes
        in as `past_key_values` (or `cache`) and reaches the model under the name its forward takes.
        """
        parts = self._backbone_and_lm_head(kwargs) if logits_positions is not None else None
        # The PEFT wrapper's forward passes its kwargs on: the name is the transformers model's.
        callee = parts[0] if parts is not None else self.transformers_model
        kwargs = self._prepare_kwargs(past_key_values, return_past_key_values, kwargs, callee)
        if return_lm_head_inputs and (parts is None or self.linear_lm_head() is None):
            raise ValueError(
                "return_lm_head_inputs=True needs logits_positions, no labels, and a model whose "
                f"linear_lm_head() is not None; got logits_positions={type(logits_positions).__name__}, "
                f"labels {'given' if 'labels' in kwargs else 'absent'}, "
                f"linear_lm_head()={type(self.linear_lm_head()).__name__}"
            )
        if parts is not None:
            backbone, lm_head = parts
            outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            hidden_states = outputs.last_hidden_state  # (B, S, H), after the final layer norm
            _check_logits_positions(logits_positions, hidden_states.shape[0])
            # Only the selected hidden states go through the LM head: no (B, S, V) tensor is built.
            selected, loss = gather_positions(hidden_states, logits_positions), None
            lm_logits = selected if return_lm_head_inputs else lm_head(selected)
        else:
            outputs = self.pretrained_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=return_values, **kwargs
            )
            hidden_states = outputs.hidden_states[-1] if return_values else None
            lm_logits, loss = outputs.logits, outputs.loss
            if logits_positions is not None:
                _check_logits_positions(logits_positions, lm_logits.shape[0])
                lm_logits = gather_positions(lm_logits, logits_positions)
        value = self.v_head(hidden_states) if return_values else None
        return self._outputs(
            lm_logits, loss, value, _returned_cache(outputs), return_past_key_values, upcast=not return_lm_head_inputs
        )

    def linear_lm_head(self) -> nn.Linear | None:
        """See `_ValueHeadModel.linear_lm_head`: here the LM head of the fast path, when it is a plain Linear."""
        parts = self._backbone_and_lm_head({})
        head = parts[1] if parts is not None else None
        # Exactly nn.Linear: subclasses (quantised layers) and adapters compute something else from
        # their weight. A ZeRO-3 head (its weight a shard outside the module's forward) is returned too: the
        # trainer calls the module itself, so DeepSpeed's hooks gather the weight (HeadPath.apply, trainer/step/head_path.py).
        if type(head) is not nn.Linear:
            return None
        return head

    def _backbone_and_lm_head(self, kwargs: dict):
        """(backbone, LM head) for the fast path, or None when it would not reproduce `forward`.

        The backbone is the transformers model's base model (`base_model_prefix`), whose last hidden
        state is what the LM head reads. Not used with `labels` (the loss needs every position),
        with prompt-learning adapters (they act in the PEFT forward) or with logit post-processing.
        """
        if "labels" in kwargs:
            return None
        if self.is_peft_model and self.pretrained_model.active_peft_config.is_prompt_learning:
            return None
        model = self.transformers_model
        if any(getattr(model.config, name, None) not in (None, 1) for name in _LOGIT_POSTPROCESSING_ATTRIBUTES):
            return None
        backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
        lm_head = model.get_output_embeddings()
        if not isinstance(backbone, nn.Module) or backbone is model or lm_head is None:
            return None
        return backbone, lm_head


class AutoModelForSeq2SeqLMWithValueHead(_ValueHeadModel):
    """An encoder-decoder language model (transformers or PEFT) with a value head on the decoder.

    `model(input_ids, attention_mask=..., decoder_input_ids=...)` returns `(lm_logits, loss, value)`:
    logits (B, S_dec, V) in float32, loss or None, values (B, S_dec).
    """

    transformers_parent_class = AutoModelForSeq2SeqLM
    lm_head_namings = ["lm_head", "embed_out", "output_projection"]

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        return_past_key_values: bool = False,
        logits_positions: torch.Tensor | None = None,
        return_values: bool = True,
        **kwargs,
    ):
        """Logits, loss and decoder values; other kwargs (decoder_input_ids, labels, ...) go to the model.

        Shapes: input_ids, attention_mask (B, S_enc); decoder_input_ids (B, S_dec); logits_positions
        (B, K) of decoder positions, or a pair (rows, positions) of length N. Returns lm_logits
        (B, S_dec, V), (B, K, V) or (N, V); loss or None;
        value (B, S_dec), or None with `return_values=False` (the head does not run); past_key_values
        last when `return_past_key_values` (a cache goes in as `past_key_values` or `cache`, as for the causal
        wrapper). The full forward runs even with `logits_positions`, whose logits are then gathered: decoder
        lengths in PPO are short, and the LM head input differs between architectures (T5 rescales it).
        """
        kwargs = self._prepare_kwargs(past_key_values, return_past_key_values, kwargs, self.transformers_model)
        outputs = self.pretrained_model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=return_values, **kwargs
        )
        value = self.v_head(outputs.decoder_hidden_states[-1]) if return_values else None
        lm_logits = outputs.logits
        if logits_positions is not None:
            _check_logits_positions(logits_positions, lm_logits.shape[0])
            lm_logits = gather_positions(lm_logits, logits_positions)
        return self._outputs(lm_logits, outputs.loss, value, _returned_cache(outputs), return_past_key_values)
