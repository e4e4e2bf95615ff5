"""Classic import path (``trl.trainer.reward_config``); the reward config lives in :mod:`trl_lite.trainer.reward`."""

from .reward.reward_config import RewardConfig  # noqa: F401
