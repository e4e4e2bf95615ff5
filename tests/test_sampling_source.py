"""PPOConfig is the one source of the sampling distribution (docs/temperature.md, PPO_SPEC section 22), at
temperature 1.0 too: a model whose generation_config samples at 0.7 with top-k 20, top-p 0.8 and a repetition
penalty (as Qwen2.5-Instruct's does) is sampled from the untruncated softmax(z) by a default run - checked against
a float64 softmax of the model's logits and seed for seed against transformers' untruncated sampler - with one
warning naming both sides; a kwarg that disagrees with PPOConfig is refused on the engines' own paths (classic
PPOTrainer.generate samples with it, tests/test_classic_sampling_kwargs.py), and the classic neutral kwargs pass
silently."""

import copy
import warnings

import pytest
import torch
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer
from transformers import GenerationConfig

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.agents import run_episodes
from trl_lite.engines import Sampling, VLLMEngine, named_policy_weights, resolve_sampling_kwargs
from trl_lite.rollouts.producer_generation import PolicyCopyEngine, policy_copy

QUERY = torch.tensor([5, 6, 7, 8, 9])
# Qwen2.5-Instruct's generation_config.json, sampling part.
QWEN_INSTRUCT = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


def instruct_trainer(**config) -> PPOTrainer:
    """A tiny GPT-2 whose generation_config samples as Qwen2.5-Instruct's, its logits spread wide enough
    (embeddings x 3, tied to the head) that truncation and temperature move the draws visibly."""
    lm = make_gpt2(seed=3)
    with torch.no_grad():
        lm.transformer.wte.weight.mul_(3.0)
    lm.generation_config = GenerationConfig(**QWEN_INSTRUCT, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, **config), model, tokenizer=make_tokenizer())


def first_token_probs(lm, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0) -> torch.Tensor:
    """(V,) float64 probabilities of QUERY's next token under softmax(z / temperature), z from a float64 forward
    pass after the repetition penalty on the prompt's tokens, then cut to the top_k tokens, renormalised, cut to
    the smallest set holding top_p of that, and renormalised (transformers' order, written out here)."""
    lm64 = copy.deepcopy(lm).double().eval()
    with torch.no_grad():
        z = lm64(input_ids=QUERY[None]).logits[0, -1]
    seen = QUERY.unique()
    z[seen] = torch.where(z[seen] > 0, z[seen] / penalty, z[seen] * penalty)
    p = torch.softmax(z / temperature, -1)
    order = p.argsort(descending=True)
    if top_k:
        p[order[top_k:]] = 0.0
        p = p / p.sum()
    mass = 0.0
    for token in order.tolist():
        if mass >= top_p:
            p[token] = 0.0
        mass += float(p[token])
    return p / p.sum()


def test_a_default_run_samples_the_untruncated_t1_distribution_whatever_the_models_generation_config_says():
    trainer = instruct_trainer()
    lm = trainer.model.pretrained_model
    n = 20000
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = trainer.generate([QUERY], batch_size=1, return_prompt=False, max_new_tokens=1, num_return_sequences=n)
    counts = torch.bincount(torch.stack([row[0] for row in rows]), minlength=VOCAB_SIZE).double() / n
    untruncated = first_token_probs(lm)
    instruct = first_token_probs(lm, 0.7, top_k=20, top_p=0.8, penalty=1.05)
    # Total variation to the run's distribution: sampling noise (about 0.02 at this n); to the model's: the whole
    # mass its top-p cuts away and more.
    assert 0.5 * float((counts - untruncated).abs().sum()) < 0.04
    assert 0.5 * float((untruncated - instruct).abs().sum()) > 0.3
    assert float(counts[instruct == 0].sum()) > 0.2  # tokens the model's config never samples
    # One warning, naming the model's settings and PPOConfig's.
    messages = [str(w.message) for w in caught if "generation_config" in str(w.message)]
    assert len(messages) == 1
    for name, value in QWEN_INSTRUCT.items():
        if name != "do_sample":
            assert f"{name}={value!r}" in messages[0]
    assert "PPOConfig samples with temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0" in messages[0]


def test_seed_for_seed_every_engine_draws_what_transformers_untruncated_sampler_draws():
    trainer = instruct_trainer()
    lm = trainer.model.pretrained_model

    def direct(seed, **sampling):
        torch.manual_seed(seed)
        out = lm.generate(input_ids=QUERY[None], attention_mask=torch.ones_like(QUERY[None]), max_new_tokens=8,
                          pad_token_id=0, **sampling)  # fmt: skip
        return out[0, len(QUERY) :].tolist()

    draws = []
    for seed in range(3):
        torch.manual_seed(seed)
        (row,) = trainer.generate([QUERY], batch_size=1, return_prompt=False, max_new_tokens=8)
        draws.append(row.tolist())
    neutral = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    assert draws == [direct(seed, **neutral) for seed in range(3)]
    assert draws != [direct(seed) for seed in range(3)]  # the model's own settings draw otherwise
    # The single-query (classic) output too.
    torch.manual_seed(0)
    assert trainer.generate(QUERY, return_prompt=False, max_new_tokens=8)[0].tolist() == draws[0]
    # And the asynchronous producer's copy of the policy (max_staleness > 0), which copies the generation_config.
    copied = PolicyCopyEngine(trainer.generation.engine, policy_copy(lm))
    copied.load_weights(named_policy_weights(lm))
    torch.manual_seed(0)
    (row,), _ = copied.generate([QUERY], {"max_new_tokens": 8}, None, 1, False, True, False)
    assert row.tolist() == draws[0]


def test_a_run_that_asks_for_truncation_gets_it_and_logprobs_are_renormalised_over_the_warpers_set():
    trainer = instruct_trainer(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    lm = trainer.model.pretrained_model
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model agrees with the run: nothing to warn about
        rows, logprobs = trainer.generate([QUERY], batch_size=1, return_prompt=False, max_new_tokens=1,
                                          num_return_sequences=4000, return_logprobs=True)  # fmt: skip
    tokens = torch.stack([row[0] for row in rows])
    instruct = first_token_probs(lm, 0.7, top_k=20, top_p=0.8, penalty=1.05)
    assert float(instruct[tokens].min()) > 0  # only tokens the truncated sampler keeps
    counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double() / len(tokens)
    assert 0.5 * float((counts - instruct).abs().sum()) < 0.04
    # generation_logprobs: log pi_T^K (PPO_SPEC section 23) - z / 0.7 renormalised over the set the warpers kept
    # (after the penalty), not the penalised logits themselves, nor the full vocabulary.
    lm64 = copy.deepcopy(lm).double().eval()
    with torch.no_grad():
        z = lm64(input_ids=QUERY[None]).logits[0, -1]
    expected = torch.log_softmax((z / 0.7).masked_fill(instruct == 0, float("-inf")), -1)[tokens]
    assert float((torch.stack([lp[0] for lp in logprobs]).double() - expected).abs().max()) < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_sampling_kwarg_that_disagrees_with_ppoconfig_is_refused_on_the_engines_own_paths(temperature):
    trainer = instruct_trainer(temperature=temperature)
    state = torch.get_rng_state()
    for kwargs, message in (
        (dict(temperature=0.5), f"generate\\(\\) got temperature=0.5, but PPOConfig.temperature={temperature}"),
        (dict(top_k=20), "generate\\(\\) got top_k=20, but PPOConfig.top_k=0"),
        (dict(top_p=0.8), "got top_p=0.8, but PPOConfig.top_p=1.0"),
        (dict(repetition_penalty=1.05), "got repetition_penalty=1.05, but PPOConfig.repetition_penalty=1.0"),
        (dict(typical_p=0.9), "got typical_p=0.9, but PPOConfig, which has no typical_p setting"),
    ):  # fmt: skip
        # (classic PPOTrainer.generate samples with it: tests/test_classic_sampling_kwargs.py)
        with pytest.raises(ValueError, match=message):
            trainer.generation.generate([QUERY], do_sample=True, max_new_tokens=2, **kwargs)  # async rollouts' path
        with pytest.raises(ValueError, match=message):
            trainer.generation.engine.generate([QUERY], dict(do_sample=True, **kwargs), None, 1, True, True, False)
        with pytest.raises(ValueError, match=message):
            run_episodes(trainer, [[{"role": "user", "content": "a b"}]], max_new_tokens=2, do_sample=True, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)  # nothing was sampled


def test_classic_neutral_kwargs_pass_silently_and_greedy_decoding_stays_greedy():
    trainer = instruct_trainer()
    lm = trainer.model.pretrained_model
    classic = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True, "pad_token_id": 0}
    plain = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=3))  # transformers' default config
    plain_trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), plain, tokenizer=make_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain_trainer.generate([QUERY], return_prompt=False, max_new_tokens=3, **classic)
        plain_trainer.generate([QUERY], return_prompt=False, max_new_tokens=3, temperature=1, top_k=None)
    # Greedy decoding (evaluation) is allowed: the argmax of the unpenalised logits, the model's repetition
    # penalty overridden (it acts on greedy decoding too).
    with pytest.warns(UserWarning, match=r"repetition_penalty=1.05, but PPOConfig samples with repetition_penalty=1.0"):
        (row,) = trainer.generate([QUERY], return_prompt=False, max_new_tokens=6, do_sample=False)
    expected = lm.generate(input_ids=QUERY[None], attention_mask=torch.ones_like(QUERY[None]), do_sample=False,
                           repetition_penalty=1.0, max_new_tokens=6, pad_token_id=0)[0, len(QUERY) :]  # fmt: skip
    assert row.tolist() == expected.tolist()


def test_resolve_sampling_kwargs_writes_out_the_run_settings_and_overrides_the_model_with_one_warning():
    run = Sampling(temperature=0.7)
    assert resolve_sampling_kwargs({"do_sample": True}, run) == {"do_sample": True, "temperature": 0.7, "top_k": 0,
                                                                 "top_p": 1.0}  # fmt: skip
    assert resolve_sampling_kwargs({"do_sample": False}, run) == {"do_sample": False}
    assert resolve_sampling_kwargs({"max_new_tokens": 3}, run) == {"max_new_tokens": 3}  # greedy by default
    asks = Sampling(top_k=20, min_p=0.05, repetition_penalty=1.1)
    assert resolve_sampling_kwargs({"do_sample": True, "top_k": 20.0}, asks) == {
        "do_sample": True, "top_k": 20.0, "temperature": 1.0, "top_p": 1.0, "min_p": 0.05, "repetition_penalty": 1.1}
    assert resolve_sampling_kwargs({}, asks) == {"repetition_penalty": 1.1}  # greedy: only what greedy uses
    model = GenerationConfig(do_sample=True, temperature=0.3, min_p=0.1, no_repeat_ngram_size=3, top_h=0.5)
    with pytest.warns(UserWarning) as caught:
        kwargs = resolve_sampling_kwargs({}, Sampling(), model)
    assert kwargs == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "top_h": None,
                      "no_repeat_ngram_size": 0}  # fmt: skip
    assert len(caught) == 1 and "temperature=0.3, min_p=0.1, top_h=0.5, no_repeat_ngram_size=3" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model that agrees: no warning
        resolve_sampling_kwargs({}, Sampling(temperature=0.3, min_p=0.1), GenerationConfig(temperature=0.3, min_p=0.1))
    with pytest.raises(TypeError, match="the generation kwarg top_p must be a number, got 'high'"):
        resolve_sampling_kwargs({"top_p": "high"}, run)
    with pytest.raises(TypeError, match=r"sampling must be a trl_lite.engines.Sampling \(Sampling.of\(config\)\)"):
        resolve_sampling_kwargs({}, 0.7)


def test_the_config_sampling_fields_are_checked():
    config = PPOConfig(top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.1, temperature=0.7)
    assert Sampling.of(config) == Sampling(0.7, 20, 0.8, 0.05, 1.1) and Sampling.of(PPOConfig()) == Sampling()
    for bad, error, message in (
        (dict(top_k=-1), ValueError, r"top_k must be an int >= 0 \(0: off\), got -1"),
        (dict(top_k=2.5), ValueError, r"top_k must be an int >= 0 \(0: off\), got 2.5"),
        (dict(top_p=0.0), ValueError, r"top_p must be a number in \(0, 1\] \(1.0: off\), got 0.0"),
        (dict(top_p=1.5), ValueError, r"top_p must be a finite number in \[0.0, 1.0\], got 1.5"),
        (dict(min_p=-0.1), ValueError, r"min_p must be a finite number in \[0.0, 1.0\], got -0.1"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be a positive finite number, got 0.0"),
        (dict(top_p="1"), TypeError, "top_p must be a number, got '1'"),
    ):  # fmt: skip
        with pytest.raises(error, match=message):
            PPOConfig(**bad)


class _RecordingBackend:
    """A vLLM backend stand-in: records the sampling parameters and answers one EOS-ended response."""

    logprobs_mode = "raw_logprobs"

    def __init__(self):
        self.params = None

    def generate(self, prompts, sampling_params):
        self.params = sampling_params
        return [[([4, 1], [-0.5, -0.25])] * p["n"] for p in sampling_params]


def test_the_vllm_engine_samples_with_ppoconfigs_settings_not_the_models():
    backend = _RecordingBackend()
    model = GenerationConfig(**QWEN_INSTRUCT, min_p=0.05, typical_p=0.9)
    engine = VLLMEngine(backend, eos_token_id=1, pad_token_id=0, generation_defaults=model)
    with pytest.warns(UserWarning, match="the model's generation_config has temperature=0.7, top_k=20, top_p=0.8"):
        engine.generate([QUERY], {"max_new_tokens": 2}, None, 1, False, True, True)
    (params,) = backend.params
    assert (params["temperature"], params["top_k"], params["top_p"]) == (1.0, 0, 1.0)
    assert "min_p" not in params and "repetition_penalty" not in params  # vLLM's defaults: off
    with pytest.raises(ValueError, match="got top_p=0.8, but PPOConfig.top_p=1.0"):
        engine.generate([QUERY], {"do_sample": True, "top_p": 0.8}, None, 1, False, True, True)
    asks = VLLMEngine(backend, 1, 0, model, sampling=Sampling(top_k=20, repetition_penalty=1.05))
    with pytest.warns(UserWarning):
        asks.generate([QUERY], {"max_new_tokens": 2}, None, 1, False, True, False)
    (params,) = backend.params
    assert [params[name] for name in ("temperature", "top_k", "top_p", "repetition_penalty")] == [1.0, 20, 1.0, 1.05]
