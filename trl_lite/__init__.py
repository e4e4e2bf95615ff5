"""trl_lite: PPO for language models with the classic ``PPOTrainer.step()`` API."""

__version__ = "0.1.0"

from .core import LengthSampler, set_seed
from .environment import TextEnvironment, TextHistory
from .extras import BestOfNSampler, DynamicSampler
from .models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
    ValueModel,
    create_reference_model,
)
from .trainer import (
    AdaptiveKLController,
    FixedKLController,
    GRPOConfig,
    GRPOTrainer,
    NoDatasetWarning,
    PPOConfig,
    PPOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    RunningMoments,
)

__all__ = [
    "AdaptiveKLController",
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2SeqLMWithValueHead",
    "BestOfNSampler",
    "DynamicSampler",
    "FixedKLController",
    "GRPOConfig",
    "GRPOTrainer",
    "LengthSampler",
    "NoDatasetWarning",
    "PPOConfig",
    "PPOTrainer",
    "PreTrainedModelWrapper",
    "RewardConfig",
    "RewardTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "RunningMoments",
    "TextEnvironment",
    "TextHistory",
    "ValueModel",
    "create_reference_model",
    "set_seed",
]
