"""The experience maker: from a checked batch to the :class:`~.experience.Experience` of one step.

``make(batch)`` runs docs/algorithm.md sections 14 and 2 (score shaping), 3 (forward passes of policy,
reference and critic, no grad), 15 (the log-prob gap to the generating engine and TIS weights), 4
(KL-shaped rewards) and 5 or 12 (GAE or the critic-free estimators, with whitening over all processes).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import core
from ...core import (
    compute_gae,
    compute_kl_rewards,
    discounted_returns,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    rloo_advantages,
    sequence_to_tokens,
    truncated_importance_weights,
)
from ...core.kept_sets import rows_of_sets
from ..layout.rows import actions_per_row, to_device
from ..memory.prefix_sharing import prompt_ids
from .experience import Experience, StepBatch, scores_tensor
from .forward import ForwardPass
from .rollout_plan import EVERY_PASS, RolloutPlan
from .timing import StepClock
from .transfer import batch_to_device


class ExperienceMaker:
    """Builds the :class:`Experience` of a step from the models' passes and the scores.

    Args:
        config: the trainer's :class:`PPOConfig` (read at every ``make``).
        accelerator: for reductions over processes (whitening).
        forward: the trainer's :class:`~.forward.ForwardPass`.
        policy: the prepared policy; ``reference``: a context-manager factory yielding the reference
            module; ``critic``: the prepared separate critic or None.
        kl_ctl: the KL controller (its ``value`` is read, never updated here).
        running: the running moments of the scores (updated with ``use_score_scaling``).
        eos_ids: the EOS ids of section 14 (empty when none is known).
        policy_values: whether the policy's value head gives the values (GAE without a separate critic).
        plan: the passes without grad that run (:class:`~.rollout_plan.RolloutPlan`; default both).
        sequence: the trainer's sequence-parallel part (:class:`~trl_lite.parallel.SequenceParallel`, whose group's
            rows are checked equal and counted once in whitening, or :class:`~trl_lite.parallel.NoSequenceParallel`).
    """

    def __init__(self, config, accelerator, forward: ForwardPass, policy, reference, critic, kl_ctl, running,
                 eos_ids: tuple[int, ...], policy_values: bool, plan: RolloutPlan = EVERY_PASS, *,
                 sequence):  # fmt: skip
        self.config = config
        self.accelerator = accelerator
        self.forward = forward
        self.policy = policy
        self.reference = reference
        self.critic = critic
        self.kl_ctl = kl_ctl
        self.running = running
        self.eos_ids = eos_ids
        self.policy_values = policy_values
        self.plan = plan
        self.sequence = sequence
        self.device = accelerator.device
        self.clock = StepClock(self.device)

    def make(self, batch: StepBatch) -> Experience:
        """One step's experience; see the module docstring for the sections it runs.

        Without the policy's pass (``plan.policy`` False) ``logprobs``, ``kls`` and the log-prob gap are
        left to :meth:`complete`, which takes the training forwards' log-probs.
        """
        config = self.config
        timings = {}
        if not self.plan.reference and self.kl_ctl.value != 0:
            raise ValueError(
                f"kl_ctl.value is {self.kl_ctl.value}, but this trainer runs no reference pass: it was built with "
                f"init_kl_coef=0 and compute_reference_kl=False. Build it with init_kl_coef={self.kl_ctl.value} "
                "(or compute_reference_kl=True) to train with a KL term."
            )

        # Sections 14 and 2: the rollout's penalties, then scaling and clipping
        lengths = to_device([len(r) for r in batch.responses], self.device)
        ends_with_eos = core.ends_with_stop(batch.responses, self.eos_ids) if self.eos_ids else None
        actions = batch.actions
        if actions is None:  # a batch that skipped step()'s checks: counted here, on the host before the copy
            actions = actions_per_row(batch.responses, batch.response_masks, 1 if self.forward.is_encoder_decoder else 0)
        # On the host, before the copy: for the shared layout and for an epoch shuffle by prompt.
        prompts = prompt_ids(batch.queries) if self.forward.prefix.looks else None
        # The batch's tensors reach the device in one copy (see transfer.py for every sync of a step).
        batch, ends_with_eos = batch_to_device(batch, self.device, ends_with_eos)
        # A sequence-parallel group trains one batch: checked before its first exchange.
        # Their kept sets too: every process replays the same sets (the group's records, gathered by generate()).
        self.sequence.check_same_rows(batch.queries, batch.responses, batch.response_masks, batch.ptx_inputs, batch.scores,
                                      rows_of_sets(batch.kept_sets))  # fmt: skip
        scores = self.shape_scores(scores_tensor(batch.scores, self.device), lengths, ends_with_eos)

        # Section 3: forward passes without grad, and section 15: the gap to the generating engine
        t = self.clock.mark()
        rows = self.forward.make_rows(batch.queries, batch.responses, batch.response_masks, prompts)
        rows = self.forward.replaying(rows, batch.kept_sets)  # truncated sampling: the sampler's sets (section 23)
        mask = rows.action_mask
        logprobs, ref_logprobs, values, full_kl = self.passes(rows)
        # Truncated sampling: the rows carry the rollout's kept sets to every training pass (docs/algorithm_rollouts.md section 23).
        rows, untruncated_entropy = self.forward.with_kept(rows)
        generation = self.generation_columns(batch.generation_logprobs, mask, rows.shift)
        gap_stats, token_weights = {}, None
        if logprobs is not None:
            gap_stats, token_weights = self.generation_gap(logprobs, generation, mask)
        if untruncated_entropy is not None:
            gap_stats["policy/entropy_untruncated"] = masked_mean(untruncated_entropy, mask)
        timings["time/ppo/forward_pass"] = (t, self.clock.mark())

        # Section 4: KL-shaped rewards; with kl_in_reward=False the KL goes to the loss (section 12)
        t = self.clock.mark()
        kl_coef = self.kl_ctl.value
        kls = None
        if logprobs is not None and ref_logprobs is not None:
            kls = kl_estimate(logprobs, ref_logprobs, config.kl_penalty, full_kl)
        kl_in_loss = not config.kl_in_reward_resolved
        # Without kls the plan guarantees the rewards' KL coefficient is 0 (checked above).
        reward_kls = kls if kls is not None else torch.zeros_like(mask)
        rewards, non_score_reward = compute_kl_rewards(scores, reward_kls, mask, 0.0 if kl_in_loss else kl_coef)
        timings["time/ppo/compute_rewards"] = (t, self.clock.mark())

        # Section 5 (GAE), or section 12 for the critic-free estimators
        t = self.clock.mark()
        if config.critic_free:
            advantages = self.critic_free_advantages(scores, rewards, non_score_reward, mask, batch.groups, batch.num_groups)
            values = returns = None
        else:
            values, advantages, returns = self.advantages(values, rewards, mask)
        timings["time/ppo/compute_advantages"] = (t, self.clock.mark())

        ptx = None
        if batch.ptx_inputs is not None:
            ptx = [seq.to(device=self.device, dtype=torch.long) for seq in batch.ptx_inputs]
        return Experience(
            rows=rows, scores=scores, ends_with_eos=ends_with_eos, groups=batch.groups, logprobs=logprobs,
            ref_logprobs=ref_logprobs, values=values, returns=returns, kls=kls, rewards=rewards,
            non_score_reward=non_score_reward, advantages=advantages, token_weights=token_weights,
            kl_coef=kl_coef, kl_in_loss=kl_in_loss, ptx=ptx, staleness=batch.staleness, generation=generation,
            gap_stats=gap_stats, timings=timings, num_groups=batch.num_groups, actions=tuple(actions),
            prompts=self.forward.prefix.epoch_prompts(rows, prompts),
        )  # fmt: skip

    def complete(self, experience: Experience, logprobs: torch.Tensor) -> Experience:
        """``experience`` made without the policy's pass, with ``logprobs (B, L)``: the log-probs of the
        learner's training forwards (detached), which are ``lp_old`` in that plan. Fills what reads
        ``lp_old`` outside the loss: the KL estimate (when the reference ran) and the log-prob gap
        statistics (section 15). The rewards and advantages did not depend on them."""
        mask = experience.action_mask
        logprobs = logprobs * mask
        kls = None
        if experience.ref_logprobs is not None:
            kls = kl_estimate(logprobs, experience.ref_logprobs, self.config.kl_penalty) * mask
        gap_stats, _ = self.generation_gap(logprobs, experience.generation, mask)
        return dataclasses.replace(experience, logprobs=logprobs, kls=kls, gap_stats=gap_stats)

    def passes(self, rows):
        """The policy's, reference's and critic's passes over ``rows`` without grad (section 3), those the
        plan runs: logprobs, ref_logprobs, values ``(B, L)`` (None where that pass did not run) and the exact
        KL ``(B, L)`` for ``kl_penalty="full"`` (else None)."""
        full_kl = self.config.kl_penalty == "full" and self.plan.policy and self.plan.reference
        return self.forward.rollout(
            rows, self.policy, self.reference, self.critic, self.policy_values, full_kl,
            policy_pass=self.plan.policy, reference_pass=self.plan.reference,
        )  # fmt: skip

    def shape_scores(self, scores: torch.Tensor, lengths: torch.Tensor, ends_with_eos) -> torch.Tensor:
        """Scores ``(B,)`` after the rollout's penalties (section 14), running-moment scaling and clipping (section 2)."""
        config = self.config
        scores = core.shape_scores(
            scores, lengths, ends_with_eos, config.missing_eos_penalty, config.max_response_length,
            config.overlong_buffer_len, config.overlong_penalty_factor,
        )  # fmt: skip
        if config.use_score_scaling:
            # On the device: the moments are read back only when asked for (a checkpoint, a user).
            mean, std = self.running.update_on_device(scores)
            scale = (std + self.running.eps).to(scores.dtype)
            scores = (scores - mean.to(scores.dtype)) / scale if config.use_score_norm else scores / scale
        if config.score_clip is not None:
            scores = scores.clamp(-config.score_clip, config.score_clip)
        return scores

    def advantages(self, values, rewards, mask):
        """Masked values, whitened GAE advantages and returns (section 5). Shapes ``(B, L)``."""
        if self.config.whiten_rewards:
            rewards = self.whiten(rewards, mask, shift_mean=False)
        advantages, returns = compute_gae(values, rewards, mask, self.config.gamma, self.config.lam)
        advantages = self.whiten(advantages, mask)
        return values * mask, advantages.detach(), returns.detach()

    def critic_free_advantages(self, scores, rewards, non_score_reward, mask, groups, num_groups=None):
        """Advantages ``(B, L)`` of the critic-free estimators (section 12).

        ``scores (B,)`` after shaping; ``rewards``, ``non_score_reward`` ``(B, L)`` (the latter zero
        when the KL is in the loss); ``groups (B,)`` group ids for 'rloo'/'grpo' on the scores' device,
        dense in ``[0, num_groups)`` (a host int; None: any ids, made dense on the device).
        """
        config = self.config
        if config.advantage_estimator == "reinforce_pp":
            if config.whiten_rewards:
                rewards = self.whiten(rewards, mask, shift_mean=False)
            return (self.whiten(discounted_returns(rewards, mask, config.gamma), mask) * mask).detach()
        sequence_rewards = scores + non_score_reward.sum(-1)
        if config.advantage_estimator == "rloo":
            sequence_advantages = rloo_advantages(sequence_rewards, groups, num_groups)
        else:
            by_batch = config.grpo_scale_rewards and config.grpo_std_scope == "batch"
            sequence_advantages = grpo_advantages(sequence_rewards, groups, config.grpo_scale_rewards and not by_batch,
                                                  config.grpo_std_eps, num_groups=num_groups)  # fmt: skip
            if by_batch:  # TRL's scale_rewards="batch": the group-centred rewards over the batch's std
                sequence_advantages = sequence_advantages / (self.batch_std(sequence_rewards) + config.grpo_std_eps)
        return sequence_to_tokens(sequence_advantages, mask).detach()

    def generation_columns(self, generation_logprobs, mask, shift: int) -> torch.Tensor | None:
        """The engine's per-row log-probs (section 15) in the compact layout ``(B, L)``, zero outside ``mask``;
        None without them."""
        if generation_logprobs is None:
            return None
        width = mask.shape[1]
        padded = torch.nn.utils.rnn.pad_sequence(
            [lp.to(device=mask.device, dtype=torch.float32) for lp in generation_logprobs], batch_first=True
        )
        # Compact column k predicts response token k + shift.
        gen = torch.nn.functional.pad(padded[:, shift:], (0, max(width - padded.shape[1] + shift, 0)))[:, :width]
        return gen * mask

    @torch.no_grad()
    def generation_gap(self, logprobs, generation, mask) -> tuple[dict, torch.Tensor | None]:
        """The log-prob gap to the generating engine and the TIS weights (section 15).

        ``logprobs``, ``mask`` ``(B, L)``: ``lp_old``; ``generation``: ``lp_gen`` ``(B, L)`` from
        :meth:`generation_columns`, or None (then no statistic and no weights). Returns the
        ``rollout/*`` statistics and, with ``importance_sampling_correction="tis"``, the weights
        ``min(exp(lp_old - lp_gen), cap)`` ``(B, L)`` (else None).
        """
        config = self.config
        if generation is None:
            return {}, None
        gap = (logprobs - generation).abs() * mask
        stats = {"rollout/logprob_diff/mean": masked_mean(gap, mask), "rollout/logprob_diff/max": gap.max()}
        if config.importance_sampling_correction != "tis":
            return stats, None
        weights = truncated_importance_weights(logprobs, generation, mask, config.importance_sampling_cap)
        stats["rollout/is_weight/mean"] = masked_mean(weights, mask)
        return stats, weights

    def batch_std(self, values):
        """The unbiased std of the non-NaN ``values (B,)`` of every process (a NaN is an unscored row)."""
        scored = ~torch.isnan(values)
        present = torch.where(scored, values, torch.zeros_like(values))
        accelerator, share = self.accelerator, self.sequence.row_share
        sums = torch.stack([present.sum(), scored.sum().to(values.dtype)])
        if accelerator.num_processes > 1:  # a sequence-parallel group's processes hold the same rows: shares
            sums = accelerator.reduce(sums * share, reduction="sum")
        mean = sums[0] / sums[1]
        squares = torch.where(scored, values - mean, torch.zeros_like(values)).pow(2).sum().reshape(1)
        if accelerator.num_processes > 1:
            squares = accelerator.reduce(squares * share, reduction="sum")
        return (squares[0] / (sums[1] - 1)).sqrt()

    def whiten(self, values, mask, shift_mean=True):
        """``masked_whiten`` with the statistics of the action tokens of every process. Shape ``(B, L)``.

        Whitening over all processes makes a step on N processes x B rows equal to one on N*B rows.
        """
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return masked_whiten(values, mask, shift_mean)
        # The processes of a sequence-parallel group hold the same rows: each adds its share, so every row counts once.
        share = self.sequence.row_share
        sums = accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]) * share, reduction="sum")
        mean, count = sums[0] / sums[1], sums[1]
        squares = accelerator.reduce((((values - mean) ** 2) * mask).sum().reshape(1) * share, reduction="sum")[0]
        whitened = (values - mean) * torch.rsqrt(squares / (count - 1).clamp(min=1) + 1e-8)
        return whitened if shift_mean else whitened + mean
