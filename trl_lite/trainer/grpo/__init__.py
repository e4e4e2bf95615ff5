"""TRL 1.x's GRPO API on trl_lite's parts: ``GRPOConfig`` and ``GRPOTrainer(...).train()`` (docs/migrating_from_trl.md).

A face (layer 0): it may import the other faces (``PPOTrainer``, ``PPOConfig``, ``accelerate_setup``), the rooms
below and the packages outside the trainer; nothing imports it but ``trl_lite.trainer``.

- ``grpo_config.py`` - ``GRPOConfig``: TRL 1.x's fields and defaults, a ``TrainingArguments``;
- ``config_mapping.py`` - the one mapping: honoured and refused fields, TRL's batch sizes, the ``PPOConfig``;
- ``prompts.py`` - which rows each generation takes, prompt ids (text or chat template);
- ``rewards.py`` - the reward functions and models, checked, with TRL's ``None`` rule;
- ``rollout.py`` - one generation: completions, rewards, ``step()``'s inputs, TRL's metrics;
- ``agents.py`` - TRL's ``tools`` / ``environment_factory``: multi-turn completions by ``agents.run_episodes``;
- ``checkpoints.py`` - ``checkpoint-N`` folders for exact resume;
- ``grpo_trainer.py`` - ``GRPOTrainer``: the loop, callbacks, logs, ``evaluate``, ``save_model``;
- ``rloo_config.py`` - ``RLOOConfig`` (TRL 1.x's names and defaults) and its one mapping onto the GRPO parts;
- ``rloo_trainer.py`` - ``RLOOTrainer``: ``GRPOTrainer`` with RLOO's config, mapping and ``kl`` metric.
"""

from .grpo_config import GRPOConfig
from .grpo_trainer import GRPOTrainer
from .rloo_config import RLOOConfig
from .rloo_trainer import RLOOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer"]
