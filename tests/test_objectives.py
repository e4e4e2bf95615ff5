"""The policy-loss variants of docs/algorithm.md section 13 and the log-prob gap of section 15.

- The pure pieces (`importance_ratio`, `clipped_surrogate`, `aggregate_loss`, the differentiable
  entropy of the fused log-prob kernels) against float64 brute force.
- Two `step()`s of the trainer (float32, SGD, so that the scale of the loss shows in the weights)
  against `plain_objectives.PlainObjectivesPPO` (float64, every token's loss and every aggregation
  written as loops), for every option, across the advantage estimators, packed and padded.
- `global_token_mean` takes the same update whatever `mini_batch_size` and gradient accumulation
  (2 processes: tests/test_distributed.py).
"""

import copy

import numpy as np
import pytest
import torch
from devices import assert_close, equal, on_cpu
from plain_objectives import PlainObjectivesPPO
from test_step_reference import BATCH_SIZE, make_batch, perturbed_copy
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core import (
    aggregate_loss,
    clipped_surrogate,
    importance_ratio,
    logprobs_and_entropy_from_hidden,
    logprobs_and_entropy_from_logits,
    ppo_policy_loss,
)


# ----------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------
def _random_tokens(seed=0, rows=5, width=6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    old = lp + 0.4 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, width, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, width, generator=g) > 0.3).double()
    mask[0] = 0  # a row without action tokens
    mask[1, 0] = 1
    return lp, old, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_ratio_and_its_gradient_match_brute_force(level):
    lp, old, _, mask = _random_tokens()
    lp.requires_grad_(True)
    values = lp.detach()
    ratio = importance_ratio(lp, old, mask, level)
    weights = torch.randn(ratio.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (ratio * weights * mask).sum().backward()
    for b in range(lp.shape[0]):
        tokens = mask[b].nonzero().flatten().tolist()
        mean = sum(float(values[b, t] - old[b, t]) for t in tokens) / len(tokens) if tokens else 0.0
        for t in range(lp.shape[1]):
            want = np.exp(mean) if level == "sequence" else np.exp(float(values[b, t] - old[b, t]))
            assert float(ratio[b, t]) == pytest.approx(want, rel=1e-12)
            # d/d lp[b, t] of sum_s w_s M_s r_s
            if level == "token":
                want_grad = float(weights[b, t] * mask[b, t]) * want
            else:
                want_grad = sum(float(weights[b, s]) for s in tokens) * np.exp(mean) / len(tokens) if t in tokens else 0.0
            assert float(lp.grad[b, t]) == pytest.approx(want_grad, rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("cliprange_high", [None, 0.5])
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_clipped_surrogate_matches_the_per_token_definition(cliprange_high, dual_clip):
    g = torch.Generator().manual_seed(1)
    ratio = torch.exp(torch.randn(400, dtype=torch.float64, generator=g))
    adv = torch.randn(400, dtype=torch.float64, generator=g)
    loss, regions = clipped_surrogate(ratio, adv, 0.2, cliprange_high, dual_clip)
    high = 0.2 if cliprange_high is None else cliprange_high
    for i in range(400):
        r, a = float(ratio[i]), float(adv[i])
        c = min(max(r, 0.8), 1 + high)
        want = max(-a * r, -a * c)
        dual = dual_clip is not None and a < 0 and want > -dual_clip * a
        if dual:
            want = -dual_clip * a
        assert float(loss[i]) == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert bool(regions["clipped_low"][i]) == (-a * c > -a * r and r < 0.8)
        assert bool(regions["clipped_high"][i]) == (-a * c > -a * r and r > 1 + high)
        assert bool(regions["dual_clipped"][i]) == dual
    assert regions["clipped_low"].any() and regions["clipped_high"].any()
    assert regions["dual_clipped"].any() == (dual_clip is not None)


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "global_token_mean"])
def test_aggregate_loss_matches_loops(loss_type):
    _, _, values, mask = _random_tokens(seed=2)
    got = aggregate_loss(values, mask, loss_type, max_response_length=9, tokens_per_minibatch=17.5)
    terms = [(b, t) for b in range(values.shape[0]) for t in range(values.shape[1]) if mask[b, t]]
    total = sum(float(values[b, t]) for b, t in terms)
    if loss_type == "token_mean":
        want = total / len(terms)
    elif loss_type == "seq_mean_token_mean":
        rows = [[float(values[b, t]) for b2, t in terms if b2 == b] for b in range(values.shape[0])]
        rows = [r for r in rows if r]  # rows without action tokens are left out of the mean
        want = sum(sum(r) / len(r) for r in rows) / len(rows)
    elif loss_type == "seq_mean_token_sum_norm":
        want = total / (values.shape[0] * 9)
    else:
        want = total / 17.5
    assert float(got) == pytest.approx(want, rel=1e-12)


def test_policy_loss_defaults_are_the_classic_clipped_surrogate():
    lp, old, adv, mask = _random_tokens(seed=4)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    ratio = torch.exp(lp - old)
    want = (torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    assert float(stats["clipfrac"]) == pytest.approx(float(stats["clipfrac_low"] + stats["clipfrac_high"]), rel=1e-12)
    assert float(stats["dual_clipfrac"]) == 0.0


@pytest.mark.parametrize("fused", [False, True])
def test_entropy_of_the_log_prob_kernels_is_differentiable(fused):
    """Gradients of sum(a * lp + b * H) through both kernels against autograd of the plain formula (float64)."""
    g = torch.Generator().manual_seed(5)
    n, hidden_size, vocab = 7, 4, 11
    hidden = torch.randn(n, hidden_size, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(vocab, (n,), generator=g)
    a, b = torch.randn(n, dtype=torch.float64, generator=g), torch.randn(n, dtype=torch.float64, generator=g)

    def plain():
        logp = torch.log_softmax(hidden @ weight.t() + bias, -1)
        return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def kernel():
        if fused:
            return logprobs_and_entropy_from_hidden(hidden, weight, bias, labels)
        return logprobs_and_entropy_from_logits(hidden @ weight.t() + bias, labels)

    grads = []
    for fn in (plain, kernel):
        for coefs in ((a, b), (a, None), (None, b)):
            lp, entropy = fn()  # the kernels' backward reuses their saved softmax: one backward per forward
            total = sum((c * x).sum() for c, x in zip(coefs, (lp, entropy)) if c is not None)
            grads.append(torch.autograd.grad(total, (hidden, weight, bias)))
    want, got = grads[:3], grads[3:]
    for want_set, got_set in zip(want, got):
        for w, x in zip(want_set, got_set):
            assert_close(x, w, rtol=1e-10, atol=1e-12)


def test_entropy_gradient_survives_underflowing_probabilities():
    logits = torch.tensor([[0.0, -200.0, -1000.0, 3.0]], dtype=torch.float32, requires_grad=True)
    _, entropy = logprobs_and_entropy_from_logits(logits, torch.tensor([0]))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    p = torch.softmax(logits.detach().double(), -1)
    h = -(p * torch.log(p.clamp(min=1e-300))).sum()
    want = -p * (torch.log(p.clamp(min=1e-300)) + h)
    assert_close(logits.grad.double(), want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# step() against the float64 row-by-row reference
# ----------------------------------------------------------------------------------------------
BASE = dict(
    batch_size=BATCH_SIZE, mini_batch_size=2, ppo_epochs=2, learning_rate=0.1, init_kl_coef=0.3,
    cliprange=0.1, cliprange_value=0.1, target=0.5, horizon=100.0, seed=0,
    shuffle_by_prompt=False,  # the plain reference shuffles rows (docs/algorithm.md section 6)
)  # fmt: skip
# Each case: config changes (the option under test, an estimator, packed or padded), and what must
# show that the option acted.
CASES = {
    "sgd_defaults_gae": dict(),
    "clip_higher_gae_padded": dict(cliprange=0.05, cliprange_high=0.3, padding_free=False),
    "dual_clip_rloo": dict(advantage_estimator="rloo", num_samples_per_query=4, dual_clip=1.02),
    "gspo_grpo_kl_in_loss": dict(advantage_estimator="grpo", num_samples_per_query=4, importance_sampling_level="sequence"),
    "seq_mean_token_mean_reinforce_pp": dict(advantage_estimator="reinforce_pp", loss_type="grpo"),
    "dr_grpo_sum_norm": dict(advantage_estimator="grpo", num_samples_per_query=4, loss_type="dr_grpo", max_response_length=9),
    "global_token_mean_grad_accum_gae": dict(loss_type="dapo", gradient_accumulation_steps=2),
    "global_token_mean_grpo_padded": dict(
        advantage_estimator="grpo", num_samples_per_query=4, loss_type="global_token_mean", padding_free=False
    ),
    "entropy_bonus_fused_gae": dict(entropy_coef=0.05),
    "entropy_bonus_logits_path_grpo": dict(
        advantage_estimator="grpo", num_samples_per_query=4, entropy_coef=0.05, loss_type="dapo", unfused=True
    ),
    "tis_grpo": dict(advantage_estimator="grpo", num_samples_per_query=4, importance_sampling_correction="tis",
                     importance_sampling_cap=1.1, generation_noise=0.3),
    "logprob_gap_without_tis_gae": dict(generation_noise=0.2),
    "everything_rloo_grad_accum": dict(
        advantage_estimator="rloo", num_samples_per_query=4, cliprange_high=0.2, dual_clip=1.05, loss_type="dapo",
        entropy_coef=0.01, gradient_accumulation_steps=2, importance_sampling_correction="tis",
        importance_sampling_cap=1.05, generation_noise=0.1,
    ),
}  # fmt: skip
COMPARED = (
    "ppo/loss/policy", "ppo/policy/clipfrac", "ppo/policy/clipfrac_low", "ppo/policy/clipfrac_high",
    "ppo/policy/dual_clipfrac", "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/entropy",
)  # fmt: skip


def _build_pair(case: dict, trainer_options: dict | None = None, reference_options: dict | None = None):
    """The trainer on ``case`` (plus ``trainer_options``) and the float64 reference on ``case`` (plus
    ``reference_options``), from the same weights; returns ``(trainer, plain, trainer config, critic_free)``."""
    options = {k: v for k, v in case.items() if k not in ("unfused", "generation_noise")}
    config = PPOConfig(**{**BASE, **options, **(trainer_options or {})})
    reference_config = PPOConfig(**{**BASE, **options, **reference_options}) if reference_options else config
    critic_free = config.advantage_estimator != "gae"
    policy = make_gpt2() if critic_free else AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    ref = perturbed_copy(policy, seed=1)
    plain_policy, plain_ref = copy.deepcopy(policy), copy.deepcopy(ref)
    tokenizer = make_tokenizer()
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=config.learning_rate)
    trainer = PPOTrainer(config, policy, ref_model=ref, tokenizer=tokenizer, optimizer=optimizer)
    if case.get("unfused"):
        trainer.forward.linear_head = lambda model: None  # the logits path of the LM head
    plain = PlainObjectivesPPO(
        plain_policy, plain_ref, reference_config, pad_id=tokenizer.pad_token_id,
        optimizer_cls=lambda params, lr: torch.optim.SGD(params, lr=lr),
    )  # fmt: skip
    return trainer, plain, config, critic_free


def _generation_logprobs(model, queries, responses, noise: float, seed: int) -> list:
    """The policy's own log-probs of each response token, with noise: a stand-in for another engine's."""
    g = torch.Generator().manual_seed(seed)
    network = getattr(model, "pretrained_model", model)
    out = []
    with torch.no_grad():
        for q, r in zip(queries, responses):
            ids = torch.cat((q, r)).unsqueeze(0)
            logp = torch.log_softmax(network(input_ids=ids).logits[0, len(q) - 1 : -1].double(), -1)
            lp = logp.gather(-1, r[:, None]).squeeze(-1)
            out.append((lp + noise * torch.randn(len(r), generator=g, dtype=torch.float64)).clamp(max=0).float())
    return out


def step_both(trainer, plain, config, case: dict, step: int):
    """Step ``step`` of the trainer and of the float64 reference on the same batch (grouped for RLOO and
    GRPO, with engine log-probs for a case with ``generation_noise``); returns ``(got, want, generation,
    (queries, responses))``."""
    queries, responses, scores, _ = make_batch(step)
    if config.advantage_estimator in ("rloo", "grpo"):
        queries = [queries[(i // 4) * 4] for i in range(BATCH_SIZE)]
    generation = None
    if "generation_noise" in case:
        generation = _generation_logprobs(plain.model, queries, responses, case["generation_noise"], step)
    torch.manual_seed(1000 + step)
    got = trainer.step(queries, responses, scores, generation_logprobs=generation)
    torch.manual_seed(1000 + step)
    want = plain.step(queries, responses, scores, generation_logprobs=generation)
    return got, want, generation, (queries, responses)


def compared_statistics(config) -> tuple:
    """:data:`COMPARED`, with the entropy-bonus and KL-in-loss losses when ``config`` turns them on."""
    compared = COMPARED + (("ppo/policy/entropy_loss",) if config.entropy_coef else ())
    return compared + (("ppo/policy/kl_loss",) if not config.kl_in_reward_resolved else ())


@pytest.mark.parametrize("name", list(CASES))
def test_two_steps_match_the_float64_reference(name):
    case = CASES[name]
    trainer, plain, config, critic_free = _build_pair(case)
    initial = {k: v.detach().double().clone() for k, v in plain.model.state_dict().items()}
    seen = {key: 0.0 for key in COMPARED}
    for step in range(2):
        got, want, generation, (queries, responses) = step_both(trainer, plain, config, case, step)
        compared = compared_statistics(config)
        if generation is not None:
            compared += ("rollout/logprob_diff/mean", "rollout/logprob_diff/max")
            compared += ("rollout/is_weight/mean",) if config.importance_sampling_correction else ()
        else:
            assert not [k for k in got if k.startswith("rollout/")]
        for key in compared:
            np.testing.assert_allclose(got[key], float(want[key]), rtol=2e-5, atol=2e-6, err_msg=key)
        for key in COMPARED:
            seen[key] = max(seen[key], float(want[key]))

    # Weights: the trainer's SGD updates equal the reference's to float32 rounding.
    got_weights = on_cpu(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    if critic_free:
        got_weights = on_cpu(trainer.model.pretrained_model.state_dict())
    moved = 0.0
    for key, want_value in plain.model.state_dict().items():
        update = want_value - initial[key]
        error = (got_weights[key].double() - want_value).norm()
        assert error <= 1e-4 * update.norm() + 1e-6, f"{key}: error {error:.3g}, update {update.norm():.3g}"
        moved = max(moved, float(update.norm()))
    assert moved > 1e-2

    # The option under test acted.
    if config.cliprange_high is not None:
        assert seen["ppo/policy/clipfrac_high"] > 0
    if config.dual_clip is not None:
        assert seen["ppo/policy/dual_clipfrac"] > 0
    assert seen["ppo/policy/clipfrac"] > 0
    if config.importance_sampling_correction:
        assert (plain.tis_weights == config.importance_sampling_cap).any()  # the cap bound somewhere
        assert float(((plain.tis_weights - 1).abs() * plain.make_batch(queries, responses).mask).max()) > 0.05


def _one_update(loss_type: str, mini_batch_size: int, gradient_accumulation_steps: int) -> dict:
    """Weights after one optimizer step (one epoch, one backward batch of all 8 rows), REINFORCE++."""
    config = PPOConfig(
        batch_size=8, mini_batch_size=mini_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
        ppo_epochs=1, learning_rate=1.0, advantage_estimator="reinforce_pp", loss_type=loss_type, seed=0,
    )  # fmt: skip
    policy = make_gpt2()
    optimizer = torch.optim.SGD(policy.parameters(), lr=config.learning_rate)
    trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer(), optimizer=optimizer)
    queries, responses, scores = random_batch(8, seed=3, query_len=(2, 5), response_len=(1, 9))
    assert len({len(r) for r in responses}) > 3  # rows of very different lengths
    torch.manual_seed(0)
    trainer.step(queries, responses, scores)
    return {k: on_cpu(v).clone() for k, v in trainer.model.pretrained_model.state_dict().items()}


def test_global_token_mean_update_is_independent_of_mini_batch_size_and_accumulation():
    splits = [(8, 1), (4, 2), (2, 4), (1, 8)]
    start = make_gpt2().state_dict()
    results = {split: _one_update("global_token_mean", *split) for split in splits}
    for split in splits[1:]:
        for key, value in results[splits[0]].items():
            update = value - start[key]
            error = (results[split][key] - value).norm()
            assert error <= 1e-5 * update.norm() + 1e-7, (split, key, float(error), float(update.norm()))
    # The check has teeth: the per-mini-batch token mean does depend on the split.
    whole, halves = _one_update("token_mean", 8, 1), _one_update("token_mean", 2, 4)
    assert max(float((whole[k] - halves[k]).abs().max()) for k in whole) > 1e-4


def test_options_on_a_peft_policy_match_the_float64_reference():
    """LoRA policy (reference: the adapter disabled), GRPO, every option at once: only the adapter
    trains, and its SGD updates equal the reference's."""
    from peft import LoraConfig, get_peft_model

    config = PPOConfig(**{
        **BASE, "advantage_estimator": "grpo", "num_samples_per_query": 4, "cliprange": 0.05, "cliprange_high": 0.2,
        "dual_clip": 1.05, "loss_type": "dapo", "entropy_coef": 0.02, "importance_sampling_level": "sequence",
        "learning_rate": 0.5,
    })  # fmt: skip
    base = make_gpt2()
    plain_ref = copy.deepcopy(base).eval()  # LoRA's B starts at zero: the disabled adapter is the base model
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0))
    plain_policy = copy.deepcopy(policy)
    tokenizer = make_tokenizer()
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=config.learning_rate)
    trainer = PPOTrainer(config, policy, tokenizer=tokenizer, optimizer=optimizer)
    plain = PlainObjectivesPPO(
        plain_policy, plain_ref, config, pad_id=tokenizer.pad_token_id,
        optimizer_cls=lambda params, lr: torch.optim.SGD(params, lr=lr),
    )  # fmt: skip
    initial = {k: v.detach().double().clone() for k, v in plain.model.named_parameters() if v.requires_grad}
    for step in range(2):
        queries, responses, scores, _ = make_batch(step)
        queries = [queries[(i // 4) * 4] for i in range(BATCH_SIZE)]
        torch.manual_seed(1000 + step)
        got = trainer.step(queries, responses, scores)
        torch.manual_seed(1000 + step)
        want = plain.step(queries, responses, scores)
        for key in COMPARED + ("ppo/policy/entropy_loss", "ppo/policy/kl_loss"):
            np.testing.assert_allclose(got[key], float(want[key]), rtol=2e-5, atol=2e-6, err_msg=key)
    got_params = on_cpu(dict(trainer.accelerator.unwrap_model(trainer.model).pretrained_model.named_parameters()))
    assert initial and all("lora_" in k for k in initial)
    for key, start in initial.items():
        want_value = dict(plain.model.named_parameters())[key].detach()
        update = (want_value - start).norm()
        assert update > 0
        assert (got_params[key].detach().double() - want_value).norm() <= 1e-4 * update + 1e-6, key


def test_options_with_a_separate_critic_train_both_models():
    from tiny_models import make_gpt2_critic

    config = PPOConfig(**{**BASE, "cliprange": 0.05, "cliprange_high": 0.2, "dual_clip": 1.05, "loss_type": "dapo",
                          "entropy_coef": 0.02, "gradient_accumulation_steps": 2})  # fmt: skip
    policy, critic = make_gpt2(), make_gpt2_critic(seed=3)
    before = [copy.deepcopy(m.state_dict()) for m in (policy, critic)]
    trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer(), value_model=critic)
    for step in range(2):
        queries, responses, scores, _ = make_batch(step)
        stats = trainer.step(queries, responses, scores)
    for key in ("ppo/policy/clipfrac_high", "ppo/policy/clipfrac_low", "ppo/loss/value", "ppo/policy/entropy_loss"):
        assert np.isfinite(stats[key]), key
    assert stats["ppo/policy/clipfrac_high"] > 0
    for model, start in zip((policy, critic), before):
        assert any(not equal(v, model.state_dict()[k]) for k, v in start.items())


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ("not a list", ValueError, "generation_logprobs must be a list of 8"),
        ("short", ValueError, "generation_logprobs must be a list of 8"),
        ("int", TypeError, r"generation_logprobs\[2\] must be a 1-D float tensor"),
        ("length", ValueError, r"generation_logprobs\[2\] must have the shape of responses\[2\]"),
        ("positive", ValueError, r"generation_logprobs\[2\] must hold finite log-probabilities"),
        ("nan", ValueError, r"generation_logprobs\[2\] must hold finite log-probabilities"),
    ],
)
def test_bad_generation_logprobs_are_rejected_before_any_state_changes(bad, error, match):
    trainer, _, _, _ = _build_pair(dict(importance_sampling_correction="tis"))
    queries, responses, scores, _ = make_batch(0)
    lps = [-torch.rand(len(r)) for r in responses]
    if bad == "not a list":
        lps = torch.zeros(8, 3)
    elif bad == "short":
        lps = lps[:7]
    elif bad == "int":
        lps[2] = torch.zeros(len(responses[2]), dtype=torch.long)
    elif bad == "length":
        lps[2] = torch.zeros(len(responses[2]) + 1)
    elif bad == "positive":
        lps[2] = lps[2].abs() + 0.5
    else:
        lps[2] = lps[2].clone()
        lps[2][0] = float("nan")
    weights = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(error, match=match):
        trainer.step(queries, responses, scores, generation_logprobs=lps)
    assert trainer.current_step == 0
    assert all(equal(v, trainer.model.state_dict()[k]) for k, v in weights.items())


def test_classic_train_minibatch_takes_every_loss_type():
    """The classic one-mini-batch entry point: with global_token_mean the mini-batch is its own backward
    batch, so its loss equals the token mean's (and a per-row mean differs, the rows' lengths differing)."""
    losses = {}
    for loss_type in ("token_mean", "global_token_mean", "seq_mean_token_mean"):
        trainer, _, _, _ = _build_pair(dict(loss_type=loss_type))
        queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])]  # equal query lengths: one slice fits all
        responses = [torch.tensor([11, 12, 13, 14]), torch.tensor([15, 16])]
        rows = trainer.forward.make_rows(queries, responses, None)
        with torch.no_grad():
            old, _, values, _ = trainer.experience_maker.passes(rows)
        mask = rows.action_mask
        logits, _, vpreds = trainer.model(**trainer.prepare_model_inputs(queries, responses))
        logits, vpreds = logits[:, 2:6], vpreds[:, 2:6]  # the positions predicting response tokens 0..3
        targets = torch.stack([torch.cat((r, r.new_zeros(4 - len(r)))) for r in responses]).to(logits.device)
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        advantages = torch.tensor([[1.0, -2.0, 0.5, 1.5], [-1.0, 2.0, 0.0, 0.0]], device=mask.device) * mask
        stats = trainer.train_minibatch(old, values, logprobs, logits, vpreds, mask, advantages, values + advantages)
        losses[loss_type] = float(stats["loss/policy"])
    assert losses["global_token_mean"] == pytest.approx(losses["token_mean"], rel=1e-6)
    assert losses["seq_mean_token_mean"] != pytest.approx(losses["token_mean"], rel=1e-3)
