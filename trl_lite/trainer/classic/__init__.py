"""What classic code calls on ``PPOTrainer`` and ``step()`` does not use.

``batched_forward`` (``prepare_model_inputs`` and ``batched_forward_pass`` over the forward part) and
``helpers`` (the classic methods, one thin mixin of ``PPOTrainer``).

May import: the faces' input checks, ``step/``, ``memory/``, ``state/``, ``layout/`` and the packages outside
the trainer.
"""
