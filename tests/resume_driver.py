"""A short PPO run (dataset, sampled generation, reward function) that can save, resume or hang in a save.

Run by ``test_reliability.py`` in fresh processes, so that resuming is checked across processes:

    python resume_driver.py --steps N --out FILE [--checkpoint DIR] [--save-at K ...] [--resume]
                            [--hang-at K --hang-mode {write,rename} --marker FILE]

``--save-at K`` saves a checkpoint after step K and writes the trainer state to ``FILE.stepK``;
``--resume`` loads ``DIR`` first; the state at the end goes to ``FILE``. ``--hang-at K`` makes the
save after step K stop for good (after writing part of the temporary directory, or between its two
renames), after creating ``--marker``, so that the test can kill the process there.

Under ``accelerate launch`` with several processes (``test_distributed_fsdp.py`` runs it under
accelerate_configs/fsdp2.yaml) every process writes its own state: process ``r > 0`` to ``FILE.rankR`` (and
``FILE.stepK.rankR``), its FSDP2 shards (``DTensor``) as its local tensors.
"""

import argparse
import os
import random
import sys
import time

import numpy as np
import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer  # noqa: E402

from trl_lite import AutoModelForCausalLMWithValueHead, LengthSampler, PPOConfig, PPOTrainer  # noqa: E402

BATCH_SIZE = 4
DATASET_ROWS = 10  # 2 batches per pass (the last 2 rows are dropped): runs cross pass boundaries
REWARD_TOKEN = 10


def collate(rows: list[dict]) -> dict:
    """Keep the variable-length queries as a list of 1-D tensors."""
    return {"input_ids": [row["input_ids"] for row in rows]}


def build_trainer(grouped: bool = False) -> PPOTrainer:
    """A trainer with everything that carries state between steps: dropout, AdamW, a scheduler,
    score scaling and normalisation, adaptive KL, several mini-batches and a shuffled dataset. ``grouped``: GRPO
    groups of 2 rows per prompt without dropout, the settings left automatic (prefix sharing on, epochs by prompt)."""
    grouped_options = dict(advantage_estimator="grpo", num_samples_per_query=2, disable_dropout=True)
    config = PPOConfig(
        **(grouped_options if grouped else {}),
        batch_size=BATCH_SIZE,
        mini_batch_size=2,
        ppo_epochs=2,
        learning_rate=1e-3,
        use_score_scaling=True,
        use_score_norm=True,
        adap_kl_ctrl=True,
        init_kl_coef=0.1,
        target=0.5,
        horizon=20.0,
        max_grad_norm=1.0,
        seed=7,
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(dropout=0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.2, total_iters=6)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 6, (DATASET_ROWS,), generator=g).tolist()
    queries = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]
    dataset = Dataset.from_dict({"input_ids": queries})
    dataset.set_format("torch")
    return PPOTrainer(
        config, model, None, make_tokenizer(), dataset=dataset, optimizer=optimizer,
        data_collator=collate, lr_scheduler=scheduler,
    )  # fmt: skip


def reward(response: torch.Tensor) -> float:
    """Reward one token, with Python-random noise so that the ``random`` state matters too."""
    return float((response == REWARD_TOKEN).sum()) + 0.1 * len(response) + 0.01 * random.random()


def _local(value):
    """``value`` with every FSDP2 shard (``DTensor``) replaced by a copy of this process's local tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _per_process(path: str) -> str:
    rank = int(os.environ.get("RANK", "0"))
    return path if rank == 0 else f"{path}.rank{rank}"


def trainer_state(trainer: PPOTrainer, last_stats: dict | None) -> dict:
    """Everything that must match between a straight and a resumed run."""
    from trl_lite.parallel.fsdp import reshard

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    reshard(unwrapped)  # FSDP2: the shards, also of a root still gathered after a forward
    return {
        "model": _local(unwrapped.state_dict()),
        "optimizer": _local(trainer.optimizer.state_dict()),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "kl_coef": trainer.kl_ctl.value,
        "running": trainer.running.state_dict(),
        "current_step": trainer.current_step,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()[1].copy(), "python": random.getstate()},
        "stats": {k: v for k, v in (last_stats or {}).items() if isinstance(v, float) and not k.startswith("time/")},
    }


def install_hang(trainer: PPOTrainer, mode: str, marker: str) -> None:
    """Make the next save stop forever, at ``mode``: 'write' (temporary directory half written) or 'rename'."""

    def hang():
        open(marker, "w").close()
        time.sleep(600)

    if mode == "write":
        save_state = trainer.accelerator.save_state

        def save_state_then_hang(*args, **kwargs):
            save_state(*args, **kwargs)
            hang()

        trainer.accelerator.save_state = save_state_then_hang
    else:
        rename = os.rename
        calls = []

        def rename_once_then_hang(src, dst):
            calls.append(src)
            if len(calls) > 1:
                hang()
            rename(src, dst)

        os.rename = rename_once_then_hang


def step_queries(batch: dict, grouped: bool) -> list:
    """The step's queries: the batch's, or with ``grouped`` its first 2 queries, each 3 times over, twice (groups)."""
    queries = batch["input_ids"]
    if not grouped:
        return queries
    return [torch.cat([q, q, q]) for q in queries[: BATCH_SIZE // 2] for _ in range(2)]


def run(args) -> None:
    trainer = build_trainer(args.grouped)
    if args.resume:
        trainer.load_checkpoint(args.checkpoint)
    length_sampler = LengthSampler(2, 6)  # numpy random: the numpy state matters too
    stats = None
    while trainer.current_step < args.steps:
        for batch in trainer.dataloader:
            queries = step_queries(batch, args.grouped)
            responses = trainer.generate(
                queries, length_sampler=length_sampler, batch_size=BATCH_SIZE, return_prompt=False, do_sample=True
            )
            stats = trainer.step(queries, responses, [reward(r) for r in responses])
            step = trainer.current_step
            if step == args.hang_at:
                install_hang(trainer, args.hang_mode, args.marker)
            if step in args.save_at:
                trainer.save_checkpoint(args.checkpoint)
                torch.save(trainer_state(trainer, stats), _per_process(f"{args.out}.step{step}"))
            if step >= args.steps:
                break
    torch.save(trainer_state(trainer, stats), _per_process(args.out))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--save-at", type=int, nargs="*", default=[])
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-mode", choices=("write", "rename"), default="write")
    parser.add_argument("--marker")
    parser.add_argument("--grouped", action="store_true", help="GRPO groups, prefix sharing and epoch order automatic")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
