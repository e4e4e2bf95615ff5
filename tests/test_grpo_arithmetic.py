"""examples/scripts/grpo_arithmetic.py: its reward, its data split, its flags, and a quick end-to-end run
whose reported accuracies are recomputed here from the models it wrote."""

import importlib.util
import json
import math

import pytest
import torch
from test_examples import SCRIPTS, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_script():
    spec = importlib.util.spec_from_file_location("grpo_arithmetic", SCRIPTS / "grpo_arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.mark.parametrize(
    ("prompt", "completion", "expected"),
    [
        ("12+35=", "47<eos>", 1.0),  # right
        ("45+89=", "134<eos>", 1.0),  # right, with a carry into a third digit
        ("12+35=", "48<eos>", 0.0),  # wrong number
        ("45+89=", "34<eos>", 0.0),  # the carry dropped
        ("12+35=", "47", 0.0),  # right digits but no EOS: the response never ended
        ("12+35=", "474747", 0.0),  # ran to the length limit
        ("12+35=", "047<eos>", 0.0),  # a leading zero is not the exact answer
        ("12+35=", "4+7<eos>", 0.0),  # garbage around digits
        ("12+35=", "+=<eos>", 0.0),  # garbage
        ("12+35=", "<eos>", 0.0),  # empty answer
        ("12+35=", "", 0.0),
    ],
)
def test_exact_match_reward_on_hand_written_cases(script, prompt, completion, expected):
    assert script.exact_match_reward(prompt, completion) == expected


def test_reward_of_decoded_token_ids_and_bad_prompts(script):
    tokenizer = script.build_tokenizer()
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id != eos
    # What trainer.generate returns: the answer's character ids, then EOS (responses are cut after it).
    right = tokenizer.convert_tokens_to_ids(list("134")) + [eos]
    wrong = tokenizer.convert_tokens_to_ids(list("124")) + [eos]
    unfinished = tokenizer.convert_tokens_to_ids(list("13413"))
    completions = tokenizer.batch_decode([right, wrong, unfinished])
    assert [script.exact_match_reward("45+89=", c) for c in completions] == [1.0, 0.0, 0.0]
    # The prompt's characters are one token each, so the prompt is exactly 6 tokens.
    assert tokenizer("45+89=")["input_ids"] == tokenizer.convert_tokens_to_ids(list("45+89="))
    for bad in ("45+89", "a+b=", "45-89=", "45+89=1"):
        with pytest.raises(ValueError, match="prompt"):
            script.exact_match_reward(bad, "134<eos>")


def test_problem_sets_are_disjoint_two_digit_and_seeded(script):
    sets = script.make_problems(seed=3, num_sft=300, num_grpo=2000, num_heldout=500)
    assert {name: len(rows) for name, rows in sets.items()} == {"sft": 300, "grpo": 2000, "heldout": 500}
    for rows in sets.values():
        assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in rows)
        assert len(set(rows)) == len(rows)
    unordered = {name: {frozenset((a, b)) for a, b in rows} for name, rows in sets.items()}
    # No held-out problem is trained on, nor its b+a twin.
    assert not unordered["heldout"] & (unordered["sft"] | unordered["grpo"])
    assert not unordered["sft"] & unordered["grpo"]
    assert sets == script.make_problems(seed=3, num_sft=300, num_grpo=2000, num_heldout=500)
    assert sets["heldout"] != script.make_problems(seed=4, num_sft=300, num_grpo=2000, num_heldout=500)["heldout"]


def test_flags_give_the_grpo_recipe_and_pass_use_vllm_through(script):
    args, config = script.parse_args([])
    assert config.advantage_estimator == "grpo" and config.num_samples_per_query == 8
    assert config.loss_type == "global_token_mean"  # TRL's "dapo", stored under its canonical name
    assert config.cliprange_high > config.cliprange and config.missing_eos_penalty > 0
    assert config.batch_size % config.num_samples_per_query == 0
    assert config.use_vllm is False
    args, config = script.parse_args(["--use_vllm", "--output_dir", "elsewhere", "--sft_steps", "7"])
    assert config.use_vllm is True and args.output_dir == "elsewhere" and args.sft_steps == 7
    with pytest.raises(ValueError, match="num_heldout"):
        script.parse_args(["--num_heldout", "0"])


def greedy_accuracy(model_dir, problems) -> float:
    """Exact-match accuracy of greedy answers, checked on token ids: answer digits then EOS, nothing else."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = torch.tensor([tokenizer.convert_tokens_to_ids(list(f"{a}+{b}=")) for a, b in problems])
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=5,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    right = 0
    for (a, b), row in zip(problems, out[:, prompts.shape[1] :].tolist()):
        expected = tokenizer.convert_tokens_to_ids(list(str(a + b))) + [tokenizer.eos_token_id]
        right += row[: len(expected)] == expected
    return right / len(problems)


class OracleTrainer:
    """Stands in for PPOTrainer in `heldout_accuracy`, answering `a+b=` with: the sum and EOS when `a` is
    even; the sum plus one, no EOS, when `a % 4 == 1`; the sum without EOS when `a % 4 == 3`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = []

    def generate(self, queries, return_prompt, batch_size, do_sample, max_new_tokens):
        self.calls.append({"return_prompt": return_prompt, "do_sample": do_sample, "max_new_tokens": max_new_tokens})
        responses = []
        for query in queries:
            a, b = map(int, self.tokenizer.decode(query)[:-1].split("+"))
            answer = str(a + b + (a % 4 == 1)) + (self.tokenizer.eos_token if a % 2 == 0 else "")
            responses.append(torch.tensor(self.tokenizer(answer)["input_ids"]))
        return responses


def test_heldout_accuracy_counts_exact_greedy_answers(script):
    tokenizer = script.build_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["<eos>"]) == [tokenizer.eos_token_id]
    problems = script.make_problems(seed=0, num_sft=10, num_grpo=10, num_heldout=200)["heldout"]
    trainer = OracleTrainer(tokenizer)
    accuracy = script.heldout_accuracy(trainer, problems, max_new_tokens=5)
    assert accuracy == pytest.approx(sum(a % 2 == 0 for a, _ in problems) / len(problems))
    assert 0.2 < accuracy < 0.8  # both kinds of answer occur
    assert trainer.calls == [{"return_prompt": False, "do_sample": False, "max_new_tokens": 5}]


@pytest.mark.parametrize("flags", [[], ["--use_vllm", "--vllm_kv_cache_gb", "1"]], ids=["transformers", "vllm"])
def test_quick_run_writes_plot_metrics_and_models(script, tmp_path, flags):
    out = tmp_path / "run"
    result = run_script(
        "grpo_arithmetic.py", "--sft_steps", "20", "--steps", "2", "--num_grpo", "64", "--num_heldout", "64",
        "--eval_every", "1", "--output_dir", str(out), *flags,
    )  # fmt: skip
    assert "held-out greedy accuracy" in result.stdout
    assert (out / "grpo_arithmetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["step"] for e in metrics["evaluations"]] == [0, 1, 2]
    assert [r["step"] for r in metrics["records"]] == [1, 2]
    for record in metrics["records"]:
        assert math.isfinite(record["ppo/loss/total"]) and math.isfinite(record["objective/kl"])
        assert 0.0 <= record["rollout/accuracy"] <= 1.0 and record["dynamic_sampling/tries"] >= 1
        # On vLLM the engine's log-probs reach step(): the float32 engine samples from the policy itself.
        assert ("rollout/logprob_diff/mean" in record) is bool(flags)
        assert record.get("rollout/logprob_diff/max", 0.0) < 1e-3
    assert metrics["num_heldout"] == 64 and metrics["use_vllm"] is bool(flags)

    # The accuracies it reports are those of the models it wrote, on the held-out problems of its seed.
    heldout = script.make_problems(seed=0, num_sft=300, num_grpo=64, num_heldout=64)["heldout"]
    assert metrics["heldout_accuracy_before"] == pytest.approx(greedy_accuracy(out / "sft_model", heldout))
    assert metrics["heldout_accuracy_after"] == pytest.approx(greedy_accuracy(out / "model", heldout))
    sft = AutoModelForCausalLM.from_pretrained(out / "sft_model").state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    assert any(not torch.equal(sft[k], tuned[k]) for k in sft), "GRPO changed nothing"
