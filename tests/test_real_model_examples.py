"""The parts of the SmolLM2 examples (examples/scripts/ppo_sentiment_smollm2.py, grpo_smollm2.py) that need no
model: their flags' checks, GRPO's answer check and its train/held-out split, the sentiment table's rows."""

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "scripts"))
import grpo_smollm2  # noqa: E402
import ppo_sentiment_smollm2  # noqa: E402


@pytest.mark.parametrize("name", ["lora_rank", "response_length", "num_samples", "num_eval", "eval_samples"])
def test_sentiment_flags_below_one_are_refused(name):
    with pytest.raises(ValueError, match=rf"{name} must be an int >= 1, got 0"):
        ppo_sentiment_smollm2.ScriptArguments(**{name: 0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"eval_every": 0}, "eval_every must be an int >= 1, got 0"), ({"max_operand": 1}, "max_operand must be an int >= 2"),
     ({"max_operand": 5, "num_heldout": 8}, "num_heldout must be at most half of the 15 unordered pairs, got 8")],
)  # fmt: skip
def test_grpo_flags_out_of_range_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        grpo_smollm2.ScriptArguments(**kwargs)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("12 + 26 = 38", 1.0), ("38", 1.0), ("The answer is 38.", 1.0), ("12 + 26 = 39", 0.0), ("38 is wrong, 39", 0.0),
     ("twelve", 0.0), ("", 0.0), ("12 + 26 = -38", 0.0)],
)  # fmt: skip
def test_the_answer_check_reads_the_last_integer_of_the_reply(reply, expected):
    assert grpo_smollm2.answer_reward(reply, 12, 26) == expected


def test_no_heldout_question_nor_its_twin_is_trained_on():
    train, heldout = grpo_smollm2.split_problems(9, 10, seed=3)
    assert len(heldout) == len(set(heldout)) == 10
    held = set(heldout) | {(b, a) for a, b in heldout}
    assert not held & set(train)
    # Every other ordered pair is a training question.
    assert set(train) | held == set(itertools.product(range(1, 10), repeat=2))
    assert grpo_smollm2.split_problems(9, 10, seed=3) == (train, heldout)


class _Words:
    """A stand-in tokenizer: id i decodes to "w<i>"."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(f"w{int(i)}" for i in row) for row in rows]


def test_the_sentiment_table_shows_the_first_continuation_of_each_prompt():
    queries = [torch.tensor([1]), torch.tensor([2])]
    # Prompt-major: two continuations of prompt 1, then two of prompt 2.
    before = (["a1", "a2", "b1", "b2"], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    after = (["c1", "c2", "d1", "d2"], torch.tensor([0.5, 0.6, 0.7, 0.8]))
    table = ppo_sentiment_smollm2.sample_table(_Words(), queries, before, after, samples=2, rows=2)
    lines = [line.split("|") for line in table.splitlines() if not line.startswith("-")]
    assert [[cell.strip() for cell in line] for line in lines[1:]] == [
        ["w1", "a1", "+0.10", "c1", "+0.50"], ["w2", "b1", "+0.30", "d1", "+0.70"],
    ]  # fmt: skip


def test_the_smollm2_generation_benchmark_refuses_empty_sizes_and_unknown_engines(monkeypatch, capsys):
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import bench_loop

    with pytest.raises(SystemExit):
        bench_loop.main(["--smollm2", "--prompts", "0"])
    assert "--prompts and --new-tokens must be >= 1, got 0 and 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_loop.main(["--smollm2", "--engines", "vLLM fp16"])
    assert "--engines: unknown ['vLLM fp16']; accepted: ['transformers fp32, one call'," in capsys.readouterr().err


ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 avx_vnni\nbogomips\t: 4800\n"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: avx512_bf16_fake\n"


def test_the_examples_decode_in_bfloat16_only_where_the_cpu_multiplies_it_and_push_the_merged_model(monkeypatch):
    from smollm2 import has_native_bf16, vllm_cpu_options

    assert has_native_bf16(ZEN4) and has_native_bf16(ZEN4.replace("avx512_bf16", "amx_bf16"))
    assert not has_native_bf16(AVX2_ONLY)  # a flag's name on another line does not count
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_cpu_options(ZEN4) == {"vllm_dtype": "bfloat16", "vllm_lora_sync": False}
    assert vllm_cpu_options(AVX2_ONLY) == {"vllm_dtype": "auto", "vllm_lora_sync": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # on a GPU: the config's own defaults
    assert vllm_cpu_options(ZEN4) == {"vllm_dtype": "auto", "vllm_lora_sync": None}
