"""The reward-model trainer: pairwise (Bradley-Terry) training of a sequence-classification model.

A face beside ``PPOTrainer``: may import the faces' set-up and checks, ``state/``, ``layout/`` and the
packages outside the trainer.
"""

from .reward_config import RewardConfig
from .reward_data import RewardDataCollatorWithPadding
from .reward_trainer import RewardTrainer

__all__ = ["RewardConfig", "RewardDataCollatorWithPadding", "RewardTrainer"]
