"""``PPOConfig.oom_backoff``: a pass that runs out of memory is redone in smaller passes (docs/out_of_memory.md).

The error is injected on the CPU (tests/oom_injection.py). A step that backed off must give the update,
the statistics and the checkpoint of the same step run without the failure (float32 tolerance): for GAE
and GRPO, several loss types, gradient accumulation with and without a budget, two PPO epochs; with the
failure in the first, a middle and the last training pass, in a rollout pass, or twice in one step. A row
that does not fit alone ends in an error naming the remedies; a resumed run keeps the smaller budget.
Two processes (DDP, ZeRO-2): tests/test_oom_backoff_distributed.py.
"""

import json
import os
import warnings

import numpy as np
import pytest
import torch
from oom_injection import InjectedOutOfMemory
from safetensors.torch import load_file
from tiny_models import make_gpt2, make_gpt2_critic, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core import masked_mean, masked_var
from trl_lite.trainer.step.pass_plan import combine_pass_stats

# Statistics that describe the passes themselves (their count and size) or the back-off: they differ by design.
PASS_STATS = ("ppo/minibatches", "ppo/tokens_per_minibatch/mean", "ppo/tokens_per_minibatch/max", "memory/", "prefix_sharing/")

CASES = {
    "gae_token_mean_accumulation": dict(gradient_accumulation_steps=2),
    "gae_seq_mean_token_mean_budget": dict(loss_type="seq_mean_token_mean", max_tokens_per_minibatch=24,
                                           gradient_accumulation_steps=2),
    "gae_global_token_mean": dict(loss_type="global_token_mean", gradient_accumulation_steps=2),
    "grpo_seq_mean_token_sum_norm": dict(advantage_estimator="grpo", num_samples_per_query=4,
                                         loss_type="seq_mean_token_sum_norm", max_response_length=12),
    # Passes planned from each row's prompt + response (no shared prompts): the split whose last pass of several
    # rows is near the end (the "last" case). grpo_seq_mean_token_sum_norm backs off into a budget with them shared.
    "grpo_token_mean_budget": dict(advantage_estimator="grpo", num_samples_per_query=4, max_tokens_per_minibatch=32,
                                   gradient_accumulation_steps=2, init_kl_coef=0.05, kl_in_reward=False,
                                   prefix_sharing=False),
}  # fmt: skip


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _trainer(critic: bool = False, **options):
    """A trainer on a tiny GPT-2 (with ``critic``, a separate critic), 8 rows per step in mini-batches of 2, two
    PPO epochs; SGD with momentum (linear in the gradients, so float32 noise stays float32 noise, and with a
    state that the checkpoint holds)."""
    config = PPOConfig(**{**dict(batch_size=8, mini_batch_size=2, ppo_epochs=2, learning_rate=0.1, seed=0), **options})
    torch.manual_seed(0)
    model = make_gpt2(seed=0)
    plain = critic or config.advantage_estimator != "gae"
    policy = model if plain else AutoModelForCausalLMWithValueHead.from_pretrained(model)
    kwargs = {}
    if critic:
        value_model = make_gpt2_critic(seed=2)
        kwargs = {"value_model": value_model, "critic_optimizer": _sgd(value_model)}
    return PPOTrainer(config, policy, tokenizer=make_tokenizer(), optimizer=_sgd(policy), **kwargs)


def _batch(trainer, seed=3):
    queries, responses, scores = random_batch(8, seed=seed, query_len=(2, 5), response_len=(1, 12))
    if trainer.config.advantage_estimator == "grpo":
        queries = [queries[(i // 4) * 4] for i in range(8)]
    return queries, responses, scores


def _step(trainer, seed=3, **injection):
    """One step of ``trainer`` with the errors of ``injection`` (none when empty); the statistics and the injector."""
    queries, responses, scores = _batch(trainer, seed)
    torch.manual_seed(100 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with InjectedOutOfMemory(trainer.model, **injection) as injected:
            stats = trainer.step(queries, responses, scores)
    return stats, injected


def _assert_same_step(got, want, got_trainer, want_trainer):
    """Statistics (but the passes' count and size) and weights equal to float32 tolerance."""
    for key, value in want.items():
        if key.startswith(PASS_STATS) or key.startswith("time/"):
            continue
        if key == "ppo/policy/ratio":  # the trained tokens' ratios, in the order of the passes
            value, other = np.sort(value), np.sort(got[key])
        else:
            other = got[key]
        np.testing.assert_allclose(other, value, rtol=1e-5, atol=1e-6, err_msg=key)
    for (name, a), b in zip(want_trainer.model.state_dict().items(), got_trainer.model.state_dict().values()):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_step_that_backed_off_equals_the_step_without_the_failure(name, where):
    clean = _trainer(**CASES[name])
    want, seen = _step(clean)
    passes = int(want["ppo/minibatches"])
    splittable = [call for call, rows in enumerate(seen.rows) if rows > 1]  # a pass of one row cannot back off
    call = {"first": splittable[0], "middle": splittable[len(splittable) // 2], "last": splittable[-1]}[where]
    assert where != "last" or passes - call <= 2
    trainer = _trainer(**CASES[name])
    got, injected = _step(trainer, calls=(call,))
    assert injected.failures == 1
    assert got["memory/oom_retries"] == 1 and want["memory/oom_retries"] == 0
    configured = CASES[name].get("max_tokens_per_minibatch")
    # Halved: the configured budget, or the failed pass's tokens without one.
    halved = (configured or injected.seen[call]) // 2
    assert got["memory/max_tokens_per_minibatch"] == trainer.forward.max_tokens == halved
    assert want["memory/max_tokens_per_minibatch"] == (configured or 0)
    assert got["ppo/minibatches"] > passes  # smaller passes after the failure
    _assert_same_step(got, want, trainer, clean)


def test_two_failures_in_one_step_under_a_memory_limit_give_the_same_step():
    """A device limit of 20 tokens a pass, a budget of 64: the first backward batch fails at 64 and again at 32,
    then trains in passes of 16 - two failures in one step, and the step is the one without failures."""
    options = dict(gradient_accumulation_steps=2, max_tokens_per_minibatch=64)
    clean = _trainer(**options)
    want, _ = _step(clean)
    limited = _trainer(**options)
    got, injected = _step(limited, max_tokens=20)
    assert injected.failures == 2 and got["memory/oom_retries"] == 2
    assert limited.forward.max_tokens == got["memory/max_tokens_per_minibatch"] == 16
    assert max(injected.seen[-int(got["ppo/minibatches"]) :]) <= 20  # every pass that trained fits the limit
    _assert_same_step(got, want, limited, clean)


def test_a_failure_in_the_backward_is_redone_too():
    clean = _trainer(gradient_accumulation_steps=2)
    want, _ = _step(clean)
    trainer = _trainer(gradient_accumulation_steps=2)
    got, injected = _step(trainer, calls=(3,), in_backward=True)
    assert injected.failures == 1 and got["memory/oom_retries"] == 1
    _assert_same_step(got, want, trainer, clean)


def test_a_separate_critic_backs_off_with_the_policy():
    """The critic's forward and backward run in the policy's passes: a failure in a pass's backward (the policy's
    comes first) redoes both, and both take the step without the failure."""
    clean = _trainer(critic=True, gradient_accumulation_steps=2)
    want, _ = _step(clean)
    trainer = _trainer(critic=True, gradient_accumulation_steps=2)
    got, injected = _step(trainer, calls=(2,), in_backward=True)
    assert injected.failures == 1 and got["memory/oom_retries"] == 1
    _assert_same_step(got, want, trainer, clean)
    for (name, a), b in zip(clean.critic.state_dict().items(), trainer.critic.state_dict().values()):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_failure_in_a_rollout_pass_redoes_the_rollout():
    """The rollout's policy pass (eval mode) fails once: the rollout is redone in passes of half its tokens."""
    clean = _trainer()
    want, _ = _step(clean)
    trainer = _trainer()
    got, injected = _step(trainer, calls=(0,), training_only=False)
    assert injected.failures == 1 and got["memory/oom_retries"] == 1
    assert injected.rows[0] == 2 and trainer.forward.max_tokens == injected.seen[0] // 2  # a rollout mini-batch
    _assert_same_step(got, want, trainer, clean)


def test_batched_forward_pass_backs_off():
    trainer = _trainer()
    queries, responses, _ = _batch(trainer)
    inputs = trainer.prepare_model_inputs(queries, responses)
    want = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with InjectedOutOfMemory(trainer.model, calls=(1,), training_only=False) as injected:
            got = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
    assert injected.failures == 1 and trainer.forward.memory.retries == 1
    for a, b in zip(want, got):
        if a is not None:
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


def test_a_row_that_does_not_fit_alone_raises_naming_the_remedies():
    trainer = _trainer(max_tokens_per_minibatch=30)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(torch.OutOfMemoryError) as error:
        _step(trainer, max_tokens=2)
    message = str(error.value)
    assert "A single row of" in message and "cannot be split" in message
    for remedy in ("gradient_checkpointing", "lm_head_chunk_size", "max_new_tokens"):
        assert remedy in message
    tokens = int(message.split("A single row of ")[1].split()[0])
    assert 3 <= tokens <= 17  # a row of the batch: 2-5 prompt and 1-12 response tokens
    # The rollout failed first: nothing was trained.
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_without_oom_backoff_the_error_ends_the_step():
    trainer = _trainer(oom_backoff=False)
    with pytest.raises(torch.OutOfMemoryError, match="Injected"):
        _step(trainer, calls=(1,))
    assert trainer.forward.memory.retries == 0 and trainer.forward.max_tokens is None


def test_oom_backoff_must_be_a_bool():
    with pytest.raises(TypeError, match="oom_backoff must be True or False, got 'yes'"):
        PPOConfig(oom_backoff="yes")


def _checkpoint(path):
    with open(os.path.join(path, "trl_lite_trainer_state.json")) as f:
        state = json.load(f)
    return state, load_file(os.path.join(path, "model.safetensors"))


def test_checkpoint_and_resume_after_a_back_off(tmp_path):
    """The checkpoint of a step that backed off holds the clean step's weights and state, plus the smaller
    budget; a run resumed from it starts with that budget and takes the same next step as the run that went on."""
    clean = _trainer(gradient_accumulation_steps=2)
    _step(clean)
    clean.save_checkpoint(str(tmp_path / "clean"))
    trainer = _trainer(gradient_accumulation_steps=2)
    _step(trainer, calls=(2,))
    trainer.save_checkpoint(str(tmp_path / "backed_off"))
    (clean_state, clean_weights), (state, weights) = _checkpoint(tmp_path / "clean"), _checkpoint(tmp_path / "backed_off")
    assert state.pop("memory") == {"budget": trainer.forward.max_tokens, "backed_off": True, "retries": 1}
    assert clean_state.pop("memory") == {"budget": None, "backed_off": False, "retries": 0}
    assert state == clean_state
    for key, value in clean_weights.items():
        np.testing.assert_allclose(weights[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)

    resumed = _trainer(gradient_accumulation_steps=2)
    resumed.load_checkpoint(str(tmp_path / "backed_off"))
    assert resumed.forward.max_tokens == trainer.forward.max_tokens
    torch.manual_seed(7)
    got, _ = _step(resumed, seed=5)
    torch.manual_seed(7)
    want, _ = _step(trainer, seed=5)
    assert got["memory/max_tokens_per_minibatch"] == want["memory/max_tokens_per_minibatch"] == trainer.forward.max_tokens
    assert got["memory/oom_retries"] == want["memory/oom_retries"] == 0
    _assert_same_step(got, want, resumed, trainer)


def test_the_trainer_owns_the_one_back_off_its_parts_share(tmp_path):
    """PPOTrainer builds one MemoryBackoff and hands it to the forward part and the learner: a failure in a training
    pass (the learner's) sets the budget the forward part's passes then take; the checkpointer saves and restores
    that back-off through its state_dict, into the resumed trainer's own, which its parts share again."""
    trainer = _trainer()
    memory = trainer.memory
    assert trainer.forward.memory is memory and trainer.learner.memory is memory
    assert trainer.checkpointer.parts == {"memory": memory}
    _step(trainer, calls=(2,))  # a training forward: the learner backs off
    assert memory.backed_off and memory.retries == 1 and trainer.forward.max_tokens == memory.budget > 0
    saved = memory.state_dict()
    trainer.save_checkpoint(str(tmp_path / "checkpoint"))

    resumed = _trainer()
    assert resumed.memory is not memory and resumed.memory.state_dict() == {"budget": None, "backed_off": False, "retries": 0}
    resumed.load_checkpoint(str(tmp_path / "checkpoint"))
    assert resumed.memory.state_dict() == saved
    assert resumed.forward.memory is resumed.memory and resumed.learner.memory is resumed.memory
    assert resumed.forward.max_tokens == memory.budget


def test_the_checkpointer_saves_each_part_through_its_state_dict(tmp_path):
    """Checkpointer(accelerator, parts): each part's state_dict() is saved under its name and given back to its
    load_state_dict(); a checkpoint without the part's name (written before it existed) leaves the part as it is."""
    from accelerate import Accelerator

    from trl_lite.trainer.state.checkpointing import Checkpointer
    from trl_lite.trainer.memory.oom_backoff import MemoryBackoff, PassOutOfMemory

    accelerator = Accelerator(cpu=True)
    memory = MemoryBackoff(accelerator, None, enabled=True)
    with pytest.raises(PassOutOfMemory), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memory.back_off(40, single_row=False)
    Checkpointer(accelerator, {"memory": memory}).save(str(tmp_path / "with"), {"step": 3})
    Checkpointer(accelerator).save(str(tmp_path / "without"), {"step": 3})

    restored = MemoryBackoff(accelerator, None, enabled=True)
    state, tensors = Checkpointer(accelerator, {"memory": restored}).load(str(tmp_path / "with"))
    assert state["memory"] == {"budget": 20, "backed_off": True, "retries": 1} and state["step"] == 3 and tensors == {}
    assert (restored.budget, restored.backed_off, restored.retries) == (20, True, 1)
    untouched = MemoryBackoff(accelerator, 64, enabled=True)
    Checkpointer(accelerator, {"memory": untouched}).load(str(tmp_path / "without"))
    assert (untouched.budget, untouched.backed_off, untouched.retries) == (64, False, 0)


def test_combined_pass_statistics_are_the_backward_batch_statistics():
    """Means weighted by action tokens, variances pooled: the statistics of the whole backward batch, whatever
    the split (float64 reference on the rows together)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(9, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(9, 7, generator=g) > 0.4).double()
    mask[4, 1:] = 0  # a pass of one action token
    parts = []
    for rows in ([0, 1, 2], [3], [4], [5, 6, 7, 8]):
        v, m = values[rows], mask[rows]
        stats = {"val/mean": masked_mean(v, m), "val/var": masked_var(v, m), "loss/value": (v * m).sum() / mask.sum()}
        parts.append((stats, float(m.sum())))
    combined = combine_pass_stats(parts)
    assert float(combined["val/mean"]) == pytest.approx(float(masked_mean(values, mask)), rel=1e-12)
    assert float(combined["val/var"]) == pytest.approx(float(masked_var(values, mask)), rel=1e-12)
    assert float(combined["loss/value"]) == pytest.approx(float((values * mask).sum() / mask.sum()), rel=1e-12)


@pytest.mark.parametrize("backoff", [True, False])
def test_generate_halves_its_chunk_of_queries_on_out_of_memory(backoff):
    """A device that fits 2 queries at a time: chunks of 4 go on in halves, with the same greedy tokens and
    log-probs as one query at a time; without the back-off the error ends the call."""
    trainer = _trainer(oom_backoff=backoff)
    queries, _, _ = random_batch(8, seed=5, query_len=(2, 6))
    kwargs = dict(do_sample=False, max_new_tokens=4, min_new_tokens=4, return_logprobs=True)
    want = trainer.generate(queries, batch_size=1, **kwargs)
    calls = []

    def limit(module, args, kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("Injected: more than 2 queries")

    handle = trainer.model.pretrained_model.register_forward_pre_hook(limit, with_kwargs=True)
    try:
        if not backoff:
            with pytest.raises(torch.OutOfMemoryError, match="Injected"):
                trainer.generate(queries, batch_size=4, **kwargs)
            return
        with pytest.warns(UserWarning, match="ran out of memory on 4 queries: going on in chunks of 2"):
            got = trainer.generate(queries, batch_size=4, **kwargs)
    finally:
        handle.remove()
    assert calls.count(4) == 1 and max(calls[1:]) == 2  # one failure, then chunks of 2 only
    for a, b in zip(want[0], got[0]):
        assert torch.equal(a, b)
    for a, b in zip(want[1], got[1]):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
