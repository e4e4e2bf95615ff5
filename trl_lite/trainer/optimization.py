"""The PPO epochs of ``step()``: shuffled mini-batches, the losses of PPO_SPEC sections 6 and 13
(the policy's through the trainer's :class:`~trl_lite.trainer.objective.PolicyObjective`), guarded
backward passes and early stopping. :class:`~trl_lite.trainer.PPOTrainer` mixes it in.
"""

from __future__ import annotations

import warnings

import torch

from ..core import (
    entropy_from_logits,
    importance_ratio,
    logprobs_and_entropy_from_hidden,
    logprobs_and_entropy_from_logits,
    masked_mean,
    masked_var,
    ppo_value_loss,
)
from .rollout import _to_compact

_POLICY_STAT_KEYS = (
    "loss/policy", "loss/total", "policy/entropy", "policy/approxkl", "policy/policykl",
    "policy/clipfrac", "policy/clipfrac_low", "policy/clipfrac_high", "policy/dual_clipfrac",
    "policy/advantages_mean", "policy/ratio",
)  # fmt: skip
_VALUE_STAT_KEYS = (
    "loss/value", "returns/mean", "returns/var", "val/vpred", "val/error", "val/clipfrac", "val/mean", "val/var",
)  # fmt: skip


class OptimizationMixin:
    """``ppo_epochs`` of mini-batch updates over the rows of one step.

    Uses the trainer's ``config``, ``accelerator``, ``model``, ``critic``, ``optimizer``, the
    forward passes of :class:`~trl_lite.trainer.rollout.RolloutMixin` and the backward and loss
    split of :class:`~trl_lite.trainer.actor_critic.ActorCriticMixin`.
    """

    def _optimize(
        self, rows, old_logprobs, old_values, advantages, returns, ref_logprobs=None, kl_coef=0.0, ptx=None,
        token_weights=None,
    ) -> dict:
        """``ppo_epochs`` epochs of shuffled mini-batches (PPO_SPEC section 6). Returns averaged statistics.

        ``old_values``/``returns`` are None for critic-free estimators; ``ref_logprobs`` is given
        when the KL term is in the loss (``kl_coef * k3``, PPO_SPEC section 12); ``ptx``: the PTX
        rows (PPO_SPEC section 10) or None; ``token_weights`` ``(B, L)``: the TIS weights of the
        policy loss (PPO_SPEC section 15) or None.
        """
        config = self.config
        batch = len(rows)
        minibatch_stats, ratios = [], []
        skipped_before = self.skipped_minibatches
        self.model.train()
        if self.critic is not None:
            self.critic.train()
        for _ in range(config.ppo_epochs):
            order = torch.randperm(batch).to(self.current_device)
            epoch_policykl = []
            tokens = self._tokens_per_minibatch(rows, order)
            for i, idx in enumerate(order.split(config.mini_batch_size)):
                w = self._width(rows, idx)
                old, old_v, adv, ret, ref, weights = (
                    None if x is None else x[idx, :w]
                    for x in (old_logprobs, old_values, advantages, returns, ref_logprobs, token_weights)
                )
                n_tokens = None if tokens is None else tokens[i // config.gradient_accumulation_steps]
                stats, ratio = self._train_rows(rows, idx, old, old_v, adv, ret, ref, kl_coef, ptx, weights, n_tokens)
                if stats is not None:
                    minibatch_stats.append(stats)
                    ratios.append(ratio)
                    epoch_policykl.append(stats["policy/policykl"])
            if config.early_stopping and self._should_stop(epoch_policykl):
                break
        if minibatch_stats:
            stacked = {k: torch.stack([s[k] for s in minibatch_stats]).mean() for k in minibatch_stats[0]}
        else:
            keys = self._train_stat_keys(ref_logprobs is not None) + (("loss/ptx",) if ptx is not None else ())
            stacked = {k: torch.tensor(float("nan")) for k in keys}
        stats = {f"ppo/{k}": v for k, v in stacked.items()}
        stats["ppo/policy/ratio"] = torch.cat(ratios) if ratios else torch.zeros(0)
        stats["ppo/skipped_minibatches"] = torch.tensor(float(self.skipped_minibatches - skipped_before))
        return stats

    def _tokens_per_minibatch(self, rows, order: torch.Tensor) -> torch.Tensor | None:
        """For ``global_token_mean``: per backward batch of this epoch's ``order``, the action tokens of
        that backward batch on all processes divided by the mini-batches averaged into its update
        (gradient accumulation steps x processes); None for the other loss types. One collective per epoch.

        accelerate divides each mini-batch's loss by the accumulation steps and DDP (or DeepSpeed)
        averages gradients over processes, so dividing each mini-batch's token sum by this number makes
        the update ``sum M l / N`` over the whole backward batch, whatever its split.
        """
        if not self._objective.needs_global_token_count:
            return None
        config = self.config
        counts = torch.stack([rows.action_mask[idx].sum() for idx in order.split(config.backward_batch_size)])
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        return counts / (config.gradient_accumulation_steps * self.accelerator.num_processes)

    def _should_stop(self, epoch_policykl: list) -> bool:
        """Early stopping: the epoch's mean policykl over all processes above 1.5 * target_kl."""
        if not epoch_policykl:
            return False
        policykl = torch.stack(epoch_policykl).mean().reshape(1)
        policykl = self.accelerator.reduce(policykl, reduction="mean")
        return bool(policykl.item() > 1.5 * self.config.target_kl)

    def _train_stat_keys(self, kl_in_loss: bool) -> tuple:
        """Names (without ``ppo/``) of the mini-batch statistics of this run."""
        keys = _POLICY_STAT_KEYS + (() if self.config.critic_free else _VALUE_STAT_KEYS)
        keys += ("policy/entropy_loss",) if self.config.entropy_coef else ()
        return keys + (("policy/kl_loss",) if kl_in_loss else ())

    def _train_rows(
        self, rows, idx, old_logprobs, old_values, advantages, returns, ref_logprobs=None, kl_coef=0.0, ptx=None,
        token_weights=None, tokens_per_minibatch=None,
    ):
        """One mini-batch: forward with grad, losses, guarded backward and optimizer step(s).

        Returns its statistics (None when skipped) and the masked per-token ratios the loss used.
        """
        mask = rows.action_mask[idx, : old_logprobs.shape[1]]
        with self.accelerator.accumulate(*self._trained_models()):
            head = self._linear_head(self.model)
            outputs, targets, vpreds, slots, width = self._head_rows(
                self.model, rows, idx, head is not None, return_values=self._uses_value_head, critic=self.critic
            )
            if head is None:
                logprobs, entropy = logprobs_and_entropy_from_logits(outputs, targets)
            else:
                logprobs, entropy = logprobs_and_entropy_from_hidden(
                    outputs, head.weight, head.bias, targets, rows.buffer_rows, self._logits_out(rows, head)
                )
            del outputs  # the logits, when the head ran in the model: the saved softmax replaces them
            logprobs = _to_compact(logprobs, slots, len(idx), width)
            entropy = _to_compact(entropy, slots, len(idx), width)
            pg_loss, vf_loss, stats = self.loss(
                old_logprobs, old_values, None, vpreds, logprobs, mask, advantages, returns, entropy=entropy,
                ref_logprobs=ref_logprobs, kl_coef=kl_coef, token_weights=token_weights,
                tokens_per_minibatch=tokens_per_minibatch,
            )
            policy_loss, critic_loss = self._split_losses(pg_loss, vf_loss, stats, ptx, idx)
            reason = self._skip_reason(stats["loss/total"], stats["policy/ratio"], mask)
            if reason is not None:
                self._skip(reason)
                if self.accelerator.sync_gradients:
                    self._zero_grad()
                return None, None
            if not self._backward_and_step(policy_loss, critic_loss):
                return None, None
        with torch.no_grad():
            ratio = importance_ratio(logprobs, old_logprobs, mask, self.config.importance_sampling_level)
        return stats, ratio[mask.bool()]

    def _skip_reason(self, loss: torch.Tensor, mean_ratio: torch.Tensor, mask: torch.Tensor) -> str | None:
        """Why this mini-batch must be skipped on every process, or None. One host sync."""
        flags = torch.stack([
            (mask.sum() == 0).float(),
            (~torch.isfinite(loss)).float(),
            (mean_ratio > self.config.ratio_threshold).float(),
        ])  # fmt: skip
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        no_actions, not_finite, ratio_high = flags.tolist()
        if no_actions:
            # Its masked means are 0 / 0: there is nothing to learn from, and no finite loss.
            return "it has no action tokens (every response in it is masked out or too short)"
        if not_finite:
            return "the loss is not finite"
        if ratio_high:
            return f"the mean ratio {mean_ratio.item():.2f} exceeds ratio_threshold={self.config.ratio_threshold}"
        return None

    def _skip(self, reason: str) -> None:
        self.skipped_minibatches += 1
        warnings.warn(f"Skipping a PPO mini-batch because {reason}; the weights are not updated for it.", stacklevel=3)

    def _gradients_finite(self, model=None, optimizer=None) -> bool:
        """Clip the gradient norm (when ``max_grad_norm``) of ``model`` (default the policy) and tell
        whether every gradient its ``optimizer`` holds is finite."""
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        if self.is_deepspeed_enabled:
            # DeepSpeed owns the gradients: it clips and checks them inside its own step, which
            # the backward has already run, and skips the update when they are not finite.
            return model.was_step_applied()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.config.max_grad_norm is not None:
            total = self.accelerator.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            # Only finiteness is wanted: a sum is inf or NaN when any term is (it would overflow only
            # past 3e38), and it reads each gradient once, without the squares of a norm.
            sums = [p.grad.sum(dtype=torch.float32) for p in params if p.grad is not None]
            total = torch.stack(sums).sum() if sums else torch.zeros(())
        return bool(torch.isfinite(torch.as_tensor(total)).item())

    def loss(
        self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, entropy=None,
        ref_logprobs=None, kl_coef=0.0, token_weights=None, tokens_per_minibatch=None,
    ):
        """PPO losses of one mini-batch (PPO_SPEC sections 6 and 13), with their statistics.

        Shapes: every per-token argument ``(b, L)``, logits ``(b, L, V)``. The entropy comes from
        ``entropy`` ``(b, L)`` when given (logits may then be None; differentiable for ``entropy_coef``),
        else from the logits. The policy loss is the trainer's objective (clip variants, ``loss_type``,
        the KL-in-loss term with ``ref_logprobs``, the entropy bonus, TIS ``token_weights``).
        Returns the policy loss, the value loss and a dict of detached 0-d statistics. Critic-free
        (``values``, ``vpreds``, ``returns`` None): the value loss is None and no value statistic is made.
        """
        if entropy is None:
            entropy = entropy_from_logits(logits if self.config.entropy_coef else logits.detach())
        pg_loss, stats = self._objective(
            logprobs, old_logprobs, advantages, mask, entropy, ref_logprobs, kl_coef, token_weights, tokens_per_minibatch
        )
        stats["loss/total"] = pg_loss.detach()
        if vpreds is None:
            return pg_loss, None, stats
        vf_loss, vf_stats = ppo_value_loss(vpreds, values, returns, mask, self.config.cliprange_value)
        with torch.no_grad():
            stats.update({
                "loss/value": vf_loss.detach(),
                "loss/total": (pg_loss + self.config.vf_coef * vf_loss).detach(),
                "returns/mean": masked_mean(returns, mask),
                "returns/var": masked_var(returns, mask),
                "val/vpred": masked_mean(vpreds.detach(), mask),
                "val/error": masked_mean((vpreds.detach() - returns) ** 2, mask),
                "val/clipfrac": vf_stats["clipfrac"],
                "val/mean": masked_mean(values, mask),
                "val/var": masked_var(values, mask),
            })  # fmt: skip
        return pg_loss, vf_loss, stats
