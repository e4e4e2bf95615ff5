"""Multi-turn GRPO on two processes: run_episodes with a step environment -> step, where the processes'
episodes last different numbers of turns.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/agent_loop.py --base_model DIR --output_dir OUT

``DIR`` holds test_agents' successor model that always guesses five. Rank 0 plays secret 5 (won in one
turn), rank 1 secret 7 (three turns, the last one shortened by max_episode_tokens): under ZeRO-3 the
transformers engine's generate is a collective, so rank 0 must join rank 1's later turns. Rank 0 writes
OUT/report.pt: every process's episodes (turns, lengths, rewards), the statistics of episode_stats over
both processes, and every process's weights after the steps.
"""

import argparse

import torch
from common import finish, flat, full_named_parameters, gather_across_processes
from test_agents import TOKENIZER, GuessGame
from transformers import AutoModelForCausalLM

from trl_lite import PPOConfig, PPOTrainer
from trl_lite.agents import episode_stats, run_episodes, step_inputs

STEPS = 2
MAX_EPISODE_TOKENS = 53  # 24 tokens per turn and its answer: the third turn gets 5 new tokens, not 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-3, advantage_estimator="grpo",
                       num_samples_per_query=2, seed=0)  # fmt: skip
    policy, reference = (AutoModelForCausalLM.from_pretrained(args.base_model) for _ in range(2))
    trainer = PPOTrainer(config, policy, ref_model=reference, tokenizer=TOKENIZER)
    rank = trainer.accelerator.process_index
    secret = 5 if rank == 0 else 7
    prompt = {"prompt": [{"role": "user", "content": "guess"}], "secret": secret}
    episodes_per_step, stats_per_step = [], []
    for _ in range(STEPS):
        episodes = run_episodes(trainer, [prompt], environment_factory=GuessGame, max_turns=3,
                                max_episode_tokens=MAX_EPISODE_TOKENS, num_generations=2, max_new_tokens=8,
                                do_sample=True)  # fmt: skip
        scores = [torch.tensor(e.reward) + 0.1 * i for i, e in enumerate(episodes)]  # unequal within the group
        stats = trainer.step(**step_inputs(episodes), scores=scores)
        stats_per_step.append({**episode_stats(episodes, trainer.accelerator), "objective/kl": stats["objective/kl"]})
        episodes_per_step.append(
            [(e.num_turns, len(e.response), int(e.response_mask.sum()), e.reward, e.truncated) for e in episodes]
        )
    everyone = [None] * trainer.accelerator.num_processes
    torch.distributed.all_gather_object(everyone, episodes_per_step)
    weights = gather_across_processes(flat(full_named_parameters(trainer)), trainer.accelerator.device)
    if trainer.accelerator.is_main_process:
        torch.save({"episodes": everyone, "stats": stats_per_step, "weights": weights,
                    "num_processes": trainer.accelerator.num_processes}, f"{args.output_dir}/report.pt")  # fmt: skip
    finish(trainer)


if __name__ == "__main__":
    main()
