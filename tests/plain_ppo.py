"""A plain, independent implementation of ``PPOTrainer.step()`` straight from docs/algorithm.md, for tests.

Everything lives in the spec's ``(B, T)`` layout: the whole batch is padded once to one length ``S``,
the model gives full logits ``(B, S, V)``, log-probabilities come from a log-softmax over the whole
vocabulary, and every formula is written out with plain torch. It is slow on purpose and shares no
code with ``trl_lite`` beyond the value-head model it trains (its transformers model and ``v_head``
are called directly). The critic-free estimators of section 12 train a plain transformers model
(or a value-head model whose head is never called).

It also covers docs/algorithm.md sections 9-11: a separate critic (a transformers sequence-classification
model whose score head reads every position's last hidden state), the PTX loss (a per-row
cross-entropy loop) and the EMA of the policy (float64 accumulators over every parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Added to variances before the square root when whitening (the classic value).
WHITEN_EPS = 1e-8
# Added to the running score std before dividing by it.
SCORE_EPS = 1e-8


@dataclass
class PaddedBatch:
    """One step's batch padded once for all rows.

    ``inputs``: kwargs of the transformers model, ``(B, S)`` tensors (plus the decoder's for
    encoder-decoders); ``targets`` ``(B, T)``: the token predicted at each position; ``mask``
    ``(B, T)`` float: the action mask of docs/algorithm.md section 3.
    """

    inputs: dict
    targets: torch.Tensor
    mask: torch.Tensor

    def rows(self, idx: torch.Tensor) -> dict:
        """The model inputs of rows ``idx`` (still padded to the whole batch's length)."""
        return {key: value[idx] for key, value in self.inputs.items()}


def pad(sequences: list, pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad 1-D tensors to the longest one on ``side``.

    Returns ids ``(B, S)``, attention mask ``(B, S)`` and the left padding of each row ``(B,)``.
    """
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(sequences), length, dtype=torch.long)
    left = torch.zeros(len(sequences), dtype=torch.long)
    for b, seq in enumerate(sequences):
        offset = length - len(seq) if side == "left" else 0
        ids[b, offset : offset + len(seq)] = seq
        attention[b, offset : offset + len(seq)] = 1
        left[b] = offset
    return ids, attention, left


def make_batch(queries, responses, response_masks, pad_id, padding_side, is_encoder_decoder) -> PaddedBatch:
    """Model inputs, targets and the action mask ``(B, T)`` of docs/algorithm.md section 3."""
    masks = response_masks or [torch.ones(len(r)) for r in responses]
    if is_encoder_decoder:
        enc, enc_attention, _ = pad(queries, pad_id, "right")
        dec, dec_attention, _ = pad(responses, pad_id, "right")
        mask = torch.zeros(len(queries), dec.shape[1] - 1)
        for b, r in enumerate(responses):
            # Decoder position t predicts decoder token t + 1; actions are positions 1 .. len - 2.
            for t in range(1, len(r) - 1):
                mask[b, t] = masks[b][t + 1]
        inputs = {
            "input_ids": enc,
            "attention_mask": enc_attention,
            "decoder_input_ids": dec,
            "decoder_attention_mask": dec_attention,
        }
        return PaddedBatch(inputs, dec[:, 1:], mask)

    ids, attention, left = pad([torch.cat((q, r)) for q, r in zip(queries, responses)], pad_id, padding_side)
    mask = torch.zeros(len(queries), ids.shape[1] - 1)
    for b, (q, r) in enumerate(zip(queries, responses)):
        start = int(left[b]) + len(q) - 1
        mask[b, start : start + len(r)] = masks[b].float()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": ids, "attention_mask": attention, "position_ids": position_ids}
    return PaddedBatch(inputs, ids[:, 1:], mask)


def forward(model, inputs: dict, values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full next-token logits ``(b, T, V)`` and values ``(b, T)`` of a value-head model.

    Calls the transformers model for the logits and the value head on its last hidden state. A
    plain transformers model, or ``values=False``, gives None for the values.
    """
    network = getattr(model, "pretrained_model", model)
    out = network(**inputs, output_hidden_states=True, use_cache=False)
    if not values or not hasattr(model, "v_head"):
        return out.logits[:, :-1].float(), None
    hidden = out.decoder_hidden_states[-1] if "decoder_input_ids" in inputs else out.hidden_states[-1]
    return out.logits[:, :-1].float(), model.v_head(hidden)[:, :-1].float()


def critic_values(critic, inputs: dict) -> torch.Tensor:
    """Values ``(b, T)`` of a sequence-classification critic: its score head at every position.

    The hidden states come from the classifier's own forward (``output_hidden_states``).
    """
    out = critic(**inputs, output_hidden_states=True, use_cache=False)
    return critic.score(out.hidden_states[-1]).squeeze(-1)[:, :-1].float()


def ptx_loss_of(model, sequences: list) -> torch.Tensor:
    """Mean next-token cross-entropy over every predicted token of ``sequences``, one row at a time."""
    network = getattr(model, "pretrained_model", model)
    total, count = 0.0, 0
    for seq in sequences:
        logits = network(input_ids=seq.unsqueeze(0), use_cache=False).logits[0, :-1].float()
        total = total + F.cross_entropy(logits, seq[1:], reduction="sum")
        count += len(seq) - 1
    return total / count


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]``. Shapes: ``(b, T, V)``, ``(b, T)`` -> ``(b, T)``."""
    return F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p log p`` per position. Shape ``(b, T, V)`` -> ``(b, T)``."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the entries where ``mask`` is 1."""
    return (x * mask).sum() / mask.sum()


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the entries where ``mask`` is 1."""
    n = mask.sum()
    return ((x - masked_mean(x, mask)) ** 2 * mask).sum() / (n - 1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Masked whitening; without ``shift_mean`` the masked mean is kept."""
    mean = masked_mean(x, mask)
    out = (x - mean) / torch.sqrt(masked_var(x, mask) + WHITEN_EPS)
    return out if shift_mean else out + mean


def kl_per_token(kind: str, lp, ref_lp, logits, ref_logits) -> torch.Tensor:
    """The four KL estimators of docs/algorithm.md section 4. Shapes ``(B, T)`` (logits ``(B, T, V)``)."""
    if kind == "kl":
        return lp - ref_lp
    if kind == "abs":
        return (lp - ref_lp).abs()
    if kind == "mse":
        return 0.5 * (lp - ref_lp) ** 2
    logp, logq = F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def group_advantages(estimator: str, rewards: list, groups: list, scale: bool) -> list:
    """RLOO or GRPO advantages of section 12, one per row, by loops over each row's group."""
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        if estimator == "rloo":
            out.append(r - (sum(members) - r) / (len(members) - 1))
            continue
        mean = sum(members) / len(members)
        std = (sum((x - mean) ** 2 for x in members) / (len(members) - 1)) ** 0.5
        out.append((r - mean) / (std + 1e-6) if scale else r - mean)
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns ``R_t = sum_{s >= t} gamma^(s-t) r_s`` on the action positions. ``(B, T)``."""
    batch, length = rewards.shape
    returns = torch.zeros(batch, length)
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                returns[b, t] = sum(gamma ** (s - t) * rewards[b, s] * mask[b, s] for s in range(t, length))
    return returns


def gae(values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Advantages by the backward recursion of docs/algorithm.md section 5 (``V_T = 0``). Shapes ``(B, T)``."""
    batch, length = rewards.shape
    advantages = torch.zeros(batch, length)
    for b in range(batch):
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(range(length)):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[b, t] = next_advantage
            next_value = values[b, t]
    return advantages


class PlainPPO:
    """``PPOTrainer.step()`` of docs/algorithm.md for one process, written out plainly.

    Holds the state that lives across steps: the Adam optimizer, the KL coefficient, every score
    seen (for score scaling) and the count of backward passes (for gradient accumulation).
    For tests to check that a feature was exercised: ``grad_norms`` holds the global gradient norm
    before clipping at each optimizer step, ``shaped_scores`` the last step's scores after shaping
    and ``epochs_run`` the last step's number of epochs.
    Skipped mini-batches (``ratio_threshold``) are not modelled: the reference raises if one occurs.
    With ``critic`` (a transformers sequence-classification model) the values come from it, it has
    its own Adam and takes the value loss alone; the policy's value head is frozen. ``optimizer_cls``
    replaces the policy's Adam (same learning rate). ``ema`` holds the policy's moving average by
    parameter name when ``config.ema_decay`` is set.
    """

    def __init__(
        self, model, ref_model, config, pad_id: int, padding_side: str = "right", critic=None, optimizer_cls=None
    ):
        self.model, self.ref_model, self.config, self.critic = model, ref_model, config, critic
        self.pad_id, self.padding_side = pad_id, padding_side
        self.is_encoder_decoder = getattr(model, "pretrained_model", model).config.is_encoder_decoder
        self.critic_free = config.advantage_estimator != "gae"
        self.kl_in_reward = config.kl_in_reward if config.kl_in_reward is not None else config.advantage_estimator != "grpo"
        if critic is not None:
            if hasattr(model, "v_head"):
                model.v_head.requires_grad_(False)
            self.critic_optimizer = torch.optim.Adam(
                critic.parameters(), lr=config.critic_learning_rate or config.learning_rate
            )
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = (optimizer_cls or torch.optim.Adam)(params, lr=config.learning_rate)
        self.ema = None
        if config.ema_decay is not None:
            self.ema = {name: p.detach().double().clone() for name, p in model.named_parameters()}
        self.kl_coef = config.init_kl_coef
        self.seen_scores = torch.zeros(0, dtype=torch.float64)
        self.backward_passes = 0
        self.grad_norms = []
        self.shaped_scores = None
        self.epochs_run = 0

    def make_batch(self, queries, responses, response_masks=None) -> PaddedBatch:
        return make_batch(queries, responses, response_masks, self.pad_id, self.padding_side, self.is_encoder_decoder)

    def shape_scores(self, scores) -> torch.Tensor:
        """Section 2: running-moment scaling (and normalisation), then clipping. ``(B,)``."""
        config = self.config
        scores = torch.tensor([float(s) for s in scores])
        if config.use_score_scaling:
            self.seen_scores = torch.cat((self.seen_scores, scores.double()))
            mean, std = self.seen_scores.mean().item(), self.seen_scores.std().item()
            scores = (scores - mean) / (std + SCORE_EPS) if config.use_score_norm else scores / (std + SCORE_EPS)
        if config.score_clip is not None:
            scores = scores.clamp(-config.score_clip, config.score_clip)
        return scores

    @torch.no_grad()
    def rollout(self, batch: PaddedBatch) -> dict:
        """Section 3: policy and reference passes in chunks of ``mini_batch_size`` rows. ``(B, T)`` each."""
        self.model.eval()
        parts = {"logprobs": [], "ref_logprobs": [], "values": [], "full_kl": []}
        rows = torch.arange(len(batch.targets))
        for idx in rows.split(self.config.mini_batch_size):
            logits, values = forward(self.model, batch.rows(idx), values=not self.critic_free)
            if self.critic is not None:
                values = critic_values(self.critic, batch.rows(idx))
            ref_logits, _ = forward(self.ref_model, batch.rows(idx))
            # Section 20: log-probs, entropy and KL under logits / temperature (dividing by 1.0 is exact).
            logits, ref_logits = logits / self.config.temperature, ref_logits / self.config.temperature
            parts["logprobs"].append(logprobs_of(logits, batch.targets[idx]))
            parts["ref_logprobs"].append(logprobs_of(ref_logits, batch.targets[idx]))
            parts["values"].append(values if values is not None else torch.zeros_like(logits[..., 0]))
            parts["full_kl"].append(kl_per_token("full", None, None, logits, ref_logits))
        return {key: torch.cat(value) for key, value in parts.items()}

    def step(self, queries, responses, scores, response_masks=None, group_ids=None, ptx_inputs=None) -> dict:
        """One PPO step; returns the statistics of docs/algorithm.md section 8 that the tests compare."""
        config = self.config
        scores = self.shaped_scores = self.shape_scores(scores)
        batch = self.make_batch(queries, responses, response_masks)
        mask = batch.mask
        out = self.rollout(batch)
        logprobs, ref_logprobs = out["logprobs"] * mask, out["ref_logprobs"] * mask

        # Section 4: KL-shaped rewards, the score at the last action of each row.
        if config.kl_penalty == "full":
            kl = out["full_kl"] * mask
        else:
            kl = kl_per_token(config.kl_penalty, logprobs, ref_logprobs, None, None) * mask
        non_score_reward = -self.kl_coef * kl if self.kl_in_reward else torch.zeros_like(kl)
        rewards = non_score_reward.clone()
        for b in range(len(scores)):
            last = int(mask[b].nonzero().max())
            rewards[b, last] += scores[b]

        if config.advantage_estimator in ("rloo", "grpo"):
            # Section 12: one advantage per row from its group, given to each of its action tokens.
            k = config.num_samples_per_query
            groups = list(group_ids) if group_ids is not None else [b // k for b in range(len(scores))]
            row_rewards = [float(scores[b]) + float(non_score_reward[b].sum()) for b in range(len(scores))]
            row_advantages = group_advantages(config.advantage_estimator, row_rewards, groups, config.grpo_scale_rewards)
            advantages = torch.tensor(row_advantages).unsqueeze(1) * mask
            values = returns = None
        elif config.advantage_estimator == "reinforce_pp":
            if config.whiten_rewards:
                rewards = whiten(rewards, mask, shift_mean=False)
            advantages = whiten(discounted_returns(rewards, mask, config.gamma), mask)
            values = returns = None
        else:
            # Section 5: GAE on masked values and rewards, then whitened advantages.
            values = out["values"] * mask
            if config.whiten_rewards:
                rewards = whiten(rewards, mask, shift_mean=False)
            advantages = gae(values, rewards * mask, config.gamma, config.lam)
            returns = advantages + values
            advantages = whiten(advantages, mask)

        # Section 6: the epochs.
        ref_for_loss = None if self.kl_in_reward else ref_logprobs
        train = self.optimize(batch, logprobs, values, advantages, returns, ref_for_loss, ptx_inputs)

        kl_per_row = kl.sum(-1)
        stats = {
            "objective/kl": kl_per_row.mean(),
            "objective/kl_dist": kl_per_row,
            "objective/logprobs": logprobs[mask.bool()],
            "objective/ref_logprobs": ref_logprobs[mask.bool()],
            "objective/kl_coef": torch.tensor(self.kl_coef),
            "objective/entropy": (-logprobs * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(non_score_reward, mask),
            "ppo/mean_scores": scores.mean(),
            "ppo/std_scores": scores.std(),
            "ppo/policy/advantages": advantages[mask.bool()],
        }
        stats.update(train)
        if not self.critic_free:
            stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]

        # Section 7: the adaptive KL controller (Ziegler et al.).
        if config.adap_kl_ctrl:
            error = min(max(stats["objective/kl"].item() / config.target - 1, -0.2), 0.2)
            self.kl_coef *= 1 + error * config.batch_size / config.horizon
        return {key: value.detach().numpy() if value.dim() else value.item() for key, value in stats.items()}

    def optimize(
        self, batch: PaddedBatch, old_logprobs, old_values, advantages, returns, ref_logprobs=None, ptx_inputs=None
    ) -> dict:
        """Section 6: ``ppo_epochs`` epochs of shuffled mini-batches; the mean of their statistics.

        ``old_values`` and ``returns`` are None for critic-free estimators; ``ref_logprobs`` is given
        when the KL is in the loss (section 12); ``ptx_inputs`` row ``i`` joins the mini-batch of row ``i``.
        """
        config = self.config
        self.model.train()
        if self.critic is not None:
            self.critic.train()
        collected = []
        self.epochs_run = 0
        for _ in range(config.ppo_epochs):
            self.epochs_run += 1
            order = torch.randperm(len(batch.targets))
            epoch_policykl = []
            for idx in order.split(config.mini_batch_size):
                cut = [None if x is None else x[idx] for x in (old_values, returns, ref_logprobs)]
                ptx = [ptx_inputs[i] for i in idx.tolist()] if ptx_inputs is not None else None
                stats = self.train_minibatch(
                    batch, idx, old_logprobs[idx], cut[0], advantages[idx], cut[1], cut[2], ptx
                )
                collected.append(stats)
                epoch_policykl.append(stats["ppo/policy/policykl"])
            if config.early_stopping and torch.stack(epoch_policykl).mean() > 1.5 * config.target_kl:
                break
        return {key: torch.stack([s[key] for s in collected]).mean() for key in collected[0]}

    def train_minibatch(
        self, batch: PaddedBatch, idx, old_lp, old_values, advantages, returns, ref_lp=None, ptx=None
    ) -> dict:
        """Forward with grad, the clipped losses, backward and (every ``gradient_accumulation_steps``) a step.

        ``ptx``: the PTX rows of this mini-batch (section 10), or None.
        """
        config = self.config
        mask = batch.mask[idx]
        logits, vpred = forward(self.model, batch.rows(idx), values=not self.critic_free)
        if self.critic is not None:
            vpred = critic_values(self.critic, batch.rows(idx))
        logits = logits / self.config.temperature
        lp = logprobs_of(logits, batch.targets[idx])

        ratio = torch.exp(lp - old_lp)
        pg_unclipped = -advantages * ratio
        pg_clipped = -advantages * torch.clamp(ratio, 1 - config.cliprange, 1 + config.cliprange)
        pg_loss = masked_mean(torch.max(pg_unclipped, pg_clipped), mask)

        # ``loss`` trains the policy; a separate critic takes ``critic_loss`` alone (sections 9 and 10).
        loss, critic_loss = pg_loss, None
        if not self.critic_free:
            v_clip = torch.clamp(vpred, old_values - config.cliprange_value, old_values + config.cliprange_value)
            vf_unclipped, vf_clipped = (vpred - returns) ** 2, (v_clip - returns) ** 2
            vf_loss = 0.5 * masked_mean(torch.max(vf_unclipped, vf_clipped), mask)
            if self.critic is None:
                loss = pg_loss + config.vf_coef * vf_loss
            else:
                critic_loss = vf_loss
        if ref_lp is not None:
            # Section 12: k3 = exp(ref - lp) - (ref - lp) - 1 on the new log-probs.
            kl_loss = masked_mean(torch.exp(ref_lp - lp) - (ref_lp - lp) - 1, mask)
            loss = loss + self.kl_coef * kl_loss
        if ptx is not None:
            ptx_loss = ptx_loss_of(self.model, ptx)
            loss = loss + config.ptx_coef * ptx_loss
        # What the step reports: policy loss + vf_coef * value loss (+ KL, PTX terms), whichever model takes each part.
        total = loss if critic_loss is None else loss + config.vf_coef * critic_loss
        if masked_mean(ratio, mask) > config.ratio_threshold:
            raise AssertionError("PlainPPO does not model mini-batches skipped by ratio_threshold")

        (loss / config.gradient_accumulation_steps).backward()
        if critic_loss is not None:
            (critic_loss / config.gradient_accumulation_steps).backward()
        self.backward_passes += 1
        if self.backward_passes % config.gradient_accumulation_steps == 0:
            self.clip_gradients(self.model)
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.critic is not None:
                self.clip_gradients(self.critic)
                self.critic_optimizer.step()
                self.critic_optimizer.zero_grad()
            self.update_ema()

        with torch.no_grad():
            log_ratio = lp - old_lp
            stats = {
                "ppo/loss/policy": pg_loss.detach(),
                "ppo/loss/total": total.detach(),
                "ppo/policy/entropy": masked_mean(entropy_of(logits), mask),
                "ppo/policy/approxkl": 0.5 * masked_mean(log_ratio**2, mask),
                "ppo/policy/policykl": masked_mean(-log_ratio, mask),
                "ppo/policy/clipfrac": masked_mean((pg_clipped > pg_unclipped).float(), mask),
                "ppo/policy/advantages_mean": masked_mean(advantages, mask),
            }
            if ref_lp is not None:
                stats["ppo/policy/kl_loss"] = kl_loss.detach()
            if ptx is not None:
                stats["ppo/loss/ptx"] = ptx_loss.detach()
            if self.critic_free:
                return stats
            return stats | {
                "ppo/loss/value": vf_loss.detach(),
                "ppo/returns/mean": masked_mean(returns, mask),
                "ppo/returns/var": masked_var(returns, mask),
                "ppo/val/vpred": masked_mean(vpred, mask),
                "ppo/val/error": masked_mean((vpred - returns) ** 2, mask),
                "ppo/val/clipfrac": masked_mean((vf_clipped > vf_unclipped).float(), mask),
                "ppo/val/mean": masked_mean(old_values, mask),
                "ppo/val/var": masked_var(old_values, mask),
            }

    @torch.no_grad()
    def update_ema(self) -> None:
        """Section 11: ``ema = decay * ema + (1 - decay) * policy`` for every policy parameter."""
        if self.ema is None:
            return
        decay = self.config.ema_decay
        for name, p in self.model.named_parameters():
            self.ema[name] = decay * self.ema[name] + (1 - decay) * p.double()

    def clip_gradients(self, model) -> None:
        """Scale ``model``'s gradients so their global L2 norm is at most ``max_grad_norm`` (when set)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        self.grad_norms.append(norm)
        max_norm = self.config.max_grad_norm
        if max_norm is not None and norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
