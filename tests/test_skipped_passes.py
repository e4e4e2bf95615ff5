"""Passes that cannot change the step are not run (docs/algorithm.md section 3, ``RolloutPlan``).

- Which passes the plan keeps, per configuration; passes counted as model calls without grad.
- With ``init_kl_coef=0`` no reference copy is made, a given reference or a PEFT policy's disabled
  adapter is not run, and the KL statistics are NaN; ``compute_reference_kl=True`` measures them.
- With the step on-policy (critic-free, no KL in the rewards, one optimizer step) the update equals the
  float64 reference's (``plain_objectives.PlainObjectivesPPO``, which runs every pass) and today's path
  (both passes forced), for each loss type, with TIS, gradient accumulation and a PEFT policy. The
  2-process case is in tests/test_distributed.py.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
from plain_objectives import PlainObjectivesPPO
from test_completions_logging import fake_wandb, run_steps  # noqa: F401 (a fixture)
from test_completions_logging import make_trainer as make_logging_trainer
from test_objectives import _generation_logprobs
from test_step_reference import BATCH_SIZE, make_batch, perturbed_copy
from tiny_models import make_gpt2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.trainer.step.rollout_plan import EVERY_PASS, RolloutPlan

# GRPO with the KL at 0 and one optimizer step per step(): 4 mini-batches of 2 rows accumulated.
ON_POLICY = dict(
    batch_size=BATCH_SIZE, mini_batch_size=2, gradient_accumulation_steps=4, ppo_epochs=1, learning_rate=0.1,
    init_kl_coef=0.0, adap_kl_ctrl=False, cliprange=0.1, advantage_estimator="grpo", num_samples_per_query=4, seed=0,
    shuffle_by_prompt=False,  # the float64 reference shuffles rows (docs/algorithm.md section 6)
)  # fmt: skip
KL_STATS = ("objective/kl", "objective/kl_dist", "objective/ref_logprobs")


class EveryPassTrainer(PPOTrainer):
    """Today's path: both passes without grad whatever the config."""

    plan_rollout = staticmethod(lambda config: EVERY_PASS)


def no_grad_calls(lm) -> list:
    """A list that grows by one at every forward of the GPT-2 body of ``lm`` run without grad (the body: the
    fused LM head path calls it, not the LM's own forward)."""
    calls = []
    lm.transformer.register_forward_pre_hook(lambda m, args: None if torch.is_grad_enabled() else calls.append(1))
    return calls


def grouped(step: int):
    queries, responses, scores, _ = make_batch(step)
    return [queries[(i // 4) * 4] for i in range(BATCH_SIZE)], responses, scores


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, reference, policy",
    [
        (dict(), False, False),
        (dict(adap_kl_ctrl=True), False, False),  # the adaptive controller multiplies 0: it stays 0
        (dict(compute_reference_kl=True), True, False),
        (dict(init_kl_coef=0.1), True, False),  # the KL in the loss reads the training forward's lp
        (dict(init_kl_coef=0.1, kl_in_reward=True), True, True),
        (dict(kl_in_reward=True), False, False),  # in the rewards, but at 0
        (dict(advantage_estimator="rloo"), False, False),
        (dict(advantage_estimator="reinforce_pp"), False, False),
        (dict(ppo_epochs=2), False, True),
        (dict(gradient_accumulation_steps=2), False, True),  # two optimizer steps per step()
        (dict(mini_batch_size=8, gradient_accumulation_steps=1), False, False),
        (dict(advantage_estimator="gae"), False, True),  # GAE needs the values
        (dict(init_kl_coef=0.1, kl_penalty="full"), True, True),  # the exact KL needs the policy's logits
        (dict(kl_penalty="full"), False, False),
    ],
)
def test_the_plan_keeps_exactly_the_passes_that_can_change_the_step(changes, reference, policy):
    config = PPOConfig(**{**ON_POLICY, **changes})
    assert RolloutPlan.from_config(config) == RolloutPlan(reference=reference, policy=policy)


@pytest.mark.parametrize(
    "changes, policy_passes",
    [(dict(), 0), (dict(ppo_epochs=2), 4), (dict(gradient_accumulation_steps=2), 4), (dict(init_kl_coef=0.1), 0)],
)
def test_passes_without_grad_are_counted_as_model_calls(changes, policy_passes):
    """No model call without grad on-policy; with ppo_epochs=2 or two optimizer steps the policy's pass runs,
    once per mini-batch of rows (4 here); a given reference runs only when its KL can act, once per mini-batch."""
    config = PPOConfig(**{**ON_POLICY, **changes})
    policy, reference = make_gpt2(), perturbed_copy(make_gpt2(), seed=1)
    trainer = PPOTrainer(config, policy, ref_model=reference, tokenizer=make_tokenizer())
    policy_calls, reference_calls = no_grad_calls(policy), no_grad_calls(reference)
    stats = trainer.step(*grouped(0))
    assert len(policy_calls) == policy_passes
    assert len(reference_calls) == (4 if config.init_kl_coef else 0)
    assert np.isfinite(stats["ppo/loss/policy"])


def test_gae_runs_each_remaining_pass_once():
    """GAE with the KL at 0: the policy's pass (values) once per mini-batch, no reference; with the KL, both once."""
    for kl_coef, reference_passes in ((0.0, 0), (0.2, 4)):
        config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, init_kl_coef=kl_coef, seed=0)
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
        trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer())
        policy_calls = no_grad_calls(policy.pretrained_model)  # after the reference copy, which copies hooks
        assert (trainer.ref_model is None) == (kl_coef == 0)
        reference_calls = no_grad_calls(trainer.ref_model.pretrained_model) if kl_coef else []
        trainer.step(*make_batch(0)[:3])
        assert (len(policy_calls), len(reference_calls)) == (4, reference_passes)


# ----------------------------------------------------------------------------------------------
# No reference when the KL cannot act
# ----------------------------------------------------------------------------------------------
def test_no_reference_copy_and_kl_statistics_not_measured():
    trainer = PPOTrainer(PPOConfig(**ON_POLICY), make_gpt2(), tokenizer=make_tokenizer())
    assert trainer.ref_model is None and trainer.rollout_plan == RolloutPlan(reference=False, policy=False)
    stats = trainer.step(*grouped(0))
    n_tokens = sum(len(r) for r in grouped(0)[1])
    assert np.isnan(stats["objective/kl"]) and np.isnan(stats["ppo/policy/kl_loss"])
    assert stats["objective/kl_dist"].shape == (BATCH_SIZE,) and np.isnan(stats["objective/kl_dist"]).all()
    assert stats["objective/ref_logprobs"].shape == (n_tokens,) and np.isnan(stats["objective/ref_logprobs"]).all()
    assert stats["objective/logprobs"].shape == (n_tokens,) and np.isfinite(stats["objective/logprobs"]).all()
    assert stats["objective/kl_coef"] == 0.0 and stats["ppo/mean_non_score_reward"] == 0.0
    with pytest.raises(ValueError, match="generate_ref_response=True needs a reference model"):
        trainer.generate([torch.tensor([3, 4])], generate_ref_response=True, max_new_tokens=2)
    # A coefficient set by hand (or loaded) cannot act without the reference: refused before any state changes.
    trainer.kl_ctl.value = 0.1
    with pytest.raises(ValueError, match="kl_ctl.value is 0.1, but this trainer runs no reference pass"):
        trainer.step(*grouped(1))
    assert trainer.current_step == 1


def test_kl_statistics_not_measured_reach_wandb_as_nan_scalars_not_histograms(tmp_path, fake_wandb):
    trainer = make_logging_trainer(tmp_path, log_with="wandb", init_kl_coef=0.0)
    assert trainer.ref_model is None
    run_steps(trainer, 1)
    ((_, logged),) = [(step, values) for step, values in fake_wandb.logged if "env/reward_mean" in values]
    assert np.isnan(logged["objective/kl"]) and "objective/kl_dist" not in logged and "objective/ref_logprobs" not in logged
    assert np.isfinite(logged["objective/logprobs"]).all()


def test_compute_reference_kl_measures_what_todays_path_measures():
    """compute_reference_kl=True: the KL statistics of the reference pass and the training forwards' lp_old
    equal those of both passes forced (and a reference copy exists)."""
    got_trainer = PPOTrainer(PPOConfig(**ON_POLICY, compute_reference_kl=True), make_gpt2(), tokenizer=make_tokenizer())
    want_trainer = EveryPassTrainer(PPOConfig(**ON_POLICY), make_gpt2(), tokenizer=make_tokenizer())
    assert got_trainer.ref_model is not None and got_trainer.rollout_plan == RolloutPlan(reference=True, policy=False)
    for step in range(2):
        batch = grouped(step)
        torch.manual_seed(step)
        got = got_trainer.step(*batch)
        torch.manual_seed(step)
        want = want_trainer.step(*batch)
        for key in KL_STATS + ("objective/logprobs", "objective/entropy"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert abs(got["objective/kl"]) > 1e-3  # the policy moved away from the reference


def test_peft_policy_runs_no_adapter_disabled_pass():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(make_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    base_calls = no_grad_calls(policy.get_base_model())
    disabled = []
    original = type(policy).disable_adapter

    def counting(self):
        disabled.append(1)
        return original(self)

    type(policy).disable_adapter = counting
    try:
        trainer = PPOTrainer(PPOConfig(**ON_POLICY), policy, tokenizer=make_tokenizer())
        stats = trainer.step(*grouped(0))
        assert (disabled, base_calls) == ([], []) and np.isnan(stats["objective/kl"])
        measured = PPOTrainer(PPOConfig(**ON_POLICY, compute_reference_kl=True), copy.deepcopy(policy), tokenizer=make_tokenizer())
        assert np.isfinite(measured.step(*grouped(0))["objective/kl"]) and disabled
    finally:
        type(policy).disable_adapter = original


# ----------------------------------------------------------------------------------------------
# The update without the passes: the float64 reference's, and today's path's
# ----------------------------------------------------------------------------------------------
WHOLE_BATCH = dict(mini_batch_size=BATCH_SIZE, gradient_accumulation_steps=1)
CASES = {
    "token_mean_grad_accum": dict(),
    "seq_mean_token_mean": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_response_length=9),
    "dapo_grad_accum": dict(loss_type="dapo"),
    "dapo_one_minibatch": dict(loss_type="dapo", mini_batch_size=8, gradient_accumulation_steps=1),
    "tis": dict(importance_sampling_correction="tis", importance_sampling_cap=1.1, generation_noise=0.3),
    "gspo_clip_higher_entropy": dict(importance_sampling_level="sequence", cliprange_high=0.3, entropy_coef=0.05),
    "kl_in_loss": dict(init_kl_coef=0.3, loss_type="dapo"),  # the reference runs, the policy's pass does not
    "rloo_kl_in_reward_at_zero": dict(advantage_estimator="rloo", kl_in_reward=True),
    # Passes by token budget (docs/algorithm.md section 18): one optimizer step after the last pass, so every
    # pass's forward is still the rollout policy's. The reference takes the backward batch as one mini-batch,
    # since a budget's statistics are the backward batch's, not means over mini-batches.
    "dapo_token_budget": dict(loss_type="dapo", **WHOLE_BATCH, max_tokens_per_minibatch=24),
    "seq_mean_token_budget": dict(loss_type="grpo", **WHOLE_BATCH, max_tokens_per_minibatch=24),
    "tis_token_budget": dict(loss_type="dapo", importance_sampling_correction="tis", importance_sampling_cap=1.1,
                             generation_noise=0.3, **WHOLE_BATCH, max_tokens_per_minibatch=24),  # fmt: skip
}
COMPARED = ("ppo/loss/policy", "ppo/policy/entropy", "ppo/policy/clipfrac", "ppo/policy/approxkl", "objective/entropy")


def _trainers(case: dict, policy, reference):
    """The trainer with the passes skipped, the one with both forced (same weights) and the float64 reference."""
    config = PPOConfig(**{**ON_POLICY, **{k: v for k, v in case.items() if k != "generation_noise"}})
    tokenizer = make_tokenizer()
    built = []
    for cls in (PPOTrainer, EveryPassTrainer):
        model, ref = copy.deepcopy(policy), copy.deepcopy(reference)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
        built.append(cls(config, model, ref_model=ref, tokenizer=tokenizer, optimizer=optimizer))
    plain = PlainObjectivesPPO(
        copy.deepcopy(policy), copy.deepcopy(reference), config, pad_id=tokenizer.pad_token_id,
        optimizer_cls=lambda params, lr: torch.optim.SGD(params, lr=lr),
    )  # fmt: skip
    return built[0], built[1], plain, config


def _compare_updates(got_trainer, forced, plain, config, case, initial):
    for step in range(2):
        queries, responses, scores = grouped(step)
        generation = None
        if "generation_noise" in case:
            generation = _generation_logprobs(plain.model, queries, responses, case["generation_noise"], step)
        results = []
        for trainer in (got_trainer, forced, plain):
            torch.manual_seed(1000 + step)
            results.append(trainer.step(queries, responses, scores, generation_logprobs=generation))
        got, today, want = results
        compared = COMPARED + (("ppo/policy/entropy_loss",) if config.entropy_coef else ())
        compared += ("objective/logprobs", "ppo/policy/advantages")
        if generation is not None:
            compared += ("rollout/logprob_diff/mean", "rollout/logprob_diff/max", "rollout/is_weight/mean")
        if config.init_kl_coef:
            compared += KL_STATS + ("ppo/policy/kl_loss",)
        else:
            assert all(np.isnan(got[key]).all() for key in KL_STATS)
        for key in compared:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=f"float64 {key}")
            np.testing.assert_allclose(got[key], today[key], rtol=1e-5, atol=1e-6, err_msg=f"today's path {key}")
        assert (got["ppo/policy/ratio"] == 1.0).all()  # lp_old is the training forward's own log-prob
        if config.max_tokens_per_minibatch is not None:
            assert got["ppo/minibatches"] > 1  # the backward batch really went in several passes

    named = [dict(t.accelerator.unwrap_model(t.model).pretrained_model.named_parameters()) for t in (got_trainer, forced)]
    moved = 0.0
    for key, start in initial.items():
        want_value = dict(plain.model.named_parameters())[key].detach()
        update = (want_value - start).norm()
        for trained in named:
            error = (trained[key].detach().double() - want_value).norm()
            assert error <= 1e-4 * update + 1e-6, f"{key}: error {error:.3g}, update {update:.3g}"
        moved = max(moved, float(update))
    assert moved > 1e-2


@pytest.mark.parametrize("name", list(CASES))
def test_on_policy_update_matches_the_float64_reference_and_todays_path(name):
    case = CASES[name]
    policy, reference = make_gpt2(), perturbed_copy(make_gpt2(), seed=1)
    got_trainer, forced, plain, config = _trainers(case, policy, reference)
    assert got_trainer.rollout_plan == RolloutPlan(reference=bool(config.init_kl_coef), policy=False)
    assert forced.rollout_plan == EVERY_PASS
    initial = {k: v.detach().double().clone() for k, v in plain.model.named_parameters()}
    _compare_updates(got_trainer, forced, plain, config, case, initial)
    if "generation_noise" in case:
        assert (plain.tis_weights == config.importance_sampling_cap).any()  # the cap bound somewhere


def test_on_policy_update_of_a_peft_policy_matches_the_float64_reference():
    """LoRA, the KL in the loss at 0.3: the reference is the adapter disabled (it runs), the policy's pass does not."""
    from peft import LoraConfig, get_peft_model

    base = make_gpt2()
    reference = copy.deepcopy(base).eval()  # LoRA's B starts at zero: the disabled adapter is the base model
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0))
    config = PPOConfig(**{**ON_POLICY, "init_kl_coef": 0.3, "loss_type": "dapo", "learning_rate": 0.5})
    tokenizer = make_tokenizer()
    trainers = []
    for cls in (PPOTrainer, EveryPassTrainer):
        model = copy.deepcopy(policy)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainers.append(cls(config, model, tokenizer=tokenizer, optimizer=optimizer))
    plain = PlainObjectivesPPO(
        copy.deepcopy(policy), reference, config, pad_id=tokenizer.pad_token_id,
        optimizer_cls=lambda params, lr: torch.optim.SGD(params, lr=lr),
    )  # fmt: skip
    assert trainers[0].rollout_plan == RolloutPlan(reference=True, policy=False) and trainers[0].ref_model is None
    initial = {k: v.detach().double().clone() for k, v in plain.model.named_parameters() if v.requires_grad}
    assert initial and all("lora_" in k for k in initial)
    _compare_updates(trainers[0], trainers[1], plain, config, {}, initial)


@pytest.mark.xdist_group("distributed")
def test_on_policy_step_on_two_processes_equals_todays_path_on_one(tmp_path):
    """REINFORCE++ with the KL at 0, one optimizer step (global_token_mean, SGD): 2 DDP processes (mini-batch 2 x
    accumulation 2 each) without any pass without grad take the step of 1 process on all 8 rows with both passes."""
    from test_distributed import SCRIPTS, launch

    results = {}
    runs = {
        "two": ("multi_gpu", 2, ("--mini_batch_size", "2", "--gradient_accumulation_steps", "2")),
        "one_every_pass": ("single_gpu", 1, ("--mini_batch_size", "8", "--every_pass")),
    }
    for name, (config, processes, args) in runs.items():
        out = tmp_path / name
        out.mkdir()
        launch(config, SCRIPTS / "global_token_mean_step.py", "--output_dir", str(out), "--init_kl_coef", "0", *args,
               num_processes=processes)  # fmt: skip
        results[name] = torch.load(out / "result.pt")
    got, want = results["two"], results["one_every_pass"]
    assert (got["no_grad_calls"], want["no_grad_calls"]) == (0, 2)  # today's path: the policy's and the reference's
    start = {k: p.detach().to(torch.float64) for k, p in make_gpt2(seed=0).named_parameters()}
    assert max((want["named_parameters"][k] - start[k]).abs().max().item() for k in start) > 1e-3
    max_diff = max((got["named_parameters"][k] - want["named_parameters"][k]).abs().max().item() for k in start)
    assert max_diff <= 1e-5, f"max abs weight difference {max_diff:.3g}"
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
