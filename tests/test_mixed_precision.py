"""Mixed precision on this CPU (accelerate's bf16 autocast runs here): a bf16 step agrees with the fp32 step
within bf16 tolerance, with float32 and with bfloat16 weights, through ``step()``, the classic helpers, the
separate critic, PTX and generation; the fused LM head runs in the autocast dtype; and fp16's grad scaler
sees every update (checked with a CPU ``GradScaler`` standing in for CUDA's)."""

import copy
import warnings

import numpy as np
import pytest
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from tiny_models import make_gpt2, make_gpt2_critic, make_tokenizer, random_batch

import trl_lite.core.lm_head as lm_head_module
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

# bf16 keeps 8 bits of mantissa: relative errors of ~1e-2 per product, a few of them per statistic.
BF16_RTOL, BF16_ATOL = 5e-2, 2e-2
COMPARED = ("objective/kl", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/entropy", "ppo/returns/mean",
            "ppo/val/vpred", "ppo/policy/approxkl")  # fmt: skip


def _reset_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state, whose mixed precision is fixed by the first Accelerator:
    each trainer here starts from a fresh one, and none of this file's precision reaches other tests."""
    _reset_accelerate_state()
    yield
    _reset_accelerate_state()


def make_trainer(lm, mixed_precision="no", value_model=None, **config_kwargs):
    _reset_accelerate_state()
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, learning_rate=1e-3, seed=0,
        accelerator_kwargs={"mixed_precision": mixed_precision}, **config_kwargs,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(lm), tokenizer=make_tokenizer(),
                          value_model=value_model)  # fmt: skip


def assert_close(got: dict, want: dict, keys=COMPARED):
    for key in keys:
        if key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=BF16_RTOL, atol=BF16_ATOL, err_msg=key)


def bf16_rounded(lm):
    """``lm`` with every weight rounded to bfloat16 and kept in float32: what a bf16 checkpoint holds."""
    return copy.deepcopy(lm).to(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_bf16_step_matches_the_fp32_step(weights):
    lm = make_gpt2(seed=1)
    torch.manual_seed(0)
    reference = make_trainer(bf16_rounded(lm) if weights == "bf16" else copy.deepcopy(lm))
    policy = copy.deepcopy(lm).to(torch.bfloat16) if weights == "bf16" else copy.deepcopy(lm)
    torch.manual_seed(0)
    amp = make_trainer(policy, mixed_precision="bf16")
    for seed in range(2):
        batch = random_batch(4, seed=seed)
        torch.manual_seed(seed)
        want = reference.step(*batch)
        torch.manual_seed(seed)
        got = amp.step(*batch)
        assert np.isfinite(got["ppo/loss/total"])
        assert_close(got, want)
    moved = [(p.float() - q).abs().max().item() for p, q in zip(amp.model.parameters(), reference.model.parameters())]
    assert max(moved) < 5e-2


def test_the_fused_lm_head_runs_in_the_autocast_dtype(monkeypatch):
    seen = []
    real = lm_head_module._lm_head_logits

    def recording(hidden, weight, bias, buffer_rows, out=None):
        device = hidden.device.type  # autocast is per device type: "cuda" where the trainer runs on a GPU
        seen.append((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), hidden.dtype))
        return real(hidden, weight, bias, buffer_rows, out)

    monkeypatch.setattr(lm_head_module, "_lm_head_logits", recording)
    trainer = make_trainer(make_gpt2(), mixed_precision="bf16", ppo_epochs=1)
    trainer.step(*random_batch(4))
    # Rollout passes of policy and reference (2 mini-batches each) and 2 training passes.
    assert len(seen) == 6
    assert all(enabled and dtype == torch.bfloat16 for enabled, dtype, _ in seen)
    # Without mixed precision the product is float32 and autocast stays off.
    seen.clear()
    make_trainer(make_gpt2(), ppo_epochs=1).step(*random_batch(4))
    assert seen and all(not enabled and hidden == torch.float32 for enabled, _, hidden in seen)


def test_bf16_critic_ptx_classic_helpers_and_generation():
    lm = make_gpt2(seed=2).to(torch.bfloat16)
    trainer = make_trainer(lm, mixed_precision="bf16", value_model=make_gpt2_critic(seed=3), ptx_coef=0.5)
    queries, responses, scores = random_batch(4, seed=4)
    ptx = random_batch(4, seed=5, query_len=(3, 6))[0]
    stats = trainer.step(queries, responses, scores, ptx_inputs=ptx)
    assert all(np.isfinite(stats[k]) for k in ("ppo/loss/total", "ppo/loss/ptx", "ppo/loss/value"))
    inputs = trainer.prepare_model_inputs(queries, responses)
    logprobs, logits, values, masks = trainer.batched_forward_pass(trainer.model, queries, responses, inputs, True)
    assert logprobs.dtype == torch.float32 and torch.isfinite(logprobs).all() and logits is not None
    # The log-probs of the classic pass are those of its float32 logits.
    want = torch.log_softmax(logits, -1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1) * masks
    torch.testing.assert_close(logprobs * masks, want, rtol=1e-5, atol=1e-5)
    out = trainer.generate(queries, return_prompt=False, max_new_tokens=4, do_sample=False, return_logprobs=True)
    assert len(out[0]) == 4 and all(torch.isfinite(lp).all() for lp in out[1])


def _with_cpu_grad_scaler(trainer, init_scale):
    """Give ``trainer`` the fp16 set-up accelerate builds on CUDA, with a CPU ``GradScaler``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    inner = trainer.optimizer.optimizer
    trainer.accelerator.scaler = scaler
    trainer.optimizer = trainer.learner.optimizer = AcceleratedOptimizer(inner, scaler=scaler)
    # What accelerate's clip_grad_norm_ does first under native fp16 (which it enables on CUDA only).
    trainer.accelerator.unscale_gradients = lambda optimizer=None: scaler.unscale_(inner)
    return scaler


def test_fp16_overflow_goes_through_the_scaler_which_backs_off():
    trainer = make_trainer(make_gpt2(), max_grad_norm=1.0, ppo_epochs=2)
    scaler = _with_cpu_grad_scaler(trainer, init_scale=1024.0)
    # An fp16 overflow: one gradient becomes inf in every backward. Each update must be skipped by the
    # scaler, which halves its scale each time - and clipping must not find unscale_ already called.
    wte = trainer.model.pretrained_model.transformer.wte.weight
    wte.register_hook(lambda grad: grad + float("inf"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.warns(UserWarning, match="gradients are not finite"):
        stats = trainer.step(*random_batch(4))
    assert stats["ppo/skipped_minibatches"] == 4.0
    assert scaler.get_scale() == 1024.0 / 2**4
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_fp16_finite_updates_step_through_the_scaler():
    lm = make_gpt2()
    torch.manual_seed(0)  # the value heads are drawn from torch's global generator
    plain = make_trainer(copy.deepcopy(lm), max_grad_norm=1.0)
    torch.manual_seed(0)
    scaled = make_trainer(copy.deepcopy(lm), max_grad_norm=1.0)
    scaler = _with_cpu_grad_scaler(scaled, init_scale=1024.0)
    batch = random_batch(4, seed=7)
    torch.manual_seed(0)
    want = plain.step(*batch)
    torch.manual_seed(0)
    got = scaled.step(*batch)
    # Scaling by a power of two and unscaling is exact: the same updates as without a scaler.
    assert got["ppo/skipped_minibatches"] == 0.0 and scaler.get_scale() == 1024.0
    np.testing.assert_allclose(got["ppo/loss/total"], want["ppo/loss/total"], rtol=1e-6)
    for p, q in zip(scaled.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
