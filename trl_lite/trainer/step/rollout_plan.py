"""Which passes without grad a step runs (docs/algorithm.md section 3), decided once from the config.

A pass whose result cannot change the step is not run:

- the **reference pass** (and the frozen reference copy it needs) when the KL coefficient is fixed at 0
  (``init_kl_coef == 0``: the adaptive controller multiplies the coefficient, so from 0 it stays 0),
  unless ``compute_reference_kl`` asks for the KL statistics anyway;
- the **policy's pass** when the step is on-policy: a critic-free estimator (no values), no KL in the
  rewards (in the loss, or at 0) and exactly one optimizer step per ``step()`` (``ppo_epochs == 1`` and
  the backward batch is the whole batch). Before that one step the policy is still the one whose
  log-probs the pass would give, so ``lp_old`` is each training forward's log-prob, detached.

:class:`RolloutPlan` holds the decision; the trainer, the experience maker and the learner read the
same object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutPlan:
    """The passes without grad of each ``step()``.

    ``reference``: the reference's pass runs (and ``PPOTrainer(ref_model=None)`` builds a frozen copy
    of a non-PEFT policy); without it the KL statistics are NaN ("not measured").
    ``policy``: the policy's pass runs, giving ``lp_old`` (and the values of GAE); without it ``lp_old``
    is each training forward's log-prob, detached.
    """

    reference: bool = True
    policy: bool = True

    @classmethod
    def from_config(cls, config) -> RolloutPlan:
        """The passes ``config`` (a validated :class:`~.ppo_config.PPOConfig`) needs."""
        kl_at_zero = kl_fixed_at_zero(config)
        reference = config.compute_reference_kl or not kl_at_zero
        kl_in_rewards = config.kl_in_reward_resolved and not kl_at_zero
        # The exact KL of kl_penalty="full" needs the policy's logits next to the reference's.
        full_kl = reference and config.kl_penalty == "full"
        on_policy = config.critic_free and not kl_in_rewards and one_update_per_step(config) and not full_kl
        return cls(reference=reference, policy=not on_policy)

    @property
    def passes(self) -> int:
        """Models run without grad over the batch in each ``step()``: 0, 1 or 2."""
        return int(self.reference) + int(self.policy)


# Today's path, every pass run whatever the config: for comparisons (tests, benchmarks/bench_step.py).
EVERY_PASS = RolloutPlan(reference=True, policy=True)


def kl_fixed_at_zero(config) -> bool:
    """Whether the KL coefficient is 0 for the whole run: ``init_kl_coef == 0`` (the fixed controller never
    moves it; the adaptive one multiplies it by ``1 + e * n / horizon``, docs/algorithm.md section 7)."""
    return config.init_kl_coef == 0


def one_update_per_step(config) -> bool:
    """Whether ``step()`` makes exactly one optimizer step: one epoch over one backward batch."""
    return config.ppo_epochs == 1 and config.mini_batch_size * config.gradient_accumulation_steps == config.batch_size
