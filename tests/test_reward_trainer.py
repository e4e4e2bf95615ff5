"""Tests of ``RewardTrainer``, ``RewardConfig`` and the preference-data checks.

References are computed independently: a sequence's reward by running the model's transformer
alone on the unpadded sequence in float64 and applying the score head to its last hidden state;
losses and accuracies by Python loops over the pairs.
"""

import math
import warnings

import pytest
import torch
from devices import FLOAT32_SLACK, assert_close, equal
from preference_pairs import make_reward_model, planted_pairs
from tiny_models import VOCAB_SIZE, make_tokenizer
from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification, pipeline

from trl_lite import RewardConfig, RewardTrainer
from trl_lite.trainer import RewardDataCollatorWithPadding


def config(tmp_path, **kwargs) -> RewardConfig:
    defaults = {"output_dir": str(tmp_path / "rm"), "per_device_train_batch_size": 4, "disable_tqdm": True,
                "max_length": 32, "learning_rate": 1e-3}  # fmt: skip
    return RewardConfig(**{**defaults, **kwargs})


def brute_force_reward(model, ids: list[int]) -> float:
    """Score head applied to the transformer's last hidden state of the sequence run alone (no padding)."""
    with torch.no_grad():
        hidden = model.transformer(input_ids=torch.tensor([ids], device=model.device)).last_hidden_state[0, -1]
        return float((model.score.weight[0].double() * hidden.double()).sum())


def ref_loss(c: float, r: float, margin: float = 0.0, center: float | None = None) -> float:
    x = c - r - margin
    loss = math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x))
    return loss + (center * (c + r) ** 2 if center else 0.0)


# ----------------------------------------------------------------------------------------------
# Rewards, loss and accuracy against brute force
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_rewards_are_the_last_token_score_whatever_the_padding_and_batch(tmp_path, padding_side):
    model = make_reward_model().double()
    tokenizer = make_tokenizer(padding_side)
    rows = planted_pairs(6, seed=1)
    trainer = RewardTrainer(model, config(tmp_path), train_dataset=rows, tokenizer=tokenizer)
    features = [trainer.train_dataset[i] for i in range(6)]
    lengths = {len(f["input_ids_chosen"]) for f in features} | {len(f["input_ids_rejected"]) for f in features}
    assert len(lengths) > 2, "the pairs must have different lengths for padding to matter"

    expected = [
        (brute_force_reward(model, f["input_ids_chosen"]), brute_force_reward(model, f["input_ids_rejected"]))
        for f in features
    ]
    collator = RewardDataCollatorWithPadding(tokenizer)
    with torch.no_grad():
        together = trainer.compute_rewards(trainer.model, collator(features))
        alone = [trainer.compute_rewards(trainer.model, collator([f])) for f in features]
        reversed_batch = trainer.compute_rewards(trainer.model, collator(features[::-1]))
    for i, (c, r) in enumerate(expected):
        assert together[0][i].item() == pytest.approx(c, rel=1e-10, abs=1e-12)
        assert together[1][i].item() == pytest.approx(r, rel=1e-10, abs=1e-12)
        assert alone[i][0].item() == pytest.approx(c, rel=1e-10, abs=1e-12)
        assert alone[i][1].item() == pytest.approx(r, rel=1e-10, abs=1e-12)
        assert reversed_batch[0][5 - i].item() == pytest.approx(c, rel=1e-10, abs=1e-12)


def test_loss_and_accuracy_match_brute_force(tmp_path):
    model = make_reward_model(seed=3).double()
    tokenizer = make_tokenizer()
    rows = planted_pairs(10, seed=2)
    for i, row in enumerate(rows):
        row["margin"] = 0.25 * (i % 3)
    trainer = RewardTrainer(
        model, config(tmp_path, center_rewards_coefficient=0.05), train_dataset=rows, eval_dataset=rows, tokenizer=tokenizer
    )
    features = [trainer.train_dataset[i] for i in range(10)]
    rewards = [
        (brute_force_reward(model, f["input_ids_chosen"]), brute_force_reward(model, f["input_ids_rejected"]))
        for f in features
    ]
    expected_losses = [ref_loss(c, r, f["margin"], 0.05) for (c, r), f in zip(rewards, features)]
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(trainer.model, RewardDataCollatorWithPadding(tokenizer)(features), True)
    assert loss.item() == pytest.approx(sum(expected_losses) / 10, rel=1e-10)
    assert outputs["rewards_chosen"].tolist() == pytest.approx([c for c, _ in rewards], rel=1e-10)

    metrics = trainer.evaluate()
    correct = sum(1 for c, r in rewards if c > r)
    assert metrics["eval_loss"] == pytest.approx(sum(expected_losses) / 10, rel=1e-10)
    assert metrics["eval_accuracy"] == pytest.approx(correct / 10)
    assert metrics["eval_rewards/chosen"] == pytest.approx(sum(c for c, _ in rewards) / 10, rel=1e-10)
    assert metrics["eval_rewards/margins"] == pytest.approx(sum(c - r for c, r in rewards) / 10, rel=1e-9, abs=1e-12)


def test_training_log_is_the_mean_over_the_window(tmp_path):
    """The logged loss of a window equals the mean of the per-pair losses of its batches (weights move
    between batches, so the reference is computed batch by batch with the trainer's own forward)."""
    tokenizer = make_tokenizer()
    rows = planted_pairs(12, seed=5)
    args = config(tmp_path, per_device_train_batch_size=4, logging_steps=3, max_steps=3, learning_rate=1e-2)
    trainer = RewardTrainer(make_reward_model(), args, train_dataset=rows, tokenizer=tokenizer)
    seen = []
    original = trainer._pair_losses

    def recording(model, inputs):
        losses, chosen, rejected = original(model, inputs)
        seen.append((losses.detach().clone(), chosen.detach().clone(), rejected.detach().clone()))
        return losses, chosen, rejected

    trainer._pair_losses = recording
    trainer.train()
    assert len(seen) == 3
    losses = [v for batch in seen for v in batch[0].tolist()]
    correct = [float(c > r) for batch in seen for c, r in zip(batch[1].tolist(), batch[2].tolist())]
    log = trainer.log_history[-1]
    assert log["step"] == 3 and log["epoch"] == pytest.approx(1.0)
    assert log["loss"] == pytest.approx(sum(losses) / 12, rel=1e-6)
    assert log["accuracy"] == pytest.approx(sum(correct) / 12)
    # The 12 pairs were each seen once: an epoch is a permutation of the data.
    assert sorted(len(b[0]) for b in seen) == [4, 4, 4]


def test_learns_a_planted_preference(tmp_path):
    tokenizer = make_tokenizer()
    train, heldout = planted_pairs(240, seed=10), planted_pairs(80, seed=11)
    args = config(tmp_path, per_device_train_batch_size=16, num_train_epochs=4, learning_rate=3e-3, logging_steps=5)
    trainer = RewardTrainer(make_reward_model(), args, train_dataset=train, eval_dataset=heldout, tokenizer=tokenizer)
    before = trainer.evaluate()
    result = trainer.train()
    after = trainer.evaluate()
    assert after["eval_accuracy"] >= 0.9, after
    assert after["eval_loss"] < 0.5 * before["eval_loss"], (before, after)
    assert after["eval_rewards/margins"] > 1.0
    assert result["global_step"] == 4 * math.ceil(240 / 16)
    # Evaluated at the end of every epoch too.
    assert sum("eval_loss" in h for h in trainer.log_history) == 2 + 4


def test_gradient_accumulation_equals_one_larger_batch(tmp_path):
    tokenizer = make_tokenizer()
    rows = planted_pairs(16, seed=6)
    weights = []
    for batch_size, accumulation in ((8, 1), (4, 2), (2, 4)):
        args = config(
            tmp_path, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, max_steps=2,
            max_grad_norm=0.5,
        )  # fmt: skip
        model = make_reward_model()
        # Plain SGD: Adam's first steps divide each gradient by its own size, which turns rounding noise
        # in near-zero gradients into full-size steps and would hide what this test checks.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        trainer = RewardTrainer(model, args, train_dataset=rows, tokenizer=tokenizer, optimizers=(optimizer, None))
        trainer.train()
        assert trainer.global_step == 2
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    assert not equal(weights[0], torch.cat([p.detach().flatten() for p in make_reward_model().parameters()]))
    assert_close(weights[1], weights[0], rtol=1e-5, atol=1e-6)
    assert_close(weights[2], weights[0], rtol=1e-5, atol=1e-6)


def test_linear_schedule_with_warmup_is_logged(tmp_path):
    tokenizer = make_tokenizer()
    args = config(tmp_path, per_device_train_batch_size=4, max_steps=6, warmup_steps=2, logging_steps=1, learning_rate=0.01)
    trainer = RewardTrainer(make_reward_model(), args, train_dataset=planted_pairs(8, seed=7), tokenizer=tokenizer)
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.log_history if "learning_rate" in h]
    # After optimizer step s the rate is lr * s / warmup during warm-up, then decays linearly to 0 at step 6.
    expected = [0.01 * (s / 2 if s < 2 else (6 - s) / (6 - 2)) for s in range(1, 7)]
    assert logged == pytest.approx(expected)
    assert [h["step"] for h in trainer.log_history] == [1, 2, 3, 4, 5, 6]


def test_resume_from_a_checkpoint_is_exact(tmp_path):
    """A run stopped at step 4 (mid-epoch, dropout on, accumulation) and resumed equals the run done straight."""
    tokenizer = make_tokenizer()
    train, heldout = planted_pairs(20, seed=14), planted_pairs(6, seed=15)

    def trainer(out, save_steps):
        args = config(
            tmp_path, output_dir=str(tmp_path / out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=8, save_steps=save_steps, logging_steps=3, learning_rate=3e-3, warmup_steps=2,
        )  # fmt: skip
        model = make_reward_model(seed=2, dropout=0.1)
        return RewardTrainer(model, args, train_dataset=train, eval_dataset=heldout, tokenizer=tokenizer)

    straight = trainer("straight", save_steps=0)
    straight.train()
    stopped = trainer("stopped", save_steps=4)

    class Killed(Exception):
        pass

    save = stopped.save_checkpoint

    def save_then_die(path):
        save(path)
        raise Killed

    stopped.save_checkpoint = save_then_die  # the process dies just after its step-4 checkpoint
    with pytest.raises(Killed):
        stopped.train()
    assert stopped.global_step == 4
    checkpoint = tmp_path / "stopped" / "checkpoint"
    resumed = trainer("resumed", save_steps=0)
    result = resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.global_step == 8 and result["global_step"] == 8
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert equal(a, b)
    assert resumed.log_history == straight.log_history
    assert [h["step"] for h in straight.log_history if "eval_loss" in h] == [5]  # the epoch ended inside the resumed part
    assert resumed.lr_scheduler.get_last_lr() == straight.lr_scheduler.get_last_lr()


def test_checkpoint_of_another_run_length_is_refused(tmp_path):
    tokenizer = make_tokenizer()
    args = config(tmp_path, max_steps=2, save_steps=2)
    RewardTrainer(make_reward_model(), args, train_dataset=planted_pairs(8, 1), tokenizer=tokenizer).train()
    other = RewardTrainer(make_reward_model(), config(tmp_path, max_steps=3), train_dataset=planted_pairs(8, 1),
                          tokenizer=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="the checkpoint's run has 2 optimizer steps, this trainer 3"):
        other.load_checkpoint(str(tmp_path / "rm" / "checkpoint"))


# ----------------------------------------------------------------------------------------------
# Saving, adapters, precision
# ----------------------------------------------------------------------------------------------


def test_saved_model_loads_as_a_classifier_and_in_a_pipeline(tmp_path):
    tokenizer = make_tokenizer()
    args = config(tmp_path, max_steps=3)
    trainer = RewardTrainer(make_reward_model(), args, train_dataset=planted_pairs(16, seed=8), tokenizer=tokenizer)
    trainer.train()
    trainer.save_model()
    loaded = AutoModelForSequenceClassification.from_pretrained(args.output_dir)
    assert loaded.config.num_labels == 1 and loaded.config.problem_type == "regression"
    texts = ["the movie was great", "it was boring and the ending was too long"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        chosen, rejected = trainer.compute_rewards(
            trainer.model,
            {"input_ids_chosen": batch["input_ids"][:1], "attention_mask_chosen": batch["attention_mask"][:1],
             "input_ids_rejected": batch["input_ids"][1:], "attention_mask_rejected": batch["attention_mask"][1:]},
        )  # fmt: skip
    pipe = pipeline("text-classification", model=args.output_dir, tokenizer=args.output_dir)
    scores = [out["score"] for out in pipe(texts)]  # regression: the raw reward, no sigmoid
    assert scores == pytest.approx([chosen.item(), rejected.item()], rel=1e-5, abs=1e-6)


def test_lora_adapters_train_only_adapters_and_head(tmp_path):
    from peft import AutoPeftModelForSequenceClassification, LoraConfig

    tokenizer = make_tokenizer()
    base_dir = tmp_path / "base"
    make_reward_model(seed=4).save_pretrained(base_dir)
    model = AutoModelForSequenceClassification.from_pretrained(base_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    peft_config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    args = config(tmp_path, max_steps=4, learning_rate=1e-2)
    trainer = RewardTrainer(model, args, train_dataset=planted_pairs(16, seed=9), tokenizer=tokenizer, peft_config=peft_config)
    assert trainer.is_peft_model
    trainer.train()
    trainer.save_model()
    merged = trainer.accelerator.unwrap_model(trainer.model)
    transformer_weight = merged.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight
    assert_close(transformer_weight, before["transformer.h.0.attn.c_attn.weight"], rtol=0, atol=0)
    reloaded = AutoPeftModelForSequenceClassification.from_pretrained(args.output_dir)
    trained_head = merged.get_base_model().score.modules_to_save["default"].weight
    assert not equal(trained_head, before["score.weight"])
    batch = tokenizer(["the movie was great"], return_tensors="pt")
    with torch.no_grad():
        on_device = merged(**batch.to(trainer.accelerator.device)).logits.item()
        assert reloaded(**batch.to("cpu")).logits.item() == pytest.approx(on_device, rel=1e-5 * FLOAT32_SLACK)


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state, fixed by the first Accelerator: mixed precision needs a
    fresh one, and the tests after this one need the default back."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_bf16_mixed_precision_trains_on_cpu(tmp_path, fresh_accelerator_state):
    tokenizer = make_tokenizer()
    args = config(tmp_path, bf16=True, max_steps=3, logging_steps=1)
    trainer = RewardTrainer(make_reward_model(), args, train_dataset=planted_pairs(12, seed=12), tokenizer=tokenizer)
    assert trainer.accelerator.mixed_precision == "bf16"
    result = trainer.train()
    assert math.isfinite(result["train_loss"])
    # Master weights stay float32 under autocast.
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


# ----------------------------------------------------------------------------------------------
# Bad data and bad arguments
# ----------------------------------------------------------------------------------------------

GOOD = {"prompt": "the movie ", "chosen": "was great", "rejected": "was bad"}


@pytest.mark.parametrize(
    "rows, error, match",
    [
        ([{"question": "the movie", "answer": "was great"}], ValueError, "needs 'chosen' and 'rejected'"),
        ([{"chosen": "was great"}], ValueError, "needs 'chosen' and 'rejected'"),
        ([GOOD, {**GOOD, "rejected": "  "}], ValueError, "row 1: 'rejected' is empty"),
        ([{**GOOD, "chosen": 3}], TypeError, "row 0: 'chosen' must be a str"),
        ([GOOD, {**GOOD, "chosen": 3}], TypeError, "column 'chosen' holds values of different types"),
        ([{**GOOD, "margin": 1.0}, {**GOOD, "margin": float("nan")}], ValueError, "row 1: margin must be a finite"),
        ([{"input_ids_chosen": [5, 6], "input_ids_rejected": [5, 0]}], ValueError, "row 0: 'input_ids_rejected' ends with the padding token"),
        ([{"input_ids_chosen": [5, 6], "input_ids_rejected": [5, 999]}], ValueError, "token id 999, outside"),
        ([{"input_ids_chosen": [5, 6], "input_ids_rejected": []}], ValueError, "'input_ids_rejected' has no tokens"),
        ([], ValueError, "train_dataset is an empty list"),
    ],
)  # fmt: skip
def test_bad_rows_raise_naming_the_row(tmp_path, rows, error, match):
    with pytest.raises(error, match=match):
        RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=rows, tokenizer=make_tokenizer())


def test_long_pairs_error_drop_or_keep_the_end(tmp_path):
    long_row = {"chosen": "the movie was " * 5 + "great", "rejected": "the movie was " * 5 + "bad"}  # 16 tokens
    rows = [GOOD, long_row, {"chosen": "good", "rejected": "bad"}]
    with pytest.raises(ValueError, match="row 1: chosen has 16 tokens and rejected 16, more than max_length=10"):
        RewardTrainer(make_reward_model(), config(tmp_path, max_length=10, truncation_mode="error"),
                      train_dataset=rows, tokenizer=make_tokenizer())  # fmt: skip
    with pytest.warns(UserWarning, match="1 of 3 pairs have a side longer than max_length=10 tokens and were dropped"):
        dropped = RewardTrainer(make_reward_model(), config(tmp_path, max_length=10), train_dataset=rows,
                                tokenizer=make_tokenizer())  # fmt: skip
    assert len(dropped.train_dataset) == 2 and dropped.data_report["train"]["dropped_too_long"] == 1
    with pytest.warns(UserWarning, match="were cut from the start"):
        cut = RewardTrainer(make_reward_model(), config(tmp_path, max_length=10, truncation_mode="keep_end"),
                            train_dataset=rows, tokenizer=make_tokenizer())  # fmt: skip
    assert cut.data_report["train"]["truncated"] == 1 and len(cut.train_dataset) == 3
    tokenizer = make_tokenizer()
    assert cut.train_dataset[1]["input_ids_chosen"] == tokenizer(long_row["chosen"])["input_ids"][-10:]


def test_identical_pairs_are_skipped_counted_and_warned(tmp_path):
    rows = [GOOD, {"prompt": "it ", "chosen": "was fine", "rejected": "was fine"}, GOOD]
    with pytest.warns(UserWarning, match="1 of 3 pairs have identical chosen and rejected"):
        trainer = RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=rows, tokenizer=make_tokenizer())
    assert trainer.data_report["train"] == {
        "pairs_read": 3, "kept": 2, "truncated": 0, "dropped_too_long": 0, "dropped_identical": 1,
    }  # fmt: skip


def test_clean_data_gives_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pairs.*")
        RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=[GOOD, GOOD], tokenizer=make_tokenizer())


def test_tokenized_pairs_are_accepted(tmp_path):
    tokenizer = make_tokenizer()
    rows = [{"input_ids_chosen": tokenizer(r["prompt"] + r["chosen"])["input_ids"],
             "input_ids_rejected": tokenizer(r["prompt"] + r["rejected"])["input_ids"]} for r in planted_pairs(8, 13)]  # fmt: skip
    from_ids = RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=rows, tokenizer=tokenizer)
    from_text = RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=planted_pairs(8, 13), tokenizer=tokenizer)
    assert from_ids.train_dataset["input_ids_chosen"] == from_text.train_dataset["input_ids_chosen"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"per_device_train_batch_size": 0}, ValueError, "per_device_train_batch_size must be a positive int"),
        ({"max_steps": 0}, ValueError, "max_steps must be a positive int, or -1"),
        ({"learning_rate": -1.0}, ValueError, "learning_rate must be a positive"),
        ({"lr_scheduler_type": "triangle"}, ValueError, "lr_scheduler_type must be one of"),
        ({"truncation_mode": "keep_start"}, ValueError, "truncation_mode must be one of"),
        ({"max_length": 0}, ValueError, "max_length must be a positive int"),
        ({"warmup_ratio": 1.5}, ValueError, "warmup_ratio must be a finite number in"),
        ({"bf16": "yes"}, TypeError, "bf16 must be True or False"),
        ({"center_rewards_coefficient": -0.1}, ValueError, "center_rewards_coefficient must be a positive"),
        ({"bf16": True, "accelerator_kwargs": {"mixed_precision": "fp16"}}, ValueError, "bf16=True conflicts"),
    ],
)
def test_config_rejects_bad_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        RewardConfig(**kwargs)


def test_constructor_rejects_bad_arguments(tmp_path):
    from peft import LoraConfig

    rows, tokenizer = [GOOD], make_tokenizer()
    two_labels = GPT2ForSequenceClassification(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=16, n_layer=1, n_head=2, num_labels=2))
    with pytest.raises(ValueError, match="num_labels=1 .* got num_labels=2"):
        RewardTrainer(two_labels, config(tmp_path), train_dataset=rows, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="args must be a RewardConfig"):
        RewardTrainer(make_reward_model(), {"learning_rate": 1e-3}, train_dataset=rows, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="model must be a transformers sequence-classification model"):
        RewardTrainer(torch.nn.Linear(2, 1), config(tmp_path), train_dataset=rows, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="pass tokenizer="):
        RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=rows)
    no_pad = make_reward_model()
    no_pad.config.pad_token_id = None
    with pytest.raises(ValueError, match="model.config.pad_token_id and tokenizer.pad_token_id are both None"):
        RewardTrainer(no_pad, config(tmp_path), train_dataset=rows, data_collator=RewardDataCollatorWithPadding(tokenizer))
    with pytest.raises(ValueError, match="train_dataset is required"):
        RewardTrainer(make_reward_model(), config(tmp_path), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="peft_config.task_type must be 'SEQ_CLS'"):
        RewardTrainer(make_reward_model(), config(tmp_path), train_dataset=rows, tokenizer=tokenizer,
                      peft_config=LoraConfig(task_type="CAUSAL_LM", target_modules=["c_attn"]))  # fmt: skip
    with pytest.raises(TypeError, match="train_dataset must be a datasets.Dataset or a list of dicts"):
        RewardTrainer(make_reward_model(), config(tmp_path), train_dataset="pairs.jsonl", tokenizer=tokenizer)
