"""PPOConfig.temperature in step()'s passes (docs/algorithm.md section 20): at T=0.7 the rollout, reference and
training passes score under logits / T, so two steps match the float64 reference with the temperature applied
(GAE and GRPO, the entropy bonus, the KL in the loss and kl_penalty="full", the one-buffer, logits and chunked
LM heads; the classic reference with the PTX loss at temperature 1 is in test_lm_head_chunk_steps.py), and so do
the classic helpers; and the gap between the transformers engine's
generation_logprobs and the trainer's lp_old is float32 noise when both use the run's temperature, and large when
the trainer scores at 1.0 tokens sampled at 0.7 (the mismatch this option removes). T=1.0 is covered by the
unchanged reference and classic-parity tests."""

import numpy as np
import pytest
import torch
from devices import on_cpu
from test_lm_head_chunk_steps import assert_two_steps_match_float64
from test_objectives import CASES, _build_pair
from test_step_reference import make_batch
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

T = 0.7
# Statistics that are computed from the scaled log-probs outside the loss: the rollout's and the KL's.
ROLLOUT_STATS = ("objective/kl", "objective/logprobs", "objective/ref_logprobs", "objective/entropy")
# GAE with the entropy bonus and the exact KL in the rewards; GRPO with the entropy bonus on the logits path
# and the KL in the loss; each once on the chunked LM head.
TEMPERATURE_CASES = {
    "gae_entropy_full_kl": dict(CASES["entropy_bonus_fused_gae"], kl_penalty="full"),
    "grpo_entropy_logits_path_kl_in_loss": CASES["entropy_bonus_logits_path_grpo"],
    "gae_entropy_full_kl_chunked": dict(CASES["entropy_bonus_fused_gae"], kl_penalty="full", lm_head_chunk_size=3),
    "grpo_kl_in_loss_chunked": dict(CASES["gspo_grpo_kl_in_loss"], entropy_coef=0.05, lm_head_chunk_size=3),
}


@pytest.mark.parametrize("name", list(TEMPERATURE_CASES))
def test_steps_at_temperature_match_the_float64_reference_with_the_temperature_applied(name):
    case = TEMPERATURE_CASES[name]
    options = {k: v for k, v in case.items() if k == "lm_head_chunk_size"}
    steps = assert_two_steps_match_float64(case, {"temperature": T, **options}, {"temperature": T}, ROLLOUT_STATS)
    # The temperature acted: the reference at 1.0 scores the same first batch otherwise.
    _, plain_at_one, config, _ = _build_pair(case, reference_options={"temperature": 1.0})
    queries, responses, scores, _ = make_batch(0)
    if config.advantage_estimator in ("rloo", "grpo"):
        queries = [queries[(i // 4) * 4] for i in range(len(queries))]
    torch.manual_seed(1000)
    at_one = plain_at_one.step(queries, responses, scores)
    gap = np.abs(np.asarray(steps[0][1]["objective/logprobs"]) - np.asarray(at_one["objective/logprobs"])).max()
    assert gap > 1e-2


def test_classic_helpers_score_at_the_temperature():
    """batched_forward_pass's log-probs, loss's entropy from logits and _kl_penalty("full") under z / T, against
    float64 formulas; the logits batched_forward_pass returns stay the model's own."""
    trainer = make_trainer(T)
    queries, responses, _ = random_batch(4, seed=4)
    inputs = trainer.prepare_model_inputs(queries, responses)
    logprobs, logits, _, masks = trainer.batched_forward_pass(trainer.model, queries, responses, inputs, True)
    network = trainer.accelerator.unwrap_model(trainer.model).pretrained_model
    with torch.no_grad():
        raw = network(**inputs).logits[:, :-1].double()
    np.testing.assert_allclose(on_cpu(logits).double() * masks[..., None], raw * masks[..., None], atol=1e-5)
    logp = torch.log_softmax(raw / T, -1)
    want = logp.gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1) * masks
    np.testing.assert_allclose(on_cpu(logprobs * masks).double(), want, atol=1e-5)

    g = torch.Generator().manual_seed(0)
    z, ref_z = (torch.randn(2, 3, 5, generator=g, dtype=torch.float64) for _ in range(2))
    p, q = torch.log_softmax(z / T, -1), torch.log_softmax(ref_z / T, -1)
    trainer.config.kl_penalty = "full"
    np.testing.assert_allclose(trainer._kl_penalty(z, ref_z), (p.exp() * (p - q)).sum(-1), atol=1e-12)

    mask, zeros = torch.ones(2, 3), torch.zeros(2, 3)
    _, _, stats = trainer.learner.loss(zeros, zeros, z.float(), zeros, zeros, mask, zeros, zeros)
    np.testing.assert_allclose(float(stats["policy/entropy"]), float(-(p.exp() * p).sum(-1).mean()), atol=1e-6)


QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15])]


def make_trainer(temperature: float) -> PPOTrainer:
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=3))
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, temperature=temperature, seed=0), model,
                      tokenizer=make_tokenizer())  # fmt: skip


def engine_gap(sampling_temperature: float, scoring_temperature: float, sampling: dict) -> dict:
    """One step at ``scoring_temperature`` on rows that the transformers engine of a run at ``sampling_temperature``
    (same weights) generated with ``sampling``, given that engine's generation_logprobs; the step's statistics."""
    sampler = make_trainer(sampling_temperature)
    torch.manual_seed(0)
    responses, logprobs = sampler.generate(
        QUERIES, batch_size=2, return_prompt=False, return_logprobs=True, max_new_tokens=6, **sampling
    )
    assert all(len(r) > 0 for r in responses)
    trainer = sampler if scoring_temperature == sampling_temperature else make_trainer(scoring_temperature)
    return trainer.step(QUERIES, list(responses), [torch.tensor(1.0)] * 4, generation_logprobs=list(logprobs))


@pytest.mark.parametrize("sampling", [dict(do_sample=True, top_k=0), dict(do_sample=False)], ids=["sampled", "greedy"])
def test_the_gap_to_the_transformers_engine_is_float32_noise_at_the_run_temperature(sampling):
    stats = engine_gap(T, T, sampling)
    assert stats["rollout/logprob_diff/mean"] < 1e-5
    assert stats["rollout/logprob_diff/max"] < 1e-5


@pytest.mark.parametrize("sampling", [dict(do_sample=True, top_k=0), dict(do_sample=False)], ids=["sampled", "greedy"])
def test_scoring_at_temperature_1_tokens_sampled_at_0_7_shows_a_large_gap(sampling):
    """The mismatch this option removes: engine log-probs of pi_0.7 against a trainer that scores pi_1."""
    stats = engine_gap(T, 1.0, sampling)
    assert stats["rollout/logprob_diff/mean"] > 1e-2
