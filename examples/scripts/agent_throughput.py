"""Episodes per second of the two agent examples' rollouts on the transformers engine and on colocated vLLM.

    python examples/scripts/agent_calculator.py --output_dir outputs/agent_calculator
    python examples/scripts/agent_guess_number.py --output_dir outputs/agent_guess_number
    python examples/scripts/agent_throughput.py --calculator_model outputs/agent_calculator/model \\
        --guess_model outputs/agent_guess_number/model

For each example's trained model, one trainer per engine (the same weights) plays the example's GRPO
rollout (8 tasks x 8 sampled episodes, 64 in all) and its greedy evaluation, the two engines taking
turns for --rounds rounds, so that both see the same machine load. Prints, and writes to --output
as JSON, the median episodes per second of each; the first round (warm-up) is left out.
"""

import json
import os
import random
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
from agent_calculator import calculator
from agent_calculator import make_tasks as calculator_tasks
from agent_calculator import prompt_of as calculator_prompt
from agent_guess_number import GuessTheNumber
from agent_guess_number import prompt_of as guess_prompt
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from trl_lite import NoDatasetWarning, PPOConfig, PPOTrainer
from trl_lite.agents import run_episodes


@dataclass
class Arguments:
    calculator_model: str = field(metadata={"help": "The model/ (or sft_model/) agent_calculator.py wrote."})
    guess_model: str = field(metadata={"help": "The model/ (or sft_model/) agent_guess_number.py wrote."})
    rounds: int = field(default=6, metadata={"help": "Rounds per engine and workload; the first is not counted."})
    output: str = field(default="outputs/agent_throughput.json", metadata={"help": "Where the medians go."})

    def __post_init__(self):
        if self.rounds < 2:
            raise ValueError(f"rounds must be an int >= 2 (the first is a warm-up), got {self.rounds}.")


def trainers(model_dir: str) -> dict:
    """A transformers-engine trainer and a colocated-vLLM one on the saved model."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    built = {}
    for name, use_vllm in (("transformers", False), ("vllm", True)):
        config = PPOConfig(batch_size=64, mini_batch_size=64, advantage_estimator="grpo", num_samples_per_query=8,
                           use_vllm=use_vllm, vllm_kv_cache_gb=1, seed=0)  # fmt: skip
        with warnings.catch_warnings():  # the workloads batch their own episodes
            warnings.simplefilter("ignore", NoDatasetWarning)
            built[name] = PPOTrainer(config, AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tokenizer)
    return built


def workloads(name: str) -> dict:
    """The example's rollout and evaluation as functions of a trainer; each returns its episodes."""
    rng = random.Random(0)
    if name == "calculator":
        tasks = calculator_tasks(seed=0, num_sft=2000, num_heldout=200)

        def play(trainer, chosen, **kwargs):
            return run_episodes(trainer, [calculator_prompt(t) for t in chosen], tools=[calculator], max_turns=3,
                                max_new_tokens=12, **kwargs)  # fmt: skip

        return {
            "rollout": lambda t: play(t, rng.sample(tasks["grpo_hard"], 4) + rng.sample(tasks["grpo_easy"], 4),
                                      num_generations=8, do_sample=True, top_k=0),  # fmt: skip
            "evaluation": lambda t: play(t, tasks["heldout_hard"] + tasks["heldout_easy"], do_sample=False),
        }

    def games(trainer, secrets, **kwargs):
        return run_episodes(trainer, [guess_prompt(s, 7) for s in secrets], environment_factory=lambda: GuessTheNumber(7),
                            max_turns=3, max_new_tokens=2, **kwargs)  # fmt: skip

    return {
        "rollout": lambda t: games(t, [rng.randint(1, 7) for _ in range(8)], num_generations=8, do_sample=True, top_k=0),
        "evaluation": lambda t: games(t, [1 + i % 7 for i in range(700)], do_sample=True, top_k=0),
    }


def main(args: Arguments) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    results = {}
    for example, model_dir in (("calculator", args.calculator_model), ("guess_number", args.guess_model)):
        engines = trainers(model_dir)
        for workload, play in workloads(example.split("_")[0]).items():
            rates = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, trainer in engines.items():
                    start = time.perf_counter()
                    episodes = play(trainer)
                    rates[name].append(len(episodes) / (time.perf_counter() - start))
            for name, values in rates.items():
                results[f"{example}/{workload}/{name}"] = statistics.median(values[1:])
                print(f"{example:12s} {workload:10s} {name:12s} {results[f'{example}/{workload}/{name}']:7.1f} episodes/s")
        engines["vllm"].generation.close()
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(HfArgumentParser(Arguments).parse_args_into_dataclasses()[0])
