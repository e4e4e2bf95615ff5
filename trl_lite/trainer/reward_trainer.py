"""Classic import path (``trl.trainer.reward_trainer``); the reward trainer lives in :mod:`trl_lite.trainer.reward`."""

from .reward.reward_trainer import RewardTrainer  # noqa: F401
