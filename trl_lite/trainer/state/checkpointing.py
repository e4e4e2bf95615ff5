"""Checkpoint and exact resume: accelerate's saved state plus the trainer's own counters, written
atomically (to a sibling directory, then renamed into place)."""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import load_file, save_file

_TRAINER_STATE = "trl_lite_trainer_state.json"
# Tensors the trainer keeps outside accelerate's objects (the policy's EMA), one file per process.
_TRAINER_TENSORS = "trl_lite_trainer_tensors_{rank}.safetensors"


class Checkpointer:
    """Writes and reads checkpoints for a trainer with an ``accelerator`` (``PPOTrainer``, ``RewardTrainer``).

    Everything ``accelerator.prepare`` saw (models, optimizers, schedulers, registered objects) and
    every process's RNG states go through ``accelerator.save_state``; the trainer hands over its own
    JSON-serialisable counters (written by the main process) and each process's own tensors (the
    policy's EMA), and gets them back from :meth:`load`. ``parts``: the trainer's parts that keep state of
    their own, by name - each offers ``state_dict()`` (JSON-serialisable, the same on every process) and
    ``load_state_dict(state)``, and is saved beside the counters under its name and restored by :meth:`load`
    (``{"memory": MemoryBackoff}`` for ``PPOTrainer``: a resumed run starts with the token budget its
    out-of-memory failures left).
    """

    def __init__(self, accelerator, parts: dict | None = None):
        self.accelerator = accelerator
        self.parts = dict(parts or {})

    def save(self, path: str, state: dict, tensors: dict | None = None) -> None:
        """Save what accelerate holds, the trainer's ``state`` (JSON) and this process's ``tensors``.

        The checkpoint is written to a sibling directory and renamed into place, so a run killed
        while saving leaves the previous checkpoint at ``path`` whole. Every process must call this.
        """
        path = os.path.abspath(path)
        tmp = f"{path}.tmp"
        accelerator = self.accelerator
        if accelerator.is_main_process and os.path.exists(tmp):
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        accelerator.save_state(tmp, safe_serialization=True)
        if tensors:
            tensors = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}
            save_file(tensors, os.path.join(tmp, _TRAINER_TENSORS.format(rank=accelerator.process_index)))
        # Every process writes its own files into tmp (RNG states, DeepSpeed shards): all must be
        # done before the main process renames tmp into place.
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {**state, "num_processes": accelerator.num_processes}
            for name, part in self.parts.items():
                state[name] = part.state_dict()
            with open(os.path.join(tmp, _TRAINER_STATE), "w") as f:
                json.dump(state, f)
            old = f"{path}.old"
            if os.path.exists(path):
                if os.path.exists(old):
                    shutil.rmtree(old)
                os.rename(path, old)
            os.rename(tmp, path)
            if os.path.exists(old):
                shutil.rmtree(old)
        accelerator.wait_for_everyone()

    def load(self, path: str) -> tuple[dict, dict]:
        """Restore what accelerate holds from a checkpoint written by :meth:`save` (same number of
        processes); return the trainer's ``state`` and this process's ``tensors`` (empty when none)."""
        path = os.path.abspath(path)
        if not os.path.exists(os.path.join(path, _TRAINER_STATE)) and os.path.exists(
            os.path.join(f"{path}.old", _TRAINER_STATE)
        ):
            # A save was killed between its two renames: the previous checkpoint is whole under .old.
            path = f"{path}.old"
        state_file = os.path.join(path, _TRAINER_STATE)
        if not os.path.exists(state_file):
            raise ValueError(f"path={path!r} is not a trl_lite checkpoint (no {_TRAINER_STATE} in it).")
        with open(state_file) as f:
            state = json.load(f)
        if state["num_processes"] != self.accelerator.num_processes:
            raise ValueError(
                f"the checkpoint at {path!r} was written by {state['num_processes']} processes; "
                f"this run has {self.accelerator.num_processes}. Resume with the same number of processes."
            )
        self.accelerator.load_state(path)
        for name, part in self.parts.items():
            if name in state:  # a checkpoint from before the part existed (the back-off's) has none
                part.load_state_dict(state[name])
        tensors_file = os.path.join(path, _TRAINER_TENSORS.format(rank=self.accelerator.process_index))
        return state, (load_file(tensors_file) if os.path.exists(tensors_file) else {})
