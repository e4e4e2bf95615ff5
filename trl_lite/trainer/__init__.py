from .kl_controllers import AdaptiveKLController, FixedKLController
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer
from .running_moments import RunningMoments

__all__ = ["AdaptiveKLController", "FixedKLController", "PPOConfig", "PPOTrainer", "RunningMoments"]
