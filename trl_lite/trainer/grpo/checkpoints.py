"""GRPOTrainer's checkpoints: ``output_dir/checkpoint-N`` with a model ``from_pretrained`` loads, transformers'
``trainer_state.json``, and under ``trl_lite_state/`` everything an exact resume needs (``PPOTrainer``'s
checkpoint: weights, optimizer, scheduler, every process's RNG, counters; plus the loop's own state).

A checkpoint is written to ``checkpoint-N.tmp`` and renamed into place, so a run killed while saving leaves no
``checkpoint-N`` (only whole checkpoints are resumed from); ``save_total_limit`` keeps the newest ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from transformers.trainer_callback import TrainerState

PREFIX = "checkpoint"
STATE_SUBFOLDER = "trl_lite_state"
LOOP_STATE = "grpo_loop_state.json"
TRAINER_STATE = "trainer_state.json"


def checkpoints_in(output_dir: str) -> list[str]:
    """The whole checkpoints in ``output_dir`` (those with a trainer state), oldest (lowest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(rf"{PREFIX}-(\d+)", name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, TRAINER_STATE)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_checkpoint(resume_from_checkpoint, output_dir: str) -> str | None:
    """``train(resume_from_checkpoint=...)``: None/False -> None; True -> the newest checkpoint of ``output_dir``
    (``ValueError`` when there is none); a path -> that path (``ValueError`` when it is no checkpoint)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        found = checkpoints_in(output_dir)
        if not found:
            raise ValueError(f"resume_from_checkpoint=True but output_dir={output_dir!r} holds no valid checkpoint.")
        return found[-1]
    path = str(resume_from_checkpoint)
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        raise ValueError(f"resume_from_checkpoint={path!r} is not a GRPOTrainer checkpoint (no {TRAINER_STATE} in it).")
    return path


def save_checkpoint(ppo_trainer, state: TrainerState, loop_state: dict, output_dir: str, save_total_limit) -> str:
    """Write ``output_dir/checkpoint-<global_step>`` (every process must call this); return its path."""
    accelerator = ppo_trainer.accelerator
    path = os.path.join(output_dir, f"{PREFIX}-{state.global_step}")
    tmp = f"{path}.tmp"
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    ppo_trainer.save_pretrained(tmp)
    ppo_trainer.save_checkpoint(os.path.join(tmp, STATE_SUBFOLDER))
    if accelerator.is_main_process:
        state.save_to_json(os.path.join(tmp, TRAINER_STATE))
        with open(os.path.join(tmp, STATE_SUBFOLDER, LOOP_STATE), "w") as f:
            json.dump(loop_state, f)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
        if save_total_limit is not None and save_total_limit > 0:
            for old in checkpoints_in(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(ppo_trainer, path: str) -> tuple[TrainerState, dict]:
    """Restore ``ppo_trainer`` from ``path``; return the saved ``TrainerState`` and the loop's state."""
    ppo_trainer.load_checkpoint(os.path.join(path, STATE_SUBFOLDER))
    with open(os.path.join(path, STATE_SUBFOLDER, LOOP_STATE)) as f:
        loop_state = json.load(f)
    return TrainerState.load_from_json(os.path.join(path, TRAINER_STATE)), loop_state
