"""The colocated vLLM engine of a run at PPOConfig.temperature=0.7 (docs/temperature.md): started with
logprobs_mode='processed_logprobs', its generation_logprobs of sampled rows equal a float64 recomputation of
log_softmax(z / 0.7) to vLLM's own float32 noise - with a model whose generation_config truncates, which PPOConfig
overrides - and the requests whose processed log-probs would be another distribution's (greedy rows, top-k/top-p)
or another temperature's are refused before anything is generated;
the same log-probs from a server launched with ``-- --logprobs-mode processed_logprobs``, whose mode the client
reads from the server; and a step on the engine's rows whose lp_old (under z / 0.7) shows only vLLM's own gap.
"""

import pytest
import torch
from engine_checks import assert_sampled_rows_and_logprobs
from test_vllm_server import launched_server
from tiny_models import make_gpt2, make_tokenizer
from transformers import GenerationConfig

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

import vllm  # noqa: F401  (a test dependency: without it this module fails, it is not skipped)

# The worker of the other colocated-engine tests: one engine at a time per process.
pytestmark = pytest.mark.xdist_group("vllm_engine")

EOS = 1
T = 0.7
QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15])]


def colocated_trainer(generation_config: GenerationConfig | None = None, **sampling) -> PPOTrainer:
    """A run at T=0.7 with a float32 colocated vLLM engine (close its generation when done); ``generation_config``:
    the model's, if given; ``sampling``: PPOConfig's top_k/top_p/min_p."""
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, use_vllm=True, vllm_kv_cache_gb=1, vllm_max_model_len=64,
        vllm_dtype="float32", vllm_enable_sleep_mode=False, temperature=T, **sampling,
    )  # fmt: skip
    lm = make_gpt2(seed=1, n_embd=64)
    if generation_config is not None:
        lm.generation_config = generation_config
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    return PPOTrainer(config, model, tokenizer=make_tokenizer())


def test_sampled_rows_logprobs_are_log_softmax_of_logits_over_the_temperature_and_mismatches_are_refused():
    # The model's generation_config truncates and penalises (Qwen2.5-Instruct's): PPOConfig's settings win.
    instruct = GenerationConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.8, repetition_penalty=1.05,
                                eos_token_id=EOS, pad_token_id=0)  # fmt: skip
    trainer = colocated_trainer(instruct)
    try:
        assert trainer.generation.engine.backend.logprobs_mode == "processed_logprobs"
        lm = trainer.model.pretrained_model.eval()
        k, new = 3, 12
        # No sampling kwargs: the engine samples at the run's 0.7, untruncated, and returns log_softmax(z / 0.7)
        # (vLLM's processed log-probs: a top-k, top-p or penalty from the model would show in them).
        with pytest.warns(UserWarning, match="generation_config has temperature=0.6, top_k=20, top_p=0.8"):
            rows, logprobs = trainer.generate(QUERIES, return_prompt=True, max_new_tokens=new,
                                              num_return_sequences=k, return_logprobs=True)  # fmt: skip
        assert_sampled_rows_and_logprobs(rows, logprobs, lm, QUERIES, k, new, EOS, temperature=T)
        # A log-prob at temperature 1 would be off by far more than vLLM's noise.
        with pytest.raises(AssertionError):
            assert_sampled_rows_and_logprobs(rows, logprobs, lm, QUERIES, k, new, EOS, temperature=1.0)
        for kwargs, message in (
            (dict(do_sample=True, temperature=1.0), "got temperature=1.0, but PPOConfig.temperature=0.7"),
            (dict(do_sample=True, top_k=50), "got top_k=50, but PPOConfig.top_k=0"),
            (dict(do_sample=True, top_k=0, top_p=0.9), "top_p=0.9"),
            (dict(do_sample=False), "greedy decoding"),
        ):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                trainer.generate(QUERIES, max_new_tokens=2, return_logprobs=True, **kwargs)
        # Without log-probs, greedy rows are transformers' greedy rows, as at temperature 1.
        greedy = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=4, do_sample=False)
        with torch.no_grad():
            expected = [lm.generate(input_ids=q[None], attention_mask=torch.ones_like(q[None]), do_sample=False,
                                    repetition_penalty=1.0, max_new_tokens=4, pad_token_id=0)[0, len(q) :]
                        for q in QUERIES]  # fmt: skip
        assert [row.tolist() for row in greedy] == [row.tolist() for row in expected]
    finally:
        trainer.generation.close()


def test_a_server_launched_with_processed_logprobs_gives_them_at_the_run_temperature(tmp_path):
    model_dir = tmp_path / "served"
    make_gpt2(seed=1, n_embd=64).save_pretrained(model_dir)
    serve_args = ("--logprobs-mode", "processed_logprobs")
    with launched_server(model_dir, tmp_path / "server.log", 64, serve_args=serve_args) as (url, _):
        config = PPOConfig(batch_size=4, mini_batch_size=2, use_vllm=True, vllm_mode="server", vllm_server_url=url,
                           vllm_server_timeout=120, temperature=T)  # fmt: skip
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2, n_embd=64))  # not the served weights
        trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
        try:
            assert trainer.generation.engine.backend.logprobs_mode == "processed_logprobs"  # read from the server
            k, new = 2, 8
            rows, logprobs = trainer.generate(QUERIES, return_prompt=True, max_new_tokens=new, do_sample=True,
                                              top_k=0, num_return_sequences=k, return_logprobs=True)  # fmt: skip
            lm = trainer.model.pretrained_model.eval()
            assert_sampled_rows_and_logprobs(rows, logprobs, lm, QUERIES, k, new, EOS, temperature=T)
        finally:
            trainer.generation.close()


def test_a_step_on_vllm_rows_at_the_run_temperature_shows_only_vllms_own_gap():
    """step(..., generation_logprobs=...) on rows the colocated engine sampled at 0.7: the trainer's lp_old, under
    z / 0.7, is within vLLM's float32 noise of the engine's log-probs (rollout/logprob_diff)."""
    trainer = colocated_trainer()
    try:
        responses, logprobs = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=True,
                                               top_k=0, return_logprobs=True)  # fmt: skip
        stats = trainer.step(QUERIES, list(responses), [torch.tensor(1.0)] * 4, generation_logprobs=list(logprobs))
        assert stats["rollout/logprob_diff/max"] < 1e-4
        assert stats["rollout/logprob_diff/mean"] < 1e-5
    finally:
        trainer.generation.close()


def test_a_truncated_vllm_run_returns_log_pi_t_k_and_the_trainer_scores_the_same():
    """PPOConfig truncating (top-k 8, top-p 0.8): vLLM's processed log-probs are log pi_T^K over the set its sampler
    kept; vLLM 0.32 returns that set only with Model Runner V2 (not on the CPU), so the trainer re-derives it from
    its rollout pass's logits in vLLM's order (min-p, top-k, top-p): lp_old equals the engine's log-probs to vLLM's
    float32 noise (PPO_SPEC section 23), where a full-vocabulary lp_old would be off by log pi_T(K)."""
    trainer = colocated_trainer(top_k=8, top_p=0.8)
    try:
        assert trainer.generation.engine.backend.logprobs_mode == "processed_logprobs"
        assert trainer.forward.truncation.order == "vllm"
        responses, logprobs = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=True,
                                               return_logprobs=True)  # fmt: skip
        stats = trainer.step(QUERIES, list(responses), [torch.tensor(1.0)] * 4, generation_logprobs=list(logprobs))
        assert stats["rollout/logprob_diff/max"] < 1e-4
        full = torch.cat([torch.as_tensor(lp) for lp in logprobs])
        assert float(full.max()) <= 0.0
    finally:
        trainer.generation.close()
