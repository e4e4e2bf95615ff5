"""What the trainer adds for DeepSpeed-Chat/OpenRLHF-style actor-critic training: the separate
critic and its optimizer (PPO_SPEC section 9), the PTX language-modelling loss (section 10), the
policy's moving average (section 11), and the backward and optimizer steps of one mini-batch that
serve both the shared value head and the separate critic.
"""

from __future__ import annotations

import os

import torch
from torch.nn.utils.rnn import pad_sequence

from ..core import logprobs_and_entropy_from_hidden, logprobs_and_entropy_from_logits
from ..models.modeling_base import _WRAPPED_PREFIX as WRAPPED_PREFIX
from .accelerate_setup import default_optimizer, save_full_model
# Where save_pretrained(save_value_model=True) writes the critic, inside the policy's directory.
VALUE_MODEL_SUBFOLDER = "value_model"


class ActorCriticMixin:
    """The critic, PTX and EMA parts of :class:`PPOTrainer`.

    Uses the trainer's ``config``, ``accelerator``, ``model``, ``optimizer``, ``critic`` (None
    without a separate critic), ``_ema`` (None without ``ema_decay``), ``_pad_id``,
    ``_vocab_size`` and ``current_device``.
    """

    # ------------------------------------------------------------------------------------------
    # The separate critic (section 9)
    # ------------------------------------------------------------------------------------------
    def _prepare_critic(self, critic_optimizer) -> None:
        """Build the critic's optimizer and prepare both like the policy (DDP, or a DeepSpeed engine)."""
        self._critic_engine = None
        if self.critic is None:
            self.critic_optimizer = None
            return
        learning_rate = self.config.critic_learning_rate or self.config.learning_rate
        optimizer = critic_optimizer or default_optimizer(self.critic, learning_rate)
        # A second prepare call: accelerate makes the critic an engine of its own under DeepSpeed,
        # saves both models and optimizers in its state, and keeps the policy's engine for
        # accelerator.backward; the critic's backward goes through its own wrapper below.
        self.critic, self.critic_optimizer = self.accelerator.prepare(self.critic, optimizer)
        if self.is_deepspeed_enabled:
            from accelerate.utils import DeepSpeedEngineWrapper

            self._critic_engine = DeepSpeedEngineWrapper(self.critic)

    def _trained_models(self) -> tuple:
        return (self.model,) if self.critic is None else (self.model, self.critic)

    def _split_losses(self, pg_loss, vf_loss, stats: dict, ptx=None, idx=None):
        """The policy's loss and the critic's (None with the shared value head); fills ``loss/total``
        and ``loss/ptx`` of ``stats``.

        Shared value head: ``pg + vf_coef * vf (+ ptx_coef * ptx)`` trains one model (no ``vf`` for
        critic-free estimators). Separate critic: the policy takes ``pg (+ ptx_coef * ptx)``, the
        critic ``vf``. ``pg_loss`` may hold the in-loss KL term already.
        """
        policy_loss = pg_loss
        if ptx is not None:
            ptx_loss = self._ptx_loss(ptx, idx)
            policy_loss = policy_loss + self.config.ptx_coef * ptx_loss
            stats["loss/ptx"] = ptx_loss.detach()
        if self.critic is None:
            if vf_loss is not None:
                policy_loss = policy_loss + self.config.vf_coef * vf_loss
            critic_loss = None
            stats["loss/total"] = policy_loss.detach()
        else:
            critic_loss = vf_loss
            stats["loss/total"] = (policy_loss + critic_loss).detach()
        return policy_loss, critic_loss

    def _backward_and_step(self, policy_loss, critic_loss) -> bool:
        """Backward of each model's own loss; at an accumulation boundary, clip, check and step both
        optimizers and update the EMA. False when the step was skipped for non-finite gradients."""
        accelerator = self.accelerator
        # The policy's backward first: it holds the vocabulary-sized gradient of the LM head, and
        # the critic's gradients would otherwise be alive under it (a higher peak).
        accelerator.backward(policy_loss)
        if critic_loss is not None:
            if self._critic_engine is not None:
                self._critic_engine.backward(critic_loss, sync_gradients=accelerator.sync_gradients)
            else:
                accelerator.backward(critic_loss)
        if not accelerator.sync_gradients:
            return True
        finite = self._gradients_finite()
        if self.critic is not None:
            finite = self._gradients_finite(self.critic, self.critic_optimizer) and finite
        if not finite:
            self._skip("the gradients are not finite")
            self._zero_grad()
            return False
        self.optimizer.step()
        if self.critic is not None:
            self.critic_optimizer.step()
        self._zero_grad()
        if self._ema is not None:
            self._ema.update()
        return True

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad()
        if self.critic is not None:
            self.critic_optimizer.zero_grad()

    # ------------------------------------------------------------------------------------------
    # PTX (section 10)
    # ------------------------------------------------------------------------------------------
    def _check_ptx_inputs(self, ptx_inputs) -> None:
        """Reject ``step()``'s ``ptx_inputs`` unless PTX is on and they are ``batch_size`` token rows."""
        if ptx_inputs is None:
            return
        n = self.config.batch_size
        if self.config.ptx_coef <= 0:
            raise ValueError(f"ptx_inputs were given but config.ptx_coef={self.config.ptx_coef}; set ptx_coef > 0.")
        if self.is_encoder_decoder:
            raise ValueError("ptx_inputs (a language-modelling loss) need a decoder-only policy.")
        if not isinstance(ptx_inputs, (list, tuple)) or len(ptx_inputs) != n:
            given = len(ptx_inputs) if isinstance(ptx_inputs, (list, tuple)) else type(ptx_inputs).__name__
            raise ValueError(f"ptx_inputs must be a list of config.batch_size={n} 1-D token tensors, got {given}.")
        for i, seq in enumerate(ptx_inputs):
            if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.dtype.is_floating_point:
                raise TypeError(f"ptx_inputs[{i}] must be a 1-D tensor of token ids, got {seq!r:.80}.")
            if len(seq) < 2:
                raise ValueError(f"ptx_inputs[{i}] has {len(seq)} token(s); a next-token loss needs at least 2.")
            if int(seq.min()) < 0 or int(seq.max()) >= self._vocab_size:
                raise ValueError(f"ptx_inputs[{i}] holds token ids outside [0, {self._vocab_size}) (the model's vocabulary).")

    def _ptx_rows(self, ptx_inputs) -> list[torch.Tensor]:
        return [seq.to(device=self.current_device, dtype=torch.long) for seq in ptx_inputs]

    def _ptx_loss(self, ptx: list, idx: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the policy over every token (but the first) of rows ``idx``
        of ``ptx``, 0-d and differentiable.

        Right-padded with explicit position ids; the LM head runs only at the N predicting positions.
        """
        index = idx.tolist()
        seqs = [ptx[i] for i in index]
        device = self.current_device
        input_ids = pad_sequence(seqs, batch_first=True, padding_value=self._pad_id)
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        attention_mask = (torch.arange(input_ids.shape[1], device=device) < lengths.unsqueeze(1)).long()
        counts = lengths - 1
        total = int(counts.sum())
        row = torch.repeat_interleave(torch.arange(len(seqs), device=device), counts, output_size=total)
        position = torch.arange(total, device=device) - (counts.cumsum(0) - counts)[row]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_positions": (row, position)}
        if self._pass_position_ids:
            inputs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        targets = input_ids[row, position + 1]
        head = self._linear_head(self.model)
        outputs, _, _ = self.model(**inputs, return_lm_head_inputs=head is not None, return_values=False)
        if head is None:
            logprobs, _ = logprobs_and_entropy_from_logits(outputs, targets)
        else:
            # Not the trainer's shared logits buffer: it holds the PPO pass's softmax until the backward.
            logprobs, _ = logprobs_and_entropy_from_hidden(outputs, head.weight, head.bias, targets, total)
        return -logprobs.mean()

    # ------------------------------------------------------------------------------------------
    # EMA (section 11) and saving
    # ------------------------------------------------------------------------------------------
    @property
    def ema_model(self):
        """The policy's moving average as a model (float32), for generation and evaluation.

        Under ZeRO-3 the average is kept partitioned: save it with ``save_pretrained(dir, ema=True)``
        and load that directory in a process without DeepSpeed.
        """
        if self._ema is None:
            raise ValueError("ema_model needs PPOConfig.ema_decay (the policy's moving average is not kept).")
        if self._ema.model is None:
            raise ValueError(
                "Under DeepSpeed ZeRO-3 the policy's EMA is kept partitioned over the processes; "
                "use save_pretrained(dir, ema=True) to write it whole."
            )
        return self._ema.model

    def save_pretrained(self, save_directory: str, ema: bool = False, save_value_model: bool = False) -> None:
        """Save the policy (full weights, also under ZeRO-3) and the tokenizer: with its value head, or as
        the plain transformers (or PEFT) model the user passed.

        ``ema=True`` writes the policy's moving average (``config.ema_decay``) instead of its weights;
        ``save_value_model=True`` also writes the separate critic to ``save_directory/value_model``.
        Every process must call this.
        """
        if ema and self._ema is None:
            raise ValueError("save_pretrained(ema=True) needs an EMA of the policy: set PPOConfig.ema_decay.")
        if save_value_model and self.critic is None:
            raise ValueError("save_pretrained(save_value_model=True) needs a separate critic: pass value_model.")
        # Under ZeRO-3 both gathers below are collectives, and DeepSpeed returns the consolidated
        # state dict on the main process only (None elsewhere): each runs exactly once on every process.
        state_dict = self.accelerator.get_state_dict(self.model)
        if ema:
            averages = self._ema.full_parameters()
            state_dict = self._ema_state_dict(state_dict, averages) if state_dict is not None else None
        accelerator, tokenizer = self.accelerator, self.tokenizer
        save_full_model(accelerator, self.model, tokenizer, save_directory, state_dict, plain=self._policy_is_plain)
        if save_value_model:
            save_full_model(accelerator, self.critic, tokenizer, os.path.join(save_directory, VALUE_MODEL_SUBFOLDER))

    def _checkpoint_tensors(self) -> dict:
        return self._ema.state_dict() if self._ema is not None else {}

    def _load_checkpoint_tensors(self, tensors: dict) -> None:
        if self._ema is not None:
            self._ema.load_state_dict(tensors)

    def _ema_state_dict(self, state_dict: dict, averages: dict) -> dict:
        """The policy's full ``state_dict`` with its trainable parameters replaced by their averages
        (in the parameters' dtypes); tied names share their parameter's average.

        ``averages``: :meth:`PolicyEMA.full_parameters`. The wrapper's ``state_dict`` keys lack the
        ``pretrained_model.`` of its parameter names.
        """
        policy = self.accelerator.unwrap_model(self.model)
        out = dict(state_dict)
        names_of = {}
        for name, param in policy.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        for name, param in policy.named_parameters():
            if name not in averages:
                continue
            for alias in names_of[id(param)]:
                for key in (alias, alias.removeprefix(WRAPPED_PREFIX)):
                    if key in out:
                        out[key] = averages[name].to(out[key].dtype)
        return out
