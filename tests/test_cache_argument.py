"""The value-head wrappers pass a key/value cache only when there is one, under the name the installed
transformers model's forward takes (classic `past_key_values`, or `cache` where later releases renamed it), and
return it as classic TRL does: the fourth output with `return_past_key_values=True`.
"""

import contextlib
import dataclasses
import functools
import inspect
import logging
import warnings
from typing import Any

import pytest
import torch
from tiny_models import VOCAB_SIZE, make_gpt2, make_qwen2, make_tokenizer, random_batch
from transformers import GPT2LMHeadModel, GPT2Model, LlamaConfig, LlamaForCausalLM
from transformers.utils import ModelOutput
from transformers.utils import logging as transformers_logging

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

PROMPT = torch.tensor([[5, 9, 12, 30, 7, 8]])
# The cache keyword of the installed transformers' GPT-2, which the stand-ins below call with the cache.
INSTALLED_NAME = "cache" if "cache" in inspect.signature(GPT2Model.forward).parameters else "past_key_values"


class _RecordingHandler(logging.Handler):
    """Keeps every record logged through the logger it is added to."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def no_deprecation_warnings():
    """Fail on any FutureWarning or DeprecationWarning raised inside the block (transformers' included), and on
    any deprecation transformers logs there (its `logger.warning_once` messages, which are no Python warnings)."""
    library_logger = logging.getLogger("transformers")  # the root of every transformers module's logger
    handler, level = _RecordingHandler(), library_logger.level
    # warning_once logs each message once per process: forgotten here, so an earlier test cannot hide it.
    transformers_logging.warning_once.cache_clear()
    library_logger.addHandler(handler)
    library_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        library_logger.removeHandler(handler)
        library_logger.setLevel(level)
    deprecations = [
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
    ]
    deprecations += [
        f"logged by {r.name}: {r.getMessage()}" for r in handler.records if "deprecat" in r.getMessage().lower()
    ]
    assert not deprecations, deprecations


class _RenamedCache:
    """Mixin: a transformers model whose forward takes the cache as `cache`, as transformers' later releases
    name it, warns on the old name like them, and records the cache keywords it was given."""

    def forward(self, input_ids=None, cache=None, **kwargs):
        given = (["cache"] if cache is not None else []) + [name for name in kwargs if name == "past_key_values"]
        self.calls = [*getattr(self, "calls", []), given]
        if "past_key_values" in kwargs:
            warnings.warn("past_key_values is deprecated; use cache instead.", FutureWarning, stacklevel=2)
        return super().forward(input_ids=input_ids, **{INSTALLED_NAME: cache}, **kwargs)


class RenamedCacheGPT2LMHeadModel(_RenamedCache, GPT2LMHeadModel):
    pass


class RenamedCacheGPT2Model(_RenamedCache, GPT2Model):
    pass


class _CacheNamedOutput(ModelOutput):
    """An output as transformers 5.24 builds them: the cache is the field `cache`, and any look-up of the old
    name (`in`, `[]`, `get`, the attribute) is answered from it with a logged (not raised) deprecation."""

    @staticmethod
    def _new_name(key):
        if key in ("past_key_values", "cache_params"):
            transformers_logging.get_logger("transformers.utils.generic").warning_once(
                "`past_key_values`/`cache_params` are deprecated. Use `cache` instead."
            )
            return "cache"
        return key

    def __contains__(self, key):
        return super().__contains__(self._new_name(key))

    def __getitem__(self, key):
        return super().__getitem__(self._new_name(key) if isinstance(key, str) else key)

    def get(self, key, default=None):
        return super().get(self._new_name(key), default)

    @property
    def past_key_values(self):
        return getattr(self, self._new_name("past_key_values"))


@functools.lru_cache(maxsize=None)
def _cache_named_type(output_type: type) -> type:
    """`output_type`'s fields with `past_key_values` renamed `cache`, as a `_CacheNamedOutput`."""
    names = ["cache" if f.name == "past_key_values" else f.name for f in dataclasses.fields(output_type)]
    return dataclasses.make_dataclass(
        f"CacheNamed{output_type.__name__}", [(name, Any, None) for name in names], bases=(_CacheNamedOutput,)
    )


class _CacheNamedOutputs:
    """Mixin: a transformers model whose forward returns its output as 5.24 names it (`cache`)."""

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        values = {("cache" if key == "past_key_values" else key): value for key, value in outputs.items()}
        return _cache_named_type(type(outputs))(**values)


class CacheNamedGPT2LMHeadModel(_CacheNamedOutputs, GPT2LMHeadModel):
    pass


class CacheNamedGPT2Model(_CacheNamedOutputs, GPT2Model):
    pass


def value_head_model(renamed: str | None) -> AutoModelForCausalLMWithValueHead:
    """A tiny GPT-2 with a value head; `renamed` = "lm" or "backbone" gives that part a forward taking `cache`."""
    lm = make_gpt2(seed=3)
    if renamed == "lm":
        lm.__class__ = RenamedCacheGPT2LMHeadModel
    elif renamed == "backbone":
        lm.transformer.__class__ = RenamedCacheGPT2Model
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    model.eval()
    return model


def cached_logits(model, positions: torch.Tensor | None, **cache_keyword) -> tuple:
    """(next-token logits through the cache (1, V), the same from one forward over the whole row (1, V)); the
    cache is built on all but the last token and passed back under `cache_keyword`'s name (or classic's)."""
    head, last = PROMPT[:, :-1], PROMPT[:, -1:]
    # With positions every call takes the fast path (the backbone, then the LM head at those positions).
    head_positions, last_positions = (None, None) if positions is None else (positions - 1, positions * 0)
    with torch.no_grad():
        _, _, _, cache = model(head, return_past_key_values=True, logits_positions=head_positions)
        name = next(iter(cache_keyword), "past_key_values")
        logits, _, value = model(last, **{name: cache}, logits_positions=last_positions)
        full, _, full_value = model(PROMPT, logits_positions=positions)
    assert value.shape == (1, 1)
    torch.testing.assert_close(value[:, -1], full_value[:, -1], rtol=0, atol=1e-5)
    return logits[:, -1], full[:, -1]


# Which part is renamed, and which path runs: a forward without logits_positions calls the LM (whose own call
# of its backbone is transformers' business), with them the backbone.
PATHS = [(None, False), (None, True), ("lm", False), ("lm", True), ("backbone", True)]
PATH_IDS = ["installed-full", "installed-fast", "renamed-lm-full", "renamed-lm-fast", "renamed-backbone-fast"]


@pytest.mark.parametrize("renamed, fast_path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_a_given_cache_is_used_under_the_callees_name_without_a_deprecation(renamed, fast_path, keyword):
    model = value_head_model(renamed)
    positions = torch.tensor([[PROMPT.shape[1] - 1]]) if fast_path else None
    with no_deprecation_warnings():
        through_cache, whole_row = cached_logits(model, positions, **{keyword: None})
    torch.testing.assert_close(through_cache, whole_row, rtol=0, atol=1e-5)
    # The part the wrapper called got the cache under its own name, and only in the call that had one.
    callee = model.pretrained_model.transformer if fast_path else model.pretrained_model
    if renamed == ("backbone" if fast_path else "lm"):
        assert callee.calls == [[], ["cache"], []]


@pytest.mark.parametrize("renamed, fast_path", PATHS, ids=PATH_IDS)
def test_no_cache_keyword_is_passed_when_there_is_no_cache(renamed, fast_path):
    model = value_head_model(renamed)
    positions = torch.tensor([[2, 5]]) if fast_path else None
    with no_deprecation_warnings(), torch.no_grad():
        logits, _, value = model(PROMPT, logits_positions=positions)
        reference = make_gpt2(seed=3).eval()(PROMPT).logits  # the same weights, untouched
    expected = reference[:, [2, 5]] if fast_path else reference
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert value.shape == PROMPT.shape
    if renamed == ("backbone" if fast_path else "lm"):  # the renamed part is the one the wrapper called
        part = model.pretrained_model.transformer if fast_path else model.pretrained_model
        assert part.calls == [[]]


def test_the_cache_comes_back_as_classic_returns_it():
    model = value_head_model(None)
    with torch.no_grad():
        outputs = model(PROMPT, return_past_key_values=True)
        plain = model(PROMPT)
    assert len(outputs) == 4 and len(plain) == 3
    cache = outputs[3]
    assert cache is not None and cache.get_seq_length() == PROMPT.shape[1]
    torch.testing.assert_close(outputs[0], plain[0], rtol=0, atol=0)


def test_a_cache_given_under_both_names_is_refused():
    model = value_head_model(None)
    with torch.no_grad():
        _, _, _, cache = model(PROMPT, return_past_key_values=True)
        with pytest.raises(ValueError, match="as past_key_values or as cache; both were given"):
            model(PROMPT[:, -1:], past_key_values=cache, cache=cache)


@pytest.mark.parametrize("fast_path", [False, True], ids=["full", "fast"])
@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "cache"])
def test_a_cache_named_output_is_read_without_a_logged_deprecation(fast_path, with_cache):
    """Outputs of transformers 5.24 name the cache `cache` and log a deprecation when asked for `past_key_values`,
    also by `in`: a forward (with or without a cache) reads them under their own name."""
    model = value_head_model(None)
    lm = model.pretrained_model
    # The part the wrapper calls: the LM on the full path (its own call of the backbone stays the installed one's).
    if fast_path:
        lm.transformer.__class__ = CacheNamedGPT2Model
    else:
        lm.__class__ = CacheNamedGPT2LMHeadModel
    positions = torch.tensor([[PROMPT.shape[1] - 1]]) if fast_path else None
    with no_deprecation_warnings(), torch.no_grad():
        outputs = model(PROMPT, logits_positions=positions, return_past_key_values=with_cache)
    cache = outputs[3] if with_cache else None
    assert len(outputs) == (4 if with_cache else 3)
    assert (cache.get_seq_length() == PROMPT.shape[1]) if with_cache else True
    reference = make_gpt2(seed=3).eval()(PROMPT).logits
    torch.testing.assert_close(outputs[0], reference[:, -1:] if fast_path else reference, rtol=0, atol=1e-5)


def test_the_check_fails_on_a_logged_deprecation():
    """What transformers logs with `warning_once` (no Python warning) fails the check, even when logged earlier."""
    lm = make_gpt2(seed=3)
    lm.__class__ = CacheNamedGPT2LMHeadModel
    outputs = lm(PROMPT)
    for _ in range(2):
        with pytest.raises(AssertionError, match="past_key_values.*deprecated"):
            with no_deprecation_warnings():
                outputs.get("past_key_values")


def make_llama(seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama (rotary positions, 2 query heads sharing one key/value head) over the tiny vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


ARCHITECTURES = {"gpt2": make_gpt2, "llama": make_llama, "qwen2": make_qwen2}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("padding_free", [None, False], ids=["packed", "padded"])
def test_step_and_generate_raise_no_deprecation_warning(padding_free, architecture):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(ARCHITECTURES[architecture](seed=4))
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, padding_free=padding_free, seed=0)
    with no_deprecation_warnings():
        trainer = PPOTrainer(config, model, tokenizer=make_tokenizer(), dataset=[{"input_ids": PROMPT[0]}] * 4)
        stats = trainer.step(*random_batch(4, seed=1))
        responses = trainer.generate([PROMPT[0], PROMPT[0, :3]], return_prompt=False, max_new_tokens=4, do_sample=False)
        single = trainer.generate(PROMPT[0], max_new_tokens=3, do_sample=True)
    assert torch.isfinite(torch.tensor(stats["ppo/loss/total"])).all()
    assert [len(r) for r in responses] == [4, 4] and single.shape == (1, PROMPT.shape[1] + 3)
