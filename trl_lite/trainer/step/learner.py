"""The learner: trains the policy (and the value head or separate critic) on an :class:`~.experience.Experience`.

``train(experience)`` runs docs/algorithm.md section 6: ``ppo_epochs`` epochs of shuffled mini-batches,
each a forward pass with grad, the policy's loss (the :class:`~.objective.PolicyObjective`, sections
6, 12, 13 and 15), the value loss, the PTX loss (section 10), a guarded backward (policy before critic)
and, at each accumulation boundary, clipped optimizer steps and the EMA update (section 11), with
early stopping on the policy's KL. Under ``max_tokens_per_minibatch`` each backward batch is trained in
passes by token budget, every loss taken over the whole backward batch (section 18, :mod:`.pass_plan`);
a backward batch whose pass runs out of memory is trained again in smaller passes (:mod:`.oom_backoff`).
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager

import torch
from torch.distributed.tensor import DTensor

from ...core import (
    entropy_from_logits,
    importance_ratio,
    masked_mean,
    masked_var,
    ppo_value_loss,
    truncated_importance_weights,
)
from ...parallel.fsdp import is_sharded
from ..layout.rows import to_compact
from ..memory.oom_backoff import MemoryBackoff, PassOutOfMemory, drop_gradients
from ..memory.prefix_sharing import epoch_order
from .experience import Experience, Minibatch
from .forward import ForwardPass
from .pass_plan import PassPlan, combine_pass_stats, plan_epoch
from .ptx import ptx_loss
from .transfer import Selected

_POLICY_STAT_KEYS = (
    "loss/policy", "loss/total", "policy/entropy", "policy/approxkl", "policy/policykl",
    "policy/clipfrac", "policy/clipfrac_low", "policy/clipfrac_high", "policy/dual_clipfrac",
    "policy/advantages_mean", "policy/ratio",
)  # fmt: skip
_VALUE_STAT_KEYS = (
    "loss/value", "returns/mean", "returns/var", "val/vpred", "val/error", "val/clipfrac", "val/mean", "val/var",
)  # fmt: skip


class Learner:
    """Owns what training changes: the policy, the critic, their optimizers, the objective and the EMA.

    Args:
        config: the trainer's :class:`PPOConfig`.
        accelerator: the run's accelerator (backward, accumulation, clipping, reductions).
        forward: the trainer's :class:`~.forward.ForwardPass`.
        model, optimizer: the prepared policy and its optimizer.
        objective: the policy's :class:`~.objective.PolicyObjective`.
        critic, critic_optimizer: the prepared separate critic and its optimizer, or None.
        ema: the policy's :class:`~.ema.PolicyEMA`, or None.
        policy_values: whether the policy's value head runs and trains (GAE without a separate critic).
        memory: the trainer's :class:`~.oom_backoff.MemoryBackoff` (the forward part's too): a backward batch
            whose pass runs out of memory is trained again in the smaller passes it leaves.
        sequence: the trainer's sequence-parallel part (:class:`~trl_lite.parallel.SequenceParallel`, or a
            :class:`~trl_lite.parallel.NoSequenceParallel`): the group trains in one order and shares PTX.
    """

    def __init__(self, config, accelerator, forward: ForwardPass, model, optimizer, objective, critic=None,
                 critic_optimizer=None, ema=None, policy_values: bool = True, *, memory: MemoryBackoff,
                 sequence):  # fmt: skip
        self.config = config
        self.accelerator = accelerator
        self.forward = forward
        self.model = model
        self.optimizer = optimizer
        self.objective = objective
        self.critic = critic
        self.critic_optimizer = critic_optimizer
        self.ema = ema
        self.policy_values = policy_values
        self.memory = memory
        self.sequence = sequence
        self.is_deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
        self.is_fsdp = is_sharded(model)
        self.skipped_minibatches = 0
        self._scale = None  # the fp16 grad scaler's scale after the last update
        self._critic_engine = None
        if critic is not None and self.is_deepspeed:
            from accelerate.utils import DeepSpeedEngineWrapper

            # accelerate keeps the policy's engine for accelerator.backward; the critic's goes through its own.
            self._critic_engine = DeepSpeedEngineWrapper(critic)

    # ------------------------------------------------------------------------------------------
    # Epochs (section 6)
    # ------------------------------------------------------------------------------------------
    def train(self, experience: Experience) -> tuple[dict, torch.Tensor | None]:
        """``ppo_epochs`` epochs of shuffled backward batches over ``experience``, each in the passes of its
        :class:`~.pass_plan.PassPlan`; returns the averaged ``ppo/*`` statistics (per mini-batch, or per
        backward batch under a token budget), the ratios of every trained token,
        ``ppo/skipped_minibatches``, and the passes' count and tokens (``ppo/minibatches``,
        ``ppo/tokens_per_minibatch/mean|max``), the LM head's path (``memory/lm_head_chunk_size``: tokens per
        chunk, 0 for one buffer) - and, when the experience has no rollout log-probs
        (:class:`~.rollout_plan.RolloutPlan`), the training forwards' log-probs ``(B, L)``, detached, which
        were ``lp_old`` (else None)."""
        config = self.config
        minibatch_stats, ratios, masks, pass_tokens = [], [], [], []
        forward_logprobs = torch.zeros_like(experience.action_mask) if experience.logprobs is None else None
        skipped_before = self.skipped_minibatches
        self.model.train()
        if self.critic is not None:
            self.critic.train()
        # Per-row attention over the backward passes too (gradient checkpointing recomputes); a pass out of memory
        # is redone with half the budget (docs/out_of_memory.md).
        with self.forward.per_row_attention(), self.memory.catching():
            for _ in range(config.ppo_epochs):
                # Drawn on the host from torch's global generator, once per epoch (a backward batch redone after an
                # out-of-memory error draws nothing). A sequence-parallel group trains in its first process's order:
                # the others' generators may differ (seeded per process, or used by a sampler of their own).
                order = self.sequence.share(epoch_order(len(experience), experience.prompts))  # rows or prompts
                epoch_policykl = []
                plans = plan_epoch(config, self.accelerator, self.forward, self.objective, experience, order)
                b, skipped = 0, self.skipped_minibatches
                while b < len(plans):
                    try:
                        units, trained = self.train_backward_batch(experience, plans[b], forward_logprobs)
                    except PassOutOfMemory:  # every process backed off: nothing of this backward batch is kept
                        drop_gradients(self.trained_models())
                        self.skipped_minibatches = skipped
                        plans = plans[:b] + plan_epoch(config, self.accelerator, self.forward, self.objective,
                                                       experience, order)[b:]  # fmt: skip
                        continue
                    skipped = self.skipped_minibatches
                    minibatch_stats += units
                    epoch_policykl += [unit["policy/policykl"] for unit in units]
                    ratios, masks, pass_tokens = (mine + new for mine, new in zip((ratios, masks, pass_tokens), trained))
                    b += 1
                if config.early_stopping and self.should_stop(epoch_policykl):
                    break
        if minibatch_stats:
            stacked = {k: torch.stack([s[k] for s in minibatch_stats]).mean() for k in minibatch_stats[0]}
        else:
            keys = self.stat_keys(experience.kl_in_loss) + (("loss/ptx",) if experience.ptx is not None else ())
            stacked = {k: torch.tensor(float("nan")) for k in keys}
        stats = {f"ppo/{k}": v for k, v in stacked.items()}
        # The trained tokens' ratios, selected on the host with the step's statistics (a boolean
        # selection on the device would read its size back: one sync).
        stats["ppo/policy/ratio"] = Selected(torch.cat(ratios), torch.cat(masks).bool()) if ratios else torch.zeros(0)
        stats["ppo/skipped_minibatches"] = torch.tensor(float(self.skipped_minibatches - skipped_before))
        if experience.kl_in_loss and experience.ref_logprobs is None:
            stats["ppo/policy/kl_loss"] = torch.tensor(float("nan"))  # its coefficient is 0: not measured
            stats["ppo/policy/kl"] = torch.tensor(float("nan"))
        stats["ppo/minibatches"] = torch.tensor(float(len(pass_tokens)))
        # The path the policy's training passes took (head_path.HeadPath.taken).
        taken = self.forward.head.taken(self.model, self.forward.buffer_rows(experience.rows))
        stats["memory/lm_head_chunk_size"] = torch.tensor(float(taken))
        stats["ppo/tokens_per_minibatch/mean"] = torch.tensor(sum(pass_tokens) / max(len(pass_tokens), 1))
        stats["ppo/tokens_per_minibatch/max"] = torch.tensor(float(max(pass_tokens, default=0)))
        stats.update(self.memory.step_stats())
        return stats, forward_logprobs

    def train_backward_batch(self, experience: Experience, plan: PassPlan, forward_logprobs) -> tuple[list, list]:
        """One backward batch: its statistics (per mini-batch, or per backward batch under a budget) and per
        trained pass its ratios and masks ``(b, L)`` and tokens; fills ``forward_logprobs`` (when not None).
        Raises :class:`~.oom_backoff.PassOutOfMemory` when a pass ran out of memory on some process."""
        width = experience.action_mask.shape[1]
        units, ratios, masks, tokens, parts = [], [], [], [], {}
        self.memory.discardable = True
        for j, index in enumerate(plan.passes):
            minibatch = experience.minibatch(index)
            stats, ratio, old_logprobs = self.train_rows(experience, minibatch, plan, j)
            tokens.append(plan.tokens[j])
            if forward_logprobs is not None:
                forward_logprobs[minibatch.idx, : old_logprobs.shape[1]] = old_logprobs
            if stats is None:
                continue
            ratios.append(torch.nn.functional.pad(ratio, (0, width - ratio.shape[1])))
            masks.append(torch.nn.functional.pad(minibatch.mask, (0, width - ratio.shape[1])))
            if plan.by_tokens:
                parts.setdefault(plan.unit(j), []).append((stats, plan.actions[j]))
            else:
                units.append(stats)
        combined = [combine_pass_stats(unit_parts) for unit_parts in parts.values()]
        return units + [unit for unit in combined if unit is not None], [ratios, masks, tokens]

    def should_stop(self, epoch_policykl: list) -> bool:
        """Early stopping: the epoch's mean policykl over all processes above 1.5 * target_kl."""
        if not epoch_policykl:
            return False
        policykl = torch.stack(epoch_policykl).mean().reshape(1)
        policykl = self.accelerator.reduce(policykl, reduction="mean")
        return bool(policykl.item() > 1.5 * self.config.target_kl)

    def stat_keys(self, kl_in_loss: bool) -> tuple:
        """Names (without ``ppo/``) of the mini-batch statistics of this run."""
        keys = _POLICY_STAT_KEYS + (() if self.config.critic_free else _VALUE_STAT_KEYS)
        if self.config.importance_sampling_level != "token":
            keys += ("policy/clipfrac_seq", "policy/clipfrac_low_seq", "policy/clipfrac_high_seq")
        keys += ("policy/entropy_loss",) if self.config.entropy_coef else ()
        return keys + (("policy/kl_loss", "policy/kl") if kl_in_loss else ())

    # ------------------------------------------------------------------------------------------
    # One mini-batch
    # ------------------------------------------------------------------------------------------
    def train_rows(self, experience: Experience, mb: Minibatch, plan: PassPlan, j: int):
        """Pass ``j`` of ``plan`` (rows ``mb``): forward with grad, losses, guarded backward and optimizer step(s).

        Returns its statistics (None when skipped), the per-token ratios ``(b, L_mb)`` the loss used (None
        when skipped) and ``lp_old`` ``(b, L_mb)``; raises :class:`~.oom_backoff.PassOutOfMemory` (see there).
        """
        memory, result = self.memory, None
        memory.begin_pass(plan.tokens[j], len(plan.passes[j]))
        with self.pass_context(plan, j):
            with memory.attempt(what="a training forward"):
                result = self.pass_losses(experience, mb, plan, j)
            memory.raise_if_alone()
            if result is None:  # out of memory here: the peers learn it from the skip check's flags, and all back off
                self.skip_reason(None, None, None)
            policy_loss, critic_loss, stats, logprobs, old_logprobs = result
            if not self.guarded_update(policy_loss, critic_loss, stats, mb.mask, plan.shares(j)):
                return None, None, old_logprobs
        with torch.no_grad():
            ratio = importance_ratio(logprobs, old_logprobs, mb.mask, self.config.importance_sampling_level)
        return stats, ratio, old_logprobs

    def pass_losses(self, experience: Experience, mb: Minibatch, plan: PassPlan, j: int):
        """Pass ``j``'s forward with grad: the policy's and critic's losses, statistics, log-probs, ``lp_old``."""
        rows, forward, shares = experience.rows, self.forward, plan.shares(j)
        path = forward.head.choose(self.model, forward.buffer_rows(rows), record=True)  # the pass's one head decision
        outputs, targets, vpreds, slots, width = forward.head_inputs(
            self.model, rows, mb.index, mb.idx, path.fused, return_values=self.policy_values, critic=self.critic
        )
        kept = forward.kept_of(rows, mb.idx, slots)  # truncated sampling: the rollout's kept sets (section 23)
        logprobs, entropy = forward.head.apply(path, outputs, targets, forward.buffer_rows(rows), rows, kept=kept)
        del outputs  # the logits, when the head ran in the model: the saved softmax replaces them
        logprobs, entropy = forward.gather_slots(logprobs, entropy)
        logprobs = to_compact(logprobs, slots, len(mb.index), width)
        entropy = to_compact(entropy, slots, len(mb.index), width)
        old_logprobs, token_weights = mb.old_logprobs, mb.token_weights
        if old_logprobs is None:
            # The step's one optimizer step comes after this forward: the policy is still the one the
            # rollout pass would have run, so lp_old is this log-prob, detached (docs/algorithm.md section 3).
            old_logprobs = logprobs.detach()
            if mb.generation is not None and self.config.importance_sampling_correction == "tis":
                token_weights = truncated_importance_weights(
                    old_logprobs, mb.generation, mb.mask, self.config.importance_sampling_cap
                )
        pg_loss, vf_loss, stats = self.loss(
            old_logprobs, mb.old_values, None, vpreds, logprobs, mb.mask, mb.advantages, mb.returns,
            entropy=entropy, ref_logprobs=mb.ref_logprobs, kl_coef=experience.kl_coef,
            token_weights=token_weights, tokens_per_minibatch=plan.tokens_per_minibatch, denominators=shares,
        )  # fmt: skip
        ptx = None if mb.ptx is None else ptx_loss(self.forward, self.model, mb.ptx, None if shares is None else shares.ptx)
        policy_loss, critic_loss = self.split_losses(pg_loss, vf_loss, stats, ptx)
        if shares is not None and plan.pieces is None:
            # accelerate (DeepSpeed) divides each backward's loss by the accumulation steps; the passes' shares
            # already add up to the backward batch's loss (docs/algorithm.md section 18); pieces' do not.
            scale = self.config.gradient_accumulation_steps
            policy_loss = policy_loss * scale
            critic_loss = None if critic_loss is None else critic_loss * scale
        return policy_loss, critic_loss, stats, logprobs, old_logprobs

    @contextmanager
    def pass_context(self, plan: PassPlan, j: int):
        """The block of pass ``j`` of ``plan``: accelerate's accumulation for mini-batches; under a token
        budget, whose pass count varies per backward batch, the boundary set here: gradients sync and the
        optimizers step after the last pass only (accelerate's optimizer wrappers and DeepSpeed's
        accumulation boundary follow ``sync_gradients``; DDP skips the all-reduce under ``no_sync``)."""
        if not plan.by_tokens:
            with self.accelerator.accumulate(*self.trained_models()):
                yield
            return
        last = j == len(plan.passes) - 1
        self.accelerator.sync_gradients = last
        with ExitStack() as stack:
            if not last:
                for model in self.trained_models():
                    stack.enter_context(self.accelerator.no_sync(model))
            yield

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, entropy=None,
             ref_logprobs=None, kl_coef=0.0, token_weights=None, tokens_per_minibatch=None, denominators=None):  # fmt: skip
        """PPO losses of one mini-batch (sections 6 and 13), with their statistics.

        Shapes: every per-token argument ``(b, L)``, logits ``(b, L, V)``. The entropy comes from
        ``entropy`` ``(b, L)`` when given (logits may then be None; differentiable for ``entropy_coef``),
        else from the logits over ``PPOConfig.temperature`` (section 20). Returns the policy loss (the objective: clipped surrogate plus the KL-in-loss
        and entropy terms where on), the value loss and a dict of detached 0-d statistics, with
        ``loss/total = policy loss + vf_coef * value loss``. Critic-free (``values``, ``vpreds``,
        ``returns`` None): the value loss is None and no value statistic is made. ``denominators``: under a
        token budget, the :class:`~.pass_plan.Denominators` of the pass's backward batch (section 18): every
        loss is then the pass's share of the backward batch's.
        """
        policy_share = None if denominators is None else denominators.policy
        value_share = None if denominators is None else denominators.value
        if entropy is None:
            entropy = entropy_from_logits(logits if self.config.entropy_coef else logits.detach(), self.forward.temperature)
        pg_loss, stats = self.objective(
            logprobs, old_logprobs, advantages, mask, entropy, ref_logprobs, kl_coef, token_weights, tokens_per_minibatch,
            policy_share, value_share,
        )
        stats["loss/total"] = pg_loss.detach()
        if vpreds is None:
            return pg_loss, None, stats
        vf_loss, vf_stats = ppo_value_loss(vpreds, values, returns, mask, self.config.cliprange_value, value_share)
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

    def split_losses(self, pg_loss, vf_loss, stats: dict, ptx_loss=None):
        """The loss each model's backward takes: the policy's and the critic's (None with the shared head).

        Shared value head: ``pg + vf_coef * vf (+ ptx_coef * ptx)`` trains one model. Separate critic: the
        policy takes ``pg (+ ptx_coef * ptx)``, the critic ``vf`` (its own learning rate plays the part of
        ``vf_coef``). ``loss/total`` (filled by :meth:`loss`) gains the PTX term: it is always
        ``pg + vf_coef * vf + ptx_coef * ptx``, the same sum whichever models take its parts.
        """
        policy_loss = pg_loss
        if ptx_loss is not None:
            # Each process of a sequence-parallel group computes the whole PTX loss: its backward takes a share.
            policy_loss = policy_loss + self.config.ptx_coef * ptx_loss / self.sequence.size
            stats["loss/ptx"] = ptx_loss.detach()
            stats["loss/total"] = stats["loss/total"] + self.config.ptx_coef * ptx_loss.detach()
        if self.critic is not None or vf_loss is None:
            return policy_loss, vf_loss
        return policy_loss + self.config.vf_coef * vf_loss, None

    def guarded_update(self, policy_loss, critic_loss, stats: dict, mask, denominators=None) -> bool:
        """Backward and (at an accumulation boundary) optimizer steps, unless the mini-batch must be skipped.

        False when it was skipped (counted in ``skipped_minibatches``, with a warning) - before the backward
        (no action token, a non-finite loss, a mean ratio over ``ratio_threshold``) or after it (non-finite
        gradients). Under gradient accumulation a mini-batch skipped before the last of its backward batch
        drops only its own part; one skipped at the boundary drops the whole backward batch (its gradients
        are zeroed): under DDP the boundary's backward is the one that synchronises them, and no process ran it.
        Under a token budget (``denominators`` given) passes take the place of mini-batches, and a pass without
        action tokens carries a zero share and trains: only a backward batch with none on any process is skipped.
        """
        actions = None if denominators is None else denominators.actions
        reason = self.skip_reason(stats["loss/total"], stats["policy/ratio"], mask, actions)
        if reason is not None:
            self.skip(reason)
            if self.accelerator.sync_gradients:
                self.zero_grad()
            return False
        return self.backward_and_step(policy_loss, critic_loss)

    def skip_reason(self, loss: torch.Tensor, mean_ratio: torch.Tensor, mask: torch.Tensor,
                    backward_batch_actions: float | None = None) -> str | None:  # fmt: skip
        """Why this mini-batch (or pass) must be skipped on every process, or None. One host sync.

        ``backward_batch_actions``: under a token budget, the action tokens of the pass's backward batch on
        this process; the pass is then skipped for lack of actions only when every process has none.
        A pass out of memory on any process (here: ``loss`` None) makes all back off (:mod:`.oom_backoff`).
        """
        memory = self.memory
        if loss is None:  # this pass's forward ran out of memory here: neutral stand-ins, only that flag is up
            loss = mean_ratio = torch.zeros((), device=self.forward.device)
            mask, backward_batch_actions = torch.ones(1, device=self.forward.device), None
        if backward_batch_actions is None:
            empty, needed = mask.sum() == 0, 1
        else:
            # A fill on the device from a host number: no blocking copy (the flags are read once, below).
            empty, needed = loss.new_full((), float(backward_batch_actions == 0)), self.accelerator.num_processes
        flags = torch.stack([
            empty.float(),
            (~torch.isfinite(loss)).float(),
            (mean_ratio > self.config.ratio_threshold).float(),
            torch.full((), float(memory.failed), device=loss.device),  # a fill, no host-to-device copy
        ])  # fmt: skip
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        no_actions, not_finite, ratio_high, out_of_memory = flags.tolist()
        if out_of_memory:
            memory.agree()
        if no_actions >= needed:
            # Its masked means are 0 / 0: there is nothing to learn from, and no finite loss.
            return "it has no action tokens (every response in it is masked out or too short)"
        if not_finite:
            return "the loss is not finite"
        if ratio_high:
            return f"the mean ratio {mean_ratio.item():.2f} exceeds ratio_threshold={self.config.ratio_threshold}"
        return None

    def skip(self, reason: str) -> None:
        self.skipped_minibatches += 1
        warnings.warn(f"Skipping a PPO mini-batch because {reason}; the weights are not updated for it.", stacklevel=3)

    def backward_and_step(self, policy_loss, critic_loss) -> bool:
        """Backward of each model's own loss; at an accumulation boundary, clip, check and step both
        optimizers and update the EMA. False when the update was skipped for non-finite gradients."""
        accelerator, memory = self.accelerator, self.memory
        # A DeepSpeed engine keeps what a backward accumulated, and on several processes the boundary's backward
        # reduces the gradients: an out-of-memory error there cannot be redone (docs/out_of_memory.md).
        # FSDP2 reduce-scatters every backward's gradients: the same holds there.
        recoverable = not self.is_deepspeed and (accelerator.num_processes == 1 or not (accelerator.sync_gradients
                                                                                         or self.is_fsdp))  # fmt: skip
        with memory.attempt(recoverable, what="a training backward"):
            memory.discardable = not self.is_deepspeed
            # The policy's backward first: it holds the vocabulary-sized gradient of the LM head, and
            # the critic's gradients would otherwise be alive under it (a higher peak).
            accelerator.backward(policy_loss)
            if critic_loss is not None:
                if self._critic_engine is not None:
                    self._critic_engine.backward(critic_loss, sync_gradients=accelerator.sync_gradients)
                else:
                    accelerator.backward(critic_loss)
        memory.raise_if_alone()
        if memory.failed:  # several processes: the next pass's skip check tells them, before its backward
            return True
        if not accelerator.sync_gradients:
            return True
        optimizers = [self.optimizer] + ([self.critic_optimizer] if self.critic is not None else [])
        scaler = accelerator.scaler
        if scaler is not None:
            # fp16: every update goes through optimizer.step(), so the grad scaler sees inf/NaN gradients,
            # skips the update and lowers its scale (and its unscale_ state is reset for the next one).
            # The scale falls exactly when an inf/NaN was found, whichever optimizer (fused ones skip
            # inside their own step, unseen by accelerate's step_was_skipped) made the decision.
            before = self._scale if self._scale is not None else scaler.get_scale()
            for model, optimizer in zip(self.trained_models(), optimizers):
                self.clip_gradients(model, optimizer)
                optimizer.step()
            self._scale = scaler.get_scale()
            finite = self._scale >= before
        else:
            finite = self.gradients_finite(list(zip(self.trained_models(), optimizers)))
            if finite:
                for optimizer in optimizers:
                    optimizer.step()
        self.zero_grad()
        if not finite:
            self.skip("the gradients are not finite")
            return False
        if self.ema is not None:
            self.ema.update()
        return True

    def clip_gradients(self, model, optimizer) -> torch.Tensor | None:
        """Clip the gradient norm of what ``optimizer`` trains to ``max_grad_norm`` (unscaling fp16 gradients
        first); the total norm before clipping, or None without ``max_grad_norm``."""
        if self.config.max_grad_norm is None:
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.accelerator.clip_grad_norm_(params, self.config.max_grad_norm)

    def gradients_finite(self, pairs: list[tuple]) -> bool:
        """Clip the gradient norm of each ``(model, optimizer)`` pair (when ``max_grad_norm``) and tell whether
        every gradient the optimizers hold is finite: one host sync for all of them."""
        if self.is_deepspeed:
            # DeepSpeed owns the gradients: it clips and checks them inside its own step, which
            # the backward has already run, and skips the update when they are not finite.
            return all([model.was_step_applied() for model, _ in pairs])
        totals = []
        for model, optimizer in pairs:
            total = self.clip_gradients(model, optimizer)
            if total is None:
                # Only finiteness is wanted: a sum is inf or NaN when any term is (it would overflow only
                # past 3e38), and it reads each gradient once, without the squares of a norm.
                params = [p for group in optimizer.param_groups for p in group["params"]]
                sums = [p.grad.sum(dtype=torch.float32) for p in params if p.grad is not None]
                total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.forward.device)
            total = total.full_tensor() if isinstance(total, DTensor) else total  # FSDP2: over every shard
            totals.append(torch.as_tensor(total, dtype=torch.float32))
        return bool(torch.isfinite(torch.stack(totals)).all().item())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        if self.critic is not None:
            self.critic_optimizer.zero_grad()

    def trained_models(self) -> tuple:
        return (self.model,) if self.critic is None else (self.model, self.critic)
