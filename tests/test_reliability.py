"""Reliability of ``PPOTrainer``: input validation, the non-finite guard, checkpoints and exact resume."""

import copy
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import resume_driver
import torch
from peft import LoraConfig
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.trainer.state.checkpointing import _TRAINER_STATE

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_driver.py")
BATCH = 4
NAN, INF = float("nan"), float("inf")


def make_trainer(model=None, **config_kwargs) -> PPOTrainer:
    """A trainer of 4 rows in mini-batches of 2, one epoch, score scaling on."""
    kwargs = dict(batch_size=BATCH, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-3, use_score_scaling=True)
    kwargs.update(config_kwargs)
    model = model if model is not None else AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    return PPOTrainer(PPOConfig(**kwargs), model, None, make_tokenizer())


def snapshot(trainer: PPOTrainer) -> dict:
    """A copy of every piece of state a step can change."""
    return {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "kl_coef": trainer.kl_ctl.value,
        "running": trainer.running.state_dict(),
        "current_step": trainer.current_step,
        "skipped": trainer.skipped_minibatches,
        "torch_rng": torch.get_rng_state(),
    }


def assert_equal(a, b, where: str = "state") -> None:
    """Exact equality of nested dicts/lists of tensors, arrays and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_all_finite(trainer: PPOTrainer) -> None:
    for name, param in trainer.model.named_parameters():
        assert torch.isfinite(param).all(), f"{name} holds a non-finite value"


def adam_steps(trainer: PPOTrainer) -> set:
    """The set of Adam step counts over the parameters (empty before the first step)."""
    return {float(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}


# Input validation ----------------------------------------------------------------------------------


def _replace(seqs: list, i: int, value) -> list:
    seqs = list(seqs)
    seqs[i] = value
    return seqs


def _masks(responses, i=None, value=None) -> list:
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    if i is not None:
        masks[i] = value(responses[i])
    return masks


# (id, make the bad call's kwargs from good (queries, responses, scores), error type, substrings that
# name the argument and row, what was given and what is accepted)
BAD_INPUTS = [
    ("too-few-queries", lambda q, r, s: dict(queries=q[:3]), ValueError, ["queries", "batch_size=4", "got 3"]),
    ("too-many-responses", lambda q, r, s: dict(responses=r + r[:1]), ValueError,
     ["responses", "batch_size=4", "got 5"]),
    ("too-few-scores", lambda q, r, s: dict(scores=s[:1]), ValueError, ["scores", "batch_size=4", "got 1"]),
    ("queries-not-a-list", lambda q, r, s: dict(queries=torch.zeros(4, 3, dtype=torch.long)), TypeError,
     ["queries", "list", "Tensor"]),
    ("query-is-a-list", lambda q, r, s: dict(queries=_replace(q, 2, [5, 6])), TypeError,
     ["queries[2]", "1-D", "list"]),
    ("response-2d", lambda q, r, s: dict(responses=_replace(r, 1, torch.tensor([[4, 5, 6]]))), ValueError,
     ["responses[1]", "1-D", "(1, 3)"]),
    ("response-float-ids", lambda q, r, s: dict(responses=_replace(r, 3, r[3].float())), TypeError,
     ["responses[3]", "integer", "float32"]),
    ("query-bool-ids", lambda q, r, s: dict(queries=_replace(q, 0, q[0] > 5)), TypeError,
     ["queries[0]", "integer", "bool"]),
    ("query-id-too-large", lambda q, r, s: dict(queries=_replace(q, 1, torch.tensor([4, VOCAB_SIZE]))), ValueError,
     ["queries[1]", f"[0, {VOCAB_SIZE})", f"max {VOCAB_SIZE}"]),
    ("response-id-negative", lambda q, r, s: dict(responses=_replace(r, 2, torch.tensor([-1, 4, 5]))), ValueError,
     ["responses[2]", f"[0, {VOCAB_SIZE})", "min -1"]),
    ("empty-query", lambda q, r, s: dict(queries=_replace(q, 3, torch.tensor([], dtype=torch.long))), ValueError,
     ["queries[3]", "empty", "at least 1 token"]),
    ("empty-response", lambda q, r, s: dict(responses=_replace(r, 0, torch.tensor([], dtype=torch.long))), ValueError,
     ["responses[0]", "empty", "at least 1 token"]),
    ("score-nan", lambda q, r, s: dict(scores=_replace(s, 1, NAN)), ValueError, ["scores[1]", "finite", "nan"]),
    ("score-inf", lambda q, r, s: dict(scores=_replace(s, 2, torch.tensor(INF))), ValueError,
     ["scores[2]", "finite", "inf"]),
    # A reward model whose head produced a NaN for one row (log of a negative number).
    ("reward-model-nan", lambda q, r, s: dict(scores=list(torch.log(torch.tensor([1.0, 2.0, -1.0, 3.0])))),
     ValueError, ["scores[2]", "finite", "nan"]),
    ("score-vector", lambda q, r, s: dict(scores=_replace(s, 0, torch.tensor([1.0, 2.0]))), ValueError,
     ["scores[0]", "one number", "(2,)"]),
    ("score-string", lambda q, r, s: dict(scores=_replace(s, 3, "1.0")), TypeError, ["scores[3]", "number", "str"]),
    ("score-none", lambda q, r, s: dict(scores=_replace(s, 1, None)), TypeError, ["scores[1]", "number", "NoneType"]),
    ("masks-wrong-count", lambda q, r, s: dict(response_masks=_masks(r)[:3]), ValueError,
     ["response_masks", "4 tensors", "got 3"]),
    ("mask-wrong-length", lambda q, r, s: dict(
        responses=_replace(r, 2, torch.tensor([4, 5, 6])), response_masks=_masks(r, 2, lambda x: torch.ones(4))),
     ValueError, ["response_masks[2]", "(3,)", "(4,)"]),
    ("mask-not-binary", lambda q, r, s: dict(response_masks=_masks(r, 1, lambda x: torch.full((len(x),), 2))),
     ValueError, ["response_masks[1]", "0 and 1", "2"]),
    ("mask-fractional", lambda q, r, s: dict(response_masks=_masks(r, 3, lambda x: torch.full((len(x),), 0.5))),
     ValueError, ["response_masks[3]", "0 and 1", "0.5"]),
    ("masks-no-action", lambda q, r, s: dict(response_masks=[torch.zeros(len(x)) for x in r]), ValueError,
     ["0 action token", "at least 2"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def trained_trainer():
    """A trainer after one step, so that Adam, the KL controller and the running moments hold state."""
    trainer = make_trainer()
    trainer.step(*random_batch(BATCH, seed=1))
    return trainer


@pytest.mark.parametrize("make_args,error,substrings", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_step_input_is_rejected_before_any_state_changes(trained_trainer, make_args, error, substrings):
    trainer = trained_trainer
    queries, responses, scores = random_batch(BATCH, seed=2)
    kwargs = dict(queries=queries, responses=responses, scores=scores)
    kwargs.update(make_args(queries, responses, scores))
    before = snapshot(trainer)

    with pytest.raises(error) as raised:
        trainer.step(**kwargs)

    message = str(raised.value)
    for substring in substrings:
        assert substring in message, f"{substring!r} not in {message!r}"
    assert_equal(snapshot(trainer), before)
    # The next good call trains as usual.
    stats = trainer.step(queries, responses, scores)
    assert trainer.current_step == before["current_step"] + 1
    assert stats["ppo/skipped_minibatches"] == 0
    assert not torch.equal(trainer.model.v_head.summary.weight, before["params"]["v_head.summary.weight"])


# Non-finite guard ----------------------------------------------------------------------------------


def _nan_once_in_training(module, inputs, output):
    """Forward hook: NaN values on the first training-mode call (the first PPO mini-batch), then none."""
    if module.training and not getattr(module, "_poisoned", False):
        module._poisoned = True
        return output * NAN
    return output


def test_nan_loss_skips_only_that_minibatch():
    trainer = make_trainer()
    trainer.model.v_head.register_forward_hook(_nan_once_in_training)

    with pytest.warns(UserWarning, match="loss is not finite"):
        stats = trainer.step(*random_batch(BATCH, seed=3))

    assert stats["ppo/skipped_minibatches"] == 1
    assert trainer.skipped_minibatches == 1
    # Two mini-batches: the poisoned one did not step the optimizer, the other one did.
    assert adam_steps(trainer) == {1.0}
    assert np.isfinite(stats["ppo/loss/total"])
    assert_all_finite(trainer)


def test_a_minibatch_without_action_tokens_is_skipped_with_its_reason():
    # Row 0's response is fully masked: its mini-batch of one row has no action token, so its masked
    # means are 0 / 0. It is skipped and named as such; the other row's mini-batch trains.
    trainer = make_trainer(batch_size=2, mini_batch_size=1)
    queries, responses, scores = random_batch(2, seed=5, response_len=(3, 6))
    masks = [torch.zeros(len(responses[0]), dtype=torch.long), torch.ones(len(responses[1]), dtype=torch.long)]
    with pytest.warns(UserWarning, match="it has no action tokens") as caught:
        stats = trainer.step(queries, responses, scores, response_masks=masks)
    assert not any("loss is not finite" in str(w.message) for w in caught)
    assert stats["ppo/skipped_minibatches"] == 1
    assert adam_steps(trainer) == {1.0}
    assert np.isfinite(stats["ppo/loss/total"]) and np.isfinite(stats["objective/kl"])
    assert_all_finite(trainer)


@pytest.mark.parametrize("bad_value,max_grad_norm", [(NAN, None), (INF, None), (-INF, None), (INF, 1.0)])
def test_non_finite_gradient_skips_the_update_and_leaves_adam_untouched(bad_value, max_grad_norm):
    trainer = make_trainer(max_grad_norm=max_grad_norm)
    batch = random_batch(BATCH, seed=4)
    trainer.step(*batch)  # Adam has moments and a step count to protect
    before = snapshot(trainer)
    bias = trainer.model.v_head.summary.bias
    handle = bias.register_hook(lambda grad: torch.full_like(grad, bad_value))

    with pytest.warns(UserWarning, match="the gradients are not finite"):
        stats = trainer.step(*batch)

    assert stats["ppo/skipped_minibatches"] == 2
    after = snapshot(trainer)
    assert_equal(after["params"], before["params"], "params")
    assert_equal(after["optimizer"], before["optimizer"], "optimizer")
    handle.remove()
    stats = trainer.step(*batch)
    assert stats["ppo/skipped_minibatches"] == 0
    assert adam_steps(trainer) == {4.0}  # 2 mini-batches per step, none in the skipped step
    assert_all_finite(trainer)


def test_non_finite_gradient_under_accumulation_drops_the_whole_window():
    # 4 mini-batches of 1 row, 2 per optimizer step: the NaN gradient of mini-batch 1 must not leak
    # into the second window.
    trainer = make_trainer(mini_batch_size=1, gradient_accumulation_steps=2)
    bias = trainer.model.v_head.summary.bias
    calls = []

    def nan_on_first_backward(grad):
        calls.append(1)
        return torch.full_like(grad, NAN) if len(calls) == 1 else grad

    bias.register_hook(nan_on_first_backward)

    with pytest.warns(UserWarning, match="the gradients are not finite"):
        stats = trainer.step(*random_batch(BATCH, seed=5))

    assert len(calls) == 4
    assert stats["ppo/skipped_minibatches"] == 1
    assert adam_steps(trainer) == {1.0}
    assert_all_finite(trainer)


def test_ratio_threshold_skips_every_minibatch():
    trainer = make_trainer(ratio_threshold=1e-3, ppo_epochs=2)
    before = snapshot(trainer)

    with pytest.warns(UserWarning, match="ratio_threshold=0.001"):
        stats = trainer.step(*random_batch(BATCH, seed=6))

    assert stats["ppo/skipped_minibatches"] == 4  # 2 epochs x 2 mini-batches
    assert_equal(snapshot(trainer)["params"], before["params"], "params")
    assert trainer.optimizer.state_dict()["state"] == {}


def test_nan_in_rollout_pass_skips_the_step_and_keeps_the_kl_coefficient():
    trainer = make_trainer()
    batch = random_batch(BATCH, seed=7)
    trainer.step(*batch)
    before = snapshot(trainer)
    final_norm = trainer.accelerator.unwrap_model(trainer.model).pretrained_model.transformer.ln_f
    # NaN hidden states in the first eval-mode (rollout) pass of the policy.
    handle = final_norm.register_forward_hook(lambda m, i, out: out * NAN if not m.training else out)

    with pytest.warns(UserWarning) as record:
        stats = trainer.step(*batch)

    handle.remove()
    messages = [str(w.message) for w in record]
    assert any("loss is not finite" in m for m in messages), messages
    assert any("KL coefficient is left unchanged" in m for m in messages), messages
    assert stats["ppo/skipped_minibatches"] == 2
    assert trainer.kl_ctl.value == before["kl_coef"]
    assert_equal(snapshot(trainer)["params"], before["params"], "params")
    stats = trainer.step(*batch)
    assert stats["ppo/skipped_minibatches"] == 0 and np.isfinite(trainer.kl_ctl.value)
    assert_all_finite(trainer)


# Checkpoints ----------------------------------------------------------------------------------------


def _driver(*args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, DRIVER, *map(str, args)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen) -> None:
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]


def _load(path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("grouped", [False, True], ids=["gae", "grpo-shared-by-prompt"])
def test_resume_in_a_new_process_is_bit_identical(tmp_path, grouped):
    # grouped: GRPO groups with the defaults prefix_sharing=None and shuffle_by_prompt=None, which share the prompts
    # and keep each group in one mini-batch: the epoch order by prompt resumes exactly too.
    steps, save_at = 5, 3  # 2 batches per data pass: the save falls in the middle of the second pass
    checkpoint = tmp_path / "checkpoint"
    mode = ("--grouped",) if grouped else ()
    straight = _driver("--steps", steps, "--out", tmp_path / "straight.pt", *mode)
    first_part = _driver(
        "--steps", save_at, "--save-at", save_at, "--checkpoint", checkpoint, "--out", tmp_path / "part.pt", *mode
    )  # fmt: skip
    _finish(first_part)
    _finish(_driver("--steps", steps, "--resume", "--checkpoint", checkpoint, "--out", tmp_path / "resumed.pt", *mode))
    _finish(straight)

    expected, resumed = _load(tmp_path / "straight.pt"), _load(tmp_path / "resumed.pt")
    at_save = _load(tmp_path / f"part.pt.step{save_at}")
    assert at_save["current_step"] == save_at and resumed["current_step"] == steps
    # Training went on after the save, and the run kept score moments and the adaptive KL busy.
    trained = "transformer.h.0.attn.c_attn.weight" if grouped else "v_head.summary.weight"
    assert not torch.equal(at_save["model"][trained], resumed["model"][trained])
    if grouped:  # every pass ran each group's prompt once: rollout passes in batch order, training passes by prompt
        assert resumed["stats"]["prefix_sharing/tokens_saved_fraction"] > 0.25
    assert resumed["running"]["count"] == steps * BATCH
    assert resumed["kl_coef"] != 0.1
    assert_equal(resumed, expected)


def _wait_for(marker, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        if process.poll() is not None:
            pytest.fail(f"the driver ended before hanging in its save:\n{process.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, "the driver never reached its save"
        time.sleep(0.2)


@pytest.mark.parametrize("hang_mode", ["write", "rename"])
def test_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path, hang_mode):
    checkpoint, out, marker = tmp_path / "checkpoint", tmp_path / "state.pt", tmp_path / "hanging"
    process = _driver(
        "--steps", 2, "--out", out, "--checkpoint", checkpoint, "--save-at", 1, 2,
        "--hang-at", 2, "--hang-mode", hang_mode, "--marker", marker,
    )  # fmt: skip
    try:
        _wait_for(marker, process)
    finally:
        process.kill()  # SIGKILL: no clean-up runs
        process.communicate()
    if hang_mode == "write":
        # Killed with the new checkpoint half written beside the old one.
        assert (tmp_path / "checkpoint.tmp").is_dir() and not (tmp_path / "checkpoint.tmp" / _TRAINER_STATE).exists()
    else:
        # Killed between moving the old checkpoint aside and moving the new one in.
        assert not checkpoint.exists() and (tmp_path / "checkpoint.old" / _TRAINER_STATE).exists()

    trainer = resume_driver.build_trainer()
    trainer.load_checkpoint(checkpoint)

    expected = _load(f"{out}.step1")
    expected.pop("stats")
    loaded = resume_driver.trainer_state(trainer, None)
    loaded.pop("stats")
    assert loaded["current_step"] == 1
    assert_equal(loaded, expected)
    # The next save over the debris leaves one clean checkpoint.
    trainer.save_checkpoint(checkpoint)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "hanging", "state.pt.step1"]
    resume_driver.build_trainer().load_checkpoint(checkpoint)


def test_dataloader_continues_the_interrupted_pass(tmp_path):
    trainer = resume_driver.build_trainer()
    first_pass = iter(trainer.dataloader)
    next(first_pass)
    trainer.save_checkpoint(tmp_path / "checkpoint")
    rest_of_pass = list(first_pass)
    next_pass = list(trainer.dataloader)

    resumed = resume_driver.build_trainer()
    resumed.load_checkpoint(tmp_path / "checkpoint")

    assert len(rest_of_pass) == len(trainer.dataloader) - 1
    assert_equal(list(resumed.dataloader), rest_of_pass, "rest of the pass")
    assert_equal(list(resumed.dataloader), next_pass, "next pass")


def test_load_checkpoint_rejects_a_directory_without_trainer_state(tmp_path):
    trainer = make_trainer()
    with pytest.raises(ValueError, match="not a trl_lite checkpoint"):
        trainer.load_checkpoint(tmp_path)


def _lora_trainer(seed: int) -> PPOTrainer:
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(), peft_config=lora)
    return make_trainer(model=model, seed=seed, use_score_norm=True)


def test_peft_checkpoint_round_trip(tmp_path):
    trainer = _lora_trainer(seed=0)
    assert trainer.is_peft_model and trainer.ref_model is None
    for seed in (8, 9):
        trainer.step(*random_batch(BATCH, seed=seed))
    trainer.save_checkpoint(tmp_path / "checkpoint")
    saved = snapshot(trainer)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and "v_head.summary.weight" in trainable

    resumed = _lora_trainer(seed=1)
    assert not torch.equal(resumed.model.v_head.summary.weight, saved["params"]["v_head.summary.weight"])
    resumed.load_checkpoint(tmp_path / "checkpoint")
    loaded = snapshot(resumed)

    assert_equal(loaded, saved)
    # Both continue identically, adapter-disabled reference included.
    batch = random_batch(BATCH, seed=10)
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    stats = trainer.step(*batch)
    torch.set_rng_state(rng[0]), np.random.set_state(rng[1]), random.setstate(rng[2])
    resumed_stats = resumed.step(*batch)
    assert resumed_stats["objective/kl"] == stats["objective/kl"] != 0.0
    assert_equal(snapshot(resumed)["params"], snapshot(trainer)["params"], "params")
