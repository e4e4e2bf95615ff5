"""What the examples print, with and without --use_vllm: their set-up lines, a progress bar and their
results; no traceback, none of vLLM's INFO lines, and no warning outside ALLOWED (each with why it stays).

Short runs with the settings of test_examples.py and test_grpo_arithmetic.py.
"""

import os
import re
import subprocess
import sys

import pytest
from test_examples import ROOT, SCRIPTS, SMALL_RUN, example_env

# A warning in any of the forms the examples' dependencies print: Python's warnings ("UserWarning: "),
# logging ("WARNING", "[WARNING]"), transformers' logger ("[transformers] ..."), torch's C++ log ("[W1125 ...");
# anywhere in a line, since a progress bar's line has no end of line before them.
WARNING = re.compile(r"warn|\[transformers\]|\[W\d{4} ", re.IGNORECASE)
ENGINE_INFO = re.compile(r"\(\w+ pid=\d+\) (INFO|DEBUG) ")  # vLLM's own set-up and progress lines
ALLOWED = {
    "DynamicSampler: after max_tries=": "a short run's policy answers whole groups alike: train longer or raise "
    "max_tries (the warning says how many groups were missing)",
    "Warning: NUMA binding: Using MEMBIND policy": "vLLM's C++ CPU extension binding the engine's memory; torch "
    "reads its C++ log level only at start-up, so only the user can hide it (TORCH_CPP_LOG_LEVEL=ERROR)",
}
VLLM = ["--use_vllm", "--vllm_kv_cache_gb", "1"]
SENTIMENT = [*SMALL_RUN, "--steps", "2"]
ARITHMETIC = ["--sft_steps", "20", "--steps", "2", "--num_grpo", "64", "--num_heldout", "64", "--eval_every", "1"]


def run_example(name: str, *args: str) -> str:
    """stdout and stderr of `examples/scripts/<name> args`, which must exit 0; vLLM's logging as a user gets it."""
    env = example_env()
    env.pop("VLLM_LOGGING_LEVEL", None)  # a level set by an earlier test's engine in this process
    env.pop("TRL_LITE_VLLM_LOGGING_LEVEL", None)
    # vLLM's CPU worker writes this into os.environ of a process that built an engine (an earlier test's);
    # a child's vLLM then warns about an unknown variable. A user's fresh shell has none.
    env.pop("VLLM_DIST_IDENT", None)
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} failed:\n{output[-5000:]}"
    return output


def check_output(output: str) -> None:
    assert "Traceback" not in output, output[-5000:]
    lines = [line.strip() for line in re.split(r"[\r\n]", output)]
    unexpected = [line for line in lines if WARNING.search(line) and not any(a in line for a in ALLOWED)]
    assert not unexpected, "warnings outside the allow-list:\n" + "\n".join(unexpected)
    engine_lines = [line for line in lines if ENGINE_INFO.search(line)]
    assert not engine_lines, "vLLM's INFO lines:\n" + "\n".join(engine_lines[:10])


@pytest.mark.parametrize("flags", [[], VLLM], ids=["transformers", "vllm"])
def test_sentiment_demo_prints_its_stages_progress_and_results(tmp_path, flags):
    output = run_example("ppo_sentiment.py", *SENTIMENT, "--output_dir", str(tmp_path), *flags)
    for line in ("SFT stage: tiny GPT-2", "Reward-model stage: tiny DistilBERT", "PPO: 100%", "mean reward: first"):
        assert line in output, output[-3000:]
    check_output(output)


QWEN2_LORA = ["--architecture", "qwen2", "--lora_rank", "4"]  # the engine serves the adapter (vllm_lora_sync)


@pytest.mark.parametrize(
    "flags", [[], VLLM, [*VLLM, *QWEN2_LORA]], ids=["transformers", "vllm", "vllm-qwen2-lora"]
)  # fmt: skip
def test_arithmetic_example_prints_its_stages_progress_and_results(tmp_path, flags):
    output = run_example("grpo_arithmetic.py", *ARITHMETIC, "--output_dir", str(tmp_path), *flags)
    for line in ("SFT: 20 steps", "GRPO: 100%", "held-out greedy accuracy (64 problems)"):
        assert line in output, output[-3000:]
    check_output(output)


def test_the_check_finds_warnings_of_every_form():
    for line in (
        "/x/ppo.py:3: UserWarning: something", "(MainProcess pid=1) WARNING 11-25 13:08:17 [arg_utils.py:1] x",
        "[2026-11-25 13:08:15,095] [WARNING] [real_accelerator.py:213:get_accelerator] x",
        "[transformers] We strongly recommend passing in an `attention_mask`", "[W1125 13:08:18.76 utils.cpp:68] x",
        "GRPO:   0%|          | 0/2 [00:00<?, ?it/s][transformers] We strongly recommend passing",
    ):  # fmt: skip
        with pytest.raises(AssertionError, match="outside the allow-list"):
            check_output(line)
    with pytest.raises(AssertionError, match="vLLM's INFO lines"):
        check_output("(MainProcess pid=18985) INFO 11-25 13:08:17 [model.py:733] Resolved architecture: GPT2LMHeadModel")
    with pytest.raises(AssertionError):
        check_output("Traceback (most recent call last):")
    check_output("SFT stage: tiny GPT-2 trained\rPPO:  50%|##  | 1/2\n" + os.linesep.join(ALLOWED))
