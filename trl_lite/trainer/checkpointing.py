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


class CheckpointMixin:
    """``save_checkpoint``/``load_checkpoint`` for a trainer with an ``accelerator`` (``PPOTrainer``, ``RewardTrainer``).

    Everything ``accelerator.prepare`` saw (models, optimizers, schedulers, registered objects) and
    every process's RNG states go through ``accelerator.save_state``; the trainer adds its own
    JSON-serialisable counters by defining ``_checkpoint_state() -> dict`` and
    ``_load_checkpoint_state(state)``, and each process's own tensors by defining
    ``_checkpoint_tensors() -> dict`` (empty when there are none) and ``_load_checkpoint_tensors(tensors)``.
    """

    def _checkpoint_tensors(self) -> dict:
        """Per-process tensors the trainer adds to a checkpoint (none by default)."""
        return {}

    def _load_checkpoint_tensors(self, tensors: dict) -> None:
        """Restore what :meth:`_checkpoint_tensors` saved (nothing by default)."""

    def save_checkpoint(self, path: str) -> None:
        """Save everything a run needs to continue exactly: what accelerate holds (weights, optimizer,
        scheduler, registered objects, every process's RNG) and the trainer's own counters (for
        ``PPOTrainer``: KL controller, score moments, step counter, dataloader position).

        The checkpoint is written to a sibling directory and renamed into place, so a run killed
        while saving leaves the previous checkpoint at ``path`` whole.
        """
        path = os.path.abspath(path)
        tmp = f"{path}.tmp"
        accelerator = self.accelerator
        if accelerator.is_main_process and os.path.exists(tmp):
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        accelerator.save_state(tmp, safe_serialization=True)
        tensors = self._checkpoint_tensors()
        if tensors:
            tensors = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}
            save_file(tensors, os.path.join(tmp, _TRAINER_TENSORS.format(rank=accelerator.process_index)))
        # Every process writes its own files into tmp (RNG states, DeepSpeed shards): all must be
        # done before the main process renames tmp into place.
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {**self._checkpoint_state(), "num_processes": accelerator.num_processes}
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

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` (same number of processes)."""
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
        self._load_checkpoint_state(state)
        tensors_file = os.path.join(path, _TRAINER_TENSORS.format(rank=self.accelerator.process_index))
        self._load_checkpoint_tensors(load_file(tensors_file) if os.path.exists(tensors_file) else {})
