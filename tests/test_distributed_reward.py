"""RewardTrainer on 2 processes (CPU, gloo) under DeepSpeed ZeRO-2, against 1 process on the same data.

`tests/distributed/reward_equivalence.py` trains on the same 8 pairs per optimizer step in both runs
(2 processes x 2 pairs x 2 accumulated passes, or 1 x 4 x 2), with clipping and a warm-up schedule,
and checks with torch.distributed that both processes hold the same weights; `reward_resume.py`
kills a 2-process run after a checkpoint and checks the resumed run against a straight one. Launched with the
helper of `tests/test_distributed.py`, in the same pytest-xdist group, so the heavy runs stay in one worker.
"""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, pipeline

from preference_pairs import make_reward_model
from test_distributed import SCRIPTS, deepspeed_cpu_collectives, launch  # noqa: F401  (module fixture)
from tiny_models import make_tokenizer

pytestmark = pytest.mark.xdist_group("distributed")


def test_zero2_reward_training_matches_one_process_on_the_global_batch(tmp_path):
    base = tmp_path / "base"
    make_reward_model(seed=5, n_embd=64).save_pretrained(base)
    two, one = tmp_path / "two", tmp_path / "one"
    script = SCRIPTS / "reward_equivalence.py"
    launch("deepspeed_zero2", script, "--base_model", str(base), "--output_dir", str(two))
    launch("single_gpu", script, "--base_model", str(base), "--output_dir", str(one), num_processes=1)
    a, b = torch.load(two / "result.pt"), torch.load(one / "result.pt")

    start = dict(make_reward_model(seed=5, n_embd=64).named_parameters())
    assert sorted(a["weights"]) == sorted(b["weights"])
    moved = max((b["weights"][k] - start[k].double()).abs().max().item() for k in start)
    assert moved > 1e-2, "training must move the weights for the comparison to mean anything"
    max_diff = max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])
    assert max_diff <= 1e-5, f"max abs weight difference {max_diff:.3g}"

    logs_a, logs_b = a["log_history"], b["log_history"]
    # Training logs every 2 steps and at the end; evaluation at the end of the first pass (step 3) and after.
    assert [(h["step"], "loss" in h) for h in logs_a] == [(h["step"], "loss" in h) for h in logs_b]
    assert [h["step"] for h in logs_a if "loss" in h] == [2, 4, 5]
    assert [h["step"] for h in logs_a if "eval_loss" in h] == [3, 5]
    keys = ("loss", "accuracy", "rewards/chosen", "rewards/rejected", "learning_rate", "grad_norm",
            "eval_loss", "eval_accuracy", "eval_rewards/chosen", "eval_rewards/margins")  # fmt: skip
    for log_a, log_b in zip(logs_a, logs_b):
        for key in keys:
            if key in log_a:
                assert log_a[key] == pytest.approx(log_b[key], rel=1e-5, abs=1e-6), (key, log_a, log_b)
    assert a["eval"]["eval_accuracy"] * 11 == pytest.approx(round(a["eval"]["eval_accuracy"] * 11))  # 11 pairs, none twice

    # The model saved by the 2-process run loads in a plain process, as a classifier and in a pipeline.
    saved = AutoModelForSequenceClassification.from_pretrained(two / "model")
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param.double(), a["weights"][name], rtol=0, atol=1e-7)
    pipe = pipeline("text-classification", model=saved, tokenizer=make_tokenizer())
    batch = make_tokenizer()(["the movie was great"], return_tensors="pt")
    with torch.no_grad():
        assert pipe("the movie was great")[0]["score"] == pytest.approx(saved(**batch).logits.item(), rel=1e-6)


def test_zero2_reward_training_resumes_exactly_with_the_metrics_of_both_processes(tmp_path):
    base = tmp_path / "base"
    make_reward_model(seed=6, n_embd=64, dropout=0.1).save_pretrained(base)
    launch("deepspeed_zero2", SCRIPTS / "reward_resume.py", "--base_model", str(base), "--output_dir", str(tmp_path))
    assert (tmp_path / "ok").exists()
