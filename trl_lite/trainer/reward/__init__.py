"""The reward-model trainer: pairwise (Bradley-Terry) training of a sequence-classification model."""

from .reward_config import RewardConfig
from .reward_data import RewardDataCollatorWithPadding
from .reward_trainer import RewardTrainer

__all__ = ["RewardConfig", "RewardDataCollatorWithPadding", "RewardTrainer"]
