"""Separate critic, PTX loss and EMA of the policy (docs/algorithm.md sections 9-11).

The steps are checked against ``plain_ppo.PlainPPO`` (a critic read through the classifier's own
forward, a per-row cross-entropy loop for PTX, float64 EMA accumulators over every parameter) with
the tolerances of ``test_step_reference.py``; then what the losses may reach, saving, exact resume
and the argument checks.
"""

import copy

import numpy as np
import pytest
import torch
from devices import assert_close, equal, on_cpu
from plain_ppo import PlainPPO
from test_step_reference import (
    BASE_CONFIG,
    BATCH_SIZE,
    COMPARED_STATS,
    STATS_ATOL,
    STATS_RTOL,
    WEIGHTS_ATOL,
    WEIGHTS_REL_L2,
    make_batch,
    perturbed_copy,
    zero_key_bias_gradients,
)
from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_tokenizer, random_batch
from transformers import GPT2ForSequenceClassification

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, ValueModel

# The KL statistics are per-row sums of up to 7 differences of log-probs of magnitude ~4, which are
# themselves compared at rtol 1e-5: their absolute error is bounded by the sum of the log-probs'
# errors (measured: 1.4e-6 per log-prob and 2.6e-6 per row in the second step of the "critic" case,
# where objective/kl is -0.069, a mean of row sums of both signs).
KL_STATS, KL_ATOL = ("objective/kl", "objective/kl_dist"), 1e-5


def assert_stats_close(got: dict, want: dict) -> None:
    for key in COMPARED_STATS:
        atol = KL_ATOL if key in KL_STATS else STATS_ATOL
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=STATS_RTOL, atol=atol, err_msg=key)


def ptx_batch(step: int) -> list:
    """BATCH_SIZE pretraining rows of 2-9 tokens."""
    return random_batch(BATCH_SIZE, seed=50 + step, query_len=(2, 9))[0]


def make_trio(
    config_kwargs: dict, critic: bool = True, padding_side: str = "right", optimizer_cls=None, plain_policy=False
):
    """A trainer and a PlainPPO from identical policy, reference and (optional) critic; the policy's
    optimizer is ``optimizer_cls`` on both sides when given (else the trainer's default Adam); with
    ``plain_policy`` the policy is a transformers causal LM without a value head."""
    policy = make_gpt2() if plain_policy else AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    ref = perturbed_copy(policy, seed=1)
    value_model = make_gpt2_critic(seed=3) if critic else None
    plain_policy, plain_ref, plain_critic = (copy.deepcopy(m) for m in (policy, ref, value_model))
    for model in (policy, plain_policy) + ((value_model, plain_critic) if critic else ()):
        assert zero_key_bias_gradients(model) == 2
    tokenizer = make_tokenizer(padding_side=padding_side)
    config = PPOConfig(**{**BASE_CONFIG, **config_kwargs})
    optimizer = None
    if optimizer_cls is not None:
        if critic and not plain_policy:
            policy.v_head.requires_grad_(False)
        optimizer = optimizer_cls([p for p in policy.parameters() if p.requires_grad], lr=config.learning_rate)
    trainer = PPOTrainer(
        config, policy, ref_model=ref, tokenizer=tokenizer, value_model=value_model, optimizer=optimizer
    )
    plain = PlainPPO(
        plain_policy, plain_ref, config, pad_id=0, padding_side=padding_side, critic=plain_critic,
        optimizer_cls=optimizer_cls,
    )  # fmt: skip
    return trainer, plain


def assert_close_by_name(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        got_value, value = on_cpu(got[name]).double(), on_cpu(value).double()
        error = (got_value - value).norm() / value.norm().clamp(min=1e-12)
        assert error <= WEIGHTS_REL_L2, f"{name}: relative L2 error {error:.2e}"
        assert_close(got_value, value, rtol=0, atol=WEIGHTS_ATOL, msg=lambda m, n=name: f"{n}: {m}")


# Without PTX the separate critic's policy learns from the clipped surrogate alone, whose gradients
# on some early-layer weights are near-cancelling sums; Adam divides each by its own running
# magnitude and turns their float32 noise into visible step differences (measured with Adam:
# h.0.mlp.c_fc.weight 4.8e-5 relative L2 apart, 0.24% of its elements more than 1e-6 apart, while
# every statistic agreed). Those cases train the policy with plain SGD on both sides, which keeps the
# noise at its own size (measured: 2.4e-6 at most); the critic keeps the default Adam.
SGD_POLICY = dict(learning_rate=0.1, critic_learning_rate=1e-3)
CASES = {
    "critic": dict(config=SGD_POLICY, optimizer_cls=torch.optim.SGD),
    "critic_left_padding": dict(config=SGD_POLICY, optimizer_cls=torch.optim.SGD, padding_side="left"),
    "plain_policy_critic": dict(config=SGD_POLICY, optimizer_cls=torch.optim.SGD, plain_policy=True),
    "critic_ptx_ema": dict(config=dict(ptx_coef=0.5, ema_decay=0.9), ptx=True),
    "critic_ptx_accumulation_clipping": dict(
        config=dict(ptx_coef=2.0, gradient_accumulation_steps=2, max_grad_norm=0.05, ema_decay=0.5), ptx=True
    ),
    "shared_head_ptx_ema": dict(config=dict(ptx_coef=0.5, ema_decay=0.9), ptx=True, critic=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_steps_match_the_plain_reference(case):
    spec = CASES[case]
    critic = spec.get("critic", True)
    trainer, plain = make_trio(
        spec["config"], critic, spec.get("padding_side", "right"), spec.get("optimizer_cls"), spec.get("plain_policy")
    )
    for step in range(2):
        queries, responses, scores, _ = make_batch(step)
        ptx = ptx_batch(step) if spec.get("ptx") else None
        torch.manual_seed(1000 + step)
        got = trainer.step(queries, responses, scores, ptx_inputs=ptx)
        torch.manual_seed(1000 + step)
        want = plain.step(queries, responses, scores, ptx_inputs=ptx)
        assert_stats_close(got, want)
        if ptx is not None:
            np.testing.assert_allclose(got["ppo/loss/ptx"], want["ppo/loss/ptx"], rtol=1e-5)
            assert want["ppo/loss/ptx"] > 1.0
        else:
            assert "ppo/loss/ptx" not in got
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert_close_by_name((policy.pretrained_model if spec.get("plain_policy") else policy).state_dict(), plain.model.state_dict())
    if critic:
        unwrapped = trainer.accelerator.unwrap_model(trainer.critic)
        assert_close_by_name(unwrapped.pretrained_model.state_dict(), plain.critic.state_dict())
    if trainer.config.ema_decay is not None:
        ema = dict(trainer.ema_model.named_parameters())
        assert_close_by_name({k: ema[k] for k in plain.ema}, plain.ema)
        # The average lags the policy: it is not the final weights.
        name = "pretrained_model.transformer.h.0.mlp.c_fc.weight"
        assert not torch.allclose(ema[name], dict(policy.named_parameters())[name], atol=1e-5)
    assert want["ppo/policy/clipfrac"] > 0 and want["ppo/val/clipfrac"] > 0
    if trainer.config.max_grad_norm is not None:
        assert max(plain.grad_norms) > trainer.config.max_grad_norm


def test_each_loss_reaches_only_its_own_model(monkeypatch):
    """The policy's loss has no gradient path into the critic and the value loss none into the
    policy; the policy's value head is frozen, unused and in no optimizer."""
    trainer, _ = make_trio(dict(ptx_coef=0.5), critic=True)
    policy_params = [p for p in trainer.model.parameters() if p.requires_grad]
    critic_params = list(trainer.critic.parameters())
    seen = []
    original = type(trainer.learner).backward_and_step

    def checked(self, policy_loss, critic_loss):
        into_critic = torch.autograd.grad(policy_loss, critic_params, retain_graph=True, allow_unused=True)
        into_policy = torch.autograd.grad(critic_loss, policy_params, retain_graph=True, allow_unused=True)
        assert all(g is None for g in into_critic) and all(g is None for g in into_policy)
        own = torch.autograd.grad(critic_loss, critic_params, retain_graph=True, allow_unused=True)
        assert any(g is not None and g.abs().sum() > 0 for g in own)
        seen.append(True)
        return original(self, policy_loss, critic_loss)

    monkeypatch.setattr(type(trainer.learner), "backward_and_step", checked)
    v_head = copy.deepcopy(trainer.model.v_head.state_dict())
    queries, responses, scores, _ = make_batch(0)
    trainer.step(queries, responses, scores, ptx_inputs=ptx_batch(0))
    assert len(seen) == trainer.config.ppo_epochs * BATCH_SIZE // trainer.config.mini_batch_size
    for key, value in trainer.model.v_head.state_dict().items():
        assert equal(value, v_head[key])
    in_policy_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    in_critic_optimizer = {id(p) for group in trainer.critic_optimizer.param_groups for p in group["params"]}
    assert not in_policy_optimizer & in_critic_optimizer
    assert not {id(p) for p in trainer.model.v_head.parameters()} & in_policy_optimizer
    assert in_critic_optimizer == {id(p) for p in critic_params}


def test_critic_learning_rate_reaches_only_the_critic_optimizer():
    trainer, _ = make_trio(dict(critic_learning_rate=7e-4), critic=True)
    assert trainer.optimizer.param_groups[0]["lr"] == BASE_CONFIG["learning_rate"]
    assert trainer.critic_optimizer.param_groups[0]["lr"] == 7e-4
    default, _ = make_trio(dict(), critic=True)
    assert default.critic_optimizer.param_groups[0]["lr"] == BASE_CONFIG["learning_rate"]


def test_save_pretrained_writes_policy_critic_and_ema(tmp_path):
    trainer, _ = make_trio(dict(ema_decay=0.8), critic=True)
    queries, responses, scores, _ = make_batch(0)
    trainer.step(queries, responses, scores)
    trainer.save_pretrained(str(tmp_path / "policy"), save_value_model=True)
    trainer.save_pretrained(str(tmp_path / "ema"), ema=True)

    critic = GPT2ForSequenceClassification.from_pretrained(str(tmp_path / "policy" / "value_model"))
    want = trainer.accelerator.unwrap_model(trainer.critic).pretrained_model.state_dict()
    for key, value in critic.state_dict().items():
        assert equal(value, want[key]), key
    assert ValueModel.from_pretrained(str(tmp_path / "policy" / "value_model")).config.num_labels == 1

    policy = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "policy")).state_dict()
    ema = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "ema")).state_dict()
    live = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    averaged = trainer.ema_model.state_dict()
    name = "transformer.h.1.attn.c_attn.weight"
    assert equal(policy[name], live[name])
    assert equal(ema[name], averaged[name]) and not equal(ema[name], live[name])
    # GPT-2 ties its LM head to the embeddings: the saved average keeps them tied.
    assert equal(ema["lm_head.weight"], averaged["transformer.wte.weight"])
    assert not equal(ema["transformer.wte.weight"], live["transformer.wte.weight"])


def _resumable_trainer():
    torch.manual_seed(0)
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(dropout=0.1))
    critic = make_gpt2_critic(seed=5)
    critic.config.resid_pdrop = 0.1
    config = PPOConfig(**{**BASE_CONFIG, "ptx_coef": 0.3, "ema_decay": 0.7, "critic_learning_rate": 2e-3, "seed": 4})
    return PPOTrainer(config, policy, tokenizer=make_tokenizer(), value_model=critic)


def _state(trainer) -> dict:
    unwrap = trainer.accelerator.unwrap_model
    out = {f"policy.{k}": v for k, v in unwrap(trainer.model).state_dict().items()}
    out.update({f"critic.{k}": v for k, v in unwrap(trainer.critic).state_dict().items()})
    out.update({f"ema.{k}": v for k, v in trainer.ema_model.state_dict().items()})
    for name, optimizer in (("adam", trainer.optimizer), ("critic_adam", trainer.critic_optimizer)):
        for i, state in optimizer.state_dict()["state"].items():
            out.update({f"{name}.{i}.{k}": v for k, v in state.items()})
    return out


def test_exact_resume_with_critic_and_ema(tmp_path):
    batches = [make_batch(step) + (ptx_batch(step),) for step in range(3)]

    def run(trainer, steps):
        return [trainer.step(q, r, s, ptx_inputs=ptx) for q, r, s, _, ptx in (batches[i] for i in steps)]

    straight = _resumable_trainer()
    want = run(straight, range(3))
    first = _resumable_trainer()
    run(first, [0])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = _resumable_trainer()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = run(resumed, [1, 2])
    for g, w in zip(got, want[1:]):
        assert g["ppo/loss/total"] == w["ppo/loss/total"] and g["ppo/loss/ptx"] == w["ppo/loss/ptx"]
    got_state, want_state = _state(resumed), _state(straight)
    assert sorted(got_state) == sorted(want_state)
    assert any(k.startswith("critic_adam.") for k in got_state)
    for key, value in want_state.items():
        assert equal(got_state[key], value), key


def test_peft_critic_trains_only_its_adapter_and_head(tmp_path):
    from peft import LoraConfig

    make_gpt2_critic(seed=3).save_pretrained(str(tmp_path / "rm"))
    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["c_attn"])
    critic = ValueModel.from_pretrained(str(tmp_path / "rm"), peft_config=lora)
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    config = PPOConfig(**{**BASE_CONFIG, "ppo_epochs": 1})
    trainer = PPOTrainer(config, policy, tokenizer=make_tokenizer(), value_model=critic)
    queries, responses, scores, _ = make_batch(0)
    stats = trainer.step(queries, responses, scores)
    assert np.isfinite(stats["ppo/loss/value"])
    changed = {k for k, v in trainer.critic.state_dict().items() if not equal(v, before[k])}
    assert changed and all("lora_" in k or "score" in k for k in changed), sorted(changed)
    trainer.save_pretrained(str(tmp_path / "out"), save_value_model=True)
    assert (tmp_path / "out" / "value_model" / "adapter_config.json").exists()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(value_model="rm"), TypeError, "value_model must be"),
        (dict(value_model=make_gpt2_critic().base_model), ValueError, "score"),
        (dict(critic_optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)), ValueError, "without value_model"),
    ],
)  # fmt: skip
def test_bad_critic_arguments_are_rejected(kwargs, error, match):
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    with pytest.raises(error, match=match):
        PPOTrainer(PPOConfig(**BASE_CONFIG), policy, tokenizer=make_tokenizer(), **kwargs)


def test_a_classifier_with_two_labels_is_rejected():
    two_labels = make_gpt2_critic()
    two_labels.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=1"):
        ValueModel(two_labels)


@pytest.mark.parametrize(
    "field, value, error",
    [("critic_learning_rate", 0.0, ValueError), ("ptx_coef", -1.0, ValueError), ("ema_decay", 1.0, ValueError),
     ("ema_decay", 0.0, ValueError), ("ema_decay", "0.9", TypeError)],
)  # fmt: skip
def test_bad_config_fields_are_rejected(field, value, error):
    with pytest.raises(error, match=field):
        PPOConfig(**{**BASE_CONFIG, field: value})


@pytest.mark.parametrize(
    "ptx, config, match",
    [
        (lambda: ptx_batch(0), dict(), "ptx_coef"),
        (lambda: ptx_batch(0)[:3], dict(ptx_coef=0.5), "batch_size=8"),
        (lambda: ptx_batch(0)[:7] + [torch.tensor([5])], dict(ptx_coef=0.5), r"ptx_inputs\[7\]"),
        (lambda: ptx_batch(0)[:7] + [torch.tensor([5, VOCAB_SIZE])], dict(ptx_coef=0.5), "vocabulary"),
    ],
)
def test_bad_ptx_inputs_are_rejected_before_any_state_changes(ptx, config, match):
    trainer, _ = make_trio(config, critic=True)
    weights = copy.deepcopy(trainer.critic.state_dict())
    queries, responses, scores, _ = make_batch(0)
    with pytest.raises((ValueError, TypeError), match=match):
        trainer.step(queries, responses, scores, ptx_inputs=ptx())
    assert trainer.current_step == 0
    assert all(equal(v, weights[k]) for k, v in trainer.critic.state_dict().items())


def test_ema_requests_without_ema_decay_are_rejected(tmp_path):
    trainer, _ = make_trio(dict(), critic=False)
    with pytest.raises(ValueError, match="ema_decay"):
        trainer.ema_model
    with pytest.raises(ValueError, match="ema_decay"):
        trainer.save_pretrained(str(tmp_path), ema=True)
    with pytest.raises(ValueError, match="value_model"):
        trainer.save_pretrained(str(tmp_path), save_value_model=True)
