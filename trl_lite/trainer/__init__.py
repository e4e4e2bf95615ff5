from .grpo import GRPOConfig, GRPOTrainer
from .kl_controllers import AdaptiveKLController, FixedKLController
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer
from .reward import RewardConfig, RewardDataCollatorWithPadding, RewardTrainer
from .running_moments import RunningMoments
from .step_inputs import NoDatasetWarning

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "GRPOConfig",
    "GRPOTrainer",
    "NoDatasetWarning",
    "PPOConfig",
    "PPOTrainer",
    "RewardConfig",
    "RewardDataCollatorWithPadding",
    "RewardTrainer",
    "RunningMoments",
]
