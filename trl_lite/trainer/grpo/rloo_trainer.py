"""``RLOOTrainer``: TRL 1.x's RLOO trainer, ``RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), ...).train()``.

The GRPO trainer's loop and parts (prompts, reward functions, rollout, checkpoints, callbacks, logs) with
:mod:`.rloo_config`'s mapping: the leave-one-out advantage of each completion's reward minus ``beta`` times its
summed k1 KL to the reference (TRL's KL in the reward). What differs from GRPO in the logs is ``kl``: TRL's
RLOO reports the mean per-token ``lp_old - lp_ref`` of the generation, not the loss's k3 estimate.
"""

from __future__ import annotations

from .grpo_trainer import GRPOTrainer
from .rloo_config import RLOOConfig, to_ppo_config


class RLOOTrainer(GRPOTrainer):
    """TRL 1.x's ``RLOOTrainer``: the constructor, ``train()``, ``evaluate()`` and ``save_model()`` of
    :class:`GRPOTrainer`, with ``args`` an :class:`RLOOConfig` (None: ``RLOOConfig(output_dir="<model name>-RLOO")``)."""

    config_class, algorithm = RLOOConfig, "RLOO"
    to_ppo_config = staticmethod(to_ppo_config)

    def __init__(self, model, reward_funcs, args: RLOOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):  # fmt: skip
        """TRL's RLOO signature: GRPO's without ``tools``, ``rollout_func`` and ``environment_factory``."""
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config)  # fmt: skip

    def _kl(self, stats: dict) -> float:
        """TRL's RLOO ``kl``: the mean per-token ``lp_old - lp_ref`` over the completions' tokens, which is the
        step's mean per-token KL penalty ``-beta * kl`` divided by ``-beta``."""
        return float(stats["ppo/mean_non_score_reward"]) / -self.args.beta
