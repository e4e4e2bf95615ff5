"""RewardTrainer under DeepSpeed ZeRO-2 on 2 processes: a run killed after its step-2 checkpoint and
resumed equals the run done straight, weights and logged metrics both.

    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/reward_resume.py --base_model DIR --output_dir OUT

Logging every 3 steps puts a checkpoint (step 2) inside a logging window: the metric sums of every
process up to step 2 must survive the restart. Every process asserts; rank 0 writes OUT/ok.
"""

import argparse
import os

import torch
from common import finish, flat, full_named_parameters
from transformers import AutoModelForSequenceClassification

from preference_pairs import planted_pairs
from tiny_models import make_tokenizer
from trl_lite import RewardConfig, RewardTrainer


class Killed(Exception):
    """Stands for the end of a process that dies just after writing a checkpoint."""


def make_trainer(base_model: str, output_dir: str, save_steps: int) -> RewardTrainer:
    config = RewardConfig(
        output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
        learning_rate=3e-3, warmup_steps=1, logging_steps=3, save_steps=save_steps, disable_tqdm=True, seed=0,
    )  # fmt: skip
    model = AutoModelForSequenceClassification.from_pretrained(base_model)
    return RewardTrainer(model, config, train_dataset=planted_pairs(24, seed=31), tokenizer=make_tokenizer())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    straight = make_trainer(args.base_model, os.path.join(args.output_dir, "straight"), save_steps=0)
    assert straight.accelerator.num_processes == 2 and straight.is_deepspeed_enabled
    straight.train()
    expected = flat(full_named_parameters(straight))

    stopped = make_trainer(args.base_model, os.path.join(args.output_dir, "stopped"), save_steps=2)
    save = stopped.save_checkpoint

    def save_then_die(path):
        save(path)
        raise Killed

    stopped.save_checkpoint = save_then_die
    try:
        stopped.train()
    except Killed:
        pass
    assert stopped.global_step == 2

    resumed = make_trainer(args.base_model, os.path.join(args.output_dir, "resumed"), save_steps=0)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "stopped", "checkpoint"))
    assert torch.equal(flat(full_named_parameters(resumed)), expected), "resumed weights differ"
    assert resumed.log_history == straight.log_history, (resumed.log_history, straight.log_history)
    assert [h["step"] for h in straight.log_history] == [3, 5]
    if resumed.accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "ok"), "w") as f:
            f.write(repr(straight.log_history))
    finish(resumed)


if __name__ == "__main__":
    main()
