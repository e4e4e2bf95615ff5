"""Classic ``PPOTrainer`` methods that classic examples and tests call, as a thin layer over the parts.

``step()`` does not use them; they give code written against classic TRL the names and results it
expects: ``prepare_model_inputs``, ``batched_forward_pass``, ``compute_rewards``, ``compute_advantages``,
``loss``, ``train_minibatch``, ``_kl_penalty``, ``_step_safety_checker``, ``gather_stats``,
``record_step_stats``, ``_save_pretrained`` and ``create_model_card``. Each calls only public methods
of the trainer's parts (``forward``, ``experience_maker``, ``learner``) or pure functions.
"""

from __future__ import annotations

import os

import torch

from ... import __version__
from ...core import compute_kl_rewards, full_kl_from_logits, kl_estimate, masked_mean
from ..step.experience import scores_tensor
from ..step_inputs import validate_step_inputs
from . import batched_forward as classic_forward

_MODEL_CARD = """---
license: apache-2.0
tags:
- trl_lite
- ppo
- reinforcement-learning
---

# {model_name}

A language model with a value head, tuned with PPO by trl_lite {version} (the classic TRL `PPOTrainer` API).

## Usage

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{model_id}")
outputs = generator("Hello, my llama is cute")
```

```python
from transformers import AutoTokenizer
from trl_lite import AutoModelForCausalLMWithValueHead

tokenizer = AutoTokenizer.from_pretrained("{model_id}")
model = AutoModelForCausalLMWithValueHead.from_pretrained("{model_id}")
```
"""


class ClassicHelpersMixin:
    """Classic helper methods of ``PPOTrainer`` that ``step()`` does not use: :class:`PPOTrainer` mixes it in."""

    def prepare_model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
        """Pad one batch the classic way (see :func:`.classic_forward.prepare_model_inputs`)."""
        return classic_forward.prepare_model_inputs(self.forward, queries, responses)

    def batched_forward_pass(self, model, queries, responses, model_inputs: dict, return_logits: bool = False,
                             response_masks=None):  # fmt: skip
        """Log-probs, logits, values and masks in the classic ``(B, T)`` layout (see
        :func:`.classic_forward.batched_forward_pass`)."""
        return classic_forward.batched_forward_pass(self.forward, model, queries, responses, model_inputs, return_logits, response_masks)

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks, full_kl=None):
        """KL-shaped rewards (docs/algorithm.md section 4) for any per-token layout.

        Shapes: scores ``(B,)`` (or a list of B scalars), the rest ``(B, L)``.
        Returns rewards, non_score_reward and the per-token KL estimate, ``(B, L)`` each.
        """
        if isinstance(scores, (list, tuple)):
            scores = scores_tensor(scores, logprobs.device)
        kls = kl_estimate(logprobs, ref_logprobs, self.config.kl_penalty, full_kl)
        rewards, non_score_reward = compute_kl_rewards(scores, kls, masks, self.kl_ctl.value)
        return rewards, non_score_reward, kls

    def compute_advantages(self, values, rewards, mask):
        """Masked values, whitened advantages and returns (docs/algorithm.md section 5). Shapes ``(B, L)``."""
        return self.experience_maker.advantages(values, rewards, mask)

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, **kwargs):
        """The PPO losses of one mini-batch with their statistics (see :meth:`.learner.Learner.loss`)."""
        return self.learner.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, **kwargs)

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns):
        """One guarded optimisation step on precomputed new log-probs/values (classic signature).

        ``logprobs``, ``vpreds`` and ``logits`` must come from a forward pass with grad. Called like classic's,
        inside the caller's ``accelerator.accumulate`` if any; the lone mini-batch is its own backward batch
        (``global_token_mean``). Returns the mini-batch statistics; when the update was skipped (see
        :meth:`.learner.Learner.guarded_update`) the weights are unchanged and ``skipped_minibatches`` counts it.
        """
        learner = self.learner
        learner.model.train()
        pg_loss, vf_loss, stats = learner.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)
        policy_loss, critic_loss = learner.split_losses(pg_loss, vf_loss, stats)
        learner.guarded_update(policy_loss, critic_loss, stats, mask)
        return stats

    def _trim_generations(self, generations, prompt_width, lengths, return_prompt, remove_padding) -> list:
        """The transformers engine's trimming of a left-padded ``generate`` output (see :func:`.engines.trim_rows`)."""
        return self.generation.reference_engine.trim(generations, prompt_width, lengths, return_prompt, remove_padding)

    def _kl_penalty(self, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate of ``config.kl_penalty`` between policy and reference log-probs.

        ``"kl"``, ``"abs"``, ``"mse"``: log-probs of the chosen tokens, ``(B, L)`` -> ``(B, L)``.
        ``"full"``: full log-softmax (or logit) rows, ``(B, L, V)`` -> ``(B, L)``, the exact ``KL(policy || ref)``
        under ``rows / PPOConfig.temperature`` (the log-softmax ignores a row's shift: either row gives it).
        """
        if self.config.kl_penalty == "full":
            return full_kl_from_logits(logprob, ref_logprob, self.forward.temperature)
        return kl_estimate(logprob, ref_logprob, self.config.kl_penalty)

    def _step_safety_checker(self, batch_size: int, queries, responses, scores, masks=None):
        """Check a ``step()`` batch as ``step()`` does; return it on the trainer's device, scores as 0-d tensors.

        Returns ``(queries, responses, scores, masks)``; raises ``ValueError``/``TypeError`` naming the bad argument.
        """
        validate_step_inputs(queries, responses, scores, masks, batch_size=batch_size, vocab_size=self._vocab_size,
                             is_encoder_decoder=self.is_encoder_decoder)
        device = self.current_device
        queries = [q.to(device) for q in queries]
        responses = [r.to(device) for r in responses]
        scores = [torch.as_tensor(s, dtype=torch.float32).to(device).reshape(()) for s in scores]
        masks = [m.to(device) for m in masks] if masks is not None else None
        return queries, responses, scores, masks

    def gather_stats(self, stats: dict) -> dict:
        """Average every tensor of ``stats`` over the processes (other values are kept); one process: unchanged."""
        if self.accelerator.num_processes == 1:
            return stats
        return {
            key: self.accelerator.reduce(value.to(self.current_device).float(), reduction="mean")
            if isinstance(value, torch.Tensor) else value
            for key, value in stats.items()
        }

    def record_step_stats(self, kl_coef: float, **data) -> dict:
        """Classic's step statistics from the tensors of a step.

        ``data``: ``masks``, ``kls``, ``logprobs``, ``ref_logprobs``, ``non_score_reward`` ``(B, L)``;
        ``scores`` ``(B,)``; ``queries``, ``responses`` (lists of 1-D tensors); ``train_stats``
        (dict of per-mini-batch tensors, averaged over dim 0 into ``ppo/<key>``).
        """
        mask = data["masks"]
        kl_per_row = (data["kls"] * mask).sum(-1)
        query_lens = torch.tensor([len(q) for q in data["queries"]], dtype=torch.float)
        response_lens = torch.tensor([len(r) for r in data["responses"]], dtype=torch.float)
        stats = {
            "objective/kl": kl_per_row.mean(),
            "objective/kl_dist": kl_per_row,
            "objective/logprobs": data["logprobs"],
            "objective/ref_logprobs": data["ref_logprobs"],
            "objective/kl_coef": kl_coef,
            "objective/entropy": (-data["logprobs"] * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(data["non_score_reward"], mask),
            "ppo/mean_scores": data["scores"].mean(),
            "ppo/std_scores": data["scores"].std(),
            "tokens/queries_len_mean": query_lens.mean().item(),
            "tokens/queries_len_std": query_lens.std().item(),
            "tokens/queries_dist": query_lens.numpy(),
            "tokens/responses_len_mean": response_lens.mean().item(),
            "tokens/responses_len_std": response_lens.std().item(),
            "tokens/responses_dist": response_lens.numpy(),
        }
        for key, value in data.get("train_stats", {}).items():
            stats[f"ppo/{key}"] = torch.as_tensor(value).float().mean(dim=0)
        if "ppo/val/error" in stats and "ppo/returns/var" in stats:
            stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        return stats

    def _save_pretrained(self, save_directory: str) -> None:
        """:meth:`save_pretrained` plus a model card (``README.md``) in ``save_directory``."""
        self.save_pretrained(save_directory)
        if self.accelerator.is_main_process:
            self.create_model_card(save_directory)

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write a model card, ``<path>/README.md``: what the model is and how to load it (from ``path``).

        Classic looked up the hub user for the model id and wrote nothing when offline; here the
        card is always written and names the local path.
        """
        os.makedirs(path, exist_ok=True)
        card = _MODEL_CARD.format(model_name=model_name, model_id=path, version=__version__)
        with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
            f.write(card)
