"""One step on 2 processes with an out-of-memory error injected on rank 1 only (docs/out_of_memory.md).

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 \\
        tests/distributed/oom_backoff_step.py --output_dir OUT --inject forward --call 1
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/oom_backoff_step.py --output_dir OUT --inject forward --call 0

Each process trains 4 rows of a fixed global batch of 8 (mini-batches of 2, 2 accumulation steps: one backward
batch, so one optimizer step per epoch; REINFORCE++, SGD). ``--inject forward|backward`` raises
``torch.OutOfMemoryError`` on rank 1 in the forward (or the backward) of its training pass number ``--call``
(tests/oom_injection.py), or with ``bug`` a plain RuntimeError in that forward; ``none`` runs clean.
``--classic_alone 1``: after the step rank 0 alone runs the classic ``batched_forward_pass`` (with the budget
the back-off left). ``--sp_size 2`` under
accelerate_configs/deepspeed_sequence_parallel.yaml: the 2 processes are one group sharing the batch. Rank 0 writes OUT/result.pt: its full weights, the step's
scalar statistics and every process's token budget after the step (gathered with torch.distributed).
"""

import argparse
import os

import torch
from common import finish, full_named_parameters, gather_across_processes

from oom_injection import InjectedOutOfMemory
from tiny_models import make_gpt2, make_tokenizer, random_batch
from trl_lite import PPOConfig, PPOTrainer, set_seed
from trl_lite.parallel import sequence_parallel_size

GLOBAL_BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--inject", choices=("none", "forward", "backward", "bug"), default="none",
                        help="bug: a plain RuntimeError in the forward instead of an out-of-memory error")
    parser.add_argument("--call", type=int, default=0)
    parser.add_argument("--ppo_epochs", type=int, default=2)
    parser.add_argument("--sp_size", type=int, default=1,
                        help="the launch config's sequence-parallel size: packed passes, one batch per group")  # fmt: skip
    parser.add_argument("--classic_alone", type=int, choices=(0, 1), default=0,
                        help="after the step, rank 0 alone runs the classic batched_forward_pass")
    args = parser.parse_args()

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    groups = world_size // args.sp_size
    per_process = GLOBAL_BATCH // groups
    config = PPOConfig(
        batch_size=per_process, mini_batch_size=2, gradient_accumulation_steps=per_process // 2,
        ppo_epochs=args.ppo_epochs, learning_rate=0.5, advantage_estimator="reinforce_pp", max_grad_norm=None, seed=0,
        padding_free=args.sp_size > 1,
    )  # fmt: skip
    set_seed(0)
    model = make_gpt2(seed=0)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer(), optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    assert trainer.accelerator.num_processes == world_size
    assert sequence_parallel_size(trainer.accelerator) == args.sp_size

    queries, responses, scores = random_batch(GLOBAL_BATCH, seed=3, query_len=(2, 5), response_len=(1, 9))
    group = rank // args.sp_size
    mine = slice(group * per_process, (group + 1) * per_process)
    inject = dict(calls=(args.call,) if args.inject != "none" and rank == 1 else (), in_backward=args.inject == "backward",
                  bug=args.inject == "bug")  # fmt: skip
    torch.manual_seed(1)
    with InjectedOutOfMemory(trainer.accelerator.unwrap_model(trainer.model), **inject) as injected:
        stats = trainer.step(queries[mine], responses[mine], scores[mine])
    budget = torch.tensor(float(trainer.forward.max_tokens or 0))
    budgets = [float(b) for b in gather_across_processes(budget, trainer.accelerator.device)]
    weights = full_named_parameters(trainer)
    if rank == 0:
        scalars = {key: float(value) for key, value in stats.items() if getattr(value, "ndim", 0) == 0}
        result = {"named_parameters": weights, "stats": scalars, "budgets": budgets}
        if args.classic_alone:  # the classic pass on this process alone, under the budget the back-off left
            q, r = queries[mine], responses[mine]
            inputs = trainer.prepare_model_inputs(q, r)
            logprobs, _, _, masks = trainer.batched_forward_pass(trainer.model, q, r, inputs)
            result.update(classic=(logprobs, masks), classic_budget=trainer.forward.max_tokens,
                          response_tokens=sum(len(response) for response in r))  # fmt: skip
        torch.save(result, os.path.join(args.output_dir, "result.pt"))
    print(f"rank {rank}: {injected.failures} injected failures, retries {stats['memory/oom_retries']}", flush=True)
    finish(trainer)


if __name__ == "__main__":
    main()
