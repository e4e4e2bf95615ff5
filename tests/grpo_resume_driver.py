"""A GRPOTrainer run in a fresh process that can be killed with SIGKILL right after a checkpoint, or half way
through writing one, and resumed (``test_grpo_trainer_resume.py``).

    python grpo_resume_driver.py --out DIR --model PATH [--resume] [--kill-after-save N | --kill-in-save N] [--tools]
                                 --result FILE

``--tools``: test_grpo_trainer_tools' environment_factory run (its own successor model; ``--model`` unused).
"""

import argparse
import os
import signal

import torch
from transformers import TrainerCallback

import grpo_helpers
from trl_lite.trainer.grpo import grpo_trainer as grpo_module


class KillAfterSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_save(step: int) -> None:
    """SIGKILL after the model of checkpoint-``step`` is written, before its state: a half-written checkpoint."""
    save = grpo_module.save_checkpoint

    def save_then_die(ppo_trainer, state, *args, **kwargs):
        if state.global_step == step:
            ppo_trainer.save_checkpoint = lambda path: os.kill(os.getpid(), signal.SIGKILL)
        return save(ppo_trainer, state, *args, **kwargs)

    grpo_module.save_checkpoint = save_then_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-after-save", type=int)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--tools", action="store_true")
    args = parser.parse_args()
    if args.kill_in_save:
        kill_inside_save(args.kill_in_save)
    if args.tools:
        from test_grpo_trainer_tools import environment_trainer

        trainer = environment_trainer(args.out, max_steps=5)
    else:
        trainer = grpo_helpers.trainer(args.out, model=args.model, reward_funcs=(grpo_helpers.count_good,
                                       grpo_helpers.length_reward), max_steps=5, save_strategy="steps", save_steps=1,
                                       beta=0.1)  # fmt: skip
    if args.kill_after_save:
        trainer.add_callback(KillAfterSave(args.kill_after_save))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    torch.save({"weights": grpo_helpers.weights(trainer), "log_history": trainer.state.log_history}, args.result)


if __name__ == "__main__":
    main()
