"""The policy's objective of one mini-batch (docs/algorithm.md sections 6, 12, 13 and 15), picked once from the config.

:class:`PolicyObjective` is a part the trainer holds: it turns new and old log-probs, advantages,
entropies, the reference's log-probs (KL in the loss) and importance weights into one loss with
its statistics, through the pure functions of :mod:`trl_lite.core.ppo`. The value loss stays with
the trainer (section 6), as it does not change with these options.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core import aggregate_loss, k3_kl, masked_mean, ppo_policy_loss


@dataclass(frozen=True)
class PolicyObjective:
    """Clipped surrogate (with clip-higher, dual clip, GSPO), KL-in-loss and entropy bonus, aggregated by ``loss_type``.

    Every field is the ``PPOConfig`` field of the same name; the defaults give docs/algorithm.md section 6.
    """

    cliprange: float = 0.2
    cliprange_high: float | None = None
    dual_clip: float | None = None
    importance_sampling_level: str = "token"
    loss_type: str = "token_mean"
    max_response_length: int | None = None
    entropy_coef: float = 0.0
    entropy_token_mean: bool = False
    seq_mean_all_rows: bool = False

    @classmethod
    def from_config(cls, config) -> PolicyObjective:
        return cls(
            cliprange=config.cliprange,
            cliprange_high=config.cliprange_high,
            dual_clip=config.dual_clip,
            importance_sampling_level=config.importance_sampling_level,
            loss_type=config.loss_type,
            max_response_length=config.max_response_length,
            entropy_coef=config.entropy_coef,
            entropy_token_mean=config.entropy_token_mean,
            seq_mean_all_rows=config.seq_mean_all_rows,
        )

    @property
    def needs_global_token_count(self) -> bool:
        """Whether the loss divides by the action tokens of the whole backward batch (``global_token_mean``)."""
        return self.loss_type == "global_token_mean"

    def aggregate(self, losses: torch.Tensor, mask: torch.Tensor, tokens_per_minibatch=None, denominator=None) -> torch.Tensor:
        """``losses (b, L)`` of a mini-batch as one number, by ``loss_type`` (:func:`trl_lite.core.aggregate_loss`)."""
        return aggregate_loss(losses, mask, self.loss_type, self.max_response_length, tokens_per_minibatch, denominator,
                              self.seq_mean_all_rows)  # fmt: skip

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        kl_coef: float = 0.0,
        token_weights: torch.Tensor | None = None,
        tokens_per_minibatch: float | torch.Tensor | None = None,
        denominator: float | torch.Tensor | None = None,
        token_denominator: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's loss of one mini-batch and its detached statistics.

        ``loss = agg(w * l_clip) [+ kl_coef * agg(k3(lp, ref))] [- entropy_coef * agg(H)]`` with ``w`` the
        ``token_weights`` (TIS, section 15), ``ref_logprobs`` given when the KL is in the loss (section 12)
        and ``entropy`` (differentiable) needed when ``entropy_coef > 0``; with ``entropy_token_mean`` the entropy
        term is the mini-batch's token mean whatever ``loss_type`` (TRL 1.x GRPOTrainer's bonus). ``tokens_per_minibatch``:
        see :func:`trl_lite.core.aggregate_loss` (``global_token_mean`` only; None: the mini-batch is its
        own backward batch, as in a lone ``train_minibatch`` call, and its action tokens are the count).
        ``denominator``: these rows are one pass of a backward batch split by a token budget, and every
        term is their share of the backward batch's (docs/algorithm.md section 18, see
        :func:`trl_lite.core.aggregate_loss`); ``token_denominator`` then is the backward batch's action tokens
        (the entropy term's with ``entropy_token_mean``).
        Shapes: every tensor ``(b, L)``. Statistics: ``loss/policy`` (the clipped surrogate alone),
        ``policy/clipfrac[_low|_high]``, ``policy/dual_clipfrac``, ``policy/approxkl``, ``policy/policykl``,
        ``policy/ratio``, ``policy/advantages_mean``, ``policy/entropy``, and ``policy/kl_loss`` (with
        ``policy/kl``, the token mean of k3) / ``policy/entropy_loss`` when those terms are on.
        """
        if self.needs_global_token_count and tokens_per_minibatch is None and denominator is None:
            tokens_per_minibatch = mask.sum()
        if self.entropy_coef and entropy is None:
            raise ValueError(f"entropy_coef={self.entropy_coef} needs the entropy of every action token, got None.")
        pg_loss, pg_stats = ppo_policy_loss(
            logprobs, old_logprobs, advantages, mask, self.cliprange, self.cliprange_high, self.dual_clip,
            self.importance_sampling_level, self.loss_type, self.max_response_length, tokens_per_minibatch,
            token_weights, denominator, self.seq_mean_all_rows,
        )  # fmt: skip
        loss = pg_loss
        stats = {"loss/policy": pg_loss.detach()}
        stats.update({f"policy/{k}": v for k, v in pg_stats.items()})
        with torch.no_grad():
            stats["policy/advantages_mean"] = masked_mean(advantages, mask)
            if entropy is not None:
                stats["policy/entropy"] = masked_mean(entropy.detach(), mask)
        if ref_logprobs is not None:
            k3 = k3_kl(logprobs, ref_logprobs)
            kl_loss = self.aggregate(k3, mask, tokens_per_minibatch, denominator)
            loss = loss + kl_coef * kl_loss
            stats["policy/kl_loss"] = kl_loss.detach()
            stats["policy/kl"] = masked_mean(k3.detach(), mask)
        if self.entropy_coef:
            if self.entropy_token_mean:
                entropy_loss = aggregate_loss(entropy, mask, "token_mean", denominator=token_denominator)
            else:
                entropy_loss = self.aggregate(entropy, mask, tokens_per_minibatch, denominator)
            loss = loss - self.entropy_coef * entropy_loss
            stats["policy/entropy_loss"] = entropy_loss.detach()
        return loss, stats
