"""examples/scripts/grpo_sentiment.py runs end to end with tiny settings, next to a tiny PPO run."""

import json
import math

import torch
from test_examples import SMALL_RUN, run_script
from transformers import AutoModelForCausalLM


def test_grpo_sentiment_trains_a_plain_policy_and_plots_against_ppo(tmp_path):
    ppo_out, grpo_out = tmp_path / "ppo", tmp_path / "grpo"
    run_script("ppo_sentiment.py", *SMALL_RUN, "--steps", "2", "--output_dir", str(ppo_out))
    tiny = ["--sft_steps", "20", "--reward_model_steps", "20", "--batch_size", "8", "--mini_batch_size", "4"]
    result = run_script(
        "grpo_sentiment.py", *tiny, "--steps", "3", "--output_dir", str(grpo_out),
        "--compare_with", str(ppo_out / "metrics.jsonl"),
    )  # fmt: skip
    records = [json.loads(line) for line in (grpo_out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert math.isfinite(record["ppo/loss/total"]) and math.isfinite(record["env/reward_mean"])
        assert "ppo/policy/kl_loss" in record and not [k for k in record if k.startswith("ppo/val/")]
    assert (grpo_out / "grpo_vs_ppo.png").stat().st_size > 0
    assert "PPO run: last" in result.stdout
    assert "No dataset is provided" not in result.stderr  # it batches its own prompts and filters that warning

    # The tuned policy is a plain transformers model that moved away from the SFT model.
    tuned = AutoModelForCausalLM.from_pretrained(grpo_out / "model")
    sft = AutoModelForCausalLM.from_pretrained(grpo_out / "offline_models" / "sft_model")
    tuned_params, sft_params = dict(tuned.named_parameters()), dict(sft.named_parameters())
    assert sorted(tuned_params) == sorted(sft_params)
    assert any(not torch.equal(tuned_params[k], sft_params[k]) for k in sft_params)
