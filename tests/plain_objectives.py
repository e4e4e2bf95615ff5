"""A float64, row-by-row reference of docs/algorithm.md sections 13 and 15 on top of ``plain_ppo.PlainPPO``.

``PlainObjectivesPPO`` keeps PlainPPO's sections 2-12 (scores, padded forward passes, rewards,
advantages, epochs) and rewrites the per-mini-batch loss: every action token's clipped surrogate
(clip-higher, dual clip, token or sequence ratio, TIS weight) is written out in a Python loop over
rows and tokens, the aggregation of each ``loss_type`` is a loop too, and the whole computation
runs in float64 (the models are converted, and the default dtype is float64 during a step). Log-probs,
entropies and the full KL are those of ``softmax(logits / config.temperature)`` (section 20).
``global_token_mean`` is written as the spec states it: the backward batch's token sum divided
by its action-token count, with no division by the accumulation steps. Shares no code with trl_lite.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from plain_ppo import PlainPPO, masked_mean, masked_var


@contextlib.contextmanager
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def forward64(model, inputs: dict, values: bool = True):
    """Full logits ``(b, T, V)`` and values ``(b, T)`` (or None) in the model's dtype (float64 here)."""
    network = getattr(model, "pretrained_model", model)
    out = network(**inputs, output_hidden_states=True, use_cache=False)
    if not values or not hasattr(model, "v_head"):
        return out.logits[:, :-1], None
    return out.logits[:, :-1], model.v_head(out.hidden_states[-1])[:, :-1]


def token_entropy(logits_row: torch.Tensor) -> torch.Tensor:
    """``-sum_v p log p`` of one position's logits ``(V,)``."""
    logp = F.log_softmax(logits_row, dim=-1)
    return -(logp.exp() * logp).sum()


class PlainObjectivesPPO(PlainPPO):
    """PlainPPO with docs/algorithm.md sections 13 and 15, in float64 (see the module docstring); a shared value
    head or none (critic-free), no separate critic, PTX or EMA."""

    def __init__(self, model, ref_model, config, pad_id, padding_side="right", optimizer_cls=None):
        model.double()
        ref_model.double()
        super().__init__(model, ref_model, config, pad_id, padding_side, optimizer_cls=optimizer_cls)
        self.generation_logprobs = None
        self.tis_weights = None
        self.gap = None

    def step(self, queries, responses, scores, response_masks=None, group_ids=None, generation_logprobs=None):
        self.generation_logprobs = generation_logprobs
        self.responses, self.queries = responses, queries
        with float64_default():
            stats = super().step(queries, responses, scores, response_masks, group_ids)
        if self.gap is not None:
            stats.update({key: value.item() for key, value in self.gap.items()})
        return stats

    @torch.no_grad()
    def rollout(self, batch) -> dict:
        self.model.eval()
        parts = {"logprobs": [], "ref_logprobs": [], "values": [], "full_kl": []}
        for idx in torch.arange(len(batch.targets)).split(self.config.mini_batch_size):
            logits, values = forward64(self.model, batch.rows(idx), values=not self.critic_free)
            ref_logits, _ = forward64(self.ref_model, batch.rows(idx))
            # Section 20: every log-prob, entropy and KL under logits / temperature; values unchanged.
            logits, ref_logits = logits / self.config.temperature, ref_logits / self.config.temperature
            targets = batch.targets[idx].unsqueeze(-1)
            parts["logprobs"].append(F.log_softmax(logits, -1).gather(-1, targets).squeeze(-1))
            parts["ref_logprobs"].append(F.log_softmax(ref_logits, -1).gather(-1, targets).squeeze(-1))
            parts["values"].append(values if values is not None else torch.zeros_like(logits[..., 0]))
            logp, logq = F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1)
            parts["full_kl"].append((logp.exp() * (logp - logq)).sum(-1))
        return {key: torch.cat(value) for key, value in parts.items()}

    def _action_positions(self, batch) -> list[list[int]]:
        """Per row, the ``(B, T)`` position predicting each response token (decoder-only rows)."""
        width = batch.inputs["input_ids"].shape[1]
        positions = []
        for q, r in zip(self.queries, self.responses):
            left = width - len(q) - len(r) if self.padding_side == "left" else 0
            start = left + len(q) - 1
            positions.append([start + j for j in range(len(r))])
        return positions

    def optimize(self, batch, old_logprobs, old_values, advantages, returns, ref_logprobs=None, ptx_inputs=None):
        config = self.config
        mask = batch.mask
        self.tis_weights, self.gap = None, None
        if self.generation_logprobs is not None:
            gen = torch.zeros_like(old_logprobs)
            for b, positions in enumerate(self._action_positions(batch)):
                for j, t in enumerate(positions):
                    gen[b, t] = float(self.generation_logprobs[b][j])
            diffs = [abs(float(old_logprobs[b, t] - gen[b, t])) for b, t in mask.nonzero().tolist()]
            self.gap = {
                "rollout/logprob_diff/mean": torch.tensor(sum(diffs) / len(diffs)),
                "rollout/logprob_diff/max": torch.tensor(max(diffs)),
            }
            if config.importance_sampling_correction == "tis":
                weights = torch.zeros_like(old_logprobs)
                for b, t in mask.nonzero().tolist():
                    weights[b, t] = min(math.exp(float(old_logprobs[b, t] - gen[b, t])), config.importance_sampling_cap)
                self.tis_weights = weights
                self.gap["rollout/is_weight/mean"] = (weights * mask).sum() / mask.sum()
        self.model.train()
        collected = []
        self.epochs_run = 0
        for _ in range(config.ppo_epochs):
            self.epochs_run += 1
            order = torch.randperm(len(batch.targets))
            backward_batch = config.mini_batch_size * config.gradient_accumulation_steps
            for i, idx in enumerate(order.split(config.mini_batch_size)):
                first = (i // config.gradient_accumulation_steps) * backward_batch
                self.backward_batch_tokens = float(mask[order[first : first + backward_batch]].sum())
                cut = [None if x is None else x[idx] for x in (old_values, returns, ref_logprobs)]
                collected.append(
                    self.train_minibatch(batch, idx, old_logprobs[idx], cut[0], advantages[idx], cut[1], cut[2])
                )
        return {key: torch.stack([s[key] for s in collected]).mean() for key in collected[0]}

    def aggregate(self, per_token: dict, rows: int) -> torch.Tensor:
        """``per_token``: ``{(row, t): loss}`` of one mini-batch -> one number, by ``loss_type``, in loops."""
        config = self.config
        loss_type = config.loss_type
        total = sum(per_token.values())
        if loss_type == "token_mean":
            return total / len(per_token)
        if loss_type == "seq_mean_token_mean":
            row_means = []
            for b in range(rows):
                terms = [v for (row, _), v in per_token.items() if row == b]
                if terms:  # a row without action tokens is no part of the mean
                    row_means.append(sum(terms) / len(terms))
            return sum(row_means) / len(row_means)
        if loss_type == "seq_mean_token_sum_norm":
            return total / (rows * config.max_response_length)
        return total / self.backward_batch_tokens

    def train_minibatch(self, batch, idx, old_lp, old_values, advantages, returns, ref_lp=None, ptx=None) -> dict:
        config = self.config
        mask = batch.mask[idx]
        logits, vpred = forward64(self.model, batch.rows(idx), values=not self.critic_free)
        logits = logits / self.config.temperature
        lp = F.log_softmax(logits, -1).gather(-1, batch.targets[idx].unsqueeze(-1)).squeeze(-1)
        weights = self.tis_weights[idx] if self.tis_weights is not None else None
        low, high = config.cliprange, config.cliprange if config.cliprange_high is None else config.cliprange_high
        losses, kls, entropies, ratios = {}, {}, {}, {}
        counts = {"clip_low": 0, "clip_high": 0, "dual": 0}
        for b in range(len(idx)):
            tokens = mask[b].nonzero().flatten().tolist()
            if config.importance_sampling_level == "sequence" and tokens:
                sequence_ratio = torch.exp(sum(lp[b, t] - old_lp[b, t] for t in tokens) / len(tokens))
            for t in tokens:
                ratio = sequence_ratio if config.importance_sampling_level == "sequence" else torch.exp(lp[b, t] - old_lp[b, t])
                a = advantages[b, t]
                clamped = torch.clamp(ratio, 1 - low, 1 + high)
                loss = torch.max(-a * ratio, -a * clamped)
                if -a * clamped > -a * ratio:
                    counts["clip_low" if ratio < 1 - low else "clip_high"] += 1
                if config.dual_clip is not None and a < 0 and loss > -config.dual_clip * a:
                    loss = -config.dual_clip * a
                    counts["dual"] += 1
                if weights is not None:
                    loss = loss * weights[b, t]
                losses[(b, t)] = loss
                ratios[(b, t)] = ratio.detach()
                if ref_lp is not None:
                    log_ratio = ref_lp[b, t] - lp[b, t]
                    kls[(b, t)] = torch.exp(log_ratio) - log_ratio - 1
                entropies[(b, t)] = token_entropy(logits[b, t])
        pg_loss = self.aggregate(losses, len(idx))
        policy = pg_loss
        if ref_lp is not None:
            kl_loss = self.aggregate(kls, len(idx))
            policy = policy + self.kl_coef * kl_loss
        if config.entropy_coef:
            entropy_loss = self.aggregate(entropies, len(idx))
            policy = policy - config.entropy_coef * entropy_loss
        # global_token_mean already divides by the whole backward batch's tokens; the value loss keeps
        # section 6 (a mean per mini-batch, averaged over the accumulation steps).
        accumulation = config.gradient_accumulation_steps
        loss = policy / (1 if config.loss_type == "global_token_mean" else accumulation)
        if not self.critic_free:
            v_clip = torch.clamp(vpred, old_values - config.cliprange_value, old_values + config.cliprange_value)
            vf_unclipped, vf_clipped = (vpred - returns) ** 2, (v_clip - returns) ** 2
            vf_loss = 0.5 * masked_mean(torch.max(vf_unclipped, vf_clipped), mask)
            loss = loss + config.vf_coef * vf_loss / accumulation
        loss.backward()
        self.backward_passes += 1
        if self.backward_passes % config.gradient_accumulation_steps == 0:
            self.clip_gradients(self.model)
            self.optimizer.step()
            self.optimizer.zero_grad()

        n = len(losses)
        # Reported per mini-batch: the value whose mean over a backward batch's mini-batches is its loss.
        report = config.gradient_accumulation_steps if config.loss_type == "global_token_mean" else 1
        with torch.no_grad():
            log_ratio = lp - old_lp
            stats = {
                "ppo/loss/policy": pg_loss.detach() * report,
                "ppo/policy/clipfrac": torch.tensor((counts["clip_low"] + counts["clip_high"]) / n),
                "ppo/policy/clipfrac_low": torch.tensor(counts["clip_low"] / n),
                "ppo/policy/clipfrac_high": torch.tensor(counts["clip_high"] / n),
                "ppo/policy/dual_clipfrac": torch.tensor(counts["dual"] / n),
                "ppo/policy/ratio": torch.stack(list(ratios.values())).mean(),
                "ppo/policy/entropy": torch.stack(list(entropies.values())).detach().mean(),
                "ppo/policy/approxkl": 0.5 * masked_mean(log_ratio**2, mask),
                "ppo/policy/policykl": masked_mean(-log_ratio, mask),
            }
            if ref_lp is not None:
                stats["ppo/policy/kl_loss"] = kl_loss.detach() * report
            if config.entropy_coef:
                stats["ppo/policy/entropy_loss"] = entropy_loss.detach() * report
            if not self.critic_free:
                stats["ppo/loss/value"] = vf_loss.detach()
                stats["ppo/returns/var"] = masked_var(returns, mask)
                stats["ppo/val/error"] = masked_mean((vpred - returns) ** 2, mask)
            return stats
