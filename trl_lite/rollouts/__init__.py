"""Rollouts produced beside the training loop: :class:`AsyncRollouts` generates the next batches while
``step()`` trains on this one, each batch tagged with the policy version that generated it."""

from .async_rollouts import AsyncRollouts, RolloutGenerate

__all__ = ["AsyncRollouts", "RolloutGenerate"]
