"""PPOConfig.temperature on the generation side (docs/temperature.md): the one rule that resolves a call's
sampling kwargs against the run's temperature, the transformers engine's generation_logprobs at T=0.7 against a
float64 recomputation of log_softmax(z / 0.7) (greedy, sampled and top-k/top-p rows), the refusal of a
different temperature on every path (the asynchronous producer's policy copy included), and the vLLM side's checks
without starting vLLM."""

import copy

import pytest
import torch
from devices import on_cpu
from tiny_models import make_gpt2, make_tokenizer
from transformers import GenerationConfig

from trl_lite import AutoModelForCausalLMWithValueHead, BestOfNSampler, LengthSampler, PPOConfig, PPOTrainer
from trl_lite.engines import (
    Sampling,
    VLLMEngine,
    check_vllm_logprobs,
    colocated_llm_options,
    engine_placement,
    named_policy_weights,
    resolve_sampling_kwargs,
    vllm_logprobs_mode,
)
from trl_lite.engines.transformers_engine import _sampled_logprobs
from trl_lite.rollouts.producer_generation import PolicyCopyEngine, policy_copy

QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15])]
T = 0.7


def test_the_config_temperature_is_a_positive_finite_number():
    assert PPOConfig().temperature == 1.0
    assert PPOConfig(temperature=0.6).temperature == 0.6
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"temperature must be a positive finite number, got {bad}"):
            PPOConfig(temperature=bad)
    with pytest.raises(TypeError, match="temperature must be a positive number, got '0.7'"):
        PPOConfig(temperature="0.7")


def test_resolve_sampling_kwargs_samples_at_the_run_temperature_and_refuses_another():
    # At every run temperature, 1.0 included, a sampling call gets it; a greedy call gets none.
    for run in (1.0, T):
        expected = {"do_sample": True, "top_k": 0, "temperature": run, "top_p": 1.0}
        assert resolve_sampling_kwargs({"do_sample": True, "top_k": 0}, Sampling(run)) == expected
    assert resolve_sampling_kwargs({"do_sample": False}, Sampling(T)) == {"do_sample": False}
    # Left unset, do_sample is the model's generation config's, whose own temperature the run's overrides.
    sampling_model = GenerationConfig(do_sample=True, temperature=0.3)
    with pytest.warns(UserWarning, match="has temperature=0.3, but PPOConfig samples with temperature=0.7"):
        assert resolve_sampling_kwargs({}, Sampling(T), sampling_model) == {"temperature": T, "top_k": 0, "top_p": 1.0}
    assert resolve_sampling_kwargs({"do_sample": False}, Sampling(T), sampling_model) == {"do_sample": False}
    given = {"do_sample": True, "temperature": 0.7}
    assert resolve_sampling_kwargs(given, Sampling(T)) == {**given, "top_k": 0, "top_p": 1.0}
    for run, other in ((T, 1.0), (1.0, 0.5)):  # the classic run refuses another temperature too
        with pytest.raises(ValueError, match=rf"generate\(\) got temperature={other}, but PPOConfig.temperature={run}"):
            resolve_sampling_kwargs({"do_sample": True, "temperature": other}, Sampling(run))
    with pytest.raises(TypeError, match="temperature must be a number, got 'hot'"):
        resolve_sampling_kwargs({"temperature": "hot"}, Sampling(T))
    with pytest.raises(ValueError, match="temperature must be a finite number, got inf"):
        resolve_sampling_kwargs({"temperature": float("inf")}, Sampling(T))


def make_trainer(**config):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=3))
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, **config), model, tokenizer=make_tokenizer())


def float64_logprobs(lm64, query, response, temperature):
    """log_softmax(z / temperature) of each response token, z from one float64 forward pass of query + response."""
    with torch.no_grad():
        logits = lm64(input_ids=torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, response[:, None]).squeeze(-1)


def worst_gap(rows, logprobs, lm64, queries, k, temperature):
    """The largest |engine - float64| over all tokens of rows that hold their query (return_prompt=True)."""
    worst = 0.0
    for index, (row, row_logprobs) in enumerate(zip(on_cpu(rows), on_cpu(logprobs))):
        query = queries[index // k]
        assert row[: len(query)].tolist() == query.tolist()
        expected = float64_logprobs(lm64, query, row[len(query) :], temperature)
        assert row_logprobs.shape == expected.shape
        worst = max(worst, float((row_logprobs.double() - expected).abs().max()))
    return worst


def test_transformers_engine_logprobs_are_those_of_logits_over_the_temperature_for_greedy_and_sampled_rows():
    trainer = make_trainer(temperature=T)
    lm64 = copy.deepcopy(trainer.model.pretrained_model).double().cpu().eval()
    torch.manual_seed(0)
    common = dict(batch_size=2, return_prompt=True, return_logprobs=True, max_new_tokens=6)
    rows, logprobs = trainer.generate(QUERIES, do_sample=True, top_k=0, num_return_sequences=2, **common)
    assert worst_gap(rows, logprobs, lm64, QUERIES, 2, T) < 1e-5
    greedy_rows, greedy_logprobs = trainer.generate(QUERIES, do_sample=False, **common)
    assert worst_gap(greedy_rows, greedy_logprobs, lm64, QUERIES, 1, T) < 1e-5
    # Not the temperature-1 log-probs: the gap to those is far above float32 noise.
    assert worst_gap(greedy_rows, greedy_logprobs, lm64, QUERIES, 1, 1.0) > 1e-2


def test_with_top_k_and_top_p_the_logprobs_are_renormalised_over_the_warpers_kept_set_not_penalised_scores():
    # PPO_SPEC section 23: the distribution that sampled, log pi_T^K - softmax(z / T) renormalised over the set the
    # warpers kept (a float64 brute force of the rule), which a full-vocabulary log-prob is not.
    from test_truncated_step import brute_logprobs

    trainer = make_trainer(temperature=T, top_k=5, top_p=0.8)
    lm = trainer.model.pretrained_model
    lm64 = copy.deepcopy(lm).double().cpu().eval()
    torch.manual_seed(1)
    rows, logprobs = trainer.generate(QUERIES, batch_size=4, return_prompt=False, return_logprobs=True,
                                      max_new_tokens=5, do_sample=True)  # fmt: skip
    for query, row, got in zip(QUERIES, rows, logprobs):
        truncated, full = brute_logprobs(lm, query, row, dict(top_k=5, top_p=0.8))
        assert torch.allclose(got.double(), truncated, atol=1e-5)
        assert bool((truncated > full + 1e-3).all())
    query = QUERIES[0][None]
    torch.manual_seed(2)
    out = lm.generate(input_ids=query, attention_mask=torch.ones_like(query), do_sample=True, temperature=T, top_k=5,
                      top_p=0.8, max_new_tokens=5, output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    tokens = out.sequences[0, query.shape[1] :]
    processed = torch.log_softmax(torch.stack(out.scores, 1)[0].double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    untruncated = float64_logprobs(lm64, QUERIES[0], tokens, T)
    # Truncation renormalises over fewer tokens: the processed log-prob of a kept token is higher.
    assert bool((processed > untruncated + 1e-3).all())


def test_generate_samples_at_the_config_temperature_unless_the_kwargs_give_one():
    trainer = make_trainer(temperature=T)
    lm = trainer.model.pretrained_model
    query = QUERIES[0]

    def direct(temperature, seed):
        torch.manual_seed(seed)
        ids = query[None]
        out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                          temperature=temperature, max_new_tokens=8, pad_token_id=0)  # fmt: skip
        return out[0, len(query) :].tolist()

    draws = []
    for seed in range(4):
        torch.manual_seed(seed)
        (row,) = trainer.generate([query], batch_size=1, return_prompt=False, do_sample=True, top_k=0, max_new_tokens=8)
        draws.append(row.tolist())
    assert draws == [direct(T, seed) for seed in range(4)]
    assert draws != [direct(1.0, seed) for seed in range(4)]  # the same seeds at temperature 1 draw otherwise
    # The single-query (classic) output samples at it too.
    torch.manual_seed(0)
    single = trainer.generate(query, return_prompt=False, do_sample=True, top_k=0, max_new_tokens=8)
    assert single[0].tolist() == direct(T, 0)


def test_a_call_that_leaves_sampling_to_the_models_generation_config_samples_at_the_run_temperature():
    trainer = make_trainer(temperature=T)
    lm = trainer.model.pretrained_model
    lm.generation_config.do_sample, lm.generation_config.temperature, lm.generation_config.top_k = True, 0.3, 0
    query = QUERIES[2]

    def draw(**kwargs):
        torch.manual_seed(7)
        ids = query[None]
        return lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, pad_token_id=0,
                           **kwargs)[0, len(query) :].tolist()  # fmt: skip

    torch.manual_seed(7)
    with pytest.warns(UserWarning, match="has temperature=0.3, but PPOConfig samples with temperature=0.7"):
        (row,) = trainer.generate([query], batch_size=1, return_prompt=False, max_new_tokens=8)
    assert row.tolist() == draw(temperature=T) != draw()  # the model's own 0.3 draws otherwise


def test_a_different_temperature_kwarg_is_refused_on_the_engines_paths_before_anything_is_generated():
    # (classic PPOTrainer.generate samples at it, with one warning: tests/test_classic_sampling_kwargs.py)
    trainer = make_trainer(temperature=T)
    message = r"got temperature=1.2, but PPOConfig.temperature=0.7"
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=message):
        trainer.generation.generate(QUERIES, do_sample=True, temperature=1.2, return_logprobs=True)
    with pytest.raises(ValueError, match=message):
        trainer.generation.generate(QUERIES[0], do_sample=True, temperature=1.2)
    with pytest.raises(ValueError, match=message):
        trainer.generation.engine.generate(QUERIES, {"do_sample": True, "temperature": 1.2}, None, 2, True, True, True)
    assert torch.equal(torch.get_rng_state(), state)  # nothing was sampled
    sampler = BestOfNSampler(trainer.model, make_tokenizer(), lambda texts: [0.0] * len(texts), LengthSampler(2, 4),
                             sample_size=2, temperature=T)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        sampler.generate([5, 6, 7], do_sample=True, temperature=1.2)
    with pytest.raises(ValueError, match="temperature must be a positive finite number, got 0"):
        BestOfNSampler(trainer.model, make_tokenizer(), len, LengthSampler(2, 4), temperature=0)


def test_best_of_n_samples_at_its_temperature():
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=3))
    tokenizer = make_tokenizer()
    texts = []

    def keep(batch):
        texts.append(list(batch))
        return [0.0] * len(batch)

    def draw(run_temperature, **kwargs):
        texts.clear()
        sampler = BestOfNSampler(policy, tokenizer, keep, LengthSampler(6, 7), sample_size=3, seed=5,
                                 temperature=run_temperature)  # fmt: skip
        sampler.generate([5, 6, 7], do_sample=True, top_k=0, **kwargs)
        return texts[0]

    assert draw(T) == draw(T, temperature=T)  # the sampler's temperature is the temperature kwarg it fills in
    with pytest.raises(ValueError, match="got temperature=0.7, but PPOConfig.temperature=1.0"):
        draw(1.0, temperature=T)
    assert draw(0.1) != draw(1.0)  # (the tiny model's logits are small: 0.7 and 1.0 may draw alike)


def test_at_temperature_one_the_log_probs_of_the_raw_logits_are_unchanged_bit_for_bit():
    torch.manual_seed(0)
    logits = tuple(torch.randn(3, 11) * 4 for _ in range(5))
    sequences = torch.randint(0, 11, (3, 9))
    classic = torch.log_softmax(torch.stack(logits, 1), -1).gather(-1, sequences[:, 4:, None]).squeeze(-1)
    assert torch.equal(_sampled_logprobs(sequences, logits, 1.0), classic)


class _RecordingBackend:
    """A vLLM backend stand-in: records the sampling parameters and answers one EOS-ended response."""

    def __init__(self, logprobs_mode):
        self.logprobs_mode = logprobs_mode
        self.params = None

    def generate(self, prompts, sampling_params):
        self.params = sampling_params
        return [[([4, 1], [-0.5, -0.25])] * p["n"] for p in sampling_params]


def test_vllm_engine_samples_at_the_config_temperature_and_refuses_logprobs_it_cannot_give():
    backend = _RecordingBackend(vllm_logprobs_mode(T))
    engine = VLLMEngine(backend, eos_token_id=1, pad_token_id=0, generation_defaults=GenerationConfig(),
                        sampling=Sampling(T))  # fmt: skip
    rows, logprobs = engine.generate(QUERIES[:2], {"do_sample": True, "top_k": 0, "max_new_tokens": 2}, None, 2,
                                     False, True, True)  # fmt: skip
    assert [p["temperature"] for p in backend.params] == [T, T] and backend.params[0]["logprobs"] == 0
    assert [r.tolist() for r in rows] == [[4, 1]] * 2 and [lp.tolist() for lp in logprobs] == [[-0.5, -0.25]] * 2
    backend.params = None
    # A run that truncates: vLLM's processed log-probs are the truncated distribution's, log pi_T^K - what the
    # trainer scores (PPO_SPEC section 23); its raw ones are untruncated, and refused.
    truncating = VLLMEngine(backend, 1, 0, GenerationConfig(), sampling=Sampling(T, top_k=50))
    truncating.generate(QUERIES[:1], {"do_sample": True, "max_new_tokens": 2}, None, 2, False, True, True)
    assert backend.params[0]["top_k"] == 50
    backend.params = None
    raw = VLLMEngine(_RecordingBackend("raw_logprobs"), 1, 0, GenerationConfig(), sampling=Sampling(1.0, top_p=0.8))
    with pytest.raises(ValueError, match=r"PPOConfig's top_p=0.8: this vLLM engine returns logprobs_mode='raw_logprobs'"):
        raw.generate(QUERIES, {"do_sample": True, "max_new_tokens": 2}, None, 2, False, True, True)
    with pytest.raises(ValueError, match="greedy decoding"):
        engine.generate(QUERIES, {"do_sample": False, "max_new_tokens": 2}, None, 2, False, True, True)
    with pytest.raises(ValueError, match="got temperature=1.0, but PPOConfig.temperature=0.7"):
        engine.generate(QUERIES, {"do_sample": True, "temperature": 1.0, "max_new_tokens": 2}, None, 2, False, True, True)
    assert backend.params is None  # every refusal came before the backend was asked
    # Without log-probs, greedy and truncated sampling are fine.
    truncating.generate(QUERIES[:1], {"do_sample": True, "max_new_tokens": 2}, None, 1, False, True, False)
    assert backend.params[0]["top_k"] == 50 and backend.params[0]["temperature"] == T


def test_which_vllm_logprobs_are_log_softmax_of_logits_over_the_temperature():
    sampled = {"temperature": T, "top_k": 0, "top_p": 1.0}
    assert vllm_logprobs_mode(1.0) == "raw_logprobs" and vllm_logprobs_mode(T) == "processed_logprobs"
    assert vllm_logprobs_mode(1.0, truncates=True) == "processed_logprobs"  # log pi_T^K at T = 1 too
    check_vllm_logprobs(sampled, T, "processed_logprobs")
    check_vllm_logprobs({**sampled, "top_p": 0.9}, T, "processed_logprobs", Sampling(T, top_p=0.9))  # the run's cut
    check_vllm_logprobs({"temperature": 1.3, "top_k": 50}, 1.0, "raw_logprobs")  # raw: always temperature 1's
    check_vllm_logprobs({"temperature": 0.0}, 1.0, "processed_logprobs")  # greedy at 1: processed = raw
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs', the log-probs at temperature 1"):
        check_vllm_logprobs(sampled, T, "raw_logprobs")
    with pytest.raises(ValueError, match="this one returns 'raw_logits'"):
        check_vllm_logprobs(sampled, 1.0, "raw_logits")
    for extra, named in (({"top_p": 0.9}, "top_p=0.9"), ({"min_p": 0.05}, "min_p=0.05"),
                         ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
                         ({"temperature": 0.9}, "sampling temperature 0.9"), ({"temperature": 0.0}, "greedy")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            check_vllm_logprobs({**sampled, **extra}, T, "processed_logprobs")
    placement = engine_placement(0, 0, 1, 1)
    options = dict(dtype="float32", max_model_len=32, enforce_eager=True, gpu_memory_utilization=0.3, seed=0,
                   enable_sleep_mode=False, on_gpu=False)  # fmt: skip
    assert "logprobs_mode" not in colocated_llm_options("dir", placement, **options)
    processed = colocated_llm_options("dir", placement, **options, logprobs_mode="processed_logprobs")
    assert processed["logprobs_mode"] == "processed_logprobs"


def test_the_async_producers_policy_copy_samples_and_scores_at_the_run_temperature():
    # max_staleness > 0 on the transformers engine generates on a copy of the policy (trl_lite.rollouts).
    trainer = make_trainer(temperature=T)
    policy = trainer.model.pretrained_model
    engine = PolicyCopyEngine(trainer.generation.engine, policy_copy(policy))
    engine.load_weights(named_policy_weights(policy))
    lm64 = copy.deepcopy(policy).double().cpu().eval()
    torch.manual_seed(0)
    rows, logprobs = engine.generate(QUERIES, {"do_sample": True, "top_k": 0, "max_new_tokens": 5}, None, 2, True, True,
                                     True)  # fmt: skip
    assert worst_gap(rows, logprobs, lm64, QUERIES, 1, T) < 1e-5
    with pytest.raises(ValueError, match="got temperature=1.2, but PPOConfig.temperature=0.7"):
        engine.generate(QUERIES, {"do_sample": True, "temperature": 1.2}, None, 2, True, True, True)
