"""Two GRPO steps with ``prefix_sharing=False`` and then ``True``, in the same processes.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/prefix_sharing_step.py --base_model DIR --output_dir OUT

with the DeepSpeed ZeRO-2 or ZeRO-3 config or the DDP one (multi_gpu). Each process takes its own 8 rows:
two groups of 4 responses to one prompt, the prompts of different lengths on each process (3 and 11 tokens
on rank 0, 6 and 9 on rank 1), one group holding a 23-token and a 1-token response. Two steps of 2 epochs
over mini-batches of the whole batch, so every pass (rollout and training) can run each prompt once. The
policy and the reference are loaded from DIR (under ZeRO-3 a loaded model is partitioned by the trainer);
the optimizer is SGD, whose update is linear in the gradient. Rank 0 writes OUT/result.pt: per setting the
full weights after the steps, the statistics of both steps, every process's weights and
``prefix_sharing/tokens_saved_fraction`` (gathered with ``torch.distributed``), and the tokens each
process's rows hold and would save.
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import finish, flat, full_named_parameters, gather_across_processes
from transformers import AutoModelForCausalLM

from tiny_models import VOCAB_SIZE, make_tokenizer
from trl_lite import PPOConfig, PPOTrainer

GROUP = 4
PROMPTS = {0: (3, 11), 1: (6, 9)}  # prompt lengths per rank


def grouped_rows(rank: int, step: int):
    """Rank ``rank``'s rows of step ``step``: two groups of ``GROUP`` responses, each group sharing a query."""
    g = torch.Generator().manual_seed(100 * rank + step)
    queries, responses = [], []
    for prompt in PROMPTS[rank]:
        query = torch.randint(3, VOCAB_SIZE, (prompt,), generator=g)
        for _ in range(GROUP):
            queries.append(query.clone())
            responses.append(torch.randint(3, VOCAB_SIZE, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g))
    responses[GROUP - 2] = torch.randint(3, VOCAB_SIZE, (23,), generator=g)
    responses[GROUP - 1] = responses[GROUP - 1][:1]
    scores = [torch.randn((), generator=g) for _ in queries]
    return queries, responses, scores


def run(base_model: str, prefix_sharing: bool) -> dict:
    config = PPOConfig(
        batch_size=2 * GROUP,
        mini_batch_size=2 * GROUP,
        ppo_epochs=2,
        learning_rate=0.1,
        advantage_estimator="grpo",
        num_samples_per_query=GROUP,
        init_kl_coef=0.2,
        prefix_sharing=prefix_sharing,
        seed=0,
    )
    policy, reference = (AutoModelForCausalLM.from_pretrained(base_model) for _ in range(2))
    optimizer = torch.optim.SGD(policy.parameters(), lr=config.learning_rate)
    trainer = PPOTrainer(config, policy, ref_model=reference, tokenizer=make_tokenizer(), optimizer=optimizer)
    assert trainer.accelerator.num_processes == 2
    rank = trainer.accelerator.process_index
    stats = [trainer.step(*grouped_rows(rank, step)) for step in range(2)]
    device = trainer.accelerator.device
    saved = [s["prefix_sharing/tokens_saved_fraction"] for s in stats]
    weights = full_named_parameters(trainer)
    return {
        "model_class": type(trainer.model).__name__,
        "named_parameters": weights,
        "weights_per_rank": gather_across_processes(flat(weights), device),
        "saved_per_rank": gather_across_processes(torch.tensor(saved, dtype=torch.float64), device),
        "stats": [{k: v for k, v in s.items() if not k.startswith("time/")} for s in stats],
        "trainer": trainer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    results = {sharing: run(args.base_model, sharing) for sharing in (False, True)}
    trainer = results[True].pop("trainer")
    results[False].pop("trainer")
    if dist.get_rank() == 0:
        rows = {rank: [grouped_rows(rank, step)[:2] for step in range(2)] for rank in PROMPTS}
        torch.save({"world_size": dist.get_world_size(), "results": results, "rows": rows},
                   os.path.join(args.output_dir, "result.pt"))  # fmt: skip
    finish(trainer)


if __name__ == "__main__":
    main()
