"""The reward-modelling examples run end to end: the shipped preference pairs, reward_modeling.py and
the three-stage rlhf_pipeline.py (short settings). Scripts run in subprocesses with this interpreter."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_examples import ROOT, run_script
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

PNG = b"\x89PNG\r\n\x1a\n"


def test_shipped_preference_pairs_are_those_the_generator_writes():
    sys.path.insert(0, str(ROOT / "examples" / "data"))
    from make_preference_pairs import make_pairs

    shipped = [json.loads(line) for line in (ROOT / "examples" / "data" / "preference_pairs.jsonl").read_text().splitlines()]
    assert shipped == make_pairs()
    for pair in shipped:
        assert pair["prompt"].endswith(" ") and len(pair["prompt"].split()) >= 2
        assert pair["chosen"] != pair["rejected"]


def check_reward_model_dir(path: Path) -> None:
    """The saved reward model loads as a one-output classifier and, in a pipeline, returns its raw score."""
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.num_labels == 1
    text = "i watched the sequel last night and it was great ."
    with torch.no_grad():
        score = model(**tokenizer(text, return_tensors="pt")).logits.item()
    assert pipeline("text-classification", model=str(path))(text)[0]["score"] == pytest.approx(score, rel=1e-5)


def test_reward_modeling_script_trains_logs_and_saves(tmp_path):
    out = tmp_path / "rm"
    result = run_script(
        "reward_modeling.py", "--output_dir", str(out), "--max_steps", "8", "--eval_steps", "4", "--logging_steps", "2",
        "--log_with", "tensorboard",
    )  # fmt: skip
    assert "held-out preference accuracy" in result.stdout
    history = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in history if "loss" in h] == [2, 4, 6, 8]
    evals = [h for h in history if "eval_accuracy" in h]
    assert [h["step"] for h in evals] == [4, 8, 8]  # every 4 steps, then the final evaluation
    assert [h["step"] for h in history if "before_accuracy" in h] == [0]  # the untrained model
    assert all(math.isfinite(h["loss"]) for h in history if "loss" in h)
    assert (out / "training_curves.png").read_bytes()[:8] == PNG
    tags = set()
    for events in (out / "runs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    assert {"loss", "accuracy", "rewards/margins", "eval_accuracy"} <= tags
    check_reward_model_dir(out)


def test_rlhf_pipeline_runs_the_three_stages(tmp_path):
    out = tmp_path / "rlhf"
    result = run_script(
        "rlhf_pipeline.py", "--output_dir", str(out), "--sft_steps", "20", "--rm_max_steps", "10", "--ppo_steps", "2",
        "--ppo_batch_size", "8", "--ppo_mini_batch_size", "4", "--eval_prompts", "4", "--samples_per_prompt", "2",
    )  # fmt: skip
    for line in ("1. SFT (20 steps", "2. reward model", "3. PPO (2 steps"):
        assert line in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    # 20 SFT steps on these reviews take the perplexity far below that of the random initialisation.
    assert summary["sft"]["heldout_perplexity_after"] < 0.5 * summary["sft"]["heldout_perplexity_before"]
    assert summary["reward_model"]["pairs"]["eval"]["kept"] == 80
    assert 0.0 <= summary["reward_model"]["heldout_accuracy_after"] <= 1.0
    assert len(summary["ppo"]["reward_per_step"]) == 2
    for key in ("heldout_reward_before", "heldout_reward_after"):
        assert math.isfinite(summary["ppo"][key])
    assert (out / "rlhf_curves.png").read_bytes()[:8] == PNG
    check_reward_model_dir(out / "reward_model")
    assert (out / "ppo" / "model" / "config.json").exists()
