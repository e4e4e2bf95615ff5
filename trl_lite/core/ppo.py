"""The PPO equations of docs/algorithm.md sections 4-6: KL estimators, KL-shaped rewards, GAE and the clipped losses."""

from __future__ import annotations

import torch

from .masked import clip_by_value, masked_mean

KL_PENALTIES = ("kl", "abs", "mse", "full")
# docs/algorithm.md section 13: how per-token losses of a mini-batch become one number, and TRL's names for them.
LOSS_TYPES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "global_token_mean")
LOSS_TYPE_ALIASES = {"bnpo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm", "dapo": "global_token_mean"}
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_sum")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_penalty: str = "kl",
    full_kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between policy and reference (docs/algorithm.md section 4).

    ``"kl"``: ``lp - ref``; ``"abs"``: ``|lp - ref|``; ``"mse"``: ``0.5 (lp - ref)^2``; ``"full"``: the
    exact KL of the full next-token distributions, which the caller computes with
    :func:`full_kl_from_logits` and passes as ``full_kl``. Shape: ``(B, L)`` -> ``(B, L)``.
    """
    if kl_penalty == "kl":
        return logprobs - ref_logprobs
    if kl_penalty == "abs":
        return (logprobs - ref_logprobs).abs()
    if kl_penalty == "mse":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if kl_penalty == "full":
        if full_kl is None:
            raise ValueError('kl_penalty="full" needs full_kl (from full_kl_from_logits), got None.')
        return full_kl
    raise ValueError(f"kl_penalty must be one of {KL_PENALTIES}, got {kl_penalty!r}.")


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in every row of ``mask`` (0 for a row of zeros). Shape: ``(B, L)`` -> ``(B,)``."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * (mask > 0)).amax(-1)


def compute_kl_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-shaped per-token rewards (docs/algorithm.md section 4).

    ``non_score_reward = -kl_coef * kl`` inside the mask; each row's score is added at its last
    action position. Shape: scores ``(B,)``, kl and mask ``(B, L)`` -> rewards and
    non_score_reward ``(B, L)``, both zero outside the mask.
    """
    non_score_reward = -kl_coef * kl * mask
    has_action = mask.any(-1)
    score_at_end = torch.zeros_like(non_score_reward)
    score_at_end.scatter_(-1, last_index(mask).unsqueeze(-1), (scores * has_action).unsqueeze(-1).to(kl.dtype))
    return non_score_reward + score_at_end, non_score_reward


def compute_gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (docs/algorithm.md section 5), before whitening.

    Values and rewards are zeroed outside the mask; then for ``t = L-1 .. 0``:
    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V_L = 0``), ``A_t = delta_t + gamma lam A_{t+1}``;
    ``returns = A + V``. Shape: ``(B, L)`` three times -> advantages, returns ``(B, L)``.
    """
    values = values * mask
    rewards = rewards * mask
    length = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    # The recursion runs backwards in time; rows stay vectorised.
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages, advantages + values


def importance_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
) -> torch.Tensor:
    """The importance ratio of every action token (docs/algorithm.md sections 6 and 13).

    ``"token"``: ``exp(lp - lp_old)``. ``"sequence"`` (GSPO): row ``i`` uses
    ``s_i = exp(masked_mean_t(lp - lp_old))`` at every position, the gradient flowing through the
    mean (a row without action tokens gets ``s_i = 1``). ``"sequence_sum"`` (TRL 1.x's RLOO): the ratio of
    the whole response's probabilities, ``s_i = exp(masked_sum_t(lp - lp_old))``, at every position.
    Shape: ``(B, L)`` three times -> ``(B, L)``.
    """
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return torch.exp(log_ratio)
    if level in ("sequence", "sequence_sum"):
        row_log_ratio = (log_ratio * mask).sum(-1)
        if level == "sequence":
            row_log_ratio = row_log_ratio / mask.sum(-1).clamp(min=1)
        return torch.exp(row_log_ratio).unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}.")


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """TIS weights of docs/algorithm.md section 15: ``min(exp(lp_old - lp_gen), cap) * M``, without grad.

    Shape: ``(B, L)`` three times -> ``(B, L)``.
    """
    with torch.no_grad():
        return torch.exp(old_logprobs - generation_logprobs).clamp(max=cap) * mask


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss (docs/algorithm.md sections 6 and 13), before aggregation.

    ``l = max(-A r, -A clamp(r, 1 - cliprange, 1 + cliprange_high))`` (``cliprange_high`` None:
    ``cliprange``); with ``dual_clip = c > 1``, where ``A < 0``: ``l = min(l, -c A)``.
    Returns ``l`` and boolean masks of where each clip binds: ``clipped`` (the clamp raised the loss,
    the classic clipfrac), ``clipped_low`` / ``clipped_high`` (its two sides) and ``dual_clipped``.
    Shape: ``(B, L)`` twice -> ``(B, L)``.
    """
    high = cliprange if cliprange_high is None else cliprange_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    loss = torch.max(unclipped, clipped)
    with torch.no_grad():
        is_clipped = clipped > unclipped
        regions = {
            "clipped": is_clipped,
            "clipped_low": is_clipped & (ratio < 1.0 - cliprange),
            "clipped_high": is_clipped & (ratio > 1.0 + high),
        }
    if dual_clip is None:
        regions["dual_clipped"] = torch.zeros_like(is_clipped)
        return loss, regions
    bound = -dual_clip * advantages
    dual_clipped = (advantages < 0) & (loss > bound)
    regions["dual_clipped"] = dual_clipped.detach()
    # The bound holds no parameter: where it binds the token gives no gradient, as min() would.
    return torch.where(dual_clipped, bound, loss), regions


def aggregate_loss(
    losses: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "token_mean",
    max_response_length: int | None = None,
    tokens_per_minibatch: float | torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    all_rows: bool = False,
) -> torch.Tensor:
    """One number from the per-token losses of a mini-batch (docs/algorithm.md section 13, ``loss_type``).

    - ``"token_mean"``: ``sum M l / sum M``;
    - ``"seq_mean_token_mean"``: mean of ``sum_t M l / sum_t M`` over the rows that hold an action token
      (a row without one carries no loss and is left out); with ``all_rows`` over every row, a row without
      an action token counting 0 (TRL 1.x's ``GRPOTrainer`` and ``RLOOTrainer``);
    - ``"seq_mean_token_sum_norm"``: ``sum M l / (B * max_response_length)``;
    - ``"global_token_mean"``: ``sum M l / tokens_per_minibatch``, where the caller gives the action
      tokens of the whole backward batch on all processes divided by the number of mini-batches that
      are averaged into one update (gradient accumulation steps times processes), so that the update
      is ``sum M l / N`` over all of them.

    ``denominator``: when given, the rows are one part of a larger batch and the result is their share of
    its loss (docs/algorithm.md section 18): ``sum M l / denominator`` for the token-summing types and the
    sum of the row means (rows with an action token) ``/ denominator`` for ``"seq_mean_token_mean"``, the
    caller giving the larger batch's count (its action tokens, rows with an action token, ``rows *
    max_response_length``, or for ``"global_token_mean"`` the action tokens of all processes over the
    process count). Shares of disjoint parts add up to the loss of their union.
    Shape: ``(B, L)`` twice -> ``()``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    if denominator is not None:
        if loss_type == "seq_mean_token_mean":
            row_means = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            return row_means.sum() / denominator
        return (losses * mask).sum() / denominator
    if loss_type == "token_mean":
        return masked_mean(losses, mask)
    if loss_type == "seq_mean_token_mean":
        tokens = mask.sum(-1)
        if all_rows:
            return ((losses * mask).sum(-1) / tokens.clamp(min=1)).sum() / max(losses.shape[0], 1)
        has_actions = (tokens > 0).to(losses.dtype)
        # A row without an action token carries no loss: it is left out of the mean, not counted as 0.
        row_means = (losses * mask).sum(-1) / tokens.clamp(min=1)
        return (row_means * has_actions).sum() / has_actions.sum().clamp(min=1)
    if loss_type == "seq_mean_token_sum_norm":
        if max_response_length is None:
            raise ValueError("loss_type='seq_mean_token_sum_norm' needs max_response_length, got None.")
        return (losses * mask).sum() / (losses.shape[0] * max_response_length)
    if tokens_per_minibatch is None:
        raise ValueError("loss_type='global_token_mean' needs tokens_per_minibatch, got None.")
    return (losses * mask).sum() / tokens_per_minibatch


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    importance_sampling_level: str = "token",
    loss_type: str = "token_mean",
    max_response_length: int | None = None,
    tokens_per_minibatch: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    all_rows: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss (docs/algorithm.md sections 6 and 13), aggregated by ``loss_type``.

    Defaults give section 6: ``masked_mean(max(-A ratio, -A clamp(ratio, 1 +- eps)))``.
    ``token_weights`` (detached, e.g. the TIS weights of section 15) multiply each token's loss
    before aggregation; ``denominator``, ``all_rows``: see :func:`aggregate_loss`. Shape: ``(B, L)`` four times (and ``token_weights``) -> loss ``()`` and
    detached statistics ``()``: clipfrac, clipfrac_low, clipfrac_high, dual_clipfrac, approxkl
    (``0.5 masked_mean((lp - lp_old)^2)``), policykl (``masked_mean(lp_old - lp)``), ratio (masked
    mean of the ratio the loss used); with a sequence-level ratio also clipfrac_seq, clipfrac_low_seq and
    clipfrac_high_seq, the shares of the rows (all ``B``) whose one ratio was clipped (TRL 1.x's ``clip_ratio/*``).
    """
    ratio = importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level)
    losses, regions = clipped_surrogate(ratio, advantages, cliprange, cliprange_high, dual_clip)
    if token_weights is not None:
        losses = losses * token_weights
    loss = aggregate_loss(losses, mask, loss_type, max_response_length, tokens_per_minibatch, denominator, all_rows)
    with torch.no_grad():
        log_ratio = logprobs - old_logprobs
        fraction = {k: masked_mean(v.to(logprobs.dtype), mask) for k, v in regions.items()}
        stats = {
            "clipfrac": fraction["clipped"],
            "clipfrac_low": fraction["clipped_low"],
            "clipfrac_high": fraction["clipped_high"],
            "dual_clipfrac": fraction["dual_clipped"],
            "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
            "policykl": masked_mean(-log_ratio, mask),
            "ratio": masked_mean(ratio, mask),
        }
        if importance_sampling_level != "token":  # one ratio per row: the share of the rows clipped
            for key, name in (("clipped", "clipfrac_seq"), ("clipped_low", "clipfrac_low_seq"),
                              ("clipped_high", "clipfrac_high_seq")):  # fmt: skip
                stats[name] = (regions[key] & (mask > 0)).any(-1).to(logprobs.dtype).mean()
    return loss, stats


def ppo_value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (docs/algorithm.md section 6).

    ``v_clip = clamp(v, v_old +- c)``; loss ``= 0.5 masked_mean(max((v - R)^2, (v_clip - R)^2))``, or with
    ``denominator`` (the action tokens of a larger batch these rows are part of, section 18) the masked sum
    divided by it instead of by the rows' own action tokens.
    Shape: ``(B, L)`` four times -> loss ``()`` and detached clipfrac ``()``.
    """
    vpred_clipped = clip_by_value(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    worst = torch.max(loss_unclipped, loss_clipped)
    loss = 0.5 * (masked_mean(worst, mask) if denominator is None else (worst * mask).sum() / denominator)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), mask)}
    return loss, stats
