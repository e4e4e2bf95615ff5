"""A PPO loop over the trainer's dataloader, with accelerate's state made before the trainer, as classic TRL's
`examples/scripts/ppo.py` makes it.

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/state_first_loop.py --output_dir OUT [--first partial_state|accelerator]

`--first partial_state` (classic ppo.py): `PartialState()`, and the dataset built inside its
`local_main_process_first()`; `--first accelerator` (classic ppo.py --use_peft): an `Accelerator()` made and
kept by the script; `--first trainer`: the trainer first, the run the others must equal. Then `PPOTrainer(..., dataset=...)` and one `step()` per dataloader batch: 12 rows in
batches of 2 per process are 3 steps on each of 2 processes, 6 on a process that trains alone. Rank 0 writes
OUT/report.pt: what the trainer's and the script's state objects say, each rank's batch count and row ids
and flat weights (gathered with `torch.distributed` itself), and the weights before training.
"""

import argparse
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from common import finish, flat, full_named_parameters, gather_across_processes
from datasets import Dataset

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer

ROWS = 12


def build_dataset() -> Dataset:
    """ROWS queries of 3-6 tokens; `label` is the row's index (a column the trainer keeps)."""
    g = torch.Generator().manual_seed(3)
    queries = [torch.randint(3, VOCAB_SIZE, (int(n),), generator=g).tolist() for n in torch.randint(3, 7, (ROWS,), generator=g)]
    dataset = Dataset.from_dict({"input_ids": queries, "label": list(range(ROWS))})
    dataset.set_format(type="torch")
    return dataset


def collator(data):
    return {key: [d[key] for d in data] for key in data[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--first", choices=("partial_state", "accelerator", "trainer"), default="partial_state")
    args = parser.parse_args()

    if args.first == "partial_state":
        user_state = PartialState()
        with user_state.local_main_process_first():
            dataset = build_dataset()
    elif args.first == "accelerator":
        user_state = Accelerator()
        dataset = build_dataset()
    else:
        dataset = build_dataset()

    config = PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-2, seed=0)
    set_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0))
    start = flat({k: p.detach().to(torch.float64).clone() for k, p in model.named_parameters()})
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer(), dataset=dataset, data_collator=collator)
    if args.first == "trainer":
        user_state = PartialState()

    g = torch.Generator().manual_seed(50 + int(os.environ.get("RANK", "0")))
    seen, steps = [], 0
    for batch in trainer.dataloader:
        queries = batch["input_ids"]
        seen += [int(i) for i in batch["label"]]
        responses = [torch.randint(3, VOCAB_SIZE, (4,), generator=g) for _ in queries]
        scores = [(r % 2 == 0).float().mean() for r in responses]
        trainer.step(queries, responses, scores)
        steps += 1

    device = trainer.accelerator.device
    # Gathered with torch.distributed over the launcher's group: accelerate or DeepSpeed joins it even where
    # accelerate's state records a single process.
    def per_rank(value: torch.Tensor) -> list:
        return gather_across_processes(value, device)

    seen_t = torch.tensor(seen + [-1] * (ROWS - len(seen)), dtype=torch.float64)
    report = {
        "trainer_num_processes": trainer.accelerator.num_processes,
        "user_num_processes": user_state.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "user_distributed_type": str(user_state.distributed_type),
        "model_class": type(trainer.model).__name__,
        "steps_per_rank": [int(v.item()) for v in per_rank(torch.tensor([float(steps)]))],
        "rows_per_rank": [[int(i) for i in v.tolist() if i >= 0] for v in per_rank(seen_t)],
        "weights_per_rank": per_rank(flat(full_named_parameters(trainer))),
        "start": start,
    }
    if dist.get_rank() == 0:
        torch.save(report, os.path.join(args.output_dir, "report.pt"))
    finish(trainer)


if __name__ == "__main__":
    main()
