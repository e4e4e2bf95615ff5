"""What the producer thread generates with: the engine at one known policy version.

- ``max_staleness=0`` (:class:`LiveGeneration`): the producer only runs while the trainer's thread
  waits in ``next()``, so no ``step()`` runs meanwhile and it generates through ``trainer.generate``
  itself - the synchronous loop moved to another thread, with its weight pushes and timings.
- ``max_staleness > 0`` (:class:`SnapshotGeneration`): ``step()`` changes the policy while the producer
  generates, so the producer never reads the live weights. Between two steps the trainer's thread
  copies them (a :class:`PolicySnapshot`, taken in ``next()``); the producer pushes a snapshot before
  its first generate on it: into the vLLM engine (colocated or server), which holds its own copy of the
  weights anyway, or, for the transformers engine (which runs the trained model itself), into a
  separate copy of the policy that only the producer generates with.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..engines import TransformersEngine, named_policy_weights
from ..engines.generation import RolloutGeneration

__all__ = ["LiveGeneration", "PolicySnapshot", "SnapshotGeneration"]


@dataclass(frozen=True)
class PolicySnapshot:
    """The policy after ``version`` completed ``step()`` calls.

    ``weights``: ``(name, tensor)`` copies with transformers' names (merged for PEFT), never modified
    once taken; None when the producer generates with the live policy (``max_staleness=0``).
    """

    version: int
    weights: list[tuple[str, torch.Tensor]] | None = None


class LiveGeneration:
    """``max_staleness=0``: ``trainer.generate`` on the live policy; call it only while no ``step()`` runs."""

    def __init__(self, trainer):
        self._trainer = trainer
        self.rollout_generation = trainer.generation
        self.snapshot_in_use = self.snapshot()

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(self._trainer.current_step)

    def use(self, snapshot: PolicySnapshot) -> None:
        """Only recorded: the live weights are the snapshot's while the trainer waits."""
        self.snapshot_in_use = snapshot

    def generate(self, *args, **kwargs):
        return self._trainer.generate(*args, **kwargs)

    def paused(self):
        return nullcontext()

    def close(self) -> None:
        """Nothing to release."""


class _PushCounter:
    """The version :class:`RolloutGeneration` compares with what its engine holds: bumped whenever the
    engine must take the producer's current snapshot again (a new snapshot, or the engine was used by
    ``trainer.generate`` meanwhile)."""

    def __init__(self):
        self.version = 0

    def bump(self) -> None:
        self.version += 1


class PolicyCopyEngine(TransformersEngine):
    """transformers ``generate`` on a copy of the policy, which takes the pushed weights.

    ``model``: a plain transformers model of the policy's architecture, used by nothing else. A push
    makes the snapshot's tensors the model's parameters (no copy: snapshots are never modified). It
    samples as ``engine`` does (the run's sampling) and takes log-probs at its temperature.
    """

    needs_weight_sync = True

    def __init__(self, engine: TransformersEngine, model: torch.nn.Module):
        super().__init__(lambda: nullcontext(model), engine.accelerator, engine.tokenizer, engine.pad_token_id,
                         engine.is_encoder_decoder, is_zero3=False, sampling=engine.sampling)  # fmt: skip
        self.model = model

    def load_weights(self, named_tensors) -> None:
        self.model.load_state_dict(dict(named_tensors), strict=True, assign=True)

    def close(self) -> None:
        self.model = None


def policy_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A fresh model of ``policy``'s architecture (its base model for PEFT), on its device, in eval mode.

    Its weights come with the first push; its parameters are replaced, not written, by every push.
    """
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    parameter = next(base.parameters())
    model = type(base)(copy.deepcopy(base.config))
    model.generation_config = copy.deepcopy(base.generation_config)
    return model.to(device=parameter.device, dtype=parameter.dtype).eval().requires_grad_(False)


class SnapshotGeneration:
    """``max_staleness > 0``: generation on the weights of the snapshot :meth:`use` names.

    The vLLM engine of ``trainer.generation`` (it holds its own weights; the producer pushes snapshots
    into it) or, for the transformers engine, a :class:`PolicyCopyEngine`. Pushes are lazy (before the
    first generate on a new snapshot) and timed as ``rollout/weight_sync``, generation as
    ``rollout/generate``, both in the trainer's timer.
    """

    def __init__(self, trainer):
        generation = trainer.generation
        self._trainer = trainer
        self._counter = _PushCounter()
        self.shares_trainer_engine = generation.engine.needs_weight_sync
        if self.shares_trainer_engine:
            engine, self._policy_weights = generation.engine, generation.policy_weights
        else:
            policy = trainer.accelerator.unwrap_model(trainer.model).pretrained_model
            engine = PolicyCopyEngine(generation.engine, policy_copy(policy))
            self._policy_weights = lambda: named_policy_weights(policy)
        self.snapshot_in_use = self.snapshot()
        # The generation part of the producer's engine; built last: it pushes the first snapshot now.
        self.rollout_generation = RolloutGeneration(
            engine, generation.reference_engine, generation.timer,
            policy_weights=lambda: iter(self.snapshot_in_use.weights), version=self._counter,
        )  # fmt: skip

    @torch.no_grad()  # merged LoRA weights are computed for the copy, not for a backward pass
    def snapshot(self) -> PolicySnapshot:
        """Copy the policy's weights now; call it on the trainer's thread, between two ``step()`` calls."""
        with self._trainer.timed("rollout/weight_snapshot"):
            weights = [(name, tensor.clone()) for name, tensor in self._policy_weights()]
        return PolicySnapshot(self._trainer.current_step, weights)

    def use(self, snapshot: PolicySnapshot) -> None:
        """Generate on ``snapshot`` from now on (pushed before the next generate)."""
        if snapshot is not self.snapshot_in_use:
            self.snapshot_in_use = snapshot
            self._counter.bump()

    def generate(self, query_tensor, length_sampler=None, batch_size: int = 4, return_prompt: bool = True,
                 generate_ref_response: bool = False, remove_padding: bool = True, return_logprobs: bool = False,
                 **generation_kwargs):  # fmt: skip
        if generate_ref_response:
            raise ValueError(
                "generate_ref_response=True is not available with max_staleness > 0: the reference generates on "
                "the trainer's own models, which step() uses meanwhile. Generate reference responses with "
                "max_staleness=0 or outside the asynchronous run."
            )
        return self.rollout_generation.generate(
            query_tensor, length_sampler, batch_size, return_prompt, False, remove_padding, return_logprobs,
            **generation_kwargs,
        )  # fmt: skip

    @contextmanager
    def paused(self):
        """Around ``trainer.generate`` calls while the producer is held: the shared engine then holds the
        live policy (pushed by the trainer's own generation), and the producer's snapshot afterwards."""
        if not self.shares_trainer_engine:
            yield
            return
        self._trainer.generation.weights_changed()
        try:
            yield
        finally:
            self._counter.bump()

    def close(self) -> None:
        """Release the copy (transformers), or mark the shared engine's weights as not the policy's, so
        that the trainer's next ``generate`` pushes them."""
        if self.shares_trainer_engine:
            self._trainer.generation.weights_changed()
        else:
            self.rollout_generation.engine.close()
        self.snapshot_in_use = None
