"""What lives across steps and is checkpointed.

``checkpointing`` (the resumable checkpoint, written atomically), ``resumable_loader`` (a dataloader that
knows its position), ``ema`` (the policy's moving average), ``running_moments`` (score statistics),
``kl_controllers`` (the KL coefficient).

May import: ``layout/`` and the packages outside the trainer; never ``step/`` or the faces.
"""
