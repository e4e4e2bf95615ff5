"""One GRPO step whose processes hold different rollouts: the section-14 statistics and the
completions table must describe the rows of all processes.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 \\
        tests/distributed/rollout_stats.py --output_dir OUT

Process r answers 8 rows with its own response lengths, EOS endings and groups (4 groups of 2 on
rank 0, 2 groups of 4 on rank 1, so a mean of the per-process fractions of equal-score groups would
differ from the fraction over all groups). Each rank writes OUT/rank<r>.pt with its rows and the
step's statistics; rank 0 also logs the completions table (every step) to TensorBoard under OUT/tb.
"""

import argparse
import os

import torch
from common import finish

from tiny_models import make_gpt2, make_tokenizer, random_batch
from trl_lite import PPOConfig, PPOTrainer, set_seed

EOS = 1
BATCH = 8
# Per rank: group size, scores (equal within some groups), which rows end with EOS, response lengths.
ROLLOUTS = {
    0: dict(group=2, scores=[0.5, 0.5, 1.0, 0.0, -1.0, 2.0, 0.25, 0.75], eos=[0, 3], response_len=(2, 5)),
    1: dict(group=4, scores=[1.5] * 4 + [-0.5] * 4, eos=[0, 1, 2, 4, 5, 7], response_len=(6, 9)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    rollout = ROLLOUTS[rank]

    config = PPOConfig(
        batch_size=BATCH, mini_batch_size=4, ppo_epochs=1, learning_rate=1e-3, seed=0,
        advantage_estimator="grpo", num_samples_per_query=rollout["group"],
        log_with="tensorboard", log_completions_every=1,
        project_kwargs={"logging_dir": os.path.join(args.output_dir, "tb")},
    )  # fmt: skip
    set_seed(0)
    trainer = PPOTrainer(config, make_gpt2(seed=0), tokenizer=make_tokenizer())
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes

    queries, responses, _ = random_batch(BATCH, seed=10 + rank, response_len=rollout["response_len"])
    queries = [queries[(i // rollout["group"]) * rollout["group"]] for i in range(BATCH)]
    responses = [
        torch.cat([r[:-1], torch.tensor([EOS])]) if i in rollout["eos"] else r for i, r in enumerate(responses)
    ]
    scores = [torch.tensor(s) for s in rollout["scores"]]
    stats = trainer.step(queries, responses, scores)
    batch = {"query": [f"q{rank}-{i}" for i in range(BATCH)], "response": [f"r{rank}-{i}" for i in range(BATCH)]}
    trainer.log_stats(stats, batch, scores)

    torch.save(
        {
            "lengths": [len(r) for r in responses],
            "ends_with_eos": [int(r[-1]) == EOS for r in responses],
            "scores": rollout["scores"],
            "group": rollout["group"],
            "stats": {k: v for k, v in stats.items() if isinstance(v, float) and not k.startswith("time/")},
        },
        os.path.join(args.output_dir, f"rank{rank}.pt"),
    )
    finish(trainer)


if __name__ == "__main__":
    main()
