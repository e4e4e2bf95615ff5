"""TRL 1.x's GRPO API on trl_lite's parts: ``GRPOConfig`` and ``GRPOTrainer(...).train()`` (docs/migrating_from_trl.md)."""

from .grpo_config import GRPOConfig
from .grpo_trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
