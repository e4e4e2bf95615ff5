"""What orchestrates PPO: the faces users call, over rooms by concern.

Faces (this folder): ``ppo_trainer`` (``PPOTrainer``, a facade: check inputs -> make the experience -> train on
it -> statistics -> KL controller), ``ppo_config`` with ``config_checks``, ``step_inputs`` (checks of what users
hand in), ``accelerate_setup`` (processes, devices, DeepSpeed), and the classic paths ``reward_config`` /
``reward_trainer``. Trainers of their own beside it: ``reward/``, ``grpo/`` (TRL 1.x's ``GRPOTrainer`` over ``PPOTrainer``); classic glue: ``classic/``.
Rooms below, imported downward only (``tests/test_layout.py``): ``step/`` (the data path of one step) ->
``memory/`` (what bounds a pass's memory) and ``state/`` (what lives across steps) -> ``layout/`` (the rows'
per-token layout) -> the packages outside the trainer (``core``, ``models``, ``engines``, ``parallel``).
"""

from .grpo import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer
from .reward import RewardConfig, RewardDataCollatorWithPadding, RewardTrainer
from .state.kl_controllers import AdaptiveKLController, FixedKLController
from .state.running_moments import RunningMoments
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
    "RLOOConfig",
    "RLOOTrainer",
    "RunningMoments",
]
