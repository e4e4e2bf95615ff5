from .kl_controllers import AdaptiveKLController, FixedKLController
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer
from .reward import RewardConfig, RewardDataCollatorWithPadding, RewardTrainer
from .running_moments import RunningMoments

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "PPOConfig",
    "PPOTrainer",
    "RewardConfig",
    "RewardDataCollatorWithPadding",
    "RewardTrainer",
    "RunningMoments",
]
