from .kl_controllers import AdaptiveKLController, FixedKLController
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer
from .reward_config import RewardConfig
from .reward_data import RewardDataCollatorWithPadding
from .reward_trainer import RewardTrainer
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
