"""examples/scripts/agent_calculator.py and agent_guess_number.py: their tools, environment, data and SFT
rows (in the token layout of run_episodes), their flags, and short end-to-end runs on transformers and
vLLM whose reported measures are recomputed here from the models they wrote."""

import importlib.util
import json
import math
import random

import pytest
import torch
from test_examples import SCRIPTS, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_lite import PPOConfig, PPOTrainer
from trl_lite.agents import ChatFormat, run_episodes
from trl_lite.engines import GenerationEngine


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_no_idle_warnings(stderr: str) -> None:
    """Neither transformers' loss_type notice (the examples name their GPT-2's causal-LM loss) nor the
    trainer's no-dataset warning (the examples filter it where they build the trainer) reaches an example's output."""
    assert "loss_type=None" not in stderr and "No dataset is provided" not in stderr, stderr[-2000:]


@pytest.fixture(scope="module")
def calculator_script():
    return load("agent_calculator")


@pytest.fixture(scope="module")
def guess_script():
    return load("agent_guess_number")


# ----------------------------------------------------------------------------------------------
# agent_calculator.py
# ----------------------------------------------------------------------------------------------


def test_calculator_tool_and_reward(calculator_script):
    calc = calculator_script.calculator
    assert [calc("23*47"), calc(" 12 + 30 "), calc("5-9"), calc("-3*4")] == ["1081", "42", "-4", "-12"]
    for bad in ("2**99999", "1+2+3", "abc", "", "4/2"):
        with pytest.raises(ValueError, match="cannot compute"):
            calc(bad)

    class Episode:
        def __init__(self, messages, tool_calls):
            self.messages, self.tool_calls = messages, tool_calls

    answered = [{"role": "user", "content": "23*47"}, {"role": "assistant", "content": "1081"}]
    reward = calculator_script.reward
    assert reward((23, 47), Episode(answered, 0), 0.1) == 1.0
    assert reward((23, 47), Episode(answered, 1), 0.1) == pytest.approx(0.9)
    assert reward((23, 47), Episode(answered[:1] + [{"role": "assistant", "content": "1080"}], 0), 0.1) == 0.0
    assert reward((23, 47), Episode(answered + [{"role": "tool", "content": "1081"}], 2), 0.1) == pytest.approx(-0.2)


def test_calculator_tasks_are_disjoint_and_seeded(calculator_script):
    sets = calculator_script.make_tasks(seed=3, num_sft=1000, num_heldout=100)
    assert len(sets["sft"]) == 1000 and len(sets["heldout_hard"]) == len(sets["heldout_easy"]) == 100
    assert all(min(t) > 10 for t in sets["heldout_hard"] + sets["grpo_hard"]) and all(1 in t for t in sets["grpo_easy"])
    unordered = {name: {frozenset(t) for t in tasks} for name, tasks in sets.items()}
    assert not unordered["heldout_hard"] & (unordered["sft"] | unordered["grpo_hard"])
    assert not unordered["heldout_easy"] & (unordered["sft"] | unordered["grpo_easy"])
    assert sets == calculator_script.make_tasks(seed=3, num_sft=1000, num_heldout=100)


def test_calculator_sft_rows_are_the_episodes_token_layout(calculator_script):
    """An SFT row equals the episode run_episodes plays with a model that writes exactly the row's turns."""
    tokenizer = calculator_script.build_tokenizer()
    chat = ChatFormat(tokenizer, [calculator_script.get_json_schema(calculator_script.calculator)])
    rows = calculator_script.sft_rows([(23, 47)] * 8, tokenizer, chat, random.Random(0))
    kinds = set()
    for row in rows:
        text = tokenizer.decode(row["input_ids"])
        kinds.add("<tool_call>" in text)
        assert text.startswith("<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n23*47<|im_end|>\n")
        trained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])
        if "<tool_call>" in text:
            assert "<tool_response>1081</tool_response>" in text
            assert trained == '<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call><|im_end|>1081<|im_end|>'
        else:
            assert trained == "1081<|im_end|>"
        assert text.endswith("1081<|im_end|>")
    assert kinds == {True, False}


def test_calculator_flags(calculator_script):
    args, config = calculator_script.parse_args([])
    assert config.advantage_estimator == "grpo" and config.batch_size % config.num_samples_per_query == 0
    assert config.use_vllm is False and args.tool_cost > 0
    args, config = calculator_script.parse_args(["--use_vllm", "--tool_cost", "0", "--max_turns", "2"])
    assert config.use_vllm and args.tool_cost == 0 and args.max_turns == 2
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        calculator_script.parse_args(["--max_turns", "0"])


def greedy_measures(model_dir, script, tasks: dict) -> dict:
    """Held-out greedy accuracy and tool rate per kind of the saved model, played here on a fresh trainer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = PPOTrainer(PPOConfig(batch_size=1, mini_batch_size=1, advantage_estimator="grpo"), model, tokenizer=tokenizer)
    args, _ = script.parse_args([])
    return {key: value for key, value in script.evaluate(trainer, tasks, args).items() if key != "episodes_per_second"}


@pytest.mark.parametrize("flags", [[], ["--use_vllm", "--vllm_kv_cache_gb", "1"]], ids=["transformers", "vllm"])
def test_calculator_quick_run(calculator_script, tmp_path, flags):
    out = tmp_path / "run"
    result = run_script(
        "agent_calculator.py", "--sft_steps", "30", "--steps", "2", "--num_heldout", "16", "--eval_every", "1",
        "--batch_size", "16", "--mini_batch_size", "16", "--output_dir", str(out), *flags,
    )  # fmt: skip
    assert "held-out (16 hard, 16 easy), SFT -> GRPO" in result.stdout
    assert_no_idle_warnings(result.stderr)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["step"] for e in metrics["evaluations"]] == [0, 1, 2] and metrics["use_vllm"] is bool(flags)
    for record in metrics["records"]:
        assert math.isfinite(record["ppo/loss/total"]) and record["env/turns/max"] <= 3
        assert record["episodes_per_second"] > 0 and record["rollout/logprob_diff/max"] < 1e-3
    tasks = calculator_script.make_tasks(seed=0, num_sft=2000, num_heldout=16)
    before = {k: v for k, v in metrics["before"].items() if k not in ("step", "episodes_per_second")}
    after = {k: v for k, v in metrics["after"].items() if k not in ("step", "episodes_per_second")}
    assert before == greedy_measures(out / "sft_model", calculator_script, tasks)
    assert after == greedy_measures(out / "model", calculator_script, tasks)
    assert (out / "sample_conversations.txt").read_text().startswith("user: ")


# ----------------------------------------------------------------------------------------------
# agent_guess_number.py
# ----------------------------------------------------------------------------------------------


def test_guess_environment(guess_script):
    env = guess_script.GuessTheNumber(15)
    assert env.reset(secret=9) is None
    assert [env.step(t) for t in ("4", "12", "9")] == [("higher", 0.0, False), ("lower", 0.0, False), ("correct", 1.0, True)]
    assert [env.step(t)[0] for t in ("0", "16", "nine", "", "-3", "4 ")] == ["invalid"] * 6
    assert guess_script.GuessTheNumber(7).step("8")[0] == "invalid"


def test_consistent_games_only_guess_what_is_possible(guess_script):
    rng = random.Random(0)
    wins = 0
    for _ in range(3000):
        secret = rng.randint(1, 7)
        guesses = guess_script.consistent_game(secret, 7, 3, rng)
        low, high = 1, 7
        for guess in guesses:
            assert low <= guess <= high
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1) if guess > secret else (guess, guess)
        wins += guesses[-1] == secret
        assert len(guesses) <= 3 and (guesses[-1] == secret or len(guesses) == 3)
    assert 0.65 < wins / 3000 < 0.71  # the docstring's "about 68%"


def test_guess_sft_rows_are_the_episodes_token_layout(guess_script):
    """An SFT game equals the episode run_episodes plays with a model that makes exactly the game's guesses."""
    args, _ = guess_script.parse_args(["--num_sft", "40", "--max_number", "15", "--max_turns", "4"])
    tokenizer = guess_script.build_tokenizer(15)
    rows = guess_script.sft_rows(args, tokenizer, ChatFormat(tokenizer), random.Random(1))
    for row in rows:
        guesses = [tokenizer.decode([t]) for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert guesses[1::2] == ["<|im_end|>"] * (len(guesses) // 2)
        text = tokenizer.decode(row["input_ids"])
        assert text.startswith("<|im_start|>user\nguess a number from 1 to 15<|im_end|>\n<|im_start|>assistant\n")
        feedback = text.count("higher") + text.count("lower")
        assert feedback == len(guesses) // 2 - 1  # after every guess but the last
    # Replayed through run_episodes with those guesses scripted, an episode has the row's tokens and labels.
    row = rows[0]
    guesses = [int(tokenizer.decode([t])) for t, label in zip(row["input_ids"], row["labels"]) if label != -100 and t != tokenizer.eos_token_id]
    secret = _secret_of(tokenizer.decode(row["input_ids"]), guesses)
    (episode,) = run_episodes(ScriptedEngine(tokenizer, guesses), [guess_script.prompt_of(secret, 15)],
                              environment_factory=lambda: guess_script.GuessTheNumber(15), max_turns=4,
                              max_new_tokens=2, tokenizer=tokenizer)  # fmt: skip
    assert torch.cat([episode.query, episode.response]).tolist() == row["input_ids"]
    assert [label != -100 for label in row["labels"][len(episode.query) :]] == episode.response_mask.bool().tolist()


def _secret_of(text: str, guesses: list[int]) -> int:
    """The secret of a consistent game: the last guess if the game ended on it, else any number consistent with the feedback."""
    low, high = 1, 15
    for guess, feedback in zip(guesses, [w for w in text.split() if w.startswith(("higher", "lower"))]):
        low, high = (guess + 1, high) if feedback.startswith("higher") else (low, guess - 1)
    return guesses[-1] if low <= guesses[-1] <= high else low


class ScriptedEngine(GenerationEngine):
    """An engine that answers every turn with the next scripted guess and <|im_end|> (log-prob 0)."""

    def __init__(self, tokenizer, guesses):
        self.tokenizer, self.turns = tokenizer, iter(guesses)

    def generate(self, queries, kwargs, length_sampler, batch_size, return_prompt, remove_padding, return_logprobs):
        rows = [torch.tensor(self.tokenizer(str(next(self.turns)))["input_ids"] + [self.tokenizer.eos_token_id]) for _ in queries]
        return rows, [torch.zeros(len(r)) for r in rows]

    def generate_one(self, query, generation_kwargs, return_prompt):
        return self.generate([query], generation_kwargs, None, 1, return_prompt, True, False)[0][0][None]


def test_guess_flags(guess_script):
    args, config = guess_script.parse_args([])
    assert (args.max_number, args.max_turns) == (7, 3) and config.num_samples_per_query == 8
    with pytest.raises(ValueError, match="num_eval_games must be an int >= 1"):
        guess_script.parse_args(["--num_eval_games", "0"])


@pytest.mark.parametrize("flags", [[], ["--use_vllm", "--vllm_kv_cache_gb", "1"]], ids=["transformers", "vllm"])
def test_guess_quick_run(guess_script, tmp_path, flags):
    out = tmp_path / "run"
    result = run_script(
        "agent_guess_number.py", "--sft_steps", "30", "--steps", "2", "--num_eval_games", "32", "--eval_every", "1",
        "--batch_size", "16", "--mini_batch_size", "16", "--output_dir", str(out), *flags,
    )  # fmt: skip
    assert "SFT -> GRPO: success" in result.stdout
    assert_no_idle_warnings(result.stderr)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["step"] for e in metrics["evaluations"]] == [0, 1, 2] and metrics["use_vllm"] is bool(flags)
    for record in metrics["records"]:
        assert math.isfinite(record["ppo/loss/total"]) and record["env/turns/max"] <= 4
        assert 0.0 <= record["success"] <= 1.0 and record["rollout/logprob_diff/max"] < 1e-3
    # The greedy success it reports is that of the models it wrote, replayed here.
    args, _ = guess_script.parse_args([])
    for name, measure in (("sft_model", metrics["before"]), ("model", metrics["after"])):
        model = AutoModelForCausalLM.from_pretrained(out / name)
        tokenizer = AutoTokenizer.from_pretrained(out / name)
        trainer = PPOTrainer(PPOConfig(batch_size=1, mini_batch_size=1, advantage_estimator="grpo"), model,
                             tokenizer=tokenizer)  # fmt: skip
        episodes, _ = guess_script.play(trainer, list(range(1, 8)), args, do_sample=False)
        assert measure["greedy_success"] == sum(e.reward for e in episodes) / 7


# ----------------------------------------------------------------------------------------------
# agent_throughput.py
# ----------------------------------------------------------------------------------------------


def test_throughput_times_both_engines_on_both_examples(calculator_script, guess_script, tmp_path):
    """On untrained models of the examples' shapes (what they play does not matter for the timing)."""
    dirs = []
    for script, tokenizer in ((calculator_script, calculator_script.build_tokenizer()),
                              (guess_script, guess_script.build_tokenizer(7))):  # fmt: skip
        args, _ = script.parse_args(["--n_layer", "1"])
        path = tmp_path / script.__name__
        script.build_model(args, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    result = run_script("agent_throughput.py", "--calculator_model", str(dirs[0]), "--guess_model", str(dirs[1]),
                        "--rounds", "2", "--output", str(tmp_path / "throughput.json"))  # fmt: skip
    rates = json.loads((tmp_path / "throughput.json").read_text())
    assert sorted(rates) == sorted(
        f"{example}/{workload}/{engine}" for example in ("calculator", "guess_number")
        for workload in ("rollout", "evaluation") for engine in ("transformers", "vllm")
    )  # fmt: skip
    assert all(rate > 0 for rate in rates.values()) and result.stdout.count("episodes/s") == 8
